"""Training-step throughput of the masking objectives on one backbone, measured in one run.

    python benchmarks/objective_speed.py                       # vit_s16, 224 px, batch 32 (~4 minutes on 2 cores)
    python benchmarks/objective_speed.py --model vit_ti16 --steps 2
    python benchmarks/objective_speed.py --model vit_l16 --batch 8 --steps 1 --only "dec 8x512" \
        --out benchmarks/results/objective_speed_vit_l16.json     # the MAE paper's scale (~11 GB of memory)

Rows: masked_patch; MAE at mask ratio 0.75 and at 0 (the same backbone encoding all tokens) with the paper's
decoder (8 blocks x 512) and with the one-block decoder of the paper's ablation (1 x 512); and the encoder alone,
forward + backward on the visible 25% of tokens and on all of them. A step is forward + backward + AdamW, fp32.
Steps of all rows are interleaved so that drift in the machine's speed hits each alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ssl_vit.backbone import build_vit
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.mae import MAEConfig
from ssl_vit.objectives.masked_patch import MaskedPatchConfig
from ssl_vit.objectives.patches import per_sample_shuffle


class EncoderOnly(torch.nn.Module):
    """The backbone on a random `keep` of the patch tokens (no decoder), to isolate the encoder's cost."""

    def __init__(self, backbone, keep_fraction: float):
        super().__init__()
        self.backbone, self.keep_fraction = backbone, keep_fraction

    def forward(self, batch):
        vit = self.backbone
        tokens = vit.add_pos(vit.patch_embed(batch["image"]))
        keep = round(tokens.shape[1] * self.keep_fraction)
        order = per_sample_shuffle(*tokens.shape[:2])[0][:, :keep]
        visible = torch.gather(tokens, 1, order[..., None].expand(-1, -1, tokens.shape[-1]))
        return {"loss": vit.run_blocks(vit.prepend_tokens(visible)).pow(2).mean()}


def build_rows(model: str, img_size: int, only: str | None = None) -> dict[str, torch.nn.Module]:
    info = DataInfo(num_classes=1000, img_size=img_size)

    def objective(config):
        return build_objective(OmegaConf.structured(config), build_vit(model, img_size=img_size), info)

    paper = dict(decoder_dim=512, decoder_depth=8, decoder_heads=16)
    one_block = dict(decoder_dim=512, decoder_depth=1, decoder_heads=16)  # MAE paper, Table 1a
    builders = {
        "masked_patch": lambda: objective(MaskedPatchConfig()),
        "mae 0.75, dec 8x512": lambda: objective(MAEConfig(mask_ratio=0.75, **paper)),
        "mae 0.00, dec 8x512": lambda: objective(MAEConfig(mask_ratio=0.0, **paper)),
        "mae 0.75, dec 1x512": lambda: objective(MAEConfig(mask_ratio=0.75, **one_block)),
        "mae 0.00, dec 1x512": lambda: objective(MAEConfig(mask_ratio=0.0, **one_block)),
        "encoder on 25% tokens": lambda: EncoderOnly(build_vit(model, img_size=img_size), 0.25),
        "encoder on all tokens": lambda: EncoderOnly(build_vit(model, img_size=img_size), 1.0),
    }
    wanted = [name for name in builders if not only or any(part in name for part in only.split(","))]
    return {name: builders[name]() for name in wanted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_s16")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up step)")
    parser.add_argument("--only", default=None, help="comma-separated substrings of the rows to run")
    parser.add_argument("--out", default="benchmarks/results/objective_speed.json")
    args = parser.parse_args()
    torch.manual_seed(0)

    rows = build_rows(args.model, args.img_size, args.only)
    batch = {"image": torch.randn(args.batch, 3, args.img_size, args.img_size),
             "pixels": torch.rand(args.batch, 3, args.img_size, args.img_size)}
    optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for name, m in rows.items()}

    def step(name):
        start = time.perf_counter()
        rows[name](batch)["loss"].backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name in rows:
        step(name)  # warm-up
    times = {name: [] for name in rows}
    for _ in range(args.steps):
        for name in rows:
            times[name].append(step(name))

    results = {name: {"step_s": statistics.median(t), "images_per_s": args.batch / statistics.median(t),
                      "step_times": t} for name, t in times.items()}

    pairs = {"mae_vs_ratio0_paper_decoder": ("mae 0.00, dec 8x512", "mae 0.75, dec 8x512"),
             "mae_vs_ratio0_one_block_decoder": ("mae 0.00, dec 1x512", "mae 0.75, dec 1x512"),
             "encoder_25_vs_all": ("encoder on all tokens", "encoder on 25% tokens")}
    speedups = {name: results[slow]["step_s"] / results[fast]["step_s"]
                for name, (slow, fast) in pairs.items() if slow in results and fast in results}
    report = {"benchmark": "objective_speed", "model": args.model, "img_size": args.img_size, "batch": args.batch,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "results": results, "speedups": speedups}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{args.model} @ {args.img_size}px, batch {args.batch}, fp32, {report['threads']} threads")
    print(f"{'row':<24}{'img/s':>9}{'step s':>9}")
    for name, row in results.items():
        print(f"{name:<24}{row['images_per_s']:>9.2f}{row['step_s']:>9.2f}")
    for name, value in speedups.items():
        print(f"{name:<34}{value:>6.2f}x")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
