"""Inference speed of an exported encoder in every runtime it goes to, against ours, on the same weights in one run:
the features a VLM takes (LLaVA's hidden_states[-2]) from `ssl_vit.VisionEncoder`, transformers' CLIPVisionModel
(our `--to hf` export, output_hidden_states as LLaVA calls it), timm's forward_intermediates (our `--to timm`
export) and onnxruntime (our `--to onnx` graph: the final tokens), plus each one's largest difference from ours.

    python benchmarks/encoder_speed.py                          # vit_b16 (CLIP layout) at 224, batch 8, fp32, CPU
    python benchmarks/encoder_speed.py --device cuda --dtype bf16 --batch 64

Calls of the runtimes are interleaved so that drift in the machine's speed hits all alike; the table reports each
one's median time per batch. fp32 and bf16 run under torch.autocast on CUDA (ONNX Runtime: CPU only here).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ssl_vit import VisionEncoder
from ssl_vit.backbone import build_vit
from ssl_vit.interop.hf import export_hf
from ssl_vit.interop.onnx import export_onnx
from ssl_vit.interop.timm import export_timm


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=None, help="default: the preset's (14 with vit_l16 at "
                        "336 px is LLaVA-1.5's ViT-L/14-336 geometry)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed batches per runtime (after one warm-up)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/encoder_speed_<device>.json")
    args = parser.parse_args()
    import timm
    import transformers

    torch.manual_seed(0)
    sizes = {"img_size": args.img_size, **({"patch_size": args.patch_size} if args.patch_size else {})}
    vit = build_vit(args.model, pre_norm=True, **sizes).eval()  # CLIP's layout: LLaVA's tower
    depth = len(vit.blocks)
    work = Path(tempfile.mkdtemp(prefix="encoder_speed_"))
    export_hf(vit, work / "hf", "clip")
    export_timm(vit, work / "timm")
    images = torch.randn(args.batch, 3, args.img_size, args.img_size)
    ours = VisionEncoder(vit, layer=-2, drop_prefix=False).to(args.device)
    hf = transformers.CLIPVisionModel.from_pretrained(work / "hf").eval().to(args.device)
    timm_model = timm.create_model(f"local-dir:{work / 'timm'}", pretrained=True).eval().to(args.device)
    x = images.to(args.device)

    def run_hf():
        return hf(pixel_values=x, output_hidden_states=True).hidden_states[-2]

    def run_timm():
        tokens, prefix = timm_model.forward_intermediates(x, indices=[depth - 2], norm=False, output_fmt="NLC",
                                                          return_prefix_tokens=True, intermediates_only=True)[0]
        return torch.cat([prefix, tokens], dim=1)

    runtimes = {"ssl_vit VisionEncoder": lambda: ours(x), "transformers CLIPVisionModel": run_hf,
                "timm forward_intermediates": run_timm}
    onnx_error = None
    if args.device == "cpu" and args.dtype == "fp32":
        import onnxruntime

        path, onnx_error = export_onnx(vit, work / "onnx")
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        runtimes["onnxruntime (final tokens)"] = lambda: torch.from_numpy(
            session.run(["last_hidden_state"], {"pixel_values": images.numpy()})[0])
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    with torch.no_grad(), autocast:
        reference = ours(x).float()
        final_tokens = vit.forward_features(x).float()  # what the ONNX graph returns
        errors = {name: float((run().float().to(args.device) - (final_tokens if "onnx" in name else reference))
                              .abs().max()) for name, run in runtimes.items()}
        times = {name: [] for name in runtimes}
        for run in runtimes.values():  # warm-up
            run()
        for _ in range(args.steps):
            for name, run in runtimes.items():
                sync(args.device)
                start = time.perf_counter()
                run()
                sync(args.device)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["ssl_vit VisionEncoder"])
    rows = {name: {"batch_s": statistics.median(t), "images_per_s": args.batch / statistics.median(t),
                   "relative_to_ours": statistics.median(t) / base, "max_abs_diff_vs_ours": errors[name],
                   "times": t} for name, t in times.items()}
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or
                                                                              platform.machine())
    result = {"benchmark": "encoder_speed", "model": args.model, "layout": "clip (pre-norm)", "img_size": args.img_size,
              "patch_size": vit.patch_embed.patch_size[0],
              "batch": args.batch, "device": device_name, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "transformers": transformers.__version__, "timm": timm.__version__,
              "onnx_export_check_error": onnx_error, "results": rows}
    out = Path(args.out or f"benchmarks/results/encoder_speed_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.model}/{result['patch_size']} (CLIP layout) @ {args.img_size}px, batch {args.batch}, {args.dtype}, "
          f"{device_name}, {result['threads']} threads; features = hidden_states[-2] (onnxruntime: final tokens)")
    print(f"{'runtime':<32}{'img/s':>9}{'s/batch':>10}{'time/ours':>10}{'max |diff|':>12}")
    for name, row in rows.items():
        print(f"{name:<32}{row['images_per_s']:>9.1f}{row['batch_s']:>10.3f}{row['relative_to_ours']:>10.2f}"
              f"{row['max_abs_diff_vs_ours']:>12.2e}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
