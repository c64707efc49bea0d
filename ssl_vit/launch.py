"""`python -m ssl_vit.launch [accelerate launch options] SCRIPT [ARGS]`: accelerate's launcher, ending with the run's
own exit status.

`accelerate launch` ends with status 1 and a traceback of its own whenever a process of the run fails, whatever it
exited with, so to a job script a run stopped for preemption (every rank saved a checkpoint and exited 75) looks
like a crash. This runs the same launch (accelerate's parser and launch code, in this process; the options are
accelerate's) and exits with the status the run's main process recorded (`record_exit_status`: at the CLI's exit,
and the step watchdog's): 75 after a preemption signal (requeue it), 130 after Ctrl-C, 2 for a bad configuration, 1
when it stopped on an error (a step past trainer.step_timeout_s included), 0 when it finished. A launch that failed
without a recorded status (a crash, a killed process) ends in one line naming the first process that failed and
status 1, or that process's own status with a single process.

    python -m ssl_vit.launch --config_file configs/accelerate/ddp_gpu8.yaml scripts/pretrain.py objective=dinov2
    ssl-vit launch --config_file ddp_gpu8 pretrain objective=dinov2      # the same, installed, from any directory

Installed, `--config_file` may name a shipped accelerate config (configs/accelerate/<name>.yaml, e.g. zero3_gpu8:
its DeepSpeed JSON is found beside it), and the script may be an `ssl-vit` command (run as `-m ssl_vit <command>`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ssl_vit.commands import COMMANDS
from ssl_vit.paths import CONFIG_DIR
from ssl_vit.train.stop_requests import EXIT_FAILED, EXIT_STATUS_FILE_ENV

MEANINGS = {0: "finished", 2: "a bad configuration", 75: "stopped for preemption with a checkpoint: requeue it",
            130: "interrupted (Ctrl-C)"}


def describe(failure: BaseException) -> tuple[str, int]:
    """(what failed, in words; the status to exit with when the run recorded none)."""
    if isinstance(failure, subprocess.CalledProcessError):  # one process: its own status is the run's
        return f"the process exited with status {failure.returncode}", failure.returncode
    if hasattr(failure, "get_first_failure"):  # torchrun's ChildFailedError
        rank, process = failure.get_first_failure()
        code = process.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"rank {rank} {how} first", EXIT_FAILED
    if hasattr(failure, "sigval"):  # torchrun's SignalException: the launcher itself was signalled
        return f"the launcher got {failure.sigval.name}", EXIT_FAILED
    if isinstance(failure, SystemExit):
        return f"the launcher exited with status {failure.code}", EXIT_FAILED
    return f"{type(failure).__name__}: {str(failure).strip().splitlines()[0] if str(failure).strip() else ''}", \
        EXIT_FAILED


def shipped_config(name: str | None, scratch: Path) -> str | None:
    """`--config_file` as given when it is a file; else the shipped accelerate config of that name (a copy in
    `scratch` whose DeepSpeed JSON points at the shipped one); FileNotFoundError naming the shipped ones."""
    if name is None or Path(name).is_file():
        return name
    shipped = CONFIG_DIR / "accelerate" / f"{Path(name).stem}.yaml"
    if not shipped.is_file():
        names = sorted(path.stem for path in (CONFIG_DIR / "accelerate").glob("*.yaml"))
        raise FileNotFoundError(f"--config_file {name}: no such file, and no shipped accelerate config of that name "
                                f"(shipped: {', '.join(names)})")
    config = yaml.safe_load(shipped.read_text())
    deepspeed = config.get("deepspeed_config", {})
    json_file = deepspeed.get("deepspeed_config_file")
    if json_file and not Path(json_file).is_file():  # configs/deepspeed/<name>.json, relative to a checkout
        deepspeed["deepspeed_config_file"] = str(CONFIG_DIR / "deepspeed" / Path(json_file).name)
    copy = scratch / shipped.name
    copy.write_text(yaml.safe_dump(config))
    return str(copy)


def main(argv: list[str] | None = None) -> int:
    # imported here, after ssl_vit.train set DS_ACCELERATOR (DeepSpeed's CPU warning), and only for a launch
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ssl-vit-launch-") as scratch:
        try:
            args.config_file = shipped_config(args.config_file, Path(scratch))
        except FileNotFoundError as err:
            print(f"ssl-vit launch: error: {err}", file=sys.stderr, flush=True)
            return 2
        if not args.module and args.training_script in COMMANDS and not Path(args.training_script).exists():
            args.module, args.training_script_args = True, [args.training_script, *args.training_script_args]
            args.training_script = "ssl_vit"  # python -m ssl_vit <command> in every process
        status_file = Path(scratch) / "exit_status"
        os.environ[EXIT_STATUS_FILE_ENV] = str(status_file)  # the processes inherit the launcher's environment
        failure = None
        try:
            launch_command(args)
        except BaseException as err:  # noqa: BLE001 (every way a launch ends is turned into an exit status)
            failure = err
        recorded = int(status_file.read_text()) if status_file.is_file() else None
    if failure is None:
        return recorded or 0
    what, fallback = describe(failure)
    if recorded is not None:
        print(f"ssl-vit launch: {what}; the run's main process exited {recorded} "
              f"({MEANINGS.get(recorded, 'stopped on an error')})", file=sys.stderr, flush=True)
        return recorded
    print(f"ssl-vit launch: error: {what}, and the run recorded no exit status (a crash or a kill: see its output "
          "above)", file=sys.stderr, flush=True)
    return fallback


if __name__ == "__main__":
    sys.exit(main())
