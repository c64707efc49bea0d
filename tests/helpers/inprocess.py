"""The entry points in this process: `python scripts/X.py args` without a new interpreter (~8 s of imports each).

`run_script` runs the file as `__main__` with that command line, so Hydra's main, `run_hydra`'s error lines and the
exit statuses are the real ones; what it changes of the process (environment, working directory, accelerate's
process-wide state, torch's thread count, the root logger's handlers, the captured streams) is put back after."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def process_state(env: dict | None = None, cwd: Path | None = None):
    """Environment (None unsets a variable), working directory, accelerate's state, torch's threads and the root
    logger as they were, whatever the block did to them."""
    from accelerate.state import AcceleratorState

    environ, directory, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    if cwd is not None:
        os.chdir(cwd)
    root.handlers[:] = []  # as in a new interpreter (logging.basicConfig configures only a bare root)
    root.setLevel(logging.WARNING)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(directory)
        torch.set_num_threads(threads)
        root.handlers[:] = handlers
        root.setLevel(level)


def run_script(script: str | Path, *argv: str, env: dict | None = None, cwd: Path | None = None
               ) -> subprocess.CompletedProcess:
    """`python script argv...` in this process: its exit status (SystemExit's code; 1 for an exception that escapes,
    with its traceback on the captured stderr, as the interpreter prints it) and what it printed."""
    path = Path(script) if Path(script).is_absolute() else ROOT / script
    out, err = io.StringIO(), io.StringIO()
    status = 0
    argv_before, path_before = sys.argv, sys.path[:]
    with process_state(env, cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv = [str(path), *map(str, argv)]
        sys.path.insert(0, str(path.parent))  # as `python script` has the script's folder first
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int | None):
                print(stop.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 (reported as the interpreter would, exit status 1)
            import traceback

            traceback.print_exc()
            status = 1
        finally:
            sys.argv, sys.path[:] = argv_before, path_before
    return subprocess.CompletedProcess([str(path), *argv], status, out.getvalue(), err.getvalue())


def pretrain(*overrides: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python scripts/pretrain.py trainer.progress=false overrides...` in this process."""
    return run_script(ROOT / "scripts" / "pretrain.py", "trainer.progress=false", *overrides, env=env, cwd=cwd)
