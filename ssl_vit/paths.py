"""Where the shipped configs are: inside the installed package (`ssl_vit/configs`, as the wheel places them), or
beside it in a checkout (`configs/` at the repository's top, where an editable install leaves them)."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
CONFIG_DIR = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
