"""Trackers through accelerate (trainer.trackers): MLflow into a local file store, read back through MLflow's own
client (the config as parameters, the metrics per step, the periodic evaluation, the summary), W&B in offline mode
(its run directory written), a resumed run continuing the same MLflow run; an unknown or missing tracker is one
line."""

import json

import pytest
from conftest import TINY, check_ok, pretrain_in_process

from ssl_vit.schema import ConfigError
from ssl_vit.train.trackers import check_trackers

mlflow = pytest.importorskip("mlflow")  # both are in the dev extra; a user's install may lack them
pytest.importorskip("wandb")


@pytest.mark.slow
def test_mlflow_and_wandb_get_the_config_metrics_evaluations_and_summary_and_a_resume_continues_them(tmp_path,
                                                                                                    monkeypatch):
    store = tmp_path / "mlruns"
    env = {"MLFLOW_TRACKING_URI": store.as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}
    args = [*TINY, "trainer.max_steps=4", "trainer.log_every=2", "trainer.checkpoint_every=2",
            "trainer.eval_every=4", "trainer.eval_max_samples=32", "trainer.trackers=[mlflow,wandb]",
            f"out={tmp_path / 'run'}"]
    check_ok(pretrain_in_process(*args, "trainer.stop_at_step=2", env=env))
    check_ok(pretrain_in_process(*args, "trainer.resume=auto", env=env))  # continues the MLflow and W&B runs
    ids = json.loads((tmp_path / "run" / "trackers.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for those who ask
    client = mlflow.tracking.MlflowClient(tracking_uri=store.as_uri())
    runs = client.search_runs([client.get_experiment_by_name("ssl-vit").experiment_id])
    assert [run.info.run_id for run in runs] == [ids["mlflow"]]  # one run across both invocations
    run = runs[0]
    assert run.data.params["optim/lr"] == "0.003" and run.data.params["model/name"] == "vit_test"
    assert run.data.tags["mlflow.runName"] == f"{tmp_path.name}/run"
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert losses == pytest.approx({row["step"]: row["loss"] for row in rows if "loss" in row})
    assert sorted(losses) == [2, 4]
    knn = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/knn")}
    assert knn == pytest.approx({row["step"]: row["eval/knn"] for row in rows if "eval/knn" in row}) and 4 in knn
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert run.data.metrics["summary/images_per_s"] == pytest.approx(summary["images_per_s"])
    assert run.data.metrics["summary/steps_this_run"] == 2  # the second invocation's
    offline = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(offline) == 2 and all((path / f"run-{ids['wandb']}.wandb").is_file() for path in offline)


def test_an_unknown_or_missing_tracker_is_one_line_with_the_choices_or_the_pip_command(monkeypatch):
    assert check_trackers(["tensorboard"]) == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbord'; valid: aim, comet_ml, mlflow, tensorboard"):
        check_trackers(["tensorbord"])
    monkeypatch.setattr("ssl_vit.train.trackers.get_available_trackers", lambda: ["tensorboard"])
    missing = r"^trainer.trackers: mlflow is not installed; pip install 'ssl-vit\[trackers\]'$"
    with pytest.raises(ConfigError, match=missing):
        check_trackers(["tensorboard", "mlflow"])


def test_a_tracker_that_cannot_start_is_one_line_and_the_started_ones_are_finished(tmp_path, monkeypatch):
    from accelerate.tracking import TensorBoardTracker

    from ssl_vit.train.trackers import Trackers

    finished = []
    monkeypatch.setattr(TensorBoardTracker, "finish", lambda self: finished.append(self.name))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")
    with pytest.raises(ConfigError, match=r"^trainer.trackers: mlflow could not start \(\w+"):
        Trackers(["tensorboard", "mlflow"], tmp_path, 0, {"optim/lr": 0.1})
    assert finished == ["tensorboard"] and not (tmp_path / "trackers.json").exists()
    assert mlflow.active_run() is None
