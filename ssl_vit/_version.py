"""The release: `ssl_vit.__version__`, the wheel's version (pyproject.toml reads it here), CHANGELOG.md's headings."""

__version__ = "0.2.0"
