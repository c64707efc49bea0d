"""A new user's first hour (the README top to bottom, the usual mistakes), each finding a regression test through
the real CLI, in-process where the launcher adds nothing: objectives bring their optimiser recipe, a run directory
holds one run, unlabelled folders in any layout, output groups wherever a run is taken, typos answered with the
closest names and exit 2, Ctrl-C saving a checkpoint that resumes exactly, and quiet launches."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY, check_ok, export_script, pretrain_in_process, read_metrics
from helpers.inprocess import run_script
from huggingface_hub import ModelCard
from hydra import compose, initialize_config_dir
from PIL import Image

from ssl_vit.cli import register_configs
from ssl_vit.run_dirs import LATEST, newest_run, resolve_run
from ssl_vit.schema import ConfigError
from ssl_vit.train import pretrain
from ssl_vit.train.checkpoint import resolve_resume

CONFIGS = str(ROOT / "configs")
PRETRAIN = [sys.executable, str(ROOT / "scripts" / "pretrain.py")]
STEPS2 = ["model=vit_test", "data.num_samples=16", "data.batch_size=8", "trainer.max_steps=2",
          "trainer.progress=false", "trainer.trackers=[]"]


def _compose(*overrides, choices=False):
    register_configs()
    with initialize_config_dir(CONFIGS, version_base="1.3"):
        return compose("pretrain", overrides=list(overrides), return_hydra_config=choices)


def _cli(*args, cwd=ROOT):
    """`python scripts/pretrain.py args` (its entry in this process)."""
    return run_script(ROOT / "scripts" / "pretrain.py", *args, cwd=cwd)


RECIPES = {  # objective -> (optim option, lr, (scaling rule, base batch), weight decay start / end, clipping, beta2)
    "supervised": ("adamw", 2e-3, ("none", None), 0.05, None, 1.0, 0.999),
    "mae": ("mae", 8e-3, ("linear", 256), 0.05, None, None, 0.999),  # MAE: blr x batch / 256, no clipping
    "dino_tiny": ("dino", 2e-3, ("linear", 256), 0.04, 0.4, 3.0, 0.999),  # DINO: lr x batch / 256
    "dinov2_tiny": ("dinov2", 2e-3, ("sqrt", 1024), 0.04, 0.4, 3.0, 0.999),  # DINOv2: sqrt_wrt_1024
    "dinov3_tiny": ("dinov3", 2e-3, ("sqrt", 1024), 0.04, None, 30.0, 0.99),  # the ViT-7B's
    "mocov3_tiny": ("mocov3", 6e-4, ("linear", 256), 0.1, None, None, 0.999),  # MoCo v3: lr x batch / 256
    "ijepa_tiny": ("ijepa", 1e-3, ("none", None), 0.04, 0.4, None, 0.999),
    "clip_tiny": ("clip", 5e-4, ("none", None), 0.2, None, None, 0.98),
    "siglip_tiny": ("clip", 5e-4, ("none", None), 0.2, None, None, 0.98),
    "deit": ("augreg", 5e-4, ("linear", 512), 0.05, None, None, 0.999),  # DeiT: 5e-4 per 512
}


@pytest.mark.parametrize("objective", RECIPES)
def test_each_objective_brings_its_optimiser_recipe_and_the_command_line_still_wins(objective):
    option, lr, scaling, wd, wd_end, clip, beta2 = RECIPES[objective]
    cfg = _compose(f"objective={objective}", choices=True)
    assert cfg.hydra.runtime.choices.optim == option
    assert (cfg.optim.lr, (cfg.optim.lr_scaling, cfg.optim.lr_base_batch), cfg.optim.weight_decay,
            cfg.optim.weight_decay_end, cfg.optim.grad_clip, cfg.optim.beta2) == (lr, scaling, wd, wd_end, clip, beta2)
    chosen = _compose(f"objective={objective}", "optim=adamw", "optim.lr=1e-3", choices=True)
    assert chosen.hydra.runtime.choices.optim == "adamw" and chosen.optim.lr == 1e-3
    assert chosen.optim.weight_decay == 0.05 and chosen.optim.grad_clip == 1.0


@pytest.mark.slow
def test_a_run_directory_holds_one_run_and_overwrite_clears_it(tmp_path):
    run = tmp_path / "run"
    first = check_ok(_cli(*STEPS2, "objective=dino_tiny", "objective.out_dim=64", "objective.hidden_dim=32",
                          "objective.bottleneck_dim=16", "objective.local_crops=2", f"out={run}"))
    # the start-up line names what was asked for (dino_tiny, not its method dino), the recipe and the directory
    assert f"objective=dino_tiny optim=dino (lr 0.002 per 256 images (linear) -> 6.25e-05 at global batch 8, " \
           f"weight decay 0.04 -> 0.4, gradient clipping 3.0) " \
           f"model=vit_test data=synthetic -> {run}" in first.stderr + first.stdout
    before = (run / "metrics.jsonl").read_text()

    again = _cli(*STEPS2, "trainer.max_steps=1", f"out={run}")
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"ssl-vit: error: {run} already holds a run (checkpoints, metrics.jsonl, summary.json, encoder.safetensors, "
        "heads.safetensors); continue it with trainer.resume=auto, start a new one in a fresh directory (out=DIR), "
        "or clear it with trainer.overwrite=true"]
    assert (run / "metrics.jsonl").read_text() == before and (run / "checkpoints" / "step_00000002").is_dir()

    check_ok(_cli(*STEPS2, "trainer.max_steps=1", f"out={run}", "trainer.overwrite=true"))
    assert [row["step"] for row in read_metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    assert json.loads((run / "summary.json").read_text())["step"] == 1


def _images(root: Path, count: int, flat: bool) -> Path:
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root if flat or i % 3 == 0 else root / f"part{i % 2}" / "deeper"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(folder / f"image{i}.png")
    (root / "notes.txt").write_text("not an image")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["mae", "dino_tiny"])
def test_unlabelled_images_in_any_layout_train_the_objectives_that_need_no_labels(tmp_path, objective, caplog):
    root = _images(tmp_path / "images", 12, flat=False)
    heads = ["objective.out_dim=64", "objective.hidden_dim=32", "objective.bottleneck_dim=16",
             "objective.local_crops=2"] if objective == "dino_tiny" else ["objective.decoder_depth=1"]
    cfg = _compose(f"objective={objective}", *heads, "model=vit_test", "data=folder", f"data.root={root}",
                   "data.img_size=16", "data.batch_size=4", "data.num_workers=0", "trainer.max_steps=2",
                   "trainer.progress=false", "trainer.trackers=[]", f"output_dir={tmp_path / 'run'}")
    with caplog.at_level("INFO", logger="ssl_vit"):
        summary = pretrain(cfg)
    assert summary["finished"] and summary["skipped_samples"] == 0
    # resolved for this objective (every image under root, any layout) and said; the config recorded as given
    assert f"data: image folder '{root}' (12 images, unlabelled, any layout)" in caplog.text
    assert "labels: null" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_labelled_objective_refuses_unlabelled_images_naming_the_class_folder_layout(tmp_path):
    root = _images(tmp_path / "flat", 4, flat=True)
    cfg = _compose("objective=supervised", "model=vit_test", "data=folder", f"data.root={root}", "output_dir=x")
    from ssl_vit.train.build import build_components

    with pytest.raises(ConfigError, match=r"no images in class subfolders of .*flat.*labelled objectives need "
                                          r"root/<class>/<image>"):
        build_components(cfg)


@pytest.mark.slow
def test_a_log_file_gets_plain_lines_and_what_the_data_set_found_not_progress_bars(tmp_path):
    """stderr that is not a terminal (a log file, a SLURM job): no carriage-return bar but a line per log step, and
    the start-up line says what the image folder held."""
    for label in ("cats", "dogs"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for index in range(3):
            Image.new("RGB", (20, 20), (40 * index, 90, 200)).save(tmp_path / "images" / label / f"{index}.png")
    steps = [override for override in STEPS2 if override not in ("trainer.progress=false", "data.num_samples=16")]
    done = _cli(*steps, "data=folder", f"data.root={tmp_path / 'images'}", "data.batch_size=6", "trainer.log_every=1",
                f"out={tmp_path / 'run'}", cwd=tmp_path)
    check_ok(done)
    printed = done.stdout + done.stderr  # the log on stdout, a bar would be on stderr
    assert "\r" not in printed and "step 1/2: loss " in printed and "step 2/2: loss " in printed
    assert f"data: image folder '{tmp_path / 'images'}' (6 images, 2 class subfolders)" in printed


@pytest.mark.slow
def test_commands_take_an_output_group_and_use_its_newest_run(tmp_path, capsys):
    """The default layout through the CLI (outputs/<group>/<time>/ under the working directory, with latest);
    evaluate, export, analyze and trainer.resume then take the group."""
    check_ok(_cli(*STEPS2, cwd=tmp_path))
    group = tmp_path / "outputs" / "supervised-vit_test-synthetic"
    run = newest_run(group)
    assert (group / LATEST).is_symlink() and (group / LATEST).resolve() == run.resolve()
    # evaluation results land in the evaluated run, beside its encoder (first: the group is announced once a process)
    evaluation = run_script(ROOT / "scripts" / "evaluate.py", str(group),  # positional
                            "data=synthetic", "data.num_samples=64", "eval=knn", "cache_dir=null", cwd=tmp_path)
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert f"using its newest run, {run}" in evaluation.stderr
    assert resolve_run(str(group)) == str(run) and resolve_run("timm:vit_tiny") == "timm:vit_tiny"
    assert resolve_resume(str(group), tmp_path / "new").parent.parent == run  # its newest checkpoint
    assert json.loads((run / "eval" / "synthetic" / "results.json").read_text())["results"]["knn"]["accuracy"] >= 0
    knn = json.loads((run / "eval" / "synthetic" / "results.json").read_text())["results"]["knn"]["accuracy"]
    export = export_script()
    assert export.main([f"checkpoint={group}", "--to", "safetensors", "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "encoder.safetensors").is_file()
    # every target's model card: architecture, preprocessing, the training, the recorded evaluation, the command
    for target in ("safetensors", "hf", "timm", "onnx"):
        out = tmp_path / "exported" if target == "safetensors" else tmp_path / target
        if target != "safetensors":
            licence = ["--license", "cc-by-nc-4.0"] if target == "onnx" else []
            assert export.main([str(run), "--to", target, "--out", str(out), *licence]) == 0
        card = (out / "README.md").read_text()
        hub = ModelCard.load(out / "README.md").data  # the Hub's front matter, read by huggingface_hub
        assert (hub.library_name, hub.license, hub.pipeline_tag) == (
            {"hf": "transformers", "safetensors": "ssl-vit"}.get(target, target),
            "cc-by-nc-4.0" if target == "onnx" else "other", "image-feature-extraction")
        assert "supervised" in hub.tags and "ssl-vit" in hub.tags
        card = card.split("\n---\n", 1)[1].lstrip()
        assert card.startswith("# vit_test pre-trained with supervised (32 wide, 2 blocks, ")
        assert "- steps: 2 of 2, 16 images seen (global batch 8); strategy single on 1 process" in card
        assert f"| synthetic | knn | accuracy | {knn:.4f} |" in card and "- img_size: 16" in card
        assert f"python scripts/pretrain.py {shlex.join(STEPS2)}" in card  # quoted for the shell
        load = {"hf": "transformers.AutoModel.from_pretrained(", "timm": "timm.create_model('local-dir:",
                "onnx": "onnxruntime.InferenceSession(", "safetensors": "ssl_vit.artifacts.load_encoder("}
        assert load[target] in card
    assert export.main([str(group), "--to", "open_clip", "--out", str(tmp_path / "clip")]) == 2
    assert "--to open_clip writes an image-text model's two towers" in capsys.readouterr().err


@pytest.mark.slow
def test_typos_get_the_closest_names_in_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """scripts/pretrain.py's entry (run_hydra around Hydra's main) in-process: Hydra's errors are intercepted before
    its own report; a +key= that no schema knows is refused by the validation in the job."""
    import importlib.util

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # a user's HYDRA_FULL_ERROR=1 keeps Hydra's report

    for args, line in [
        (["trainer.max_step=10"], "ssl-vit: error: unknown key trainer.max_step; did you mean trainer.max_steps or "
                                  "trainer.stop_at_step?"),
        (["+trainer.max_step=10"], "ssl-vit: error: unknown key trainer.max_step; did you mean trainer.max_steps or "
                                   "trainer.stop_at_step?"),
        (["objective=masked_patches"], "ssl-vit: error: objective=masked_patches is not an option of objective; "
                                       "did you mean objective=masked_patch?"),
        (["data=wds", "data.urls=data/shapes/shard-{000000..000019}.tar"],
         "ssl-vit: error: data.urls=data/shapes/shard-{000000..000019}.tar: Hydra's override grammar reads {...} "
         "as a dictionary; a brace pattern needs double quotes inside the shell's single quotes: "
         "'data.urls=\"data/shapes/shard-{000000..000019}.tar\"'"),
        (["trainer.preempt_signals=[SIGTERM,SIGUSR3]"],  # a value the schema's type refuses: its choices
         "ssl-vit: error: trainer.preempt_signals[1]=SIGUSR3 is not one of SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, "
         "SIGQUIT; did you mean trainer.preempt_signals[1]=SIGUSR2 or trainer.preempt_signals[1]=SIGUSR1?"),
        (["data=wds", *(f"data.urls=data/shapes/shard-{i:06d}.tar" for i in range(3))],  # the shell expanded it
         "ssl-vit: error: data.urls is given 3 times (data/shapes/shard-000000.tar ... data/shapes/shard-000002.tar): "
         "the shell expanded a brace pattern"),
    ]:
        monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "pretrain.py"), "model=vit_test", *args,
                                          f"out={tmp_path / 'run'}"])
        spec = importlib.util.spec_from_file_location("__main__", ROOT / "scripts" / "pretrain.py")
        with pytest.raises(SystemExit) as stop:  # the script as `python scripts/pretrain.py ...` runs it
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        lines = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith(line), (args, lines)
    assert not (tmp_path / "run").exists()  # a refused run leaves no directory behind
    assert "HYDRA_FULL_ERROR" not in os.environ  # run_hydra leaves the environment as it found it
    # --help lists the groups this script composes, not every folder of configs/
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "pretrain.py"), "--help"])
    spec = importlib.util.spec_from_file_location("__main__", ROOT / "scripts" / "pretrain.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    shown = capsys.readouterr().out
    assert "  objective: clip, clip_tiny, deit," in shown and "  optim: adamw, augreg, clip, dino" in shown
    assert "accelerate:" not in shown and "schema/" not in shown and "eval:" not in shown
    # --cfg job shows a preset's architecture (and the objective's model defaults) where the config says null
    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "pretrain.py"), "--cfg", "job", "objective=deit"])
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    shown = capsys.readouterr().out
    assert "  embed_dim: 64\n  depth: 4\n  num_heads: 4\n" in shown and "  dist_token: true\n" in shown


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_with_a_checkpoint_that_resumes_exactly(reference_run, tmp_path):
    """SIGINT at step 12 of 30 (sent by the process to itself after that step, as a Ctrl-C would) to a real
    `python scripts/pretrain.py`: exit 130, a checkpoint and the encoder at step 12, one line with the resume
    command, nothing from DeepSpeed's import; resuming reproduces the uninterrupted run's losses."""
    stopped = subprocess.run([*PRETRAIN, *TINY, "trainer.progress=false", "trainer.max_steps=30", f"out={tmp_path}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "SSL_VIT_FAULT": "sigint@12"})
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "Setting accelerator to CPU" not in output
    assert "stopped at step 12 of 30 (SIGINT), checkpoint and encoder saved, exit status 130; continue with:" in output
    assert f"python {ROOT / 'scripts' / 'pretrain.py'} model=vit_test" in output
    assert f"trainer.resume=auto out={tmp_path}" in output
    assert (tmp_path / "checkpoints" / "step_00000012").is_dir()
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by"] == "SIGINT"
    from ssl_vit.artifacts import read_metadata

    assert read_metadata(tmp_path / "encoder.safetensors")["step"] == "12"
    check_ok(pretrain_in_process(*TINY, "trainer.max_steps=30", "trainer.resume=auto", f"out={tmp_path}",
                                 env={"SSL_VIT_FAULT": None}))
    resumed = {m["step"]: m["loss"] for m in read_metrics(tmp_path)}
    reference = {m["step"]: m["loss"] for m in read_metrics(reference_run)}
    assert sorted(resumed) == list(range(1, 31))
    assert all(resumed[s] == pytest.approx(reference[s], abs=1e-6) for s in range(1, 31))
    assert os.environ.get("SSL_VIT_FAULT") is None
