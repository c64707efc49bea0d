"""Training throughput of our ViT against timm's VisionTransformer with the same config, in the same run, and the
model FLOPs utilisation (achieved FLOP/s over this machine's measured fp32 matmul throughput).

    python benchmarks/train_speed.py                         # vit_s16, 224 px, batch 32 (about 3 minutes on 2 cores)
    python benchmarks/train_speed.py --model vit_ti16 --batch 64 --steps 5

One training step = forward + backward + AdamW step, fp32. Steps of the two models are interleaved so that drift in
the machine's speed hits both alike; the table reports the median step time of each.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.vit import PRESETS, build_vit

TIMM_NAMES = {"vit_ti16": "vit_tiny_patch16_224", "vit_s16": "vit_small_patch16_224",
              "vit_b16": "vit_base_patch16_224", "vit_l16": "vit_large_patch16_224"}


def matmul_peak(size: int = 4096, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of a size x size matmul (the machine's practical peak for the layers a ViT is made of)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def train_step(model, optimizer, images, labels):
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_flops(model, images, labels) -> int:
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_s16", choices=sorted(TIMM_NAMES))
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/train_speed.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    ours = build_vit(args.model, img_size=args.img_size, num_classes=1000)
    theirs = timm.create_model(TIMM_NAMES[args.model], pretrained=False, num_classes=1000, img_size=args.img_size)
    theirs.load_state_dict(ours.state_dict())
    models = {"ssl_vit": ours, "timm": theirs}
    images = torch.randn(args.batch, 3, args.img_size, args.img_size)
    labels = torch.randint(0, 1000, (args.batch,))
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    flops = {name: step_flops(m, images, labels) for name, m in models.items()}

    peak = matmul_peak()
    for name, model in models.items():  # warm-up
        train_step(model, optimizers[name], images, labels)
    times = {name: [] for name in models}
    for _ in range(args.steps):
        for name, model in models.items():
            start = time.perf_counter()
            train_step(model, optimizers[name], images, labels)
            times[name].append(time.perf_counter() - start)
    peak = max(peak, matmul_peak())  # measured before and after: the better of the two

    rows = {}
    for name in models:
        step = statistics.median(times[name])
        achieved = flops[name] / step / 1e9
        rows[name] = {"step_s": step, "images_per_s": args.batch / step, "step_gflop": flops[name] / 1e9,
                      "achieved_gflop_s": achieved, "mfu": achieved / peak, "step_times": times[name]}
    result = {
        "benchmark": "train_speed", "model": args.model, "img_size": args.img_size, "batch": args.batch,
        "params": sum(p.numel() for p in ours.parameters()), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "timm": timm.__version__, "machine": platform.processor() or platform.machine(),
        "matmul_peak_gflop_s": peak, "results": rows,
        "speedup_vs_timm": rows["timm"]["step_s"] / rows["ssl_vit"]["step_s"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{args.model} @ {args.img_size}px, batch {args.batch}, fp32, {result['threads']} threads; "
          f"matmul peak {peak:.1f} GFLOP/s")
    print(f"{'model':<10}{'img/s':>9}{'step s':>9}{'GFLOP/step':>12}{'GFLOP/s':>10}{'MFU':>8}")
    for name, row in rows.items():
        print(f"{name:<10}{row['images_per_s']:>9.2f}{row['step_s']:>9.2f}{row['step_gflop']:>12.1f}"
              f"{row['achieved_gflop_s']:>10.1f}{row['mfu']:>8.1%}")
    print(f"ssl_vit vs timm: {result['speedup_vs_timm']:.3f}x  -> {out}")


if __name__ == "__main__":
    assert set(TIMM_NAMES) <= set(PRESETS)
    main()
