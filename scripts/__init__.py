"""The entry points (`python scripts/<name>.py`); installed, the same modules are `ssl_vit.scripts.<name>`, which the
`ssl-vit <command>` console command runs (ssl_vit/commands.py)."""
