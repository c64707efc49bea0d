"""Trackers through accelerate (trainer.trackers): MLflow into a local file store, read back through MLflow's own
client (the config as parameters, the metrics per step, the periodic evaluation, the summary), W&B in offline mode
(its run directory written), a resumed run continuing the same MLflow run; an unknown or missing tracker is one
line."""

import json
from pathlib import Path

import pytest
from conftest import TINY, check_ok, pretrain_in_process
from helpers.processes import index_reachable

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


TRACKER_PACKAGES = ("mlflow", "wandb", "sqlalchemy", "alembic", "mako")  # the trackers extra and its own packages


@pytest.mark.slow
@pytest.mark.network
def test_each_tracker_works_with_no_environment_set_from_a_fresh_install_of_the_extra(tmp_path):
    """A venv that sees this one's packages but none of the trackers extra's (mlflow-skinny, wandb, sqlalchemy,
    alembic and Mako left out of a filtered copy of site-packages), `pip install 'ssl-vit[trackers]'` from the
    built wheel, then `ssl-vit pretrain trainer.trackers=[tensorboard,mlflow,wandb]` with no tracker variable set,
    no W&B login and a fresh HOME, from an empty working directory: every tracker writes under the run directory
    (TensorBoard's events, MLflow's SQLite store, W&B's offline run), nothing lands in the working directory, and
    MLflow's own client reads the run's metrics back."""
    import os
    import subprocess
    import sys
    import sysconfig

    if not index_reachable():
        pytest.skip("the package index (pypi.org) cannot be reached")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(root)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("ssl_vit-*.whl"))
    base = tmp_path / "base"  # this venv's packages without the extra's
    base.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if not name.startswith(TRACKER_PACKAGES) and not name.startswith(("ssl_vit", "__editable__")):
            (base / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "base.pth").write_text(f"{base}\n")
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import mlflow"], capture_output=True).returncode != 0  # not there yet
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                              f"{wheel}[trackers]"], capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert {"mlflow_skinny", "wandb", "sqlalchemy", "alembic", "ssl_vit"} <= installed, installed
    assert not installed & {"torch", "timm", "accelerate"}  # the core came from the base
    work, home = tmp_path / "empty", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_", "PYTHON"))}
    env["HOME"] = str(home)
    done = subprocess.run([str(venv / "bin" / "ssl-vit"), "pretrain", "model=vit_test", "data.num_samples=16",
                           "data.batch_size=8", "trainer.max_steps=3", "trainer.log_every=1", "trainer.progress=false",
                           "trainer.trackers=[tensorboard,mlflow,wandb]", "out=run"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    run = work / "run"
    assert sorted(p.name for p in work.iterdir()) == ["run"]  # nothing of the trackers' in the working directory
    assert list((run / "tb").glob("events.out.tfevents.*")) and (run / "mlflow.db").is_file()
    ids = json.loads((run / "trackers.json").read_text())
    assert list((run / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    said = done.stdout + done.stderr
    assert f"mlflow: sqlite:///{run.resolve() / 'mlflow.db'}, artifacts in {run.resolve() / 'mlartifacts'}" in said
    assert f"wandb: offline into {run.resolve() / 'wandb'} (no W&B login here" in said
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    losses = client.get_metric_history(ids["mlflow"], "train/loss")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert {m.step: m.value for m in losses} == pytest.approx({r["step"]: r["loss"] for r in rows if "loss" in r})


def test_mlflows_default_store_without_its_packages_is_one_line_and_wandb_goes_offline_without_a_login(
        tmp_path, monkeypatch):
    import importlib.util

    from ssl_vit.train.trackers import Trackers, wandb_credentials

    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_credentials()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / "netrc").chmod(0o600)
    assert wandb_credentials()
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_credentials()
    real = importlib.util.find_spec
    monkeypatch.setattr("ssl_vit.train.trackers.importlib.util.find_spec",
                        lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    with pytest.raises(ConfigError, match=rf"^trainer.trackers: mlflow's store here would be sqlite:///{tmp_path}/"
                                          r"mlflow.db \(no MLFLOW_TRACKING_URI set\), which needs sqlalchemy: pip "
                                          r"install 'ssl-vit\[trackers\]', or set MLFLOW_TRACKING_URI$"):
        Trackers(["mlflow"], tmp_path, 0, {})
    assert not mlflow.is_tracking_uri_set()
