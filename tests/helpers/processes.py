"""Real launches and what every launching test reads back: `launch` (the real `accelerate launch`), `check_ok`,
`read_metrics`; `index_reachable` for the tests that install from the package index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from helpers.cores import widen

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# accelerate's own launch entry point: `accelerate launch` runs exactly this (launch_command_parser + launch_command)
# after the accelerate CLI has registered all its other subcommands, whose imports (timm, torchvision models via
# `accelerate estimate-memory`) cost ~4 s per launch here. The `accelerate` command itself is run by
# test_pretrain_cli (launcher="accelerate").
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def launch(*overrides, config="cpu", env=None, timeout=300, launcher=None, **popen) -> subprocess.CompletedProcess:
    """Run scripts/pretrain.py through accelerate's launcher in a subprocess (env: None unsets; launcher="accelerate":
    the `accelerate launch` command itself; popen: more subprocess.run arguments, e.g. preexec_fn)."""
    start = [ACCELERATE, "launch"] if launcher == "accelerate" else ACCELERATE_LAUNCH
    cmd = [*start, "--config_file", str(ROOT / "configs" / "accelerate" / f"{config}.yaml"),
           str(ROOT / "scripts" / "pretrain.py"), "trainer.progress=false", *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    if "preexec_fn" not in popen and processes(config) > 1:
        popen["preexec_fn"] = widen  # the launcher and its ranks on the session's cores (helpers.cores)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout, **popen)


def processes(config: str) -> int:
    """The number of processes configs/accelerate/<config>.yaml launches."""
    return int(yaml.safe_load((ROOT / "configs" / "accelerate" / f"{config}.yaml").read_text())["num_processes"])


def check_ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def index_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10):
            return True
    except OSError:
        return False
