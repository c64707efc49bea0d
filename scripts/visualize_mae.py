"""Write a PNG of MAE reconstructions (original / masked / reconstruction) from a pre-training run.

    python scripts/visualize_mae.py outputs/mae-vit_tiny-synthetic/2026-11-29_12-00-00
    python scripts/visualize_mae.py RUN_DIR --checkpoint RUN_DIR/checkpoints/step_00000300 --num-images 8 --scale 4

Uses the run's config.yaml to rebuild the objective and its data, and the newest checkpoint's weights (the decoder
is not part of encoder.safetensors). Images come from the run's dataset; the masks are drawn with --seed.
"""

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from ssl_vit.analysis.mae_reconstruction import save_reconstruction_png
from ssl_vit.objectives.mae import MAE
from ssl_vit.run_dirs import resolve_run
from ssl_vit.train import build_components
from ssl_vit.train.checkpoint import list_checkpoints


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the run's newest checkpoint")
    parser.add_argument("--num-images", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, default=4, help="integer upscaling of the PNG (small images)")
    parser.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/mae_reconstructions.png")
    args = parser.parse_args(argv)
    args.run_dir = Path(resolve_run(args.run_dir))  # an output group: its newest run

    config_path = args.run_dir / "config.yaml"
    if not config_path.is_file():
        parser.error(f"{config_path} not found: pass the output directory of a pre-training run")
    cfg = OmegaConf.load(config_path)
    if cfg.objective.name != "mae":
        parser.error(f"the run at {args.run_dir} trained objective={cfg.objective.name}, not mae")
    checkpoint = args.checkpoint or (list_checkpoints(args.run_dir) or [None])[-1]
    if checkpoint is None:
        parser.error(f"no checkpoints under {args.run_dir / 'checkpoints'}")

    objective, dataset, views, preprocess = build_components(cfg)
    assert isinstance(objective, MAE)
    objective.load_state_dict(load_file(str(Path(checkpoint) / "model.safetensors")))
    images = torch.stack([views(dataset[i])["image"] for i in range(min(args.num_images, len(dataset)))])
    torch.manual_seed(args.seed)
    out = save_reconstruction_png(objective, images, preprocess.mean, preprocess.std,
                                  args.out or args.run_dir / "mae_reconstructions.png", scale=args.scale)
    print(f"wrote {out} ({len(images)} images, checkpoint {checkpoint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
