"""trainer.step_timeout_s: a step that stops making progress (a collective one rank never joins, a loop that never
ends) is reported instead of holding the job until its time limit. A thread of each process waits for the step to
finish; past the limit it prints one line naming the step and the limit, dumps every thread's Python stack
(faulthandler) and ends the process with EXIT_FAILED. Every rank of a hung step runs past the limit, so each dumps
its own stacks (the rank that never arrived shows where it is; the others, the collective they wait in): a
process waits as long again (at most EXIT_GRACE_MAX_S) before it exits, because its exit breaks the others'
collective, and the stuck rank's step began before theirs (they entered the next one). The limit
covers the whole step: data loading, forward, backward, the update, and the evaluation and checkpoint when due.

The thread needs the interpreter lock for a moment to fire; a step stuck in C++ code holds it rarely (torch's ops
and collectives release it)."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

from ssl_vit.train.stop_requests import EXIT_FAILED, record_exit_status

log = logging.getLogger("ssl_vit")
EXIT_GRACE_MAX_S = 60.0


class StepWatchdog:
    """A context: `started(step)` before each step, `finished()` after it; nothing when `timeout_s` is None."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.step: int | None = None
        self.since = 0.0
        self.changed = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None

    def __enter__(self) -> StepWatchdog:
        if self.timeout_s is not None:
            self.thread = threading.Thread(None, self._watch, "ssl-vit step watchdog", daemon=True)  # (group, function)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify()
        if self.thread is not None:
            self.thread.join()

    def started(self, step: int) -> None:
        with self.changed:
            self.step, self.since = step, time.monotonic()
            self.changed.notify()

    def finished(self) -> None:
        with self.changed:
            self.step = None
            self.changed.notify()

    def _watch(self) -> None:
        with self.changed:
            while not self.closed:  # woken by each change, or when the step in progress reaches the limit
                if self.step is None:
                    self.changed.wait()
                    continue
                left = self.since + self.timeout_s - time.monotonic()
                if left > 0:
                    self.changed.wait(left)
                    continue
                self._expire(self.step)

    def _expire(self, step: int) -> None:
        rank = int(os.environ.get("RANK", "0"))
        print(f"ssl-vit: error: {'' if rank == 0 else f'[rank {rank}] '}step {step} has run past "
              f"trainer.step_timeout_s={self.timeout_s:g}; every thread's stack follows, then this process exits "
              f"with status {EXIT_FAILED} (resume from the last checkpoint with trainer.resume=auto)",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        time.sleep(min(self.timeout_s, EXIT_GRACE_MAX_S))  # the other ranks' limits pass first (see the docstring)
        record_exit_status(EXIT_FAILED)  # for ssl_vit.launch: a stop of ours, not a crash
        os._exit(EXIT_FAILED)
