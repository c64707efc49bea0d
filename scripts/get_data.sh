#!/usr/bin/env bash
# Install the real data sets that ship through Debian (no downloads at run time exist elsewhere here):
# - Fashion-MNIST idx files under /usr/share/datasets/fashion-mnist/ (MIT licence);
# - Tux Paint's stamps under /usr/share/tuxpaint/stamps/ (GPL): 785 drawings with English captions, the image-text
#   pairs of data=tuxpaint (objective=clip, eval=retrieval).
set -euo pipefail
PACKAGES="dataset-fashion-mnist tuxpaint-stamps-default"
if dpkg -s $PACKAGES >/dev/null 2>&1; then
  echo "already installed: $PACKAGES"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update
  $SUDO apt-get install -y $PACKAGES
fi
ls -l /usr/share/datasets/fashion-mnist/
echo "tuxpaint stamps: $(find /usr/share/tuxpaint/stamps -name '*.png' | wc -l) png drawings"
