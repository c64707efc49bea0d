"""Frozen-feature quality on Fashion-MNIST: a randomly initialised encoder against the same encoder pre-trained by
masked_patch, MAE, DINO, DINOv2, DINOv3, MoCo v3 and I-JEPA for the same CPU time budget, with logistic regression on
raw pixels as the floor.

    bash scripts/get_data.sh                                      # Fashion-MNIST from Debian
    python benchmarks/fashion_mnist_eval.py --budget-minutes 8    # ~2 hours on 2 cores in all
    python benchmarks/fashion_mnist_eval.py --objectives dino,mae # a subset (random init is always measured)

Model: ViT-Ti width (D=192, 12 blocks, 3 heads) at 32 px with 4x4 patches (64 tokens); pre-training on the 60k
training images (labels unused), 64 images per step, step count set from a measured rate to fill the budget. DINO
and DINOv2 use their `_tiny` configs (1,024 / 256 prototypes, teacher momentum 0.99 for so short a run; 2 global
32 px + 6 local 12 px crops), lr 5e-4 and weight decay 0.04 -> 0.4; the evaluated encoder is the teacher. DINOv3
starts Gram anchoring (64 px Gram crops) after 50 steps, refreshing it every 25, so that a budget of about 100 steps
sees it. MoCo v3 and I-JEPA use their `_tiny` configs and recipes; I-JEPA's encoder has no class token and is
evaluated on the average patch token alone (192 features; the others: class token + average, 384).
Evaluation on all 60k / 10k images: linear probe (L-BFGS, L2 chosen on held-out train), weighted k-NN (k=20,
T=0.07) and 10-shot ridge, on class-token + average-patch features; the wall time of every stage is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir

from ssl_vit.artifacts import load_encoder
from ssl_vit.cli import register_configs
from ssl_vit.config import EvalConfig
from ssl_vit.data import FashionMNIST
from ssl_vit.eval.linear import linear_probe
from ssl_vit.eval.run import run_evaluators
from ssl_vit.train import build_components, pretrain

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODEL = ["model=vit_ti16", "model.patch_size=4", "data=fashion_mnist", "data.img_size=32", "data.batch_size=64"]
DINO_SHORT_RUN = ["optim.lr=5e-4", "optim.weight_decay=0.04", "optim.weight_decay_end=0.4"]
OBJECTIVES = {
    "masked_patch": ["objective=masked_patch"],
    "mae": ["objective=mae", "objective.decoder_dim=128", "objective.decoder_depth=2", "objective.decoder_heads=4"],
    "dino": ["objective=dino_tiny", *DINO_SHORT_RUN],
    "dinov2": ["objective=dinov2_tiny", *DINO_SHORT_RUN],
    "dinov3": ["objective=dinov3_tiny", *DINO_SHORT_RUN, "objective.gram_start=50", "objective.gram_warmup_steps=10",
               "objective.gram_update_every=25"],
    "mocov3": ["objective=mocov3_tiny"],
    "ijepa": ["objective=ijepa_tiny"],
}


def _config(out_dir, *overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[*MODEL, "trainer.progress=true", "trainer.log_every=50",
                                              f"output_dir={out_dir}", *overrides])


def _pretrain(cfg) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    return pretrain(cfg)


def pretrain_for(name: str, minutes: float, out_root: Path) -> tuple[Path, dict]:
    probe = _pretrain(_config(out_root / f"{name}-rate", *OBJECTIVES[name], "trainer.max_steps=12",
                              "trainer.trackers=[]"))
    steps = max(20, int(minutes * 60 * probe["images_per_s"] / 64))
    start = time.perf_counter()
    summary = _pretrain(_config(out_root / name, *OBJECTIVES[name], f"trainer.max_steps={steps}",
                                f"optim.warmup_steps={max(10, steps // 20)}", "trainer.checkpoint_every=1000000"))
    summary["pretrain_wall_s"] = time.perf_counter() - start
    return out_root / name / "encoder.safetensors", summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=8.0)
    parser.add_argument("--work-dir", default="outputs/bench_fashion_mnist")
    parser.add_argument("--out", default="benchmarks/results/fashion_mnist_eval.json")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"comma-separated, of {list(OBJECTIVES)}")
    args = parser.parse_args()
    names = args.objectives.split(",")
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown:
        parser.error(f"unknown objective(s) {unknown}; valid choices: {list(OBJECTIVES)}")
    register_configs()
    work = Path(args.work_dir)
    train_set, test_set = FashionMNIST(split="train"), FashionMNIST(split="test")

    encoders, pretraining = {}, {}
    torch.manual_seed(0)
    random_objective, _, _, preprocess = build_components(_config(work / "random", *OBJECTIVES["masked_patch"]))
    encoders["random init"] = random_objective.encoder
    for name in names:
        path, summary = pretrain_for(name, args.budget_minutes, work)
        encoders[name] = load_encoder(path)
        pretraining[name] = {k: summary[k] for k in ("step", "images_per_s", "pretrain_wall_s")}
        pretraining[name]["final_loss"] = summary["last"].get("loss")

    rows = {}
    for name, encoder in encoders.items():
        features = "cls_avg" if encoder.cls_token is not None else "avg"
        ecfg = EvalConfig(evaluators=["linear", "knn", "fewshot"], features=features, fewshot_shots=[10])
        results, timings, dim = run_evaluators(encoder, train_set, test_set, ecfg, preprocess)
        rows[name] = {"linear": results["linear"]["accuracy"], "knn": results["knn"]["accuracy"],
                      "10_shot": results["fewshot"]["accuracy"]["10_shot"], "feature_dim": dim, "timings": timings}
    start = time.perf_counter()
    pixels = {s: (torch.tensor(d.images.reshape(len(d), -1)).float() / 255, torch.tensor(d.labels).long())
              for s, d in (("train", train_set), ("test", test_set))}
    floor = linear_probe(*pixels["train"], *pixels["test"])
    rows["raw pixels (floor)"] = {"linear": floor["accuracy"], "knn": None, "10_shot": None, "feature_dim": 784,
                                  "timings": {"linear_s": time.perf_counter() - start}}

    report = {"benchmark": "fashion_mnist_eval", "budget_minutes": args.budget_minutes, "model": MODEL,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "pretraining": pretraining, "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    print(f"Fashion-MNIST, ViT-Ti width at 32 px / 4x4 patches, {args.budget_minutes:g} min pre-training budget")
    for name, info in pretraining.items():
        print(f"  {name}: {info['step']} steps at {info['images_per_s']:.1f} img/s, "
              f"final loss {info['final_loss']:.4f}")
    print(f"{'encoder':<20}{'linear':>8}{'k-NN':>8}{'10-shot':>9}{'extract s':>11}{'linear s':>10}{'k-NN s':>8}")
    for name, row in rows.items():
        t = row["timings"]
        extract = t.get("features_train_s", 0) + t.get("features_test_s", 0)

        def pct(value):
            return f"{100 * value:.2f}" if value is not None else "-"
        print(f"{name:<20}{pct(row['linear']):>8}{pct(row['knn']):>8}{pct(row['10_shot']):>9}{extract:>11.1f}"
              f"{t.get('linear_s', 0):>10.1f}{t.get('knn_s', 0):>8.1f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
