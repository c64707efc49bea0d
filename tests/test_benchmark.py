"""ssl-vit benchmark: encoders x data sets x protocols, one table and PNGs; cell by cell resume; VTAB-1k's split;
bad input in one line."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY
from helpers.inprocess import pretrain
from hydra import compose, initialize_config_dir
from sklearn.linear_model import LogisticRegression

from ssl_vit.cli import register_configs
from ssl_vit.eval.benchmark import encoder_specs, frozen_protocol, run_benchmark, spec_label
from ssl_vit.eval.benchmark_report import encoder_means, markdown_table, task_rows, write_report
from ssl_vit.eval.linear import standardise
from ssl_vit.eval.vtab import vtab_1k
from ssl_vit.schema import ConfigError

SMALL = ["img_size=32", "benchmark.datasets.synthetic.num_samples=96", "eval.fewshot_draws=2",
         "eval.fewshot_shots=[1,5]", "vtab_train=200", "vtab_val=40", "eval.batch_size=64"]


def _config(tmp_path, *overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("benchmark", overrides=[f"out={tmp_path / 'bench'}", *SMALL, *overrides])


def _benchmark_process(out, *overrides):
    return subprocess.Popen([sys.executable, "-m", "ssl_vit", "benchmark", f"out={out}", *SMALL, *overrides],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


@pytest.mark.slow
def test_two_encoders_on_two_data_sets_write_the_table_and_pictures_and_resume_cell_by_cell(tmp_path):
    """The real command: killed (SIGKILL) once its first cell is stored, then run again, it reads back the stored
    cells untouched and computes only the rest; the outputs hold every cell."""
    out = tmp_path / "bench"
    args = ["encoders=[timm:resnet18,timm:convnext_atto]", "datasets=[digits,synthetic]"]
    first = _benchmark_process(out, *args)
    deadline = time.monotonic() + 240
    while not list((out / "cells").glob("*.json")) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    stored = {path.name: path.stat().st_mtime_ns for path in (out / "cells").glob("*.json")}
    assert stored and not (out / "benchmark.json").exists(), "killed after its first cell, before the end"

    second = _benchmark_process(out, *args)
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr[-3000:]
    # 2 encoders x (digits: linear, knn, fewshot, vtab; synthetic: the same + segmentation) = 18 cells
    assert f"{18 - len(stored)} cells computed, {len(stored)} read back" in stdout
    assert {path.name: path.stat().st_mtime_ns for path in (out / "cells").glob("*.json")
            if path.name in stored} == stored  # read back, not rewritten
    report = json.loads((out / "benchmark.json").read_text())
    assert len(report["cells"]) == 18 and report["read_back"] == len(stored)
    assert {(c["dataset"], c["protocol"]) for c in report["cells"]} == {
        (d, p) for d in ("digits", "synthetic") for p in ("linear", "knn", "fewshot", "vtab")} | {
        ("synthetic", "segmentation")}
    rows = list(csv.DictReader((out / "benchmark.csv").open()))
    assert len(rows) == 2 * (5 + 6)  # per encoder: digits linear, k-NN, 1-shot, 5-shot, VTAB-1k; synthetic + mIoU
    assert all(0 <= float(row["score"]) <= 1 and 0 < float(row["chance"]) < 1 for row in rows)
    table = (out / "benchmark.md").read_text()
    assert "| task | chance | timm:resnet18 | timm:convnext_atto |" in table and "digits 5-shot" in table
    assert "synthetic mIoU" in table and "mean (11 tasks every encoder has)" in table and table in stdout + "\n"
    for picture in ("heatmap.png", "fewshot.png"):
        assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((out / "feature_cache").glob("*.pt"))) == 2 * 2 * 2 + 2 * 2  # features, patch tokens


@pytest.mark.slow
def test_an_added_encoder_computes_only_its_cells_and_a_text_side_adds_zero_shot_and_retrieval(tmp_path):
    """A run of ours with a text side (objective=clip_tiny, a few steps) gets zeroshot and retrieval cells under
    protocols=[auto]; the random ResNet beside it does not. The same benchmark again with one more encoder reads the
    first two back."""
    run = tmp_path / "clip"
    proc = pretrain(*TINY, "objective=clip_tiny", "trainer.max_steps=2", "objective.context_length=16",
                    f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = _config(tmp_path, f"encoders=[{run},timm:resnet18]", "datasets=[synthetic]")
    report = run_benchmark(cfg, progress=False)
    protocols = {(c["encoder"], c["protocol"]) for c in report["cells"]}
    assert {("clip", "zeroshot"), ("clip", "retrieval")} <= protocols
    assert not {("timm:resnet18", "zeroshot"), ("timm:resnet18", "retrieval")} & protocols
    zero_shot = next(c for c in report["cells"] if c["protocol"] == "zeroshot")
    linear = next(c for c in report["cells"] if c["protocol"] == "linear")
    assert zero_shot["chance"]["zero-shot"] == linear["chance"]["linear"]  # the test labels' majority, read two ways
    assert zero_shot["details"]["num_test"] == 24 and 0 <= zero_shot["scores"]["zero-shot"] <= 1
    before = report["computed"]
    again = run_benchmark(_config(tmp_path, f"encoders=[{run},timm:resnet18,timm:convnext_atto]",
                                  "datasets=[synthetic]", "protocols=[auto]"), progress=False)
    added = [c for c in again["cells"] if c["encoder"] == "timm:convnext_atto"]
    assert again["read_back"] == before and again["computed"] == len(added) == 5
    paths = write_report(again, tmp_path / "bench", plots=True)
    assert {"markdown", "csv", "json", "heatmap", "fewshot"} <= set(paths)


def test_bad_input_is_one_line_each(tmp_path):
    cases = [
        (["encoders=[timm:resnet_nope]"], "encoders: timm:resnet_nope: timm:resnet_nope: 'resnet_nope' is not a "
                                          "timm model name"),
        ([f"encoders=[{tmp_path / 'no_run'}]"], "encoders: no_run: "),
        (["encoders=[timm:resnet18]", "datasets=[digits]", "protocols=[segmentation]"],
         "protocols=segmentation: data set digits has no masks; protocols=[auto] runs each protocol where it applies"),
        (["encoders=[timm:resnet18]", "datasets=[synthetic]", "protocols=[zeroshot]"],
         "protocols=zeroshot: encoder timm:resnet18 has no text side"),
        (["encoders=[timm:resnet18]", "datasets=[mnist]"], "datasets: 'mnist' is not a data set of benchmark=default"),
        (["encoders=[timm:resnet18]", "protocols=[auto,linear]"], "auto stands alone"),
        (["encoders=[timm:resnet18,timm:resnet18]"], "two encoders are labelled 'timm:resnet18'"),
        (["encoders=[timm:resnet18]", "eval.window_size=4"],
         "eval: ssl-vit benchmark does not take window_size=4 (ssl-vit evaluate does"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            run_benchmark(_config(tmp_path, *overrides), progress=False)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_encoder_labels():
    assert spec_label("outputs/mae/2026-12-06_10-00-00") == "2026-12-06_10-00-00"
    assert spec_label("outputs/run/encoder.safetensors") == "run"
    assert spec_label("timm:resnet50") == "timm:resnet50"
    assert spec_label("hf:/models/convnext-tiny") == "hf:convnext-tiny"
    assert encoder_specs({"mine": "outputs/run"}) == {"mine": "outputs/run"}
    assert encoder_specs("timm:resnet18") == {"timm:resnet18": "timm:resnet18"}


def test_vtab_1k_chooses_on_200_of_1000_and_refits_on_all_1000_as_scikit_learn_would():
    """On 1,500 separable-ish samples: the chosen L2 is the best validation accuracy over exactly 200 held-out images
    (accuracies in 1/200 steps) after fitting 800; the refit on the 1,000 scores on the test set as scikit-learn's
    logistic regression at that L2 on the same 1,000 does, within 1 point."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(5, 16, generator=generator) * 1.2
    train_y = torch.randint(0, 5, (1500,), generator=generator)
    test_y = torch.randint(0, 5, (500,), generator=generator)
    train_x = centres[train_y] + torch.randn(1500, 16, generator=generator)
    test_x = centres[test_y] + torch.randn(500, 16, generator=generator)
    result = vtab_1k(train_x, train_y, test_x, test_y, seed=3)
    assert result["num_train"] == 1000 and result["num_val"] == 200
    assert all(abs(v * 200 - round(v * 200)) < 1e-6 for v in result["val_accuracy"].values())
    assert result["val_accuracy"][str(result["l2"])] == max(result["val_accuracy"].values())
    chosen = torch.randperm(1500, generator=torch.Generator().manual_seed(3))[:1000]  # the documented draw
    fit_x, eval_x = standardise(train_x[chosen], test_x)
    reference = LogisticRegression(C=1 / (result["l2"] * 1000), max_iter=5000, tol=1e-8)
    reference.fit(fit_x.double().numpy(), train_y[chosen].numpy())
    assert abs(reference.score(eval_x.double().numpy(), test_y.numpy()) - result["accuracy"]) <= 0.01
    with pytest.raises(ValueError, match="vtab_val must be below 100"):
        vtab_1k(train_x[:100], train_y[:100], test_x, test_y, val_size=100)


