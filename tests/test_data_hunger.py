"""benchmarks/data_hunger.py end to end on a tiny setting: every model at two training-set sizes, the table, the
JSON and the PNG."""

import importlib.util
import json

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_data_hunger_runs_end_to_end_on_a_tiny_setting(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("data_hunger", ROOT / "benchmarks" / "data_hunger.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "data_hunger.json"
    report = module.main(["--data", "digits", "--img-size", "16", "--model", "model=vit_test", "--sizes", "100,400",
                          "--steps", "3", "--batch-size", "16", "--test-samples", "100", "--work-dir",
                          str(tmp_path / "work"), "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == report["results"]
    assert set(written["results"]) == {"cnn", "vit", "vit_augreg", "deit"}
    for by_size in written["results"].values():
        assert set(by_size) == {"100", "400"}
        assert all(0 <= row["test_acc"] <= 1 and row["wall_s"] > 0 and row["cpu_s"] > 0 for row in by_size.values())
    # DeiT distilled from the CNN trained on the same subset; the ViTs saved their heads
    assert (tmp_path / "work" / "cnn-400" / "resnet10t.safetensors").is_file()
    assert (tmp_path / "work" / "deit-400" / "heads.safetensors").is_file()
    assert out.with_suffix(".png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "model" in table and "deit" in table and "cpu s" in table
