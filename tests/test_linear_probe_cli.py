import json
import subprocess
import sys

import pytest
import timm
import torch
from conftest import ROOT

from ssl_vit.export import from_timm, save_encoder
from ssl_vit.vit import build_vit


def _probe(*overrides):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "linear_probe.py"), *map(str, overrides)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    return save_encoder(build_vit("vit_test"), tmp_path / "run" / "encoder.safetensors", step=0)


def test_cli_end_to_end_writes_results_and_reuses_cached_features(tmp_path, tiny_checkpoint):
    out, cache = tmp_path / "eval", tmp_path / "cache"
    args = [f"checkpoint={tiny_checkpoint.parent}", "data=digits", "eval=all", f"cache_dir={cache}",
            "eval.fewshot_draws=2", "eval.finetune_steps=20", f"hydra.run.dir={out}"]
    proc = _probe(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert set(report["results"]) == {"linear", "knn", "fewshot", "finetune"}
    assert report["results"]["finetune"]["steps"] == 20
    assert report["num_train"] == 1438 and report["num_test"] == 359 and report["feature_dim"] == 64
    assert set(report["results"]["fewshot"]["accuracy"]) == {"1_shot", "5_shot", "10_shot", "25_shot"}
    assert 0.5 < report["results"]["linear"]["accuracy"] <= 1.0  # random tiny encoder on digits, chance 0.1
    for line in ("evaluator", "linear", "knn", "fewshot 10-shot", "finetune"):
        assert line in proc.stdout
    assert len(list(cache.glob("*.pt"))) == 2  # train and test features
    proc = _probe(*args[:-1], "eval=knn", f"hydra.run.dir={tmp_path / 'again'}")
    assert proc.returncode == 0 and len(list(cache.glob("*.pt"))) == 2
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["results"]["knn"] == report["results"]["knn"] and again["timings"]["features_train_s"] < 1.0


def test_cli_bad_checkpoint_and_evaluator_are_clear_errors(tmp_path, tiny_checkpoint):
    proc = _probe(f"checkpoint={tmp_path / 'missing.safetensors'}", f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == 2 and "is not an encoder file" in proc.stderr
    proc = _probe(f"checkpoint={tiny_checkpoint}", "eval.evaluators=[svm]", f"hydra.run.dir={tmp_path / 'b'}")
    assert proc.returncode == 2 and "unknown evaluator(s) ['svm']" in proc.stderr and "'linear'" in proc.stderr


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "vit_base_patch16_reg4_gap_256"])
def test_timm_models_import_with_identical_features(name):
    theirs = timm.create_model(name, pretrained=False, num_classes=0).eval()
    ours = from_timm(theirs).eval()
    images = torch.randn(1, 3, *theirs.patch_embed.img_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)
