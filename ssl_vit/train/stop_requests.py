"""Stopping a run cleanly on request: Ctrl-C (SIGINT), or a preemption signal (`trainer.preempt_signals`, by
default SIGTERM, what SLURM and torchrun send before a time limit or a preemption, and SIGUSR1, what
`sbatch --signal=USR1@<seconds>` sends ahead of it).

The first signal asks the run to stop after the current optimizer step: the trainer then writes a checkpoint and
the encoder, prints the command that resumes it and exits with `stop_status`: 130 after Ctrl-C, EXIT_PREEMPTED (75,
"temporary failure: try again") after a preemption signal, so a job script can requeue on it. A second signal of
the same kind stops at once (`StoppedNow`, a KeyboardInterrupt), after printing every thread's Python stack (a step
that does not end shows where it is), with the same status: 130 after Ctrl-C, 75 after a preemption signal (the job
requeues and resumes from the last checkpoint); one within SAME_REQUEST_S of the first is taken as the same request
(a scheduler signals every process and the launcher forwards it again). The handler only sets a flag, so no step,
collective or file write is cut in half. The ranks of a launch agree on the step they stop at and on the signal
(one all-reduce every step in one process and every log step in several), so no rank waits in a collective alone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("ssl_vit")

EXIT_FAILED, EXIT_PREEMPTED, EXIT_INTERRUPTED = 1, 75, 130  # 75: EX_TEMPFAIL of sysexits.h
SAME_REQUEST_S = 2.0
EXIT_STATUS_FILE_ENV = "SSL_VIT_EXIT_STATUS_FILE"  # set by ssl_vit.launch: where the main process records its status


def record_exit_status(status: int) -> None:
    """The main process's exit status, for the launch that started it (ssl_vit.launch names the file in
    EXIT_STATUS_FILE_ENV): accelerate's launcher reports every failing run, a preempted one too, as status 1."""
    path = os.environ.get(EXIT_STATUS_FILE_ENV)
    if path and int(os.environ.get("RANK", "0")) == 0:
        with contextlib.suppress(OSError):
            Path(path).write_text(str(status))


def stop_status(signal_name: str | None) -> int:
    """The exit status of a run that stopped on `signal_name` after saving; 0 for None (it finished)."""
    if signal_name is None:
        return 0
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


class StoppedNow(KeyboardInterrupt):
    """A second stop signal of the same kind: the run stops at once, without a checkpoint of the current step."""

    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} again: stopped at once")
        self.signal_name = signal_name


class StopRequests:
    """A context: while inside, SIGINT and the preemption signals set `requested` (the signal's name) instead of
    ending the process."""

    def __init__(self, preempt_signals=("SIGTERM", "SIGUSR1"), announce: bool = True):
        self.signals = [signal.SIGINT, *(signal.Signals[str(getattr(s, "value", s))] for s in preempt_signals)]
        self.requested: str | None = None
        self.requested_at = 0.0
        self.announce, self.previous = announce, {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and time.monotonic() - self.requested_at < SAME_REQUEST_S:
            return  # the same request reaching this process twice (scheduler and launcher)
        if self.requested == name:  # the second of the same kind: stop now, showing where the step was
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            print(f"\nssl-vit: {name} again: stopping now; every thread's stack:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise StoppedNow(name)
        if self.requested is not None:
            return  # another kind while stopping (e.g. SIGTERM after SIGUSR1): the checkpoint is on its way
        self.requested, self.requested_at = name, time.monotonic()
        if self.announce and int(os.environ.get("RANK", "0")) == 0:
            print(f"\nssl-vit: {name}: stopping after this step with a checkpoint ({name} again: stop now, "
                  "losing the steps since the last checkpoint)", file=sys.stderr, flush=True)

    def agreed(self, accelerator) -> str | None:
        """The signal any rank was asked to stop by (the same name on every rank; collective when there are
        several ranks), or None."""
        if accelerator.num_processes == 1:
            return self.requested
        number = signal.Signals[self.requested].value if self.requested else 0
        flag = torch.tensor([float(number)], device=accelerator.device)
        number = int(accelerator.reduce(flag, reduction="max").item())
        return signal.Signals(number).name if number else None


def resume_command(out_dir) -> str:
    """The command line of this run with trainer.resume=auto and its run directory, for the closing message."""
    kept = [arg for arg in sys.argv[1:]
            if not arg.lstrip("+").startswith(("trainer.resume=", "out=", "hydra.run.dir=", "trainer.overwrite="))]
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ
    start = "accelerate launch <the same launch options>" if launched else "python"
    return " ".join([start, shlex.quote(sys.argv[0]), *map(shlex.quote, kept), "trainer.resume=auto",
                     shlex.quote(f"out={out_dir}")])
