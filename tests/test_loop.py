"""The engine in-process: non-finite losses, gradient accumulation."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from objectives.supervised import Supervised
from ssl_vit.config import register_configs
from ssl_vit.train import NonFiniteLossError, pretrain

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """accelerate keeps one process-wide state (precision, device); each run here starts from a clean one."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _config(tmp_path, *overrides):
    register_configs()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[
            "model=vit_test", "data.batch_size=8", "trainer.log_every=1",
            "trainer.progress=false", "trainer.tensorboard=false", f"output_dir={tmp_path}", *overrides])


def test_non_finite_losses_are_skipped_counted_then_stop_with_the_last_good_weights(tmp_path, monkeypatch):
    calls = {"n": 0}
    original = Supervised.forward

    def poisoned(self, batch):
        out = original(self, batch)
        calls["n"] += 1
        if calls["n"] > 2:  # steps 3, 4, 5, ... produce NaN
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(Supervised, "forward", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"non-finite for 3 consecutive steps.*max_consecutive_nonfinite"):
        pretrain(_config(tmp_path, "trainer.max_steps=20", "trainer.max_consecutive_nonfinite=3"))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["nonfinite_steps"] for m in metrics] == [0, 0, 1, 2, 3]
    saved = load_file(str(tmp_path / "checkpoints" / "step_00000005" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in saved.values())


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """2 micro-batches of 8 accumulate to the same update as 1 batch of 16 (same samples, same order)."""
    big = pretrain(_config(tmp_path / "big", "trainer.max_steps=3", "data.batch_size=16"))
    small = pretrain(_config(tmp_path / "acc", "trainer.max_steps=3", "data.batch_size=8",
                             "trainer.grad_accum_steps=2"))
    assert big["global_batch"] == small["global_batch"] == 16
    a = load_file(str(tmp_path / "big" / "checkpoints" / "step_00000003" / "model.safetensors"))
    b = load_file(str(tmp_path / "acc" / "checkpoints" / "step_00000003" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4)


def test_bf16_mixed_precision_runs(tmp_path):
    summary = pretrain(_config(tmp_path, "trainer.max_steps=2", "trainer.precision=bf16"))
    assert summary["finished"] and torch.isfinite(torch.tensor(summary["last"]["loss"]))


def test_training_on_an_image_folder(tmp_path):
    from PIL import Image
    for index, colour in enumerate(((220, 30, 30), (30, 30, 220), (30, 200, 30))):
        folder = tmp_path / "images" / f"class_{index}"
        folder.mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (24 + i, 20), colour).save(folder / f"{i}.png")
    summary = pretrain(_config(tmp_path / "run", "data=folder", f"data.root={tmp_path / 'images'}",
                               "data.num_workers=0", "data.batch_size=4", "trainer.max_steps=3"))
    assert summary["finished"] and summary["global_batch"] == 4
    with pytest.raises(Exception, match="does not exist"):
        pretrain(_config(tmp_path / "bad", "data=folder", f"data.root={tmp_path / 'nope'}"))
