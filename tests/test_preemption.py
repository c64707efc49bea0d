"""Preemption signals (ssl_vit.train.stop_requests): which signals stop a run after its step, the window in which a
repeated signal is the same request, a second one stopping at once, and the exit statuses. The launches (SIGTERM to
2-process DDP and ZeRO-3 runs through the real launcher, then trainer.resume=auto, against the session's pool of
uninterrupted runs) are below; Ctrl-C is in test_first_hour."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from conftest import ROOT, check_ok, read_metrics
from helpers.pool import EVAL, OBJECTIVES, STEPS, strategy_run

from ssl_vit.train import stop_requests
from ssl_vit.train.stop_requests import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopRequests, stop_status

ONE_PROCESS = SimpleNamespace(num_processes=1)


def test_the_configured_signals_stop_after_the_step_and_others_keep_their_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests(["SIGUSR1"], announce=False) as requests:
        assert signal.getsignal(signal.SIGTERM) is before  # not configured: left alone
        assert requests.agreed(ONE_PROCESS) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requests.requested == "SIGUSR1" and requests.agreed(ONE_PROCESS) == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is not requests._handle  # restored on leaving


def test_a_repeat_within_the_window_is_the_same_request_and_a_later_one_stops_at_once(monkeypatch):
    with StopRequests(["SIGTERM", "SIGUSR1"], announce=False) as requests:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher forwarding what the scheduler also sent
        assert requests.requested == "SIGTERM"
        monkeypatch.setattr(stop_requests, "SAME_REQUEST_S", 0.0)
        os.kill(os.getpid(), signal.SIGUSR1)  # another kind while stopping: the checkpoint is on its way
        assert requests.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)


def test_exit_statuses_tell_a_preempted_run_from_an_interrupted_and_a_finished_one():
    assert (stop_status(None), stop_status("SIGINT"), stop_status("SIGTERM"), stop_status("SIGUSR1")) == (
        0, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_PREEMPTED) == (0, 130, 75, 75)


@pytest.mark.slow
def test_loader_workers_survive_the_stop_signals_and_a_process_exiting_with_its_loader_still_exits():
    """SLURM signals every process of a job step, loader workers included: they ignore it (the training process
    stops after its step), so the loader keeps serving batches until the trainer has its checkpoint. A script that
    exits while it holds such a loader (PyTorch's and torchdata's) still exits: the workers are killed at exit,
    where multiprocessing's own SIGTERM would be ignored and its join would wait for ever."""
    import subprocess
    import sys

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ssl_vit.data.workers import ignore_stop_signals

    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=1, persistent_workers=True,
                        worker_init_fn=ignore_stop_signals)
    batches = iter(loader)
    assert next(batches)[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    (worker,) = batches._workers
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        os.kill(worker.pid, signal.Signals[name])
    assert [next(batches)[0][0].item() for _ in range(3)] == [4.0, 8.0, 12.0] and worker.is_alive()
    del batches
    script = ("import torch; from torch.utils.data import DataLoader, TensorDataset\n"
              "from torchdata.stateful_dataloader import StatefulDataLoader\n"
              "from ssl_vit.data.workers import ignore_stop_signals\n"
              "data = TensorDataset(torch.arange(64.0))\n"
              "held = [iter(kind(data, batch_size=4, num_workers=2, persistent_workers=True,\n"
              "                  worker_init_fn=ignore_stop_signals)) for kind in (DataLoader, StatefulDataLoader)]\n"
              "print([float(next(batches)[0][0]) for batches in held])\n")  # exits with both loaders and workers
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "[0.0, 0.0]\n", done.stderr


def _launch_and_signal(config, out, overrides, target):
    """Launch a 2-process run through ssl_vit.launch (accelerate's launch, ending with the run's exit status) and
    send SIGTERM once step 2 is logged: to the launcher (target "launcher", which forwards it to every rank, as
    torchrun does when SLURM signals it) or to rank 1's process alone ("rank1")."""
    model = [] if any(o.startswith("model=") for o in overrides) else ["model=vit_test"]
    cmd = [sys.executable, "-m", "ssl_vit.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / f"{config}.yaml"),
           str(ROOT / "scripts" / "pretrain.py"), "trainer.progress=false", *model, *STEPS, *overrides,
           f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while len(read_metrics(out) if (out / "metrics.jsonl").is_file() else []) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "the run logged no second step"
        time.sleep(0.05)
    if target == "launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        workers = psutil.Process(proc.pid).children(recursive=True)
        next(w for w in workers if w.environ().get("RANK") == "1").send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    return proc.returncode, output


@pytest.mark.distributed
@pytest.mark.parametrize("config, objective, target", [("ddp_cpu2", "masked_patch", "rank1"),
                                                       ("zero3_cpu2", "dinov3", "launcher")])
def test_sigterm_stops_every_rank_with_a_checkpoint_and_resume_auto_gives_the_uninterrupted_losses(
        pool, tmp_path, config, objective, target):
    """SIGTERM after step 2 (DDP: to rank 1 alone; ZeRO-3, DINOv3: to the launcher, which forwards it): every rank
    stops after the step they agree on, writes that step's checkpoint (ZeRO-3: its shards) and exits 75; resuming
    with trainer.resume=auto in the same directory gives the uninterrupted run's losses for the remaining steps."""
    status, output = _launch_and_signal(config, tmp_path, [*EVAL, *OBJECTIVES[objective]], target)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = summary["step"]
    assert 2 <= stopped < 5 and summary["stopped_by"] == "SIGTERM" and summary["exit_status"] == 75, output[-3000:]
    assert f"stopped at step {stopped} of 5 (SIGTERM), checkpoint and encoder saved, exit status 75" in output
    # accelerate's launcher reports the workers' 75 (or its own signal) as a failed launch, status 1; ours says it
    how = "the launcher got SIGTERM" if target == "launcher" else "rank 0 exited with status 75 first"
    assert status == 75 and (f"ssl-vit launch: {how}; the run's main process exited 75 (stopped for preemption with "
                             "a checkpoint: requeue it)") in output, output[-3000:]
    assert f"step_{stopped:08d}" in {p.name for p in (tmp_path / "checkpoints").iterdir()}
    check_ok(strategy_run(config, tmp_path, *EVAL, *OBJECTIVES[objective], "trainer.resume=auto"))
    resumed = {m["step"]: m["loss"] for m in read_metrics(tmp_path) if "loss" in m}
    reference = {m["step"]: m["loss"] for m in read_metrics(pool[objective, config]) if "loss" in m}
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert [resumed[s] for s in range(1, 6)] == pytest.approx([reference[s] for s in range(1, 6)], abs=1e-6)
