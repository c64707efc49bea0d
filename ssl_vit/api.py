"""The Python API: what `ssl-vit pretrain` and `ssl-vit evaluate` do, called from a notebook or another framework.

    run = ssl_vit.pretrain("objective=mae", "model=vit_s16", data="folder", out="runs/mae")  # -> the run directory
    report = ssl_vit.evaluate(run, "data=digits", "eval=knn")                               # -> results.json's dict

Overrides are the command line's `key=value` strings, keyword arguments (`trainer={"max_steps": 3}` sets
trainer.max_steps) or both; the config is composed from the same files (Hydra's compose API), the run directory gets
the same files as a command's (`.hydra/`, the link `latest`), and a bad value raises `ConfigError` with the command's
one-line message. Nothing of Hydra's global state, accelerate's process-wide state or the logging setup is left
behind, so a process can call them any number of times.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from ssl_vit.backbone import VisionTransformer, build_vit
from ssl_vit.cli import discard_unused_run_dir, explain_hydra_error, register_configs
from ssl_vit.encoder import VisionEncoder
from ssl_vit.eval.run import evaluate as run_evaluation
from ssl_vit.eval.run import write_report
from ssl_vit.paths import CONFIG_DIR
from ssl_vit.schema import ConfigError
from ssl_vit.train import pretrain as run_pretraining
from ssl_vit.train.outputs import check_writable


def pretrain(*overrides: str, out: str | Path | None = None, **config) -> Path:
    """Pre-train as `ssl-vit pretrain *overrides` does; returns the run directory. `out` is the command's out=
    (default: outputs/<objective>-<model>-<data>/<time>, relative to the working directory)."""
    arguments = [*overrides, *_keyword_overrides(config)] + ([f"out={out}"] if out is not None else [])
    with _job("pretrain", arguments) as cfg:
        run_pretraining(cfg)
        return Path(cfg.output_dir)


def evaluate(run_or_spec: str | Path, *overrides: str, **config) -> dict:
    """Evaluate an encoder as `ssl-vit evaluate run_or_spec *overrides` does (a run, an encoder file or an import
    form: timm:..., hf:..., open_clip:...); returns the report written to results.json."""
    arguments = [f"checkpoint={run_or_spec}", *overrides, *_keyword_overrides(config)]
    with _job("evaluate", arguments) as cfg:
        report = run_evaluation(cfg, progress=sys.stderr.isatty())
        write_report(report, cfg.output_dir)
        return report


def create_model(name: str, **kwargs) -> VisionTransformer:
    """A backbone preset (`vit_tiny` ... `vit_22b`, `vit_test`, hybrids) with keyword overrides, as
    `timm.create_model`: `create_model("vit_b16", img_size=384, num_registers=4)`."""
    return build_vit(name, **kwargs)


def load_encoder(spec: str | Path, **kwargs) -> VisionEncoder:
    """A trained encoder from any source the commands take: a run directory, its encoder.safetensors, an output
    group, `timm:<name or dir>`, `hf:<id or dir>`, `open_clip:<name or dir>`; kwargs as VisionEncoder.from_pretrained
    (layer, drop_prefix, img_size)."""
    return VisionEncoder.from_pretrained(str(spec), **kwargs)


def _keyword_overrides(config: dict, prefix: str = "") -> list[str]:
    """`trainer={"max_steps": 3}, model="vit_s16"` -> ["trainer.max_steps=3", "model=vit_s16"]."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _keyword_overrides(value, f"{prefix}{key}.")
        else:
            found.append(f"{prefix}{key}={_override_value(value)}")
    return found


def _override_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(_override_value(item) for item in value) + "]"
    return str(value)


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    register_configs()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3", job_name=config_name):
            return compose(config_name, overrides=overrides, return_hydra_config=True)
    except (ConfigCompositionException, OverrideParseException) as err:
        raise ConfigError(explain_hydra_error(err, config_name, overrides)) from err


@contextlib.contextmanager
def _job(config_name: str, overrides: list[str]) -> Iterator[DictConfig]:
    """The job's config, with Hydra's runtime set as `@hydra.main` sets it for a command (the run directory, its
    .hydra/ files) and taken down again afterwards, whatever happens."""
    cfg = _compose(config_name, overrides)
    hydra = HydraConfig.instance()
    with open_dict(cfg):
        run_dir = Path(cfg.hydra.run.dir).resolve()
        cfg.hydra.runtime.output_dir = str(run_dir)
    hydra.set_config(cfg)
    try:
        check_writable(run_dir)
        job = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
        _save_hydra_files(job, cfg.hydra, run_dir, overrides)
        with _progress_log():
            yield job
    except ConfigError:
        discard_unused_run_dir()
        raise
    finally:
        hydra.cfg = None
        AcceleratorState._reset_state(reset_partial_state=True)  # the next call may ask for other precision


def _save_hydra_files(job: DictConfig, hydra: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """config.yaml, hydra.yaml and overrides.yaml in <run>/.hydra, as a command's run has them."""
    folder = run_dir / str(hydra.output_subdir)
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(job, folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": hydra}), folder / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(overrides), folder / "overrides.yaml")


@contextlib.contextmanager
def _progress_log() -> Iterator[None]:
    """The engine's INFO lines (the start-up line, checkpoints) on stdout, as a command shows them, unless the
    caller configured logging; removed afterwards."""
    engine = logging.getLogger("ssl_vit")
    if engine.hasHandlers():
        yield
        return
    handler, level = logging.StreamHandler(sys.stdout), engine.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    engine.addHandler(handler)
    engine.setLevel(logging.INFO)
    try:
        yield
    finally:
        engine.removeHandler(handler)
        engine.setLevel(level)
