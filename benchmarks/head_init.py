"""How the classification head of objective=supervised / deit starts (`objective.head_init`), on a small ViT
trained from scratch.

    python benchmarks/head_init.py                        # 2 heads x 3 inits x 10 seeds: ~25 min on 2 cores
    python benchmarks/head_init.py --seeds 0 --steps 50   # a smoke run

The protocol: vit_tiny cut to 2 blocks (width 64, 32 px, 4 px patches, `model.weight_init=jax` as the presets),
the built-in synthetic shapes (8 classes), AdamW at lr 2e-3 with weight decay 0.05 and a 30-step warm-up then a
cosine, batch 64, no augmentation, 600 steps; the same images, batches and backbone weights for every head init of
a seed. Reported per head kind and init: the top-1 accuracy of the trained classifier on 2,000 held-out images,
mean and spread over the seeds, and the train loss of the last 50 steps. The inits are the schemes' own:
`timm` trunc-normal(0.02), `jax` zero (big_vision's `head_zeroinit`), `torch` PyTorch's nn.Linear default.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ssl_vit.backbone import build_vit
from ssl_vit.backbone.init import WEIGHT_INITS
from ssl_vit.data import SyntheticShapes
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.supervised import SupervisedConfig
from ssl_vit.optim import apply_schedule, build_optimizer, schedule


def _images(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = SyntheticShapes(num_samples=count, img_size=32, seed=seed)
    samples = [shapes[i] for i in range(count)]
    images = torch.stack([s["image"] for s in samples]).float().div_(255).sub_(0.5).div_(0.5)
    return images, torch.tensor([s["label"] for s in samples])


def train(head: str, head_init: str, seed: int, steps: int, data, batch: int = 64) -> dict:
    (train_x, train_y), (test_x, test_y) = data
    torch.manual_seed(seed)
    backbone = build_vit("vit_tiny", depth=2, weight_init="jax")
    torch.manual_seed(1000 + seed)  # the head's own draw, apart from the backbone's
    objective = build_objective(SupervisedConfig(head=head, head_init=head_init), backbone,
                                DataInfo(num_classes=8, img_size=32))
    optim = type("Optim", (), dict(name="adamw", weight_decay=0.05, layer_decay=None, lr=2e-3, beta1=0.9,
                                   beta2=0.999, eps=1e-8))()
    optimizer = build_optimizer(objective, optim)
    lrs = schedule(2e-3, 1e-5, steps, warmup_steps=30)
    order = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        index = torch.randint(len(train_x), (batch,), generator=order)
        apply_schedule(optimizer, float(lrs[step]), 0.05, step)
        out = objective({"image": train_x[index], "label": train_y[index]})
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out["loss"].detach()))
    objective.eval()
    with torch.no_grad():
        predicted = torch.cat([objective.predict(test_x[i:i + 500]).argmax(-1) for i in range(0, len(test_x), 500)])
    return {"test_acc": float((predicted == test_y).float().mean()), "train_loss": statistics.mean(losses[-50:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--heads", nargs="+", default=["mlp", "linear"])
    parser.add_argument("--inits", nargs="+", default=list(WEIGHT_INITS[:3]), choices=WEIGHT_INITS)
    parser.add_argument("--out", default="benchmarks/results/head_init.json")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    data = (_images(8192, seed=0), _images(2000, seed=1))
    start = time.perf_counter()
    runs = {f"{head}/{init}": [] for head in args.heads for init in args.inits}
    with tqdm(total=len(runs) * len(args.seeds), desc="head init runs") as bar:
        for seed in args.seeds:
            for head in args.heads:
                for init in args.inits:
                    runs[f"{head}/{init}"].append(train(head, init, seed, args.steps, data))
                    bar.update()
    summary = {name: {key: {"mean": statistics.mean(r[key] for r in rows), "std": float(np.std([r[key] for r in rows])),
                            "min": min(r[key] for r in rows), "max": max(r[key] for r in rows)}
                      for key in ("test_acc", "train_loss")} for name, rows in runs.items()}
    report = {"benchmark": "head_init", "model": "vit_tiny depth 2 (width 64), weight_init jax", "steps": args.steps,
              "seeds": args.seeds, "data": "synthetic shapes, 8 classes, 8192 train / 2000 test", "lr": 2e-3,
              "batch": 64, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "wall_s": time.perf_counter() - start, "runs": runs, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"supervised, vit_tiny at depth 2, {args.steps} steps, {len(args.seeds)} seeds (mean ± std [min, max])")
    print(f"{'head':<8}{'init':<8}{'test acc %':>30}{'train loss':>16}")
    for name, stats in summary.items():
        head, init = name.split("/")
        acc = {key: value * 100 for key, value in stats["test_acc"].items()}
        cell = f"{acc['mean']:.1f} ± {acc['std']:.1f} [{acc['min']:.1f}, {acc['max']:.1f}]"
        print(f"{head:<8}{init:<8}{cell:>30}{stats['train_loss']['mean']:>16.3f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
