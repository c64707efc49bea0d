"""Experiment trackers through accelerate's tracker classes (`trainer.trackers=[tensorboard, mlflow, wandb, ...]`):
each gets the resolved config as hyperparameters, the per-step metrics, the periodic evaluations and the final
summary (`summary/<key>` at the last step). The main process alone runs them.

A resumed run continues the same tracker run: the MLflow run id and the W&B run id are kept in `<run>/trackers.json`
(MLflow keeps the first invocation's parameters: it refuses to change a logged one, e.g. trainer.resume).
Where they store is the tracker's own setting (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, WANDB_MODE, WANDB_PROJECT);
with none set, everything goes under the run directory and nothing into the working directory: MLflow into
`<run>/mlflow.db` (SQLite, what MLflow 3 defaults to in the working directory) with artifacts in `<run>/mlartifacts`,
W&B into `<run>/wandb`, offline unless this machine has W&B credentials (WANDB_API_KEY, or `wandb login`'s netrc
entry). The experiment / project is "ssl-vit" and the run is named after the run directory.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
from torch.utils.tensorboard.summary import hparams as hparams_summary

from ssl_vit.extras import EXTRA_OF, require
from ssl_vit.run_dirs import TRACKER_IDS_FILE
from ssl_vit.schema import ConfigError

log = logging.getLogger("ssl_vit")

PROJECT = "ssl-vit"
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"
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
        self.trackers, self.reset_mlflow = [], False
        for name in check_trackers(names):
            try:
                tracker = self._make(name, step, run_name, ids)
                tracker.start()
                if name == "tensorboard":  # into the run's own event file: add_hparams would start a sub-run
                    for summary in hparams_summary(hparams, {}):
                        tracker.writer.file_writer.add_summary(summary)
                elif not (name == "mlflow" and "mlflow" in ids):  # MLflow refuses to change a logged parameter
                    tracker.store_init_configuration(hparams)
            except ConfigError:  # ours: already one line
                self.finish()
                raise
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
            return cls(experiment_name=PROJECT, run_id=ids.get("mlflow"), run_name=run_name,
                       logging_dir=self._mlflow_store())
        if name == "wandb":
            return cls(os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(self.out_dir),
                       id=ids.get("wandb"), resume="allow", mode=self._wandb_mode())
        return cls(PROJECT, self.out_dir) if cls.requires_logging_directory else cls(PROJECT)

    def _mlflow_store(self) -> str | None:
        """The run's own SQLite store when no tracking URI is set (the artifact location to create the experiment
        with), else None (the user's store, its own artifact root)."""
        mlflow = require("mlflow", "trainer.trackers=[mlflow]")
        if mlflow.is_tracking_uri_set():
            return None
        missing = [module for module in ("sqlalchemy", "alembic") if importlib.util.find_spec(module) is None]
        if missing:
            raise ConfigError(f"trainer.trackers: mlflow's store here would be sqlite:///{self.out_dir / MLFLOW_DB} "
                              f"(no MLFLOW_TRACKING_URI set), which needs {' and '.join(missing)}: pip install "
                              f"'ssl-vit[{EXTRA_OF['mlflow']}]', or set MLFLOW_TRACKING_URI")
        run = self.out_dir.resolve()
        mlflow.set_tracking_uri(f"sqlite:///{run / MLFLOW_DB}")
        self.reset_mlflow = True
        log.info("mlflow: sqlite:///%s, artifacts in %s (set MLFLOW_TRACKING_URI for a shared store)",
                 run / MLFLOW_DB, run / MLFLOW_ARTIFACTS)
        return str(run / MLFLOW_ARTIFACTS)

    def _wandb_mode(self) -> str:
        """WANDB_MODE if set; else online where W&B has credentials here, offline (into <run>/wandb) where not."""
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        if wandb_credentials():
            return "online"
        log.info("wandb: offline into %s (no W&B login here; `wandb sync %s` uploads it later)",
                 self.out_dir / "wandb", self.out_dir / "wandb" / "offline-run-*")
        return "offline"

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
        if self.reset_mlflow:  # the next run in this process (the Python API) chooses its own store
            require("mlflow", "trainer.trackers=[mlflow]").set_tracking_uri(None)
            self.reset_mlflow = False


def wandb_credentials() -> bool:
    """Whether W&B can log in here without asking: WANDB_API_KEY or an identity token file in the environment, or
    a netrc entry for its host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no netrc, or one that cannot be read
        return False


def _run_id(name: str, tracker) -> dict:
    if name == "mlflow":
        return {"mlflow": tracker.active_run.info.run_id}
    if name == "wandb":
        return {"wandb": tracker.run.id}
    return {}
