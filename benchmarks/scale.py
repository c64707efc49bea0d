"""Memory per rank and step time of the shipped strategies, next to scripts/plan_memory.py's prediction for the
same setting, in the same run.

    python benchmarks/scale.py                                       # vit_b16 and vit_l16, 2 CPU processes, fp32
    python benchmarks/scale.py --models vit_b16 --strategies ddp,zero3 --batch 2
    python benchmarks/scale.py --device cuda --precision bf16 --gpus 8 --models vit_l16,vit_h14 --batch 16
    python benchmarks/scale.py --models vit_22b --depth 2 --strategies fsdp2,zero3 --batch 1 --steps 2 \
        --out benchmarks/results/scale_vit_22b_depth2.json   # ViT-22B's real width (0.9B parameters)
(the last needs ~29 GB for its 2 ranks in fp32: on a 24 GB host with swap; swapped memory is counted as held)

Each (model, strategy) is one `accelerate launch` of benchmarks/scale_worker.py with the strategy's shipped config
(configs/accelerate/<strategy>_cpu2.yaml, or <strategy>_gpu8.yaml with --num_processes on GPUs): the supervised
objective, AdamW, random images. Measured per rank: model states (resident memory after the first step, before the
gradients are freed; on GPU the CUDA allocator's), peak memory (peak RSS; on GPU also the allocator's peak) and the
median step time. On CPU glibc's dynamic mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_) so that freed tensors
leave the resident set; the CPU allocator keeps no peak counter, so RSS is the CPU figure. Predicted: model states
+ communication buffers, and the total with activations (ssl_vit/train/memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from ssl_vit.train.memory import ModelShape, plan

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2


def measure(model: str, strategy: str, args) -> dict:
    config = ROOT / "configs/accelerate" / f"{strategy}_{'gpu8' if args.device == 'cuda' else 'cpu2'}.yaml"
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               *(["--num_processes", str(args.gpus)] if args.device == "cuda" else []),
               str(ROOT / "benchmarks/scale_worker.py"), "--model", model, "--batch", str(args.batch),
               "--img-size", str(args.img_size), "--steps", str(args.steps), "--precision", args.precision,
               *(["--depth", str(args.depth)] if args.depth else []), "--out", out]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{model} under {strategy} failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    world = ranks[0]["world_size"]
    shape = ModelShape.of(model, img_size=args.img_size, **({"depth": args.depth} if args.depth else {}))
    predicted = plan(shape, strategy, world, gpus_per_node=world,
                     batch_per_gpu=args.batch, precision=args.precision)
    states = max(r["model_states_mib"] for r in ranks)
    peak = max((r["peak_allocated_mib"] or r["peak_rss_mib"]) for r in ranks)
    expected_states = (predicted.model_states + predicted.comm_buffers) / MIB
    return {"model": model, "depth": shape.depth, "params": shape.params, "strategy": strategy, "world_size": world,
            "ranks": ranks,
            "model_states_mib": states, "peak_mib": peak, "step_s": max(r["step_s"] for r in ranks),
            "predicted": {k: v / MIB if isinstance(v, int) and k not in ("gpus",) else v
                          for k, v in predicted.as_dict().items()},
            "predicted_states_mib": expected_states, "predicted_total_mib": predicted.total / MIB,
            "states_ratio": states / expected_states, "peak_ratio": peak / (predicted.total / MIB)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit_b16,vit_l16")
    parser.add_argument("--strategies", default="ddp,zero2,zero3,fsdp2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=None, help="blocks, overriding the presets' (the real width of "
                                                                  "a large preset at a depth that fits here)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--gpus", type=int, default=8, help="processes on --device cuda (CPU: 2, as the configs)")
    parser.add_argument("--out", default="benchmarks/results/scale.json")
    args = parser.parse_args()
    rows = [measure(model, strategy, args) for model in args.models.split(",")
            for strategy in args.strategies.split(",")]
    for model in args.models.split(","):
        ddp = next((r for r in rows if r["model"] == model and r["strategy"] == "ddp"), None)
        for row in rows:
            if row["model"] == model and ddp is not None:
                row["states_vs_ddp"] = row["model_states_mib"] / ddp["model_states_mib"]
    report = {"benchmark": "scale", "device": args.device, "precision": args.precision, "batch_per_rank": args.batch,
              "img_size": args.img_size, "machine": platform.processor() or platform.machine(), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.device}, {args.precision}, batch {args.batch}/rank at {args.img_size} px, "
          f"{rows[0]['world_size']} ranks; MiB per rank (max over ranks)")
    print(f"{'model':<9}{'strategy':<9}{'states':>9}{'planned':>9}{'ratio':>7}{'vs ddp':>8}"
          f"{'peak':>9}{'planned':>9}{'ratio':>7}{'step s':>8}")
    for r in rows:
        print(f"{r['model']:<9}{r['strategy']:<9}{r['model_states_mib']:>9.0f}{r['predicted_states_mib']:>9.0f}"
              f"{r['states_ratio']:>7.2f}{r.get('states_vs_ddp', float('nan')):>8.2f}{r['peak_mib']:>9.0f}"
              f"{r['predicted_total_mib']:>9.0f}{r['peak_ratio']:>7.2f}{r['step_s']:>8.2f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
