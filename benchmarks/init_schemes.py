"""Weight-init schemes (`model.weight_init` = timm | jax | torch) on a small ViT trained from scratch.

    python benchmarks/init_schemes.py                      # vit_tiny, supervised, synthetic shapes: ~8 min on 2 cores
    python benchmarks/init_schemes.py --model vit_test --steps 100 --seeds 0   # a smoke run

Each scheme trains the same config (the default run: supervised vit_tiny on the built-in shapes, 300 steps) with
several seeds; reported per scheme: the training loss and accuracy over the last 30 steps and the weighted k-NN
accuracy of the final encoder on held-out shapes (frozen features), mean and spread over the seeds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir

from ssl_vit.backbone.init import WEIGHT_INITS
from ssl_vit.cli import register_configs
from ssl_vit.train import pretrain

MEASURED = WEIGHT_INITS[:3]  # timm, jax, torch: the schemes the docs table compares (mocov3 came later)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run(model: str, scheme: str, seed: int, steps: int, work: Path) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("pretrain", overrides=[
            f"model={model}", f"model.weight_init={scheme}", f"seed={seed}", f"trainer.max_steps={steps}",
            "trainer.log_every=10", f"trainer.eval_every={steps}", "trainer.progress=false",
            "trainer.trackers=[]", f"trainer.checkpoint_every={steps}",
            f"output_dir={work / scheme / str(seed)}"])
    start = time.perf_counter()
    pretrain(cfg)
    rows = [json.loads(line) for line in (work / scheme / str(seed) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r][-3:]
    return {"loss": statistics.mean(r["loss"] for r in train), "acc": statistics.mean(r["acc"] for r in train),
            "knn": next(r["eval/knn"] for r in rows if "eval/knn" in r), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work-dir", default="outputs/bench_init")
    parser.add_argument("--out", default="benchmarks/results/init_schemes.json")
    args = parser.parse_args()
    register_configs()
    results = {scheme: [run(args.model, scheme, seed, args.steps, Path(args.work_dir)) for seed in args.seeds]
               for scheme in MEASURED}
    summary = {scheme: {key: {"mean": statistics.mean(r[key] for r in runs),
                              "min": min(r[key] for r in runs), "max": max(r[key] for r in runs)}
                        for key in ("loss", "acc", "knn")} for scheme, runs in results.items()}
    report = {"benchmark": "init_schemes", "model": args.model, "steps": args.steps, "seeds": args.seeds,
              "data": "synthetic", "objective": "supervised", "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "runs": results, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.model}, supervised on synthetic shapes, {args.steps} steps, seeds {args.seeds} (mean [min, max])")
    print(f"{'init':<8}{'train loss':>24}{'train acc %':>24}{'k-NN acc %':>24}")
    for scheme, stats in summary.items():
        cells = [f"{s['mean'] * f:.3f} [{s['min'] * f:.2f}, {s['max'] * f:.2f}]"
                 for s, f in ((stats["loss"], 1), (stats["acc"], 100), (stats["knn"], 100))]
        print(f"{scheme:<8}" + "".join(f"{c:>24}" for c in cells))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
