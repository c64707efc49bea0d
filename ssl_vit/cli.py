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

import contextlib
import dataclasses
import inspect
import logging
import os
import re
import shutil
import sys
from enum import Enum
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from ssl_vit.backbone import PRESETS, VisionTransformer
from ssl_vit.config import (
    BenchmarkConfig,
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
from ssl_vit.objectives import OBJECTIVES
from ssl_vit.paths import CONFIG_DIR
from ssl_vit.run_dirs import default_run_dir, evaluation_dir
from ssl_vit.schema import ConfigError, closest_names, not_one_of
from ssl_vit.train.build import requirements
from ssl_vit.train.guard import TrainingDiverged
from ssl_vit.train.outputs import OutputError, check_writable, describe_write_failure
from ssl_vit.train.stop_requests import EXIT_FAILED, record_exit_status, stop_status
from ssl_vit.train.strategy import MainProcessFailed

EXIT_STOPPED, EXIT_CONFIG = EXIT_FAILED, 2


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
    record_exit_status(status)
    sys.exit(status)


def exit_without_teardown(status: int = 0) -> None:
    """End a finished multi-process run here, skipping the interpreter's teardown of C++ state (process-group
    threads): measured on this machine, rank 1 of a finished 2-process gloo run sometimes aborted there
    ("terminate called without an active exception", SIGABRT: 2 of 3 full test runs, each time after every output
    was written and the process group destroyed). A single process exits normally."""
    record_exit_status(status)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if status:
            sys.exit(status)
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def stopped_status(summary: dict | None) -> int:
    """The exit status of a run that stopped on a signal after saving (130: Ctrl-C, 75: a preemption signal), so a
    job script can tell it from a finished run (0) and requeue it; else 0."""
    return (summary or {}).get("exit_status") or 0


def run_reporting_errors(function, *args):
    """Call `function(*args)`; known failures become one line on stderr and an exit status."""
    try:
        return function(*args)
    except ConfigError as err:
        discard_unused_run_dir()
        fail(user_message(err), EXIT_CONFIG)
    except (TrainingDiverged, OutputError, DataError, MainProcessFailed) as err:
        fail(user_message(err), EXIT_STOPPED)
    except KeyboardInterrupt as err:  # a second Ctrl-C or preemption signal (the first stops with a checkpoint)
        name = getattr(err, "signal_name", "SIGINT")
        how = "requeue the job, or continue" if name != "SIGINT" else "continue"
        fail(f"{'interrupted' if name == 'SIGINT' else f'stopped at once ({name} again)'}: the steps since the last "
             f"checkpoint are lost; {how} from it with trainer.resume=auto and the same out=", stop_status(name))


def discard_unused_run_dir() -> None:
    """A run refused for its configuration leaves nothing behind: remove Hydra's run directory when it holds only
    what Hydra wrote there (.hydra/), and its output group when that is then empty."""
    if int(os.environ.get("RANK", "0")) != 0 or not HydraConfig.initialized():
        return
    run = Path(HydraConfig.get().runtime.output_dir)
    if run.is_dir() and {entry.name for entry in run.iterdir()} <= {".hydra"}:
        shutil.rmtree(run, ignore_errors=True)
        with contextlib.suppress(OSError):
            run.parent.rmdir()  # only when empty: the output group this launch created


POSITIONAL = {"evaluate": "checkpoint"}  # the key a leading argument without "=" sets
HELP_GROUPS = {"pretrain": ("model", "objective", "data", "optim", "trainer"), "evaluate": ("data", "eval"),
               "benchmark": ("benchmark",),
               "plan_memory": ("model",)}


def print_help(config_name: str, doc: str | None) -> None:
    """--help: the script's docstring and the groups it composes, with their options (Hydra's own help lists every
    folder of configs/, the schema groups and the accelerate files included)."""
    print((doc or "").strip() + "\n\nGroups (group=option):")
    stored = ConfigStore.instance().repo
    for group in HELP_GROUPS.get(config_name, ()):
        options = {path.stem for path in (CONFIG_DIR / group).glob("*.yaml")}
        options |= {name.removesuffix(".yaml") for name in stored.get(group, {})}
        print(f"  {group}: {', '.join(sorted(options))}")
    program = sys.argv[0] if sys.argv[0].startswith("ssl-vit") else f"python {sys.argv[0]}"
    print(f"\nAny key: key=value (the keys and their values: {program} --cfg job; one group's: "
          "--cfg job --package <group>). Hydra's own flags: --hydra-help.")


def wants_job_config(args: list[str]) -> bool:
    """`--cfg job` (or `-c job`) without `--package`: the whole composed config of the job."""
    pairs = list(zip(args, args[1:], strict=False))
    return any(flag in ("--cfg", "-c") and value == "job" for flag, value in pairs) and not any(
        arg in ("--package", "-p") for arg in args)


def show_job_config(config_name: str, overrides: list[str], resolve: bool) -> bool:
    """Print the composed config as `--cfg job` does, but with the values a model preset (and the objective's
    model defaults) gives where `model.*` is null ("the preset's"), so the architecture is visible. False (Hydra
    prints instead) where composing fails: Hydra then reports why."""
    try:
        cfg = _compose_job(config_name, [o for o in overrides if "=" in o or o.startswith("~")])  # not "job"
        if "model" in cfg and cfg.model.get("name") in PRESETS and "objective" in cfg:
            _, needs = requirements(cfg.objective)
            built = {name: param.default for name, param in inspect.signature(VisionTransformer).parameters.items()
                     if param.default is not inspect.Parameter.empty}
            effective = {**built, **PRESETS[cfg.model.name], **needs.defaults_for(cfg.model.name)}
            for key in list(cfg.model):
                if cfg.model[key] is None and effective.get(key) is not None:
                    cfg.model[key] = effective[key]
        text = OmegaConf.to_yaml(cfg, resolve=resolve)
    except Exception:  # noqa: BLE001 (Hydra's own --cfg path reports the problem)
        return False
    print(text, end="")
    return True


def run_hydra(main, config_name: str, doc: str | None = None) -> None:
    """Call a @hydra.main function so that Hydra's own errors about the command line (an unknown key, an unknown
    option of a group, a value its grammar cannot read) end in one `ssl-vit: error:` line naming the closest valid
    names, with exit status 2, instead of Hydra's message (which advises `+key=`, silently adding a key nothing
    reads) and exit status 1. HYDRA_FULL_ERROR=1 set by the user keeps Hydra's full report."""
    positional = POSITIONAL.get(config_name)
    if positional and len(sys.argv) > 1 and "=" not in sys.argv[1] and not sys.argv[1].startswith("-"):
        sys.argv[1] = f"{positional}={sys.argv[1]}"  # `evaluate.py RUN ...` as export.py and analyze.py take it
    overrides = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print_help(config_name, doc)
        return
    if wants_job_config(sys.argv[1:]) and show_job_config(config_name, overrides, "--resolve" in sys.argv):
        return
    users = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing and exiting
    try:
        repeated_key_check(overrides)
        main()
    except (ConfigCompositionException, OverrideParseException) as err:
        if users:
            raise
        fail(explain_hydra_error(err, config_name, overrides), EXIT_CONFIG)
    except OSError as err:  # Hydra's own writes of the run's config (.hydra/): ours become OutputError in the job
        if users or not HydraConfig.initialized():
            raise
        run = Path(HydraConfig.get().runtime.output_dir)
        fail(f"cannot write the run's config in {run}: {describe_write_failure(run, err)} (out=)", EXIT_CONFIG)
    finally:
        if not users:  # as it was (a caller in the same process, e.g. a test, sees no change)
            os.environ.pop("HYDRA_FULL_ERROR", None)


def repeated_key_check(overrides: list[str]) -> None:
    """A key given several times with paths that differ only in their digits: the shell expanded a brace pattern
    (data.urls=shard-{000000..000019}.tar unquoted) and Hydra would keep only the last path."""
    values: dict[str, list[str]] = {}
    for arg in overrides:
        if "=" in arg:
            key, value = arg.split("=", 1)
            values.setdefault(key.lstrip("+~"), []).append(value)
    for key, found in values.items():
        patterns = {re.sub(r"\d+", "#", value) for value in found}
        pattern = next(iter(patterns))
        path_like = "/" in pattern or re.search(r"\.[A-Za-z]{2,}$", pattern)
        if len(found) > 1 and len(set(found)) == len(found) and len(patterns) == 1 and path_like:
            fail(f"{key} is given {len(found)} times ({found[0]} ... {found[-1]}): the shell expanded a brace "
                 f"pattern; quote it for the shell and for Hydra: '{key}=\"...{{000000..000019}}.tar\"'", EXIT_CONFIG)


def explain_hydra_error(err: Exception, config_name: str, overrides: list[str]) -> str:
    """One line for Hydra's and OmegaConf's composition errors, read from their exception types and attributes:
    an option a config group lacks (MissingConfigException), a key no schema has (ConfigKeyError /
    ConfigAttributeError with the schema as object_type), a value its type refuses (ValidationError: an enum's
    choices, a number), an override the grammar cannot parse."""
    cause = err.__cause__
    if isinstance(err, MissingConfigException) and "/" in (err.missing_cfg_file or ""):
        group, option = err.missing_cfg_file.rsplit("/", 1)
        return f"{group}={option} is not an option of {group}" + closest_names(option, list(err.options or []),
                                                                               prefix=f"{group}=")
    if isinstance(err, OverrideParseException) and "{" in " ".join(overrides):
        braced = next(o for o in overrides if "{" in o)
        key, _, value = braced.partition("=")
        return (f"{braced}: Hydra's override grammar reads {{...}} as a dictionary; a brace pattern needs double "
                f"quotes inside the shell's single quotes: '{key}=\"{value}\"'")
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.key is not None:
        return _unknown_key(cause, config_name, overrides)
    if isinstance(cause, ValidationError) and cause.full_key:
        enum_type = _enum_of(cause)
        if enum_type is not None:
            return not_one_of(cause.full_key, cause.value, [member.name for member in enum_type])
        return f"{cause.full_key}={cause.value} is invalid: {cause.msg.strip().splitlines()[0]}"
    return str(err).strip().splitlines()[0] + " (see https://hydra.cc/docs/advanced/override_grammar/basic)"


def _enum_of(cause: ValidationError):
    """The Enum a refused value was meant for: its node's (a field), or its list's element type (a list item)."""
    if getattr(cause.child_node, "enum_type", None) is not None:
        return cause.child_node.enum_type
    element = getattr(getattr(cause.parent_node, "_metadata", None), "element_type", None)
    return element if isinstance(element, type) and issubclass(element, Enum) else None


def _unknown_key(cause, config_name: str, overrides: list[str]) -> str:
    """A key its schema lacks: at a config path, or inside an item of a list of schemas (objective.teachers=[{}])."""
    schema, key = cause.object_type, str(cause.key)
    valid = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    listed = next((o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o
                   and o.split("=", 1)[1].lstrip().startswith("[") and f"{key}:" in o.split("=", 1)[1]), None)
    if listed is not None and "." not in (cause.full_key or ""):
        return (f"unknown key {key!r} in an item of {listed} ({getattr(schema, '__name__', 'its schema')})"
                + closest_names(key, valid, prefix=""))
    full_key = cause.full_key or key
    parent = full_key.rpartition(".")[0]
    if not valid:  # a node without a schema: the keys it has once the other overrides are composed
        valid = _keys_of(config_name, parent, [o for o in overrides if not o.lstrip("+~").startswith(full_key + "=")])
    return f"unknown key {full_key}" + closest_names(key, valid, prefix=f"{parent}." if parent else "")


def _compose_job(config_name: str, overrides: list[str]):
    """The job's config as the script would compose it (Hydra's own hydra.* overrides left out)."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name, overrides=[o for o in overrides if not o.startswith("hydra")])


def _keys_of(config_name: str, node: str, overrides: list[str]) -> list[str]:
    """The keys of `node` in the config composed from the other overrides (empty if that fails too)."""
    try:
        composed = _compose_job(config_name, overrides)
        selected = OmegaConf.select(composed, node) if node else composed
        return [str(key) for key in selected] if selected is not None else []
    except Exception:  # noqa: BLE001 (only a suggestion: any failure leaves it out)
        return []


class OutputDirCheck(Callback):
    def on_run_start(self, config, **kwargs) -> None:
        directory = Path(str(config.hydra.run.dir))
        try:
            check_writable(directory)
        except OutputError as err:
            fail(f"{err} (hydra.run.dir)", EXIT_CONFIG)


def register_configs() -> None:
    """Register the schemas, the model presets and the `launch_time` resolver (idempotent: once a process, while
    the store holds them; each schema is converted by OmegaConf, ~0.3 s in all)."""
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)
        OmegaConf.register_new_resolver("run_dir", default_run_dir, use_cache=True)
        OmegaConf.register_new_resolver("evaluation_dir", evaluation_dir, use_cache=True)
    store = ConfigStore.instance()
    if "pretrain_schema.yaml" in store.repo:
        return
    store.store(name="pretrain_schema", node=PretrainConfig)
    store.store(name="probe_schema", node=ProbeConfig)
    store.store(name="plan_schema", node=PlanConfig)
    store.store(name="benchmark_schema", node=BenchmarkConfig)
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