def test_few_shot_counts_a_class_cannot_fill_are_left_out_by_name():
    cfg = type("Cfg", (), {})()
    cfg.seed = 0
    cfg.eval = type("E", (), {"fewshot_shots": [1, 5], "fewshot_draws": 2, "fewshot_l2": 1.0})()
    train_y = torch.tensor([0] * 10 + [1] * 3)
    result = frozen_protocol("fewshot", torch.randn(13, 4), train_y, torch.randn(6, 4), torch.tensor([0] * 4 + [1] * 2),
                             cfg)
    assert result["scores"]["5-shot"] is None and result["scores"]["1-shot"] is not None
    assert result["details"]["left_out"] == {"5-shot": "the smallest class has 3 training images"}
    assert result["chance"]["1-shot"] == pytest.approx(4 / 6)


def test_the_mean_is_over_the_tasks_every_encoder_has_and_the_best_score_is_bold():
    def cell(encoder, dataset, scores, chance):
        return {"encoder": encoder, "spec": encoder, "dataset": dataset, "data": dataset, "protocol": "linear",
                "scores": scores, "chance": chance, "img_size": 32, "seconds": 1.0}

    report = {"encoders": {"a": {}, "b": {}}, "cells": [
        cell("a", "d1", {"linear": 0.9}, {"linear": 0.1}), cell("b", "d1", {"linear": 0.5}, {"linear": 0.1}),
        cell("a", "d2", {"linear": 0.7}, {"linear": 0.2}),  # b has no d2: left out of both means
    ]}
    rows = task_rows(report)
    assert [row["task"] for row in rows] == ["d1 linear", "d2 linear"] and rows[1]["scores"] == {"a": 0.7}
    means, chance, count = encoder_means(rows, ["a", "b"])
    assert means == {"a": pytest.approx(0.9), "b": pytest.approx(0.5)} and chance == pytest.approx(0.1) and count == 1
    table = markdown_table(report)
    assert "| d1 linear | 10.0 | **90.0** | 50.0 |" in table and "| d2 linear | 20.0 | 70.0 | - |" in table
    assert "| mean (1 task every encoder has) | 10.0 | 90.0 | 50.0 |" in table


