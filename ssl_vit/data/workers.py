"""Loader workers leave the stop signals to the training process. A scheduler signals every process of a job step
(SLURM's --signal, its time limit) and a terminal's Ctrl-C reaches the whole foreground group; a worker killed by
such a signal would end the run with a DataLoader error before the trainer writes its checkpoint.

A stop signal sent by the worker's own parent still ends it: that is how the parent shuts down the workers of a loader
it still holds when it exits (multiprocessing's exit handler terminates its daemonic children and then waits for
them), and a worker ignoring it would keep the parent from ever exiting. The workers also end when the loader shuts
them down and with the training process (PyTorch's parent watchdog)."""

from __future__ import annotations

import os
import signal
import threading

from ssl_vit.config import PreemptSignal

STOP_SIGNALS = ("SIGINT", *(choice.value for choice in PreemptSignal))  # Ctrl-C and trainer.preempt_signals' choices


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader `worker_init_fn`: stop signals from outside are ignored, those from the parent end the worker."""
    signals = {signal.Signals[name] for name in STOP_SIGNALS}
    if not hasattr(signal, "sigwaitinfo"):  # macOS: no sender to tell apart; the parent's SIGTERM must still work
        for sig in signals - {signal.SIGTERM}:
            signal.signal(sig, signal.SIG_IGN)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # before the thread starts, so that every thread blocks them
    threading.Thread(target=_end_on_signals_from_parent, args=(signals, os.getppid()), daemon=True,
                     name="stop-signals").start()


def _end_on_signals_from_parent(signals: set[signal.Signals], parent: int) -> None:
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_pid == parent:
            os._exit(128 + info.si_signo)  # as the signal's default action reports it
