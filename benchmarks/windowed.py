"""ViTDet / SAM windows at high resolution: memory and time of one forward + backward of a ViT-B/16 encoder, global
attention against windowed (window 14, blocks 2, 5, 8, 11 global, as SAM ViT-B and ViTDet), with and without
decomposed relative positions, at 512 and 1024 px, one image, fp32 (bf16 autocast on a GPU); next to the matmul
peak measured in the same run, and the memory planner's prediction (ssl_vit.train.memory: activations + gradients).

    python benchmarks/windowed.py                        # CPU: 512 and 1024 px, 2 timed repeats each
    python benchmarks/windowed.py --sizes 512 --reps 1   # quicker

Each configuration runs in its own process, so that peak memory is its own: on CUDA max_memory_allocated, on a CPU
the growth of the process's peak resident set over what it held once the model and the input were built (the
allocator's caching included). Time: the median of `--reps` steps after one warm-up step. Writes
benchmarks/results/windowed.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ssl_vit.backbone import build_vit
from ssl_vit.train.memory import ModelShape, activation_bytes

VARIANTS = {  # name: VisionTransformer overrides
    "global": {},
    "windowed": {"window_size": 14, "global_attn_indexes": [2, 5, 8, 11]},
    "windowed + rel_pos (SAM)": {"window_size": 14, "global_attn_indexes": [2, 5, 8, 11], "rel_pos": True},
}
MODEL = "vit_b16"


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(size: int, variant: str, reps: int) -> dict:
    """One configuration, in this process: {"seconds", "peak_bytes"}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_vit(MODEL, img_size=size, **VARIANTS[variant]).to(device)
    images = torch.randn(1, 3, size, size, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = model.forward_features(images).float().square().mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    base = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    step()
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else rss_bytes()) - base
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_bytes": peak}


def matmul_tflops(size: int = 2048) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * size**3 / (time.perf_counter() - start) / 1e12


def planned_bytes(size: int, variant: str) -> int:
    """The planner's activations + gradients (one image, fp32), windows and relative positions included."""
    shape = ModelShape.of(MODEL, img_size=size, **VARIANTS[variant])
    return activation_bytes(shape, 1, "fp32", False) + 4 * shape.params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "windowed.json"))
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # size variant: measure in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1], args.reps)))
        return
    rows = []
    peak = matmul_tflops()
    print(f"{MODEL}, one image, forward + backward; {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads; fp32 matmul peak {peak:.2f} TFLOP/s")
    print(f"{'size':>5} {'variant':<26} {'seconds':>8} {'peak GiB':>9} {'planner GiB':>12}")
    for size in (int(s) for s in args.sizes.split(",")):
        for variant in VARIANTS:
            proc = subprocess.run([sys.executable, __file__, "--one", str(size), variant, "--reps", str(args.reps)],
                                  capture_output=True, text=True, check=True)
            row = {"size": size, "variant": variant, **json.loads(proc.stdout.splitlines()[-1]),
                   "planner_bytes": planned_bytes(size, variant)}
            rows.append(row)
            print(f"{size:>5} {variant:<26} {row['seconds']:>8.2f} {row['peak_bytes'] / 2**30:>9.2f} "
                  f"{row['planner_bytes'] / 2**30:>12.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "device": "cuda" if torch.cuda.is_available() else "cpu",
                               "threads": torch.get_num_threads(), "matmul_tflop_s": peak, "rows": rows}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
