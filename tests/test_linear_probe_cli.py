import json

import pytest
import timm
import torch
from conftest import ROOT
from helpers.inprocess import run_script

from ssl_vit.artifacts import save_encoder
from ssl_vit.backbone import build_vit
from ssl_vit.interop.timm import from_timm


def _probe(*overrides, script=None):
    """scripts/linear_probe.py (the old name of scripts/evaluate.py, which it runs) or `script`, as
    `python scripts/<script> ...` runs it (in this process)."""
    return run_script(ROOT / "scripts" / (script or "linear_probe.py"), *map(str, overrides))


@pytest.fixture
def tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    return save_encoder(build_vit("vit_test"), tmp_path / "run" / "encoder.safetensors", step=0)


@pytest.mark.slow
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


@pytest.mark.slow
def test_cli_bad_checkpoint_and_evaluator_are_clear_errors(tmp_path, tiny_checkpoint):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x07" * 300)
    cases = [
        ([f"checkpoint={tmp_path / 'missing.safetensors'}"], "is not an encoder file"),
        ([], "ssl-vit: error: checkpoint is not set; give it on the command line, e.g. checkpoint="),
        ([f"checkpoint={garbage}"], f"checkpoint: '{garbage}' is not a readable ssl_vit encoder file"),
        ([f"checkpoint={tiny_checkpoint}", "eval.evaluators=[svm]"],
         "eval.evaluators=svm is not one of linear, knn, fewshot, finetune, zeroshot, retrieval, segmentation"),
        ([f"checkpoint={tiny_checkpoint}", "data.max_test_samples=0"], "data.max_test_samples=0 is invalid"),
    ]
    # two through the scripts (the old name and the new), the others through evaluate() directly
    for index, (args, expected) in enumerate(cases[:2]):
        proc = _probe(*args, f"hydra.run.dir={tmp_path / str(index)}", script="evaluate.py" if index else None)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().startswith("ssl-vit: error:") and "Traceback" not in proc.stderr
    from ssl_vit.eval.run import evaluate
    from ssl_vit.schema import ConfigError

    for args, expected in cases[2:]:
        with pytest.raises(ConfigError) as err:
            evaluate(_probe_config(*args, f"output_dir={tmp_path}"), progress=False)
        assert expected.removeprefix("ssl-vit: error: ") in str(err.value)


def _probe_config(*overrides):
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


@pytest.mark.slow
def test_the_encoders_recorded_preprocessing_is_the_default_and_data_values_override_it(tmp_path):
    from collections import Counter

    from ssl_vit.eval.run import evaluate
    from ssl_vit.preprocess import Preprocess

    torch.manual_seed(0)
    path = save_encoder(build_vit("vit_test"), tmp_path / "encoder.safetensors", step=0,
                        preprocess=Preprocess(16, mean=[0.1] * 3, std=[0.2] * 3, interpolation="bicubic"))
    common = [f"checkpoint={path}", "data=digits", "eval=knn", "data.max_train_samples=200",
              "data.max_test_samples=50", "threads=1", f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path}"]
    threads = torch.get_num_threads()
    try:
        report = evaluate(_probe_config(*common), progress=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)  # the CLI's setting is for its whole process; not for the rest of the tests
    assert report["preprocess"] == {"img_size": 16, "mean": [0.1] * 3, "std": [0.2] * 3,
                                    "interpolation": "bicubic", "crop_pct": 1.0, "resize_mode": "shortest"}
    assert (report["num_train"], report["num_test"]) == (200, 50)
    from ssl_vit.data import Digits
    from ssl_vit.data.subset import limit_samples
    full = Digits("train")
    counts, shares = Counter(int(y) for y in limit_samples(full, 200).targets), Counter(int(y) for y in full.labels)
    assert all(abs(counts[c] - 200 * shares[c] / len(full)) < 1 for c in shares)  # stratified: each class's share

    overridden = evaluate(_probe_config(*common, "data.mean=[0.3,0.3,0.3]", "data.img_size=24"), progress=False)
    assert overridden["preprocess"]["mean"] == [0.3] * 3 and overridden["preprocess"]["std"] == [0.2] * 3
    assert overridden["preprocess"]["img_size"] == 24  # the encoder ran at 24 px (6x6 patches), not at 16
    assert overridden["results"]["knn"]["accuracy"] != report["results"]["knn"]["accuracy"]
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 4  # different inputs, different cache entries


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_small_patch16_224", "vit_base_patch16_reg4_gap_256"])
def test_timm_models_import_with_identical_features(name):
    theirs = timm.create_model(name, pretrained=False, num_classes=0).eval()
    ours = from_timm(theirs).eval()
    images = torch.randn(1, 3, *theirs.patch_embed.img_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)
