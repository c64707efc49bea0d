"""Writing `.safetensors` files readable as other files are: safetensors' `save_file` creates them mode 0600
(owner only), which hides a run's encoder, checkpoints and exports from colleagues on a shared file system. Files
written here get the mode of a file `open()` creates (0666 less the process's umask)."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file


def plain_mode() -> int:
    """The mode `open()` gives a new file under this process's umask (read and restored at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, plain_mode())
    return Path(path)


def make_readable(directory: Path) -> None:
    """Give every `.safetensors` file under `directory` (written by accelerate's save_state) the plain mode."""
    mode = plain_mode()
    for path in directory.rglob("*.safetensors"):
        os.chmod(path, mode)
