"""Stopping a run cleanly on request: Ctrl-C (SIGINT), or SIGTERM (what a launcher sends its workers when it is
itself interrupted, and what a scheduler sends before a time limit).

The first signal asks the run to stop after the current optimizer step: the trainer then writes a checkpoint and
the encoder and prints the command that resumes it. A second signal of the same kind stops at once
(KeyboardInterrupt). The handler only sets a flag, so no step, collective or file write is cut in half. The ranks of
a launch agree on the step they stop at (one all-reduce of the flag, every step in one process and every log step
in several), so no rank waits in a collective alone.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading

import torch

log = logging.getLogger("ssl_vit")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """A context: while inside, the stop signals set `requested` (the signal's name) instead of ending the process."""

    def __init__(self, announce: bool = True):
        self.requested: str | None = None
        self.announce, self.previous = announce, {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested == name:  # the second of the same kind: stop now
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            raise KeyboardInterrupt
        self.requested = self.requested or name
        if self.announce and int(os.environ.get("RANK", "0")) == 0:
            print(f"\nssl-vit: {name}: stopping after this step with a checkpoint ({name} again: stop now, "
                  "losing the steps since the last checkpoint)", file=sys.stderr, flush=True)

    def agreed(self, accelerator) -> bool:
        """Whether any rank was asked to stop (collective when there are several ranks)."""
        if accelerator.num_processes == 1:
            return self.requested is not None
        flag = torch.tensor([float(self.requested is not None)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def resume_command(out_dir) -> str:
    """The command line of this run with trainer.resume=auto and its run directory, for the closing message."""
    kept = [arg for arg in sys.argv[1:]
            if not arg.lstrip("+").startswith(("trainer.resume=", "out=", "hydra.run.dir=", "trainer.overwrite="))]
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ
    start = "accelerate launch <the same launch options>" if launched else "python"
    return " ".join([start, shlex.quote(sys.argv[0]), *map(shlex.quote, kept), "trainer.resume=auto",
                     shlex.quote(f"out={out_dir}")])
