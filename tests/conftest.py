import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def launch(*overrides, config="cpu", env=None, timeout=300) -> subprocess.CompletedProcess:
    """Run scripts/pretrain.py through the real `accelerate launch` in a subprocess (env: None unsets)."""
    cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "configs" / "accelerate" / f"{config}.yaml"),
           str(ROOT / "scripts" / "pretrain.py"), "trainer.progress=false", *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
