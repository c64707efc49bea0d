"""benchmarks/gpu_suite.py on the CPU with test-sized models: every section runs and writes its JSON (the suite is
run for real on a GPU whenever one is lent; this keeps it from rotting in between)."""

import importlib
import json
import time

import pytest
import torch
from conftest import ROOT
from helpers.inprocess import run_script


@pytest.mark.slow
def test_the_gpu_suite_runs_every_section_on_the_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "suite.json"
    proc = run_script("benchmarks/gpu_suite.py", "--device", "cpu", "--tiny", "--steps", "1", "--quality-seconds", "1",
                      "--compile-backend", "aot_eager", "--work-dir", str(tmp_path / "work"), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["peak"]["measured_tflop_s"] > 0 and report["peak"]["datasheet_tflop_s"] is None
    # the fused CPU kernel, forward and backward, not the math fallback
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in report["peak"]["attention_kernels"]
    assert not any("math" in name for name in report["peak"]["attention_kernels"])
    rows = {(row["objective"], row["compiled"]): row for row in report["speed"]}
    objectives = ["supervised", "masked_patch", "mae", "dino", "dinov2", "clip", "siglip", "deit", "timm supervised"]
    windowed = ["supervised global", "supervised windowed", "supervised windowed + rel_pos",  # eager only
                "supervised square, mixed aspect", "supervised NaFlex, mixed aspect"]
    assert set(rows) == {(name, compiled) for name in objectives for compiled in (False, True)} | {
        (name, False) for name in windowed}
    assert rows["supervised windowed", False]["img_size"] == 32
    assert rows["supervised NaFlex, mixed aspect", False]["batch"] == 8  # one bucket of 16 patches, 8 x 16 tokens
    for row in rows.values():
        assert row["images_per_s"] > 0 and row["flops_per_image"] > 0 and 0 < row["utilisation_measured_peak"]
    assert rows["supervised", True]["compile_s"] > 0 and rows["supervised", False]["compile_s"] == 0
    assert rows["dino", False]["batch"] == 4  # half the images per step: 4 crops each
    loader = {row["photometric_on"]: row for row in report["loader"]}
    assert set(loader) == {"workers", "device"} and all(len(row["crop_sizes"]) == 4 for row in loader.values())
    assert all(row["images_per_s"] > 0 for row in loader.values())  # 2 global crops, 2 local ones
    assert loader["device"]["device_stage_images_per_s"] > 0 and loader["workers"]["device_stage_images_per_s"] is None
    packing = report["packing"]
    assert packing["max_abs_difference"] < 1e-5 and set(packing["rows"]) == {"per resolution", "packed"}
    quality = report["quality"]["results"]
    assert set(quality) == {"random init", "masked_patch", "mae", "dino", "dinov2", "raw pixels"}
    assert all(0.1 < row["linear"] <= 1 for row in quality.values())  # 10 classes: above chance
    assert "DINO multi-crop loader" in proc.stdout and "Fashion-MNIST quality" in proc.stdout


def test_a_speed_row_is_measured_and_a_failing_one_is_recorded_on_a_gpu_run_but_raised_in_the_cpu_check(
        monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports packed_crops beside it
    gpu_suite = importlib.import_module("gpu_suite")
    peak = {"measured_tflop_s": 2.0, "datasheet_tflop_s": None}

    class Runner:  # 8 images a step, 1 GFLOP each
        batch_size, steps = 8, 0

        def flops_per_image(self):
            return 1e9

        def step(self):
            self.steps += 1
            time.sleep(1e-4)

    runner = Runner()
    row = gpu_suite.measure_row({"objective": "mae", "model": "vit_b16", "batch": 8, "compiled": False}, lambda: runner,
                                torch.device("cpu"), peak, 3, keep_going=True)
    assert runner.steps == 2 + 3 and "error" not in row  # two warm-up steps, then the timed ones
    assert row["achieved_tflop_s"] == pytest.approx(1e9 * row["images_per_s"] / 1e12)
    assert row["utilisation_measured_peak"] == pytest.approx(row["achieved_tflop_s"] / 2.0)

    def broken():
        raise RuntimeError("no kernel image is available for execution on the device")

    row = gpu_suite.measure_row({"objective": "dino", "model": "vit_b16", "compiled": True}, broken,
                                torch.device("cpu"), peak, 3, keep_going=True)
    assert row["error"] == "RuntimeError: no kernel image is available for execution on the device"
    assert "flops_per_image" not in row
    assert "dino            vit_b16  compiled failed: RuntimeError" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="no kernel image"):
        gpu_suite.measure_row({"objective": "dino", "model": "vit_test", "compiled": True}, broken,
                              torch.device("cpu"), peak, 3, keep_going=False)
