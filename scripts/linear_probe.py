"""The evaluation script under its old name: `python scripts/linear_probe.py ...` = `python scripts/evaluate.py ...`
(same configs, same overrides)."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).with_name("evaluate.py")), run_name="__main__")
