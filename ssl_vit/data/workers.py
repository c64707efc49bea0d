"""Loader workers leave the stop signals to the training process. A scheduler signals every process of a job step
(SLURM's --signal, its time limit) and a terminal's Ctrl-C reaches the whole foreground group; a worker killed by
such a signal would end the run with a DataLoader error before the trainer writes its checkpoint. The workers
still end when the loader shuts them down, and with the training process (PyTorch's parent watchdog)."""

from __future__ import annotations

import signal

from ssl_vit.config import PreemptSignal

STOP_SIGNALS = ("SIGINT", *(choice.value for choice in PreemptSignal))  # Ctrl-C and trainer.preempt_signals' choices


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader `worker_init_fn`."""
    for name in STOP_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)
