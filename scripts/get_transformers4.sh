#!/usr/bin/env bash
# transformers 4.57 (LLaVA-family code pins 4.37+) beside the project's 5.x, for the test that our transformers
# exports load exactly in 4.x too. Installed into .venv/compat/transformers4 (not on the venv's path); the test
# puts it first on PYTHONPATH in a subprocess. Needs PyPI once; ~15 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
target=.venv/compat/transformers4
if [ -f "$target/transformers/__init__.py" ]; then
  echo "transformers 4.x already in $target"
  exit 0
fi
.venv/bin/pip install --quiet --no-deps --target "$target" transformers==4.57.6 huggingface_hub==0.36.2 \
  tokenizers==0.22.2 requests==2.34.2 urllib3==2.8.0 charset_normalizer==3.5.3 idna==3.20 certifi==2026.10.19.post1
echo "installed transformers 4.57.6 into $target"
