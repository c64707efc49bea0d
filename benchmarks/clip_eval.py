"""Image-text models trained here for the same CPU time budget each: zero-shot classification of held-out synthetic
shapes and retrieval on held-out Tux Paint pairs, against the untrained model (same architecture) in the same run.

    bash scripts/get_data.sh                            # Tux Paint's stamps from Debian
    python benchmarks/clip_eval.py --budget-minutes 5   # ~35 minutes on 2 cores in all
    python benchmarks/clip_eval.py --runs clip,siglip   # a subset (the untrained model is always measured)

Runs (each `--budget-minutes` of training; steps set from a measured rate):
- clip: objective=clip_tiny from scratch (vit_tiny image tower with CLIP's pre-norm at 32 px, open_clip text
  transformer of width 64, 2 layers), batch 64, lr 2e-3.
- siglip: objective=siglip_tiny, the same towers and budget.
- clip_accum4: clip at batch 16 x 4 accumulated micro-steps (the same global batch of 64, the same gradients by
  feature caching): what accumulation costs in images per second.
- lit: LiT on a masked_patch encoder (vit_tiny, pre-trained on the same images for the same budget, not counted in
  the LiT budget): the image tower is frozen, the projection and the text tower train.
Data: one shard directory of 8,192 synthetic shapes with captions and the 713 Tux Paint training pairs written four
times (~26% of the samples), drawn with replacement (data=wds). Evaluation: zero-shot top-1 on 2,000 synthetic test
shapes (seed 1, chance 12.5%) with the dataset's templates; image->text and text->image R@1 / R@5 on the 72 held-out
Tux Paint pairs (chance R@1 1.4%).
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

from ssl_vit.artifacts import read_preprocess
from ssl_vit.cli import register_configs
from ssl_vit.config import EvalConfig
from ssl_vit.data import SyntheticShapes, TuxPaintStamps
from ssl_vit.data.shards import write_shards
from ssl_vit.data.sources import ReadableSamples
from ssl_vit.eval.run import run_evaluators
from ssl_vit.objectives import load_trained
from ssl_vit.train import build_components, pretrain

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
COMMON = ["model=vit_tiny", "data=wds", "data.img_size=32", "data.num_workers=1", "trainer.log_every=50",
          "trainer.checkpoint_every=1000000"]
CLIP_OPTIM = ["optim.lr=2e-3"]
RUNS = {
    "clip": ["objective=clip_tiny", "data.batch_size=64", *CLIP_OPTIM],
    "siglip": ["objective=siglip_tiny", "data.batch_size=64", *CLIP_OPTIM],
    "clip_accum4": ["objective=clip_tiny", "data.batch_size=16", "trainer.grad_accum_steps=4", *CLIP_OPTIM],
    "lit": ["objective=clip_tiny", "data.batch_size=64", *CLIP_OPTIM, "objective.lock_image=true"],
}
ENCODER_FOR_LIT = ["objective=masked_patch", "data.batch_size=64"]


def _config(out_dir, shards, *overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[*COMMON, f"data.urls={shards}", "trainer.progress=true",
                                              f"output_dir={out_dir}", *overrides])


def _pretrain(cfg) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    return pretrain(cfg)


def train_for(name: str, overrides: list[str], minutes: float, shards: Path, out_root: Path) -> dict:
    """Measure the rate over 12 steps, then train for `minutes` (global batch 64)."""
    probe = _pretrain(_config(out_root / f"{name}-rate", shards, *overrides, "trainer.max_steps=12",
                              "trainer.trackers=[]"))
    steps = max(20, int(minutes * 60 * probe["images_per_s"] / 64))
    start = time.perf_counter()
    summary = _pretrain(_config(out_root / name, shards, *overrides, f"trainer.max_steps={steps}",
                                f"optim.warmup_steps={max(10, steps // 20)}"))
    return {"steps": summary["step"], "images_per_s": summary["images_per_s"],
            "wall_s": time.perf_counter() - start, "final_loss": summary["last"].get("loss")}


def write_mixture(out: Path, tuxpaint_copies: int = 4) -> dict:
    """Synthetic shapes + Tux Paint training pairs as shards in one directory (skipped when already there)."""
    if (out / "sizes.json").is_file():
        return json.loads((out / "sizes.json").read_text())
    write_shards(iter(SyntheticShapes(8192, 32, seed=0)), out, source="synthetic", prefix="shapes",
                 samples_per_shard=1024)
    for copy in range(tuxpaint_copies):
        write_shards(ReadableSamples(TuxPaintStamps(split="train")), out, source="tuxpaint", prefix=f"tux{copy}",
                     samples_per_shard=1024)
    return json.loads((out / "sizes.json").read_text())


def evaluate_model(model, preprocess) -> dict:
    zeroshot_cfg = EvalConfig(evaluators=["zeroshot"])
    retrieval_cfg = EvalConfig(evaluators=["retrieval"], retrieval_ks=[1, 5])
    shapes, tuxpaint = SyntheticShapes(2000, preprocess.img_size, seed=1), TuxPaintStamps(split="test")
    zeroshot, timings, _ = run_evaluators(model.backbone, None, shapes, zeroshot_cfg, preprocess, model=model,
                                          data_name="synthetic", progress=False)
    retrieval, more, _ = run_evaluators(model.backbone, None, tuxpaint, retrieval_cfg, preprocess, model=model,
                                        data_name="tuxpaint", progress=False)
    recall = retrieval["retrieval"]["accuracy"]
    return {"zeroshot": zeroshot["zeroshot"]["accuracy"], "zeroshot_top5": zeroshot["zeroshot"]["top5"],
            "i2t_R@1": recall["image_to_text_R@1"], "t2i_R@1": recall["text_to_image_R@1"],
            "i2t_R@5": recall["image_to_text_R@5"], "t2i_R@5": recall["text_to_image_R@5"],
            "retrieval_pairs": retrieval["retrieval"]["num_pairs"],
            "eval_s": timings["zeroshot_s"] + more["retrieval_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=5.0)
    parser.add_argument("--work-dir", default="outputs/bench_clip")
    parser.add_argument("--out", default="benchmarks/results/clip_eval.json")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {list(RUNS)}")
    args = parser.parse_args()
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; valid choices: {list(RUNS)}")
    register_configs()
    work = Path(args.work_dir)
    shards = work / "shards"
    sizes = write_mixture(shards)

    rows, training = {}, {}
    torch.manual_seed(0)
    untrained, _, _, preprocess = build_components(_config(work / "untrained", shards, *RUNS["clip"]))
    rows["untrained"] = evaluate_model(untrained, preprocess)
    for name in names:
        overrides = RUNS[name]
        if name == "lit":
            training["masked_patch encoder"] = train_for("masked_patch", ENCODER_FOR_LIT, args.budget_minutes,
                                                         shards, work)
            overrides = [*overrides, f"objective.image_encoder={work / 'masked_patch'}"]
        training[name] = train_for(name, overrides, args.budget_minutes, shards, work)
        rows[name] = evaluate_model(load_trained(work / name), read_preprocess(work / name / "encoder.safetensors"))

    report = {"benchmark": "clip_eval", "budget_minutes": args.budget_minutes, "common": COMMON, "runs": RUNS,
              "shards": sizes, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "training": training, "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    print(f"Image-text models, {args.budget_minutes:g} min of training each (2 CPU cores, fp32), synthetic shapes + "
          "Tux Paint shards")
    print(f"{'run':<22}{'steps':>7}{'img/s':>8}{'loss':>8}{'zero-shot':>11}{'top-5':>8}{'i2t R@1':>9}{'t2i R@1':>9}"
          f"{'i2t R@5':>9}{'t2i R@5':>9}")
    for name, row in rows.items():
        info = training.get(name, {})
        steps = f"{info['steps']}" if info else "-"
        rate = f"{info['images_per_s']:.1f}" if info else "-"
        loss = f"{info['final_loss']:.3f}" if info.get("final_loss") is not None else "-"
        scores = [row["zeroshot"], row["zeroshot_top5"], row["i2t_R@1"], row["t2i_R@1"], row["i2t_R@5"],
                  row["t2i_R@5"]]
        print(f"{name:<22}{steps:>7}{rate:>8}{loss:>8}{100 * scores[0]:>10.1f}%"
              + "".join(f"{100 * value:>8.1f}%" for value in scores[1:]))
    if "masked_patch encoder" in training:
        info = training["masked_patch encoder"]
        print(f"(lit's masked_patch encoder: {info['steps']} steps at {info['images_per_s']:.1f} img/s, not counted)")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