def test_evaluate_and_benchmark_give_one_result_per_protocol_from_the_shared_table(tmp_path):
    """On the same features, `ssl-vit evaluate`'s evaluators (run_evaluators) and a benchmark cell
    (frozen_protocol) give the same linear, k-NN and few-shot results: both run ssl_vit.eval.protocols' table."""
    from helpers.builders import pretrain_config
    from omegaconf import OmegaConf

    from ssl_vit.backbone import build_vit
    from ssl_vit.config import EvalConfig
    from ssl_vit.data import eval_datasets
    from ssl_vit.eval.features import extract_features
    from ssl_vit.eval.run import run_evaluators
    from ssl_vit.preprocess import Preprocess

    encoder = build_vit("vit_test").eval()
    train, test = eval_datasets(pretrain_config(tmp_path, "data.num_samples=48").data, 16)
    ecfg = OmegaConf.merge(OmegaConf.structured(EvalConfig), {"evaluators": ["linear", "knn", "fewshot"],
                                                             "fewshot_shots": [1, 2], "fewshot_draws": 2})
    preprocess = Preprocess(16)
    results, _, _ = run_evaluators(encoder, train, test, ecfg, preprocess, seed=3, progress=False)
    views = preprocess.view_builder()
    features = [extract_features(encoder, d, views, ecfg.features, ecfg.last_k, ecfg.batch_size, progress=False)
                for d in (train, test)]
    cfg = OmegaConf.create({"eval": OmegaConf.to_container(ecfg), "seed": 3})
    for name in ("linear", "knn", "fewshot"):
        cell = frozen_protocol(name, *features[0], *features[1], cfg)
        assert cell["details"] == results[name], name
