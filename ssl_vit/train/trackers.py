"""Experiment trackers through accelerate's tracker classes (`trainer.trackers=[tensorboard, mlflow, wandb, ...]`):
each gets the resolved config as hyperparameters, the per-step metrics, the periodic evaluations and the final
summary (`summary/<key>` at the last step). The main process alone runs them.

A resumed run continues the same tracker run: the MLflow run id and the W&B run id are kept in `<run>/trackers.json`
(MLflow keeps the first invocation's parameters: it refuses to change a logged one, e.g. trainer.resume).
Where they store is each tracker's own business (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, WANDB_MODE=offline,
WANDB_PROJECT); the experiment / project is "ssl-vit" and the run is named after the run directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
from torch.utils.tensorboard.summary import hparams as hparams_summary

from ssl_vit.extras import EXTRA_OF
from ssl_vit.run_dirs import TRACKER_IDS_FILE
from ssl_vit.schema import ConfigError

PROJECT = "ssl-vit"
PIP_NAMES = {"comet_ml": "comet-ml"}  # where the package's pip name differs from the tracker's name


def check_trackers(names) -> list[str]:
    """The names, or a ConfigError naming an unknown tracker (with the valid ones) or the pip command to install."""
    names = [str(name) for name in names]
    available = {str(getattr(tracker, "value", tracker)) for tracker in get_available_trackers()}
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ConfigError(f"trainer.trackers: unknown tracker {name!r}; valid: {', '.join(LOGGER_TYPE_TO_CLASS)}")
        if name not in available:
            how = f"'ssl-vit[{EXTRA_OF[name]}]'" if name in EXTRA_OF else PIP_NAMES.get(name, name)
            raise ConfigError(f"trainer.trackers: {name} is not installed; pip install {how}")
    return names


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Trackers:
    """The run's started trackers; `log` sends numbers to each, `finish` ends them."""

    def __init__(self, names, out_dir: Path, step: int, hparams: dict):
        self.out_dir = Path(out_dir)
        ids_path = self.out_dir / TRACKER_IDS_FILE
        ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
        run_name = f"{self.out_dir.parent.name}/{self.out_dir.name}"
        self.trackers = []
        for name in check_trackers(names):
            try:
                tracker = self._make(name, step, run_name, ids)
                tracker.start()
                if name == "tensorboard":  # into the run's own event file: add_hparams would start a sub-run
                    for summary in hparams_summary(hparams, {}):
                        tracker.writer.file_writer.add_summary(summary)
                elif not (name == "mlflow" and "mlflow" in ids):  # MLflow refuses to change a logged parameter
                    tracker.store_init_configuration(hparams)
            except Exception as err:  # the tracker's own failure (an unreachable server, a missing store)
                self.finish()  # the ones already started (MLflow's active run is process-global)
                raise ConfigError(f"trainer.trackers: {name} could not start ({type(err).__name__}: "
                                  f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})") from err
            self.trackers.append(tracker)
            ids.update(_run_id(name, tracker))
        if ids:
            tmp = ids_path.with_name(f".{ids_path.name}.tmp")
            tmp.write_text(json.dumps(ids, indent=2) + "\n")
            os.replace(tmp, ids_path)

    def _make(self, name: str, step: int, run_name: str, ids: dict):
        cls = LOGGER_TYPE_TO_CLASS[name]
        if name == "tensorboard":  # purge_step hides the events a killed run logged past its checkpoint
            return cls("tb", self.out_dir, purge_step=step + 1)
        if name == "mlflow":
            return cls(experiment_name=PROJECT, run_id=ids.get("mlflow"), run_name=run_name)
        if name == "wandb":
            return cls(os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(self.out_dir),
                       id=ids.get("wandb"), resume="allow")
        return cls(PROJECT, self.out_dir) if cls.requires_logging_directory else cls(PROJECT)

    def log(self, values: dict, step: int) -> None:
        numbers = {key: value for key, value in values.items() if _is_number(value)}
        for tracker in self.trackers:
            tracker.log(numbers, step=step)

    def finish(self, summary: dict | None = None) -> None:
        """Log the summary's numbers as summary/<key> at its step, then end every tracker."""
        if summary is not None:
            self.log({f"summary/{key}": value for key, value in summary.items() if key != "step"}, summary["step"])
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


def _run_id(name: str, tracker) -> dict:
    if name == "mlflow":
        return {"mlflow": tracker.active_run.info.run_id}
    if name == "wandb":
        return {"wandb": tracker.run.id}
    return {}
