"""Training processes without paying their imports at every launch.

`accelerate launch --config_file X scripts/pretrain.py ...` costs ~10 s here before its first step: the launcher's
imports, then every rank's (torch, the project, DeepSpeed). `launch_ranks` gives each process the environment that
launch gives its workers (accelerate's own launch code turns the config file into variables; torchrun's per-rank
ones are added as its local agent sets them) and forks the processes from one server that imported the project once
per session (multiprocessing's forkserver: a fresh interpreter, so no thread or OpenMP state of the test process is
forked). Each process then runs the script as `python script.py ...` would, and ends; nothing carries over from one
run to the next. `on_ranks` runs a function on 2 such processes.

What the launcher itself does (forwarding signals, reporting failed ranks, its exit status, a multi-node
rendezvous) is tested through real launches (conftest.launch). The session's pool (helpers.pool) launches CLIP under
every shipped strategy through the real launcher, and the preemption and two-machine tests compare real DDP and
ZeRO-3 launches with forked runs of the same configuration, loss for loss.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.cores import widen

ROOT = Path(__file__).resolve().parents[2]
# What a rank of a training run imports, imported once by the server the ranks are forked from. Names of installed
# packages only: Python 3.11's forkserver does not take the test process's sys.path (tests/ is not on it), and it
# skips a preload it cannot import without a word.
PRELOAD = ["ssl_vit.cli", "ssl_vit.train", "deepspeed", "accelerate.utils.deepspeed", "open_clip", "transformers",
           "tensorboard", "torch.distributed.checkpoint", "torch.distributed.fsdp"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)
GRACE_S = 5  # torchrun stops the other ranks when one fails; so do we, after this long


def _start(process) -> None:
    """Every process this module starts passes here (the fast tier's guard, in conftest, replaces it)."""
    process.start()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(config_file: Path, port: int) -> tuple[dict[str, str], int]:
    """The environment `accelerate launch --config_file config_file` runs its script in (before torchrun's
    per-rank variables), and its number of processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(config_file), "--main_process_port", str(port), "script.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command prepares a DeepSpeed launch
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
        return env, 1
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with more than one process per node
    return env, args.num_processes


def rank_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for one worker of a one-node launch (torch.distributed.elastic's local agent)."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _as_launched(env: dict[str, str], out: str, err: str) -> None:
    """This process as a launched one: that environment, stdout and stderr into those files."""
    os.environ.clear()
    os.environ.update(env)
    if int(env.get("WORLD_SIZE", "1")) > 1:
        widen()  # the ranks of a run share the session's cores (helpers.cores)
    # A process started by the forkserver inherits its start method; a launched one starts DataLoader workers with
    # the platform's default (fork here), not by a second server of its own that imports everything again (~12 s).
    multiprocessing.set_start_method(None, force=True)
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path and path not in sys.path]
    sys.path[:0] = paths  # as an interpreter started with that PYTHONPATH has it
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stream)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _run_script(script: str, argv: list[str], env: dict[str, str], out: str, err: str, setup) -> None:
    _as_launched(env, out, err)
    if setup is not None:
        setup()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _wait(processes: list, timeout: float, what: str) -> list[int]:
    """Exit statuses; when one process fails the others get GRACE_S to finish, then are killed, as torchrun does."""
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any(p.exitcode is None for p in processes):
            running = [p.sentinel for p in processes if p.exitcode is None]
            limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
            if not multiprocessing.connection.wait(running, timeout=max(0.0, limit - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{what} ran past {timeout} s")
                break  # the grace period after a failure is over
            if failed_at is None and any(p.exitcode for p in processes if p.exitcode is not None):
                failed_at = time.monotonic()
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join()
    return [p.exitcode for p in processes]


def start_script(script: Path, *argv: str, config: Path, log_dir: Path, env: dict | None = None, setup=None):
    """Start `script argv` on the processes `config` (an accelerate config file) launches; returns them and their
    (stdout, stderr) files. `env`: more variables (None removes one); `setup`: a picklable function each process
    calls first (e.g. to lower a resource limit)."""
    port = free_port()
    base, world = launch_env(config, port)
    for name, value in (env or {}).items():
        if value is None:
            base.pop(name, None)
        else:
            base[name] = str(value)
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [(log_dir / f"rank{r}.out", log_dir / f"rank{r}.err") for r in range(world)]
    processes = []
    for rank, (out, err) in enumerate(logs):
        environment = rank_env(base, rank, world, port) if world > 1 else base
        processes.append(_CONTEXT.Process(target=_run_script, name=f"rank{rank}", args=(
            str(script), list(map(str, argv)), environment, str(out), str(err), setup)))
        _start(processes[-1])
    return processes, logs


def finish(processes, logs, argv, timeout: float = 300) -> subprocess.CompletedProcess:
    """Wait for started processes: the first failing exit status (0 if none; -N: killed by signal N), and their
    stdout and stderr each in rank order."""
    codes = _wait(processes, timeout, " ".join(map(str, argv)))
    status = next((code for code in codes if code), 0)
    return subprocess.CompletedProcess(list(argv), status, "".join(out.read_text() for out, _ in logs),
                                       "".join(err.read_text() for _, err in logs))


def launch_ranks(script: Path, *argv: str, config: Path, log_dir: Path, env: dict | None = None, setup=None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file config script argv` as forked processes (see the module's docstring)."""
    processes, logs = start_script(script, *argv, config=config, log_dir=log_dir, env=env, setup=setup)
    return finish(processes, logs, [str(script), *argv], timeout)


def pretrain_ranks(*overrides: str, config: str = "cpu", log_dir: Path, env: dict | None = None, setup=None,
                   timeout: float = 300) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/<config>.yaml scripts/pretrain.py trainer.progress=false
    overrides` as forked processes."""
    return launch_ranks(ROOT / "scripts" / "pretrain.py", "trainer.progress=false", *overrides,
                        config=ROOT / "configs" / "accelerate" / f"{config}.yaml", log_dir=log_dir, env=env,
                        setup=setup, timeout=timeout)


def _call_on_rank(function, rank: int, world: int, port: int, args: tuple, out: str, err: str) -> None:
    import torch.distributed as dist

    _as_launched(rank_env(dict(os.environ), rank, world, port), out, err)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        function(rank, *args)
    finally:
        dist.destroy_process_group()


def on_ranks(function, *args, log_dir: Path, world: int = 2, timeout: float = 300) -> None:
    """function(rank, *args) on `world` forked processes joined in one gloo process group (function: importable,
    e.g. a test module's top-level function). Raises with the ranks' stderr if one fails."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [(log_dir / f"rank{r}.out", log_dir / f"rank{r}.err") for r in range(world)]
    processes = [_CONTEXT.Process(target=_call_on_rank, args=(function, r, world, port, args, str(out), str(err)))
                 for r, (out, err) in enumerate(logs)]
    for process in processes:
        _start(process)
    codes = _wait(processes, timeout, getattr(function, "__name__", str(function)))
    if any(codes):
        raise RuntimeError(f"{function.__name__} on {world} ranks: exit statuses {codes}\n"
                           + "".join(err.read_text()[-3000:] for _, err in logs))
