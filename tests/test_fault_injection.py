"""Fault injection: SIGKILL the training process (scripts/pretrain.py in a process of its own, forked with the
environment `accelerate launch` gives it: helpers.ranks) at named points and at a random moment, resume with
trainer.resume=auto, and compare with an uninterrupted run: the same losses at every step, each step logged once
(metrics.jsonl and TensorBoard), an encoder and summary that match the final checkpoint.

Fault points (ssl_vit/train/faults.py): SSL_VIT_FAULT=<point>@<step> kills the training process there."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, check_ok, launch, read_metrics
from helpers.cores import widen
from helpers.ranks import pretrain_ranks, start_script
from safetensors.torch import load_file

from ssl_vit.artifacts import load_encoder, read_metadata
from ssl_vit.train.watchdog import StepWatchdog

STEPS = 30


def _run_args(out):
    return [*TINY, f"trainer.max_steps={STEPS}", f"hydra.run.dir={out}"]


def _assert_matches_reference(run_dir, reference_run):
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # each step once, in order
    reference = {m["step"]: m["loss"] for m in read_metrics(reference_run)}
    for row in metrics:
        assert row["loss"] == pytest.approx(reference[row["step"]], abs=1e-6), row["step"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    tb_steps = [event.step for event in events.Scalars("train/loss")]
    assert tb_steps == list(range(1, STEPS + 1))  # purge_step hid what the killed run logged past its checkpoint

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["step"] == STEPS and summary["last"]["step"] == STEPS
    assert summary["checkpoint"].endswith(f"step_{STEPS:08d}")
    assert int(read_metadata(run_dir / "encoder.safetensors")["step"]) == STEPS
    encoder = load_encoder(run_dir / "encoder.safetensors")
    final = load_file(str(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))
    for name, value in encoder.state_dict().items():
        torch.testing.assert_close(value, final[f"backbone.{name}"], atol=0, rtol=0)
    assert not list((run_dir / "checkpoints").glob(".*"))  # no temp directories left
    return summary


def _kill_at_random(run_dir, args, first_step: int, last_step: int) -> int:
    """Start the training process, SIGKILL it once a random step in [first_step, last_step] is logged."""
    kill_at = random.randint(first_step, last_step)
    (process,), _ = start_script(ROOT / "scripts" / "pretrain.py", "trainer.progress=false", *args,
                                 config=ROOT / "configs" / "accelerate" / "cpu.yaml", log_dir=run_dir.parent / "random")
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and process.exitcode is None:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        if rows and json.loads(rows[-1])["step"] >= kill_at:
            break
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    return kill_at


@pytest.mark.slow
def test_killed_again_and_again_then_resumed_matches_the_uninterrupted_run(tmp_path, reference_run):
    """One run killed four times (checkpoints every 10 steps), each invocation resuming the previous one. Each is
    a fresh process (forked: helpers.ranks) with the environment `accelerate launch` gives one process."""
    run = tmp_path / "run"
    args = _run_args(run)

    def train(*overrides, env=None):
        return pretrain_ranks(*overrides, log_dir=tmp_path / "logs", env=env)

    # 1. mid-interval: steps 11..15 are logged past checkpoint 10 and must not survive the resume
    assert train(*args, env={"SSL_VIT_FAULT": "step_done@15"}).returncode != 0
    assert [m["step"] for m in read_metrics(run)][-1] == 15
    # 2. resumed at 10, killed while checkpoint 20 is complete in its temp directory, not yet renamed
    assert train(*args, "trainer.resume=auto", env={"SSL_VIT_FAULT": "checkpoint_written@20"}).returncode != 0
    assert [p.name for p in (run / "checkpoints").iterdir()] == [".tmp_step_00000020", "step_00000010"] or \
        sorted(p.name for p in (run / "checkpoints").iterdir()) == [".tmp_step_00000020", "step_00000010"]
    # 3. resumed at 10 again, killed at a random moment before the final checkpoint
    kill_at = _kill_at_random(run, [*args, "trainer.resume=auto"], 12, 24)
    print(f"random kill after step {kill_at} was logged")
    # 4. resumed, killed after the final checkpoint is in place, in the middle of deleting the oldest one
    #    (trainer.keep_checkpoints=2) and before encoder.safetensors is rewritten: that one is out of the way first
    assert train(*args, "trainer.resume=auto", env={"SSL_VIT_FAULT": "checkpoint_rotating@30"}).returncode != 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        ".old_step_00000010", "step_00000020", "step_00000030"]
    assert int(read_metadata(run / "encoder.safetensors")["step"]) == 20
    # 5. resumed at the final step: nothing to train, the outputs are brought in line with the checkpoint, the
    #    half-deleted one swept away
    check_ok(train(*args, "trainer.resume=auto"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000020", "step_00000030"]
    summary = _assert_matches_reference(run, reference_run)
    assert summary["steps_this_run"] == 0 and summary["images_per_s"] is None


@pytest.mark.distributed
def test_a_failure_of_the_main_process_alone_stops_every_rank_at_once(tmp_path):
    """Rank 0's periodic evaluation raises (SSL_VIT_FAULT=eval_error@2): rank 1, which does not evaluate, is told
    and stops too, in one line, instead of waiting in its next collective until the timeout."""
    start = time.perf_counter()
    proc = launch("model=vit_test", "data.num_samples=32", "data.batch_size=8", "trainer.max_steps=4",
                  "trainer.eval_every=2", "trainer.eval_max_samples=16", "trainer.collective_timeout_s=600",
                  f"hydra.run.dir={tmp_path}", config="ddp_cpu2", env={"SSL_VIT_FAULT": "eval_error@2"}, timeout=240)
    assert proc.returncode != 0 and time.perf_counter() - start < 120, proc.stderr[-3000:]
    assert "RuntimeError: injected failure (SSL_VIT_FAULT=eval_error@2)" in proc.stderr  # rank 0's own traceback
    assert "ssl-vit: error: [rank 1] the main process stopped (RuntimeError: injected failure" in proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 2 and summary["error"].startswith("injected failure")


@pytest.mark.distributed
def test_a_step_past_step_timeout_s_stops_every_rank_with_its_stacks(tmp_path):
    """Rank 1 never ends step 2 (SSL_VIT_FAULT=hang@2); rank 0 waits for it in step 3's gradient reduction. With
    trainer.step_timeout_s each rank says which step ran past the limit, dumps its threads' stacks (rank 1's shows
    the fault point it waits in) and exits 1, long before the collective's own timeout (30 min by default). Through
    the real `python -m ssl_vit.launch`: the launcher reports the status the watchdog recorded (a stop on an
    error), not a crash without one."""
    cmd = [sys.executable, "-m", "ssl_vit.launch", "--config_file", str(ROOT / "configs" / "accelerate" /
                                                                          "ddp_cpu2.yaml"),
           str(ROOT / "scripts" / "pretrain.py"), "trainer.progress=false", "model=vit_test", "data.num_samples=64",
           "data.batch_size=8", "trainer.max_steps=6", "trainer.step_timeout_s=8", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "SSL_VIT_FAULT": "hang@2"},
                          capture_output=True, text=True, timeout=300, preexec_fn=widen)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "ssl-vit: error: step 3 has run past trainer.step_timeout_s=8; every thread's stack follows" in proc.stderr
    assert "ssl-vit: error: [rank 1] step 2 has run past trainer.step_timeout_s=8" in proc.stderr
    assert 'ssl_vit/train/faults.py", line' in proc.stderr and "in fault_point" in proc.stderr  # where it hung
    assert "the run's main process exited 1 (stopped on an error)" in proc.stderr
    assert "a crash or a kill" not in proc.stderr


@pytest.mark.slow
def test_a_second_signal_stops_a_step_that_never_ends_and_prints_every_stack(tmp_path):
    """The first SIGTERM asks for a stop after the step, which never comes (SSL_VIT_FAULT=hang@2); the second (past
    the 2 s in which a repeat counts as the same request) stops at once: every thread's stack, then exit 75 (a
    preemption signal's status: the job requeues and resumes from the last checkpoint), also in summary.json."""
    run = tmp_path / "run"
    processes, logs = start_script(ROOT / "scripts" / "pretrain.py", "trainer.progress=false", *_run_args(run),
                                   config=ROOT / "configs" / "accelerate" / "cpu.yaml", log_dir=tmp_path / "logs",
                                   env={"SSL_VIT_FAULT": "hang@2"})
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").is_file() or not any(m.get("step") == 2 for m in read_metrics(run)):
        assert time.monotonic() < deadline and processes[0].exitcode is None, logs[0][1].read_text()[-3000:]
        time.sleep(0.2)
    os.kill(processes[0].pid, signal.SIGTERM)
    time.sleep(3)
    assert processes[0].exitcode is None  # asked to stop after a step that does not end
    os.kill(processes[0].pid, signal.SIGTERM)
    processes[0].join(60)
    err = logs[0][1].read_text()
    assert processes[0].exitcode == 75, err[-3000:]
    assert "ssl-vit: SIGTERM again: stopping now; every thread's stack:" in err
    assert "in fault_point" in err and "ssl-vit: error: stopped at once (SIGTERM again): the steps since the last " \
        "checkpoint are lost; requeue the job, or continue from it with trainer.resume=auto" in err
    assert json.loads((run / "summary.json").read_text())["exit_status"] == 75


def test_the_step_watchdog_fires_only_for_a_step_past_its_limit(monkeypatch):
    """In this process, its exit replaced by a record: steps that finish in time pass; the one that does not is
    reported once, with its number; none is watched without a limit."""
    fired = []
    monkeypatch.setattr(StepWatchdog, "_expire", lambda self, step: (fired.append(step), self.finished()))
    with StepWatchdog(0.5) as watchdog:
        for step in (1, 2, 3):
            watchdog.started(step)
            time.sleep(0.05)
            watchdog.finished()
        watchdog.started(4)
        deadline = time.monotonic() + 30
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    assert fired == [4] and not watchdog.thread.is_alive()
    with StepWatchdog(None) as unwatched:
        unwatched.started(1)
    assert unwatched.thread is None
