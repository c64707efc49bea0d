"""Training throughput of our ViT, eager and compiled per block (trainer.compile=true), against timm's
VisionTransformer eager and compiled (timm's --torchcompile: the whole model) and HF transformers' ViT (SDPA
attention), all with the same architecture, in one interleaved run; and the model FLOPs utilisation (achieved FLOP/s
over this machine's fp32 matmul throughput, measured in the same run).

    python benchmarks/train_speed.py        # vit_s16 at 224 px batch 32, and vit_tiny at 32 px batch 256 (~10 min)
    python benchmarks/train_speed.py --configs vit_ti16:224:64 --steps 5 --no-compile

One training step = forward + cross-entropy + backward + AdamW step, fp32. After every model's warm-up (which
compiles the compiled ones: its compile seconds are reported), the timed steps of the models are interleaved so that
drift in the machine's speed hits all alike; the table reports the median step time of each.
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
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.backbone import PRESETS, build_vit
from ssl_vit.train.strategy import compile_blocks, compile_seconds

NUM_CLASSES = 1000


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


def architecture(name: str, img_size: int) -> dict:
    preset = {**PRESETS[name], "img_size": img_size}
    return dict(img_size=img_size, patch_size=preset["patch_size"], embed_dim=preset["embed_dim"],
                depth=preset["depth"], num_heads=preset["num_heads"])


def hf_vit(arch: dict) -> torch.nn.Module:
    import transformers  # only for this row

    config = transformers.ViTConfig(image_size=arch["img_size"], patch_size=arch["patch_size"],
                                    hidden_size=arch["embed_dim"], num_hidden_layers=arch["depth"],
                                    num_attention_heads=arch["num_heads"], intermediate_size=4 * arch["embed_dim"],
                                    num_labels=NUM_CLASSES, layer_norm_eps=1e-6, attn_implementation="sdpa")
    model = transformers.ViTForImageClassification(config)
    return lambda images, model=model: model(pixel_values=images).logits, model


def build_models(name: str, arch: dict, compile_models: bool) -> dict:
    """name -> (callable images -> logits, module whose parameters train)."""
    ours = build_vit(name, img_size=arch["img_size"], num_classes=NUM_CLASSES)
    theirs = TimmViT(**arch, num_classes=NUM_CLASSES)
    theirs.load_state_dict(ours.state_dict())
    models = {"ssl_vit": (ours, ours), "timm": (theirs, theirs), "transformers": hf_vit(arch)}
    if compile_models:
        ours_compiled = build_vit(name, img_size=arch["img_size"], num_classes=NUM_CLASSES)
        ours_compiled.load_state_dict(ours.state_dict())
        compile_blocks(ours_compiled)  # what trainer.compile=true does
        timm_compiled = TimmViT(**arch, num_classes=NUM_CLASSES)
        timm_compiled.load_state_dict(ours.state_dict())
        models["ssl_vit compiled"] = (ours_compiled, ours_compiled)
        models["timm compiled"] = (torch.compile(timm_compiled), timm_compiled)  # timm's train.py --torchcompile
    return models


def train_step(forward, optimizer, images, labels):
    loss = torch.nn.functional.cross_entropy(forward(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_flops(forward, module, images, labels) -> int:
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(forward(images), labels).backward()
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def measure(name: str, img_size: int, batch: int, steps: int, compile_models: bool) -> dict:
    torch.manual_seed(0)
    arch = architecture(name, img_size)
    models = build_models(name, arch, compile_models)
    images = torch.randn(batch, 3, img_size, img_size)
    labels = torch.randint(0, NUM_CLASSES, (batch,))
    optimizers = {key: torch.optim.AdamW(module.parameters(), lr=1e-4) for key, (_, module) in models.items()}
    # FLOPs of the eager models (a compiled one does the same work)
    flops = {key: step_flops(forward, module, images, labels) for key, (forward, module) in models.items()
             if "compiled" not in key}
    flops["ssl_vit compiled"] = flops["timm compiled"] = flops["ssl_vit"]
    peak = matmul_peak()
    compile_s = {}
    for key, (forward, _) in models.items():  # warm-up; compiles the compiled ones
        before, start = compile_seconds(), time.perf_counter()
        train_step(forward, optimizers[key], images, labels)
        compile_s[key] = {"first_step_s": time.perf_counter() - start, "compile_s": compile_seconds() - before}
    times = {key: [] for key in models}
    for _ in range(steps):
        for key, (forward, _) in models.items():
            start = time.perf_counter()
            train_step(forward, optimizers[key], images, labels)
            times[key].append(time.perf_counter() - start)
    peak = max(peak, matmul_peak())  # measured before and after: the better of the two
    rows = {}
    for key in models:
        step = statistics.median(times[key])
        achieved = flops[key] / step / 1e9
        rows[key] = {"step_s": step, "images_per_s": batch / step, "step_gflop": flops[key] / 1e9,
                     "achieved_gflop_s": achieved, "mfu": achieved / peak, "step_times": times[key],
                     **(compile_s[key] if "compiled" in key else {})}
    eager_peer = min(rows["timm"]["step_s"], rows["transformers"]["step_s"])
    result = {"model": name, "img_size": img_size, "batch": batch, "params": sum(
        p.numel() for p in models["ssl_vit"][1].parameters()), "matmul_peak_gflop_s": peak, "results": rows,
        "eager_vs_faster_eager_peer": eager_peer / rows["ssl_vit"]["step_s"]}
    if compile_models:
        result["compiled_vs_faster_eager_peer"] = eager_peer / rows["ssl_vit compiled"]["step_s"]
        result["compiled_vs_timm_compiled"] = rows["timm compiled"]["step_s"] / rows["ssl_vit compiled"]["step_s"]
        result["compiled_vs_eager"] = rows["ssl_vit"]["step_s"] / rows["ssl_vit compiled"]["step_s"]
    return result


def print_table(result: dict) -> None:
    print(f"\n{result['model']} @ {result['img_size']}px, batch {result['batch']}, fp32; "
          f"matmul peak {result['matmul_peak_gflop_s']:.1f} GFLOP/s")
    print(f"{'model':<18}{'img/s':>9}{'step s':>9}{'GFLOP/step':>12}{'GFLOP/s':>10}{'MFU':>8}{'compile s':>11}")
    for key, row in result["results"].items():
        compile_s = f"{row['compile_s']:>11.1f}" if "compile_s" in row else f"{'':>11}"
        print(f"{key:<18}{row['images_per_s']:>9.2f}{row['step_s']:>9.3f}{row['step_gflop']:>12.2f}"
              f"{row['achieved_gflop_s']:>10.1f}{row['mfu']:>8.1%}{compile_s}")
    ratios = {k: v for k, v in result.items() if k.startswith(("compiled_vs", "eager_vs"))}
    print("  " + ", ".join(f"{k.replace('_', ' ')} {v:.3f}x" for k, v in ratios.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="vit_s16:224:32,vit_tiny:32:256",
                        help="comma-separated model:img_size:batch (models from ssl_vit.backbone.PRESETS)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager rows only")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/train_speed.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = []
    for spec in args.configs.split(","):
        name, img_size, batch = spec.split(":")
        if name not in PRESETS:
            parser.error(f"unknown model {name!r}; valid choices: {sorted(PRESETS)}")
        configs.append((name, int(img_size), int(batch)))
    import transformers  # for the record

    results = [measure(name, img_size, batch, args.steps, args.compile) for name, img_size, batch in configs]
    record = {"benchmark": "train_speed", "threads": torch.get_num_threads(), "torch": torch.__version__,
              "timm": timm.__version__, "transformers": transformers.__version__,
              "machine": platform.processor() or platform.machine(), "runs": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['threads']} threads, torch {record['torch']}, timm {record['timm']}, "
          f"transformers {record['transformers']}")
    for result in results:
        print_table(result)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
