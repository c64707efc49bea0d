"""The engine in-process: non-finite losses, gradient accumulation."""

import json
import math

import pytest
import torch
from conftest import assert_weights_close, read_metrics
from helpers.builders import pretrain_config
from safetensors.torch import load_file

from ssl_vit.objectives.supervised import Supervised
from ssl_vit.train import TrainingDiverged, pretrain
from ssl_vit.train.guard import UpdateGuard


def _strict_json_rows(path):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_non_finite_losses_are_skipped_counted_then_stop_with_the_last_applied_weights(tmp_path, monkeypatch):
    calls = {"n": 0}
    original = Supervised.forward

    def poisoned(self, batch):
        out = original(self, batch)
        calls["n"] += 1
        if calls["n"] > 2:  # steps 3, 4, 5, ... produce NaN
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(Supervised, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match=r"non-finite for 3 consecutive steps.*max_consecutive_nonfinite=3"):
        pretrain(pretrain_config(tmp_path, "trainer.max_steps=20", "trainer.max_consecutive_nonfinite=3"))
    metrics = _strict_json_rows(tmp_path / "metrics.jsonl")  # NaN is written as null
    assert [m["nonfinite_steps"] for m in metrics] == [0, 0, 1, 2, 3]
    assert metrics[-1]["loss"] is None and metrics[1]["loss"] > 0
    saved = load_file(str(tmp_path / "checkpoints" / "step_00000005" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in saved.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 5 and not summary["finished"] and "non-finite" in summary["error"]
    assert summary["checkpoint"].endswith("step_00000005")


def test_an_update_that_wrecks_the_weights_stops_at_once_without_saving_them(tmp_path):
    """optim.lr=1e6: the first real update has a finite loss but ruins the weights."""
    with pytest.raises(TrainingDiverged) as caught:
        pretrain(pretrain_config(tmp_path, "trainer.max_steps=20", "optim.lr=1e6", "optim.warmup_steps=0",
                         "trainer.checkpoint_every=1"))
    message = str(caught.value)
    assert "update of step 1" in message and "parameter norm" in message and "not saved" in message
    assert "lower optim.lr (now 1e+06)" in message and "lengthen optim.warmup_steps (now 0)" in message
    assert "grad_clip" not in message  # clipping is already on (1.0): no advice to turn it on
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 1 and "ruined" in summary["error"] and summary["checkpoint"] is None


@pytest.mark.slow
def test_fused_adamw_skips_a_non_finite_update_on_the_device_and_the_loop_reads_it_at_log_steps(tmp_path,
                                                                                                 monkeypatch, caplog):
    """The CUDA path (fused AdamW, whose found_inf skips the update on the device), forced on the CPU: step 2's loss
    is NaN; the loop reads the verdicts only at its log steps (3 and 6), counts the skip there, and ends with the
    weights of the host-decided path (unfused AdamW, the update skipped by the loop)."""
    import ssl_vit.train.trainer as trainer_module

    monkeypatch.setenv("SSL_VIT_FAULT", "nan_loss@2")
    settled = []
    original_settle = trainer_module.Trainer._settle

    def settle(self):
        settled.append(self.state.step)
        original_settle(self)

    monkeypatch.setattr(trainer_module.Trainer, "_settle", settle)
    host = pretrain(pretrain_config(tmp_path / "host", "trainer.max_steps=6", "trainer.log_every=3"))
    assert settled == [1, 2, 3, 4, 5, 6]  # decided on the host: every step
    settled.clear()
    monkeypatch.setattr(trainer_module, "fused_optimizer", lambda accelerator: True)
    with caplog.at_level("WARNING", logger="ssl_vit"):
        device = pretrain(pretrain_config(tmp_path / "device", "trainer.max_steps=6", "trainer.log_every=3"))
    assert settled == [3, 6]  # read at the log steps only
    assert host["nonfinite_steps"] == device["nonfinite_steps"] == 1
    assert [m["nonfinite_steps"] for m in read_metrics(tmp_path / "device") if "loss" in m] == [1, 1]
    assert "non-finite loss at step 2: update skipped" in caplog.text
    final = [load_file(str(tmp_path / run / "checkpoints" / "step_00000006" / "model.safetensors"))
             for run in ("host", "device")]
    # the two kernels' rounding: measured after 6 steps, up to 3.3e-4 in the key bias (the default torch-init
    # head), the query and value biases within 4e-9
    assert_weights_close(final[1], final[0], atol=1e-5, rtol=1e-4, key_bias_atol=1e-3)


def test_the_guard_keeps_the_first_ruinous_update_on_the_device_until_asked():
    """UpdateGuard judges every update without reading the device; `verdict` gives the first that ruined the
    weights (growth above x100 of max(norm, 1), or a non-finite norm), whatever came after it."""
    norms = iter([0.5, 1.5, 100.0, 400.0, math.inf, 2.0])
    guard = UpdateGuard([torch.nn.Parameter(torch.ones(1))], 100.0, lambda parameters: torch.tensor(next(norms)))
    guard.check_update(1)
    guard.check_update(2)  # 1.5 -> 100: x66.7, fine
    assert guard.verdict() is None
    for step in (3, 4, 5):  # 100 -> 400 is fine too (x4); inf is not
        guard.check_update(step)
    assert guard.verdict() == (4, 400.0, math.inf)


def test_divergence_advice_follows_the_config(tmp_path):
    with pytest.raises(TrainingDiverged) as caught:
        pretrain(pretrain_config(tmp_path, "trainer.max_steps=100", "optim.lr=1e6", "optim.warmup_steps=50",
                         "optim.grad_clip=null", "trainer.checkpoint_every=1"))
    message = str(caught.value)
    assert "set optim.grad_clip=1.0" in message and "warmup_steps" not in message
    assert "Last good checkpoint: " + str(tmp_path / "checkpoints" / "step_00000001") in message  # lr 0 at step 1


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """2 micro-batches of 8 accumulate to the same update as 1 batch of 16 (same samples, same order)."""
    big = pretrain(pretrain_config(tmp_path / "big", "trainer.max_steps=3", "data.batch_size=16"))
    small = pretrain(pretrain_config(tmp_path / "acc", "trainer.max_steps=3", "data.batch_size=8",
                             "trainer.grad_accum_steps=2"))
    assert big["global_batch"] == small["global_batch"] == 16
    a = load_file(str(tmp_path / "big" / "checkpoints" / "step_00000003" / "model.safetensors"))
    b = load_file(str(tmp_path / "acc" / "checkpoints" / "step_00000003" / "model.safetensors"))
    # measured after 3 steps: the key bias up to 4.9e-5 apart (the sums' order; the default torch-init head), every
    # other tensor within 1.2e-7
    assert_weights_close(b, a, atol=2e-5, rtol=1e-4, key_bias_atol=2e-4)


@pytest.mark.slow
def test_bf16_autocast_on_the_cpu_gives_the_fp32_losses_within_bf16_rounding(tmp_path):
    """The DDP / single-process bf16 path (accelerate's autocast over fp32 weights), slow on this CPU but the same
    code as on GPUs: finite, within 2% of the fp32 run's losses, and not equal to them (autocast did run)."""
    from accelerate.state import AcceleratorState

    runs = {}
    for precision in ("fp32", "bf16"):
        AcceleratorState._reset_state(reset_partial_state=True)  # the precision is accelerate's process-wide state
        runs[precision] = pretrain(pretrain_config(tmp_path / precision, "trainer.max_steps=3",
                                           f"trainer.precision={precision}"))
    assert all(summary["finished"] for summary in runs.values())
    losses = {precision: [m["loss"] for m in read_metrics(tmp_path / precision)] for precision in runs}
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2) and losses["bf16"] != losses["fp32"]


@pytest.mark.slow
def test_training_on_an_image_folder(tmp_path):
    from PIL import Image
    for index, colour in enumerate(((220, 30, 30), (30, 30, 220), (30, 200, 30))):
        folder = tmp_path / "images" / f"class_{index}"
        folder.mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (24 + i, 20), colour).save(folder / f"{i}.png")
    summary = pretrain(pretrain_config(tmp_path / "run", "data=folder", f"data.root={tmp_path / 'images'}",
                               "data.num_workers=0", "data.batch_size=4", "trainer.max_steps=3"))
    assert summary["finished"] and summary["global_batch"] == 4
    with pytest.raises(Exception, match="does not exist"):
        pretrain(pretrain_config(tmp_path / "bad", "data=folder", f"data.root={tmp_path / 'nope'}"))


