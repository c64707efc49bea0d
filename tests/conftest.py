import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# accelerate's own launch entry point: `accelerate launch` runs exactly this (launch_command_parser + launch_command)
# after the accelerate CLI has registered all its other subcommands, whose imports (timm, torchvision models via
# `accelerate estimate-memory`) cost ~4 s per launch here. The `accelerate` command itself is run by
# test_pretrain_cli (launcher="accelerate").
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def launch(*overrides, config="cpu", env=None, timeout=300, launcher=None, **popen) -> subprocess.CompletedProcess:
    """Run scripts/pretrain.py through accelerate's launcher in a subprocess (env: None unsets; launcher="accelerate":
    the `accelerate launch` command itself; popen: more subprocess.run arguments, e.g. preexec_fn)."""
    start = [ACCELERATE, "launch"] if launcher == "accelerate" else ACCELERATE_LAUNCH
    cmd = [*start, "--config_file", str(ROOT / "configs" / "accelerate" / f"{config}.yaml"),
           str(ROOT / "scripts" / "pretrain.py"), "trainer.progress=false", *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None removes a variable
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout, **popen)


def export_script():
    """scripts/export.py as a module (its `main(argv)` in-process: each CLI process costs ~6 s of imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


TINY = ["model=vit_test", "data.num_samples=32", "data.batch_size=16", "trainer.log_every=1",
        "optim.lr=3e-3", "optim.warmup_steps=3", "trainer.checkpoint_every=10"]


def assert_weights_close(ours: dict, reference: dict, atol: float, rtol: float, key_bias_atol: float) -> None:
    """State dicts equal within atol / rtol, the key part of every fused qkv bias within key_bias_atol: its exact
    gradient is zero (softmax ignores a shift of all of a query's logits), so its computed gradient is rounding noise,
    which Adam turns into lr-sized steps whose sign the order of the float sums decides."""
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        got = ours[name]
        if name.endswith("qkv.bias"):
            keys = slice(value.shape[0] // 3, 2 * value.shape[0] // 3)
            torch.testing.assert_close(got[keys], value[keys], atol=key_bias_atol, rtol=0, msg=name)
            got = torch.cat([got[: keys.start], value[keys], got[keys.stop:]])
        torch.testing.assert_close(got, value, atol=atol, rtol=rtol, msg=name)


def check_ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """An uninterrupted 30-step run of TINY through the CLI (shared by the resume and fault-injection tests)."""
    out = tmp_path_factory.mktemp("reference")
    check_ok(launch(*TINY, "trainer.max_steps=30", f"hydra.run.dir={out}"))
    return out


def write_tar(path, samples) -> None:
    """A tar shard from [(key, {extension: bytes})], written member by member (for shards made bad on purpose)."""
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for extension, data in files.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
