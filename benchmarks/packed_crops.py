"""DINO's student over multi-crop batches: today's one forward per resolution (the global crops together, the local
crops together) against every crop of an image packed into one sequence with block-diagonal attention (SDPA with a
boolean mask: no token attends across crops), forward + backward, interleaved in one run. Both give the same pooled
embeddings (checked here: the largest difference is reported); the table says which is faster on this device.

    python benchmarks/packed_crops.py                                  # vit_s16, 2 x 224 + 6 x 96 crops, batch 8
    python benchmarks/packed_crops.py --device cuda --model vit_b16 --batch 64 --dtype bf16

Packing pays where a forward's fixed costs (kernel launches, per-op overheads) dominate; it costs attention over
the whole packed sequence (the mask zeroes most of it, the kernel still computes it), and a mask rules out the
flash kernel on GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ssl_vit.backbone import build_vit


@contextlib.contextmanager
def block_diagonal_attention(mask: torch.Tensor):
    """Every scaled_dot_product_attention call inside gets `mask` ((S, S) bool: True = may attend)."""
    original = F.scaled_dot_product_attention

    def masked(q, k, v, *args, attn_mask=None, **kwargs):
        if attn_mask is not None:
            raise ValueError("packing crops of a model with its own attention bias (relative positions) is not built")
        return original(q, k, v, *args, attn_mask=mask, **kwargs)

    F.scaled_dot_product_attention = masked
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def per_resolution(model, crops: list[torch.Tensor]) -> torch.Tensor:
    """Today's student: one forward per run of equal-sized crops; (n_crops * B, D) pooled, crop-major."""
    pooled, start = [], 0
    while start < len(crops):
        end = start + 1
        while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
            end += 1
        pooled.append(model.pool(model.forward_features(torch.cat(crops[start:end]))))
        start = end
    return torch.cat(pooled)


def packed(model, crops: list[torch.Tensor]) -> torch.Tensor:
    """Each image's crops as one token sequence, attention kept within each crop; the same crop-major output."""
    batch = crops[0].shape[0]
    sequences = [model.embed(crop) for crop in crops]  # (B, L_i, D) each, prefix tokens in front
    lengths = [s.shape[1] for s in sequences]
    mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool, device=crops[0].device) for n in lengths])
    with block_diagonal_attention(mask):
        tokens = model.run_blocks(torch.cat(sequences, dim=1))
    return torch.cat([model.pool(t) for t in tokens.split(lengths, dim=1)]).reshape(len(crops) * batch, -1)


def timed_step(forward, model, crops, device) -> float:
    start = time.perf_counter()
    forward(model, crops).square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_s16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=8, help="images per step (each gives every crop)")
    parser.add_argument("--global-size", type=int, default=224)
    parser.add_argument("--local-size", type=int, default=96)
    parser.add_argument("--crops", default="2,6", help="global,local crop counts")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    n_global, n_local = (int(n) for n in args.crops.split(","))
    torch.manual_seed(0)
    model = build_vit(args.model, img_size=args.global_size).to(device)
    crops = ([torch.randn(args.batch, 3, args.global_size, args.global_size, device=device)] * n_global
             + [torch.randn(args.batch, 3, args.local_size, args.local_size, device=device)] * n_local)
    crops = [c + 0.01 * i for i, c in enumerate(crops)]  # distinct crops
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    with torch.no_grad(), autocast:
        difference = float((per_resolution(model, crops).float() - packed(model, crops).float()).abs().max())
    ways = {"per resolution": per_resolution, "packed": packed}
    times = {name: [] for name in ways}
    with autocast:
        for forward in ways.values():  # warm-up
            timed_step(forward, model, crops, device)
        for _ in range(args.steps):  # interleaved
            for name, forward in ways.items():
                times[name].append(timed_step(forward, model, crops, device))
                model.zero_grad(set_to_none=True)
    rows = {name: {"step_s": statistics.median(t), "images_per_s": args.batch / statistics.median(t)}
            for name, t in times.items()}
    record = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
              platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "dtype": args.dtype,
              "batch": args.batch, "crops": [args.global_size] * n_global + [args.local_size] * n_local,
              "max_abs_difference": difference, "rows": rows,
              "packed_speedup": rows["per resolution"]["step_s"] / rows["packed"]["step_s"]}
    print(f"{args.model}, {n_global} x {args.global_size} + {n_local} x {args.local_size} px crops, batch "
          f"{args.batch}, {args.dtype} on {record['device']} ({record['threads']} threads); pooled embeddings agree "
          f"to {difference:.1e}")
    print(f"{'student forward + backward':<28}{'step s':>10}{'img/s':>10}")
    for name, row in rows.items():
        print(f"{name:<28}{row['step_s']:>10.3f}{row['images_per_s']:>10.1f}")
    print(f"packed / per resolution: {record['packed_speedup']:.2f}x")
    out = Path(args.out or f"benchmarks/results/packed_crops_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