@pytest.mark.slow
def test_resume_refuses_what_cannot_continue_the_run_exactly(tmp_path, caplog):
    import shutil

    from accelerate.state import AcceleratorState

    from ssl_vit.schema import ConfigError

    def attempt(*overrides):
        AcceleratorState._reset_state(reset_partial_state=True)
        return pretrain(pretrain_config(tmp_path / "resumed", "trainer.max_steps=6", *overrides))

    pretrain(pretrain_config(tmp_path / "run", "trainer.max_steps=4", "trainer.checkpoint_every=2"))
    good = tmp_path / "run" / "checkpoints" / "step_00000004"
    cases = {"empty": lambda d: [p.unlink() for p in d.iterdir()],
             "garbage": lambda d: (d / "model.safetensors").write_bytes(b"\x13" * 999),
             "truncated": lambda d: (d / "optimizer.bin").write_bytes((d / "optimizer.bin").read_bytes()[:500]),
             "no_rng": lambda d: (d / "random_states_0.pkl").unlink(),
             # a whole (one-process / DDP) checkpoint of 2 processes on 1: weights and optimizer whole, RNG not
             "two_ranks": lambda d: shutil.copy(d / "random_states_0.pkl", d / "random_states_1.pkl")}
    for name, damage in cases.items():
        shutil.copytree(good, tmp_path / name)
        damage(tmp_path / name)
    expected = {
        "missing": r"trainer.resume='.*missing' does not exist or is not a directory; valid values: auto",
        "empty": r"holds no checkpoint \(no custom_checkpoint_0.pkl\)",
        "garbage": r"model.safetensors is unreadable \(SafetensorError",
        "truncated": r"truncated/optimizer.bin is unreadable \(RuntimeError: PytorchStreamReader",
        "no_rng": r"lacks random_states_0.pkl .* set trainer.allow_inexact_resume=true",
        "two_ranks": r"was written by 2 processes \(this run has 1: the other ranks' RNG states are unused\), so "
                     r"the run cannot continue exactly; set trainer.allow_inexact_resume=true",
    }
    for name, pattern in expected.items():
        with pytest.raises(ConfigError, match=pattern):
            attempt(f"trainer.resume={tmp_path / name}")
    with pytest.raises(ConfigError, match=r"holds a different model: backbone.cls_token is \(1, 1, 32\) there, "
                                          r"\(1, 1, 64\) here.*configuration of that run \(.*run/config.yaml\)"):
        attempt(f"trainer.resume={good}", "model.embed_dim=64")
    with pytest.raises(ConfigError, match=r"holds a different model \(the checkpoint is model=vit_test, this config "
                                          r"asks model=vit_tiny\): "):
        attempt(f"trainer.resume={good}", "model=vit_tiny")
    summary = attempt(f"trainer.resume={tmp_path / 'no_rng'}", "trainer.allow_inexact_resume=true")
    assert summary["finished"] and summary["step"] == 6
    assert "RESUME IS NOT EXACT" in caplog.text and "random_states_0.pkl" in caplog.text
    assert attempt(f"trainer.resume={tmp_path / 'two_ranks'}", "trainer.allow_inexact_resume=true")["finished"]
    summary = attempt(f"trainer.resume={tmp_path / 'run'}")  # a run directory: its newest checkpoint
    assert summary["steps_this_run"] == 2


def test_a_weight_decay_schedule_reaches_the_optimizer_every_step(tmp_path, monkeypatch):
    """optim.weight_decay_end: cosine from weight_decay to it (DINO's 0.04 -> 0.4), logged and applied per step."""
    seen = []
    original = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append(max(group["weight_decay"] for group in self.param_groups))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    pretrain(pretrain_config(tmp_path, "trainer.max_steps=5", "optim.weight_decay=0.04", "optim.weight_decay_end=0.4"))
    expected = [0.4 + 0.5 * (0.04 - 0.4) * (1 + math.cos(math.pi * k / 5)) for k in range(5)]  # DINO: k / n
    assert [row["wd"] for row in read_metrics(tmp_path)] == pytest.approx(expected)
    assert seen == pytest.approx(expected)
