"""Named fault points for the fault-injection tests: with SSL_VIT_FAULT=<point>@<step> in the environment, the
process SIGKILLs itself when it reaches that point at that step, exactly as a node failure or an OOM killer would.

Points: `step_done` (after the optimizer step and its log line, before any checkpoint), `checkpoint_written` (the
checkpoint is complete in its temp directory, not yet renamed into place), `checkpoint_rotating` (in place, the
oldest beyond trainer.keep_checkpoints renamed out of the way, not yet deleted), `checkpoint_saved` (renamed into
place, old ones deleted, before encoder.safetensors is written). And one that is not a kill: `nan_loss@<step>`
makes that step's loss NaN on rank 0, to test that the update is skipped under every strategy; `eval_error@<step>`
makes the main process's evaluation at that step raise, to test that every rank stops; and `sigint@<step>`
(`sigterm@`, `sigusr1@`, any signal's lower-case name) makes the last rank send itself that signal at `step_done`,
as a Ctrl-C or a scheduler would (the other ranks get none: they must stop with it); `hang@<step>` makes the last
rank wait for ever at `step_done`, as a step that never ends would (trainer.step_timeout_s, a second signal).
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_ENV = "SSL_VIT_FAULT"


def _fault() -> str | None:
    """The fault asked for, read when a point is reached (a run in a process forked or called after the
    environment was set sees its own)."""
    return os.environ.get(FAULT_ENV)


def fault_point(name: str, step: int) -> None:
    fault = _fault()
    if fault is None:
        return
    if fault == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    last_rank = int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
    if name == "step_done" and fault.startswith("sig") and fault.endswith(f"@{step}") and last_rank:
        os.kill(os.getpid(), signal.Signals[fault.split("@")[0].upper()])
    if name == "step_done" and fault == f"hang@{step}" and last_rank:
        threading.Event().wait()  # never set; a signal's handler still runs (and may raise) in this thread


def poisoned(loss, step: int):
    """The loss, or NaN at the step SSL_VIT_FAULT=nan_loss@<step> names (rank 0 only: the others stay finite)."""
    if _fault() == f"nan_loss@{step}" and os.environ.get("RANK", "0") == "0":
        return loss * float("nan")
    return loss


def injected_error(name: str, step: int) -> None:
    """Raise at the point SSL_VIT_FAULT=<name>@<step> names (a failure of this process alone)."""
    if _fault() == f"{name}@{step}":
        raise RuntimeError(f"injected failure ({FAULT_ENV}={_fault()})")
