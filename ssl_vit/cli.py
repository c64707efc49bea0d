"""What the entry points share: failures end in one line, `ssl-vit: error: <what, the value, what is allowed>`,
never a traceback. Exit status 2 for a bad configuration (nothing was trained), 1 for a run that stopped
(divergence, unusable data, an output that cannot be written). `accelerate launch` reports any failing child with
its own CalledProcessError traceback and exit status 1 after our line; the first line on stderr is ours.

`OutputDirCheck` is a Hydra callback (`hydra.callbacks` in configs/pretrain.yaml and evaluate.yaml): Hydra
creates the run directory before the job starts, so an unwritable one is reported from here, before Hydra's own
traceback. `register_configs` puts every schema in Hydra's ConfigStore: the engine's, each dataset kind's (the
registry) and each objective's (the registry), so it lives here, above all of them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from objectives import OBJECTIVES
from ssl_vit.config import (
    EvalConfig,
    ModelConfig,
    OptimConfig,
    PlanConfig,
    PretrainConfig,
    ProbeConfig,
    TrainerConfig,
    launch_time,
)
from ssl_vit.data import DATASETS
from ssl_vit.data.errors import DataError
from ssl_vit.schema import ConfigError
from ssl_vit.train.guard import TrainingDiverged
from ssl_vit.train.outputs import OutputError, check_writable
from ssl_vit.train.strategy import MainProcessFailed
from ssl_vit.vit import PRESETS

EXIT_STOPPED, EXIT_CONFIG = 1, 2


def user_message(err: BaseException) -> str:
    """The message of an error; a DataLoader worker's error arrives wrapped in its traceback text, whose last line
    is `module.Class: message`."""
    text = str(err).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text.replace("\n", " ")


def fail(message: str, status: int) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if status != EXIT_CONFIG or rank == 0:  # a bad config is the same on every rank: say it once
        print(f"ssl-vit: error: {'' if rank == 0 else f'[rank {rank}] '}{message}", file=sys.stderr, flush=True)
    sys.exit(status)


def exit_without_teardown() -> None:
    """End a finished multi-process run here, skipping the interpreter's teardown of C++ state (process-group
    threads): measured on this machine, rank 1 of a finished 2-process gloo run sometimes aborted there
    ("terminate called without an active exception", SIGABRT: 2 of 3 full test runs, each time after every output
    was written and the process group destroyed). A single process exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_reporting_errors(function, *args):
    """Call `function(*args)`; known failures become one line on stderr and an exit status."""
    try:
        return function(*args)
    except ConfigError as err:
        fail(user_message(err), EXIT_CONFIG)
    except (TrainingDiverged, OutputError, DataError, MainProcessFailed) as err:
        fail(user_message(err), EXIT_STOPPED)


class OutputDirCheck(Callback):
    def on_run_start(self, config, **kwargs) -> None:
        directory = Path(str(config.hydra.run.dir))
        try:
            check_writable(directory)
        except OutputError as err:
            fail(f"{err} (hydra.run.dir)", EXIT_CONFIG)


def register_configs() -> None:
    """Register the schemas, the model presets and the `launch_time` resolver (idempotent)."""
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)
    store = ConfigStore.instance()
    store.store(name="pretrain_schema", node=PretrainConfig)
    store.store(name="probe_schema", node=ProbeConfig)
    store.store(name="plan_schema", node=PlanConfig)
    store.store(group="schema/eval", name="eval", node=EvalConfig)
    # Schemas live in their own groups (schema/<group>/<option>) so that Hydra's list of valid options for a
    # group shows only the real options; each option file pulls its schema in with `/schema/...@_here_`.
    store.store(group="schema/optim", name="adamw", node=OptimConfig)
    store.store(group="schema/trainer", name="default", node=TrainerConfig)
    for name, kind in DATASETS.items():
        store.store(group="schema/data", name=name, node=kind.config)
    for name, objective in OBJECTIVES.items():
        store.store(group="schema/objective", name=name, node=objective.config_class)
    for name in PRESETS:
        store.store(group="model", name=name, node=ModelConfig(name=name))
