"""NaFlex against the ways around it: speed, attention packing, and accuracy on images of mixed aspect ratios.

    python benchmarks/naflex.py                           # all three parts (CPU: ~15 min)
    python benchmarks/naflex.py --parts speed attention   # the timings only
    python benchmarks/naflex.py --parts accuracy --steps 300

speed: one forward + backward of an encoder (default ViT-Ti/16; vit_s16 / vit_b16 on a GPU) on a batch of images
of mixed aspect ratios (width / height 1/4 .. 4) under one token budget, three ways: NaFlex (each image at its own
aspect ratio within the sequence length, padded to it, the key mask in SDPA), padding every image to the largest
size (the images at the same sizes, zero-padded to the batch's largest height and width: a dense batch, no mask),
and square resizing (every image squashed to the square grid of the same length: no padding, the speed bound).
Images/s and valid tokens/s; the measured matmul peak for reference.

attention: the attention of that NaFlex batch alone, padded with a key mask (what the backbone runs) against
packing every image's valid tokens into one sequence with a block-diagonal mask (dense SDPA; and FlexAttention's
block-sparse kernel where torch.compile runs it); the faster one per device is what the backbone should run.

accuracy: a supervised ViT-Ti (vit_tiny, 4 px patches) trained on built-in shapes at 5 aspect ratios (1/4 .. 4, the
area of 32 x 32 px) with NaFlex (64 patches per image) and at a square 32 px (the same 64 patches) two ways: the
shorter side resized and the centre cropped (timm's eval transform), or both sides squashed (transformers'
processors); the same images per step; k-NN and linear-probe accuracy on the held-out shapes, each encoder evaluated
with NaFlex and at 32 px as it was trained.

Writes benchmarks/results/naflex.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ssl_vit.backbone import build_vit
from ssl_vit.data.naflex import grid_for_seq
from ssl_vit.naflex import NaFlexLayout, pack

ROOT = Path(__file__).resolve().parents[1]
ASPECTS = (0.25, 0.5, 1.0, 2.0, 4.0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    return f"{models[0] if models else platform.processor() or 'CPU'}, {len(models) or '?'} cores (CPU)"


def matmul_tflops(device: torch.device, size: int = 2048) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    timed(lambda: a @ b, device, 1)
    return 2 * size ** 3 / timed(lambda: a @ b, device, 5) / 1e12


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mixed_batch(count: int, patch: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """`count` images, aspect ratios cycling through ASPECTS, each at its NaFlex size for `seq_len` patches."""
    generator = torch.Generator().manual_seed(seed)
    images = []
    for i in range(count):
        aspect = ASPECTS[i % len(ASPECTS)]
        rows, cols = grid_for_seq(100, round(100 * aspect), patch, seq_len)
        images.append(torch.randn(3, rows * patch, cols * patch, generator=generator))
    return images


def speed(model_name: str, seq_len: int, batch: int, reps: int, device: torch.device) -> list[dict]:
    vit = build_vit(model_name, img_size=int(math.isqrt(seq_len)) * 16 if "16" in model_name else 32).to(device)
    patch = vit.patch_embed.patch_size[0]
    images = mixed_batch(batch, patch, seq_len)
    valid = sum(image.shape[1] * image.shape[2] // patch ** 2 for image in images)
    naflex = {k: v.to(device) for k, v in pack(images, patch, seq_len).items()}
    height, width = (max(image.shape[i] for image in images) for i in (1, 2))
    padded = torch.zeros(batch, 3, height, width)
    for i, image in enumerate(images):
        padded[i, :, :image.shape[1], :image.shape[2]] = image
    side = int(math.isqrt(seq_len)) * patch
    square = torch.stack([F.interpolate(image[None], size=(side, side), mode="bilinear")[0] for image in images])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(inputs):
        def run():
            with autocast:
                loss = vit(inputs).float().square().mean()
            loss.backward()
        return run

    rows = []
    for name, inputs, tokens in (("NaFlex (padded to the bucket, key mask)", naflex, batch * seq_len),
                                 ("pad to the largest image", padded.to(device),
                                  batch * (height // patch) * (width // patch)),
                                 ("square resize (same length)", square.to(device), batch * (side // patch) ** 2)):
        seconds = timed(step(inputs), device, reps)
        rows.append({"method": name, "seconds": seconds, "images_per_s": batch / seconds,
                     "valid_tokens_per_s": (valid if name != "square resize (same length)" else tokens) / seconds,
                     "tokens_computed": tokens, "padding_share": 1 - valid / tokens if "square" not in name else 0.0})
    return rows


def attention(seq_len: int, batch: int, heads: int, head_dim: int, reps: int, device: torch.device) -> list[dict]:
    """SDPA over the NaFlex layout: padded + key mask vs packed + block-diagonal mask (and FlexAttention)."""
    images = mixed_batch(batch, 16, seq_len)
    layout = NaFlexLayout.of(pack(images, 16, seq_len))
    lengths = layout.valid.sum(1).tolist()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype)
    mask = layout.attention_mask(0).to(device)
    total = sum(lengths)
    packed = torch.randn(1, heads, total, head_dim, device=device, dtype=dtype)
    owner = torch.repeat_interleave(torch.arange(batch), torch.tensor(lengths)).to(device)
    block = (owner[:, None] == owner[None, :])[None, None]
    rows = [{"method": "padded + key mask (the backbone's)",
             "seconds": timed(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask), device, reps)},
            {"method": "packed + block-diagonal mask (dense SDPA)",
             "seconds": timed(lambda: F.scaled_dot_product_attention(packed, packed, packed, attn_mask=block), device,
                              reps)}]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def same_image(b, h, q_index, kv_index):
            return owner[q_index] == owner[kv_index]

        sparse = create_block_mask(same_image, None, None, total, total, device=device.type)
        flex = torch.compile(flex_attention)
        rows.append({"method": "packed + FlexAttention block mask (compiled)",
                     "seconds": timed(lambda: flex(packed, packed, packed, block_mask=sparse), device, reps)})
    except Exception as err:  # noqa: BLE001 - a kernel this torch / device does not run is reported, not fatal
        rows.append({"method": "packed + FlexAttention block mask (compiled)", "seconds": None,
                     "error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"})
    return rows


def run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")
    return proc


def accuracy(steps: int, out: Path, seed: int = 0) -> list[dict]:
    data = ["data=synthetic", "data.num_samples=8192", f"data.aspect_ratios={list(ASPECTS)}", "data.batch_size=32"]
    common = ["objective=supervised", "model=vit_tiny", *data, f"trainer.max_steps={steps}", "trainer.progress=false",
              "trainer.log_every=50", f"seed={seed}"]
    recipes = {"NaFlex, 64 patches per image": ["data.resolution=naflex", "data.naflex.seq_lens=[64]",
                                                "data.naflex.max_tokens=2048"],
               "square crop, 32 px (64 patches)": ["data.img_size=32"],
               "squashed, 32 px (64 patches)": ["data.img_size=32", "data.resize_mode=squash"]}
    rows = []
    for name, extra in recipes.items():
        run_dir = out / name.split(",")[0].lower().replace(" ", "_")
        start = time.perf_counter()
        run("scripts/pretrain.py", *common, *extra, f"hydra.run.dir={run_dir}")
        minutes = (time.perf_counter() - start) / 60
        for evaluated in ("naflex", "fixed"):
            report_dir = run_dir / f"eval_{evaluated}"
            run("scripts/evaluate.py", f"checkpoint={run_dir}", *data[:3], "data.img_size=32", "eval=linear",
                "eval.evaluators=[linear,knn]", f"eval.resolution={evaluated}", "eval.seq_len=64",
                f"hydra.run.dir={report_dir}", "cache_dir=null")
            report = json.loads((report_dir / "results.json").read_text())
            rows.append({"trained": name, "evaluated": "NaFlex, 64 patches" if evaluated == "naflex" else
                         "32 px as trained (crop or squash)", "train_minutes": round(minutes, 1),
                         "knn": report["results"]["knn"]["accuracy"],
                         "linear": report["results"]["linear"]["accuracy"]})
    return rows


def table(title: str, rows: list[dict], columns: list[str]) -> str:
    lines = [f"\n{title}", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row.get(c) for c in columns]
        lines.append("| " + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["speed", "attention", "accuracy"],
                        choices=["speed", "attention", "accuracy"])
    parser.add_argument("--model", default="vit_ti16")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="accuracy: training steps per recipe")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "naflex.json"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": device_name(device), "torch": torch.__version__, "matmul_tflops": matmul_tflops(device),
              "model": args.model, "seq_len": args.seq_len, "batch": args.batch}
    print(f"{result['device']}: matmul peak {result['matmul_tflops']:.2f} TFLOP/s")
    if "speed" in args.parts:
        result["speed"] = speed(args.model, args.seq_len, args.batch, args.reps, device)
        print(table(f"{args.model}, {args.batch} images of aspect 1/4..4, sequence {args.seq_len}: fwd + bwd",
                    result["speed"], ["method", "seconds", "images_per_s", "valid_tokens_per_s", "padding_share"]))
    if "attention" in args.parts:
        vit = build_vit(args.model)
        result["attention"] = attention(args.seq_len, args.batch, vit.config.num_heads,
                                        vit.embed_dim // vit.config.num_heads, args.reps, device)
        print(table("attention alone (one layer's SDPA)", result["attention"], ["method", "seconds", "error"]))
    if "accuracy" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            result["accuracy"] = accuracy(args.steps, Path(tmp))
        result["steps"] = args.steps
        print(table(f"supervised vit_tiny, {args.steps} steps of 32 images, shapes at aspect 1/4..4",
                    result["accuracy"], ["trained", "evaluated", "knn", "linear", "train_minutes"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
