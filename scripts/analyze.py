"""Inspect a trained ViT as in the paper (section 4.5); writes four PNGs.

    python scripts/analyze.py outputs/<run>/encoder.safetensors
    python scripts/analyze.py outputs/<run> --images digits --num-images 6 --out figures/

  pos_embed_similarity.png   cosine similarity of each patch position's embedding with every other, on the grid
  attention_distance.png     mean attention distance (pixels) per head and layer
  attention_rollout.png      class-token attention rolled out onto a few images
  patch_filters_pca.png      principal components of the patch-embedding filters
"""

import argparse
import sys
from pathlib import Path

import torch

from ssl_vit.analysis.inspect import (
    class_token_rollout_maps,
    mean_attention_distance,
    patch_embedding_components,
    pos_embed_similarity,
)
from ssl_vit.analysis.plots import (
    plot_attention_distance,
    plot_filter_components,
    plot_pos_embed_similarity,
    plot_rollout,
)
from ssl_vit.data import Digits, SyntheticShapes
from ssl_vit.eval.run import load_any_encoder
from ssl_vit.preprocess import Preprocess
from ssl_vit.run_dirs import resolve_run
from ssl_vit.schema import ConfigError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="encoder.safetensors, a run directory, or an import form: timm:..., "
                        "hf:<dir>, open_clip:... (ssl_vit/interop/sources.py)")
    parser.add_argument("--images", default="synthetic", choices=("synthetic", "digits"))
    parser.add_argument("--num-images", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="default: beside the checkpoint")
    args = parser.parse_args(argv)
    args.checkpoint = resolve_run(args.checkpoint.removeprefix("checkpoint="))  # as evaluate.py; a group: newest
    try:
        encoder, _, recorded = load_any_encoder(args.checkpoint)
    except ConfigError as err:
        parser.error(str(err))
    encoder.eval()
    size, patch = encoder.patch_embed.img_size[0], encoder.patch_embed.stride[0]  # image pixels per token
    dataset = SyntheticShapes(args.num_images, size, seed=7) if args.images == "synthetic" else Digits("test")
    preprocess = recorded or Preprocess(size)  # the encoder's own normalisation (ImageNet's if it records none)
    views = preprocess.view_builder(("image", "pixels"))
    samples = [views(dataset[i]) for i in range(args.num_images)]
    images, pixels = torch.stack([s["image"] for s in samples]), torch.stack([s["pixels"] for s in samples])
    attentions = encoder.attention_maps(images)
    grid, prefix = encoder.grid_size, encoder.num_prefix_tokens

    checkpoint = Path(args.checkpoint)
    out = args.out or (checkpoint if checkpoint.is_dir() else checkpoint.parent if checkpoint.exists()
                       else Path("outputs")) / "analysis"
    written = [plot_attention_distance(mean_attention_distance(attentions, grid, patch, prefix),
                                       out / "attention_distance.png", size)]
    if encoder.pos_embed is not None:
        written.insert(0, plot_pos_embed_similarity(pos_embed_similarity(encoder), out / "pos_embed_similarity.png"))
    else:
        print(f"pos_embed={encoder.config.pos_embed}: no absolute position embedding, similarity plot skipped",
              file=sys.stderr)
    if encoder.config.stem == "patch":
        written.append(plot_filter_components(*patch_embedding_components(encoder), out / "patch_filters_pca.png"))
    else:
        print("hybrid stem: the projection sees ResNet features, not pixels: filter PCA skipped", file=sys.stderr)
    if prefix and encoder.cls_token is not None:
        maps = class_token_rollout_maps(attentions, grid, prefix)
        written.append(plot_rollout(pixels, maps, out / "attention_rollout.png"))
    else:
        print("no class token: attention rollout skipped", file=sys.stderr)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
