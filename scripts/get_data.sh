#!/usr/bin/env bash
# Install the real data sets that ship through Debian (no downloads at run time exist elsewhere here):
# Fashion-MNIST idx files under /usr/share/datasets/fashion-mnist/ (MIT licence).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update
$SUDO apt-get install -y dataset-fashion-mnist
ls -l /usr/share/datasets/fashion-mnist/
