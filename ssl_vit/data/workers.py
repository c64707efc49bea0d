"""Loader workers leave the stop signals to the training process. A scheduler signals every process of a job step
(SLURM's --signal, its time limit) and a terminal's Ctrl-C reaches the whole foreground group; a worker killed by
such a signal would end the run with a DataLoader error before the trainer writes its checkpoint. The workers
still end when the loader shuts them down, and with the training process (PyTorch's parent watchdog).

A process that exits while it still holds such a loader would wait for ever: multiprocessing's exit handler terminates
its daemonic children with SIGTERM, which these workers ignore, and then joins them. So an exit handler of this module
runs first (exit handlers run last-registered first; multiprocessing.util registers its own when it is imported, which
this module does before registering) and does the same with a bound: SIGTERM, then SIGKILL for a daemonic child still
alive a second later."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401 (registers multiprocessing's exit handler before ours)
import signal
import time

from ssl_vit.config import PreemptSignal

STOP_SIGNALS = ("SIGINT", *(choice.value for choice in PreemptSignal))  # Ctrl-C and trainer.preempt_signals' choices


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader `worker_init_fn`. The dispositions hold for every thread of the worker (a blocked mask would
    not: threads started before this call would still take the signals)."""
    for name in STOP_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


def _end_daemonic_children() -> None:
    """What multiprocessing's exit handler does to daemonic children (they may not outlive this process), without
    waiting for ever on one that ignores SIGTERM."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children:  # PyTorch's SIGCHLD handler would raise on a worker ended here, cutting this short
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + 1.0  # one second for all of them, then SIGKILL for those still there
    for child in children:
        child.join(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


atexit.register(_end_daemonic_children)
