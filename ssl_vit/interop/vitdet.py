"""A checkpoint detectron2's ViTDet backbone loads (`ssl-vit export --to detectron2`): detectron2 is not installable
here, so names and layouts follow detectron2/modeling/backbone/vit.py as read (commit 0818132):

- `backbone.net.` + the ViT's names: `patch_embed.proj`, `pos_embed`, `blocks.{i}.norm1 / attn.qkv / attn.proj /
  attn.rel_pos_h / attn.rel_pos_w / norm2 / mlp.fc1 / mlp.fc2` (its Block; timm's Mlp), the same as ours;
- `pos_embed` (1, 1 + N, D) at the pre-training grid with the class slot first when `pretrain_use_cls_token`
  (detectron2's `get_abs_pos` drops that slot and resizes the square grid bicubic at run time), else (1, N, D);
- detectron2's ViT runs no class or register token and no final norm (the pyramid reads the last block's output):
  those weights are left out, and said;
- `vitdet_args.json`: the keyword arguments of detectron2's `ViT` for it (`window_block_indexes` lists the windowed
  blocks: the complement of our `global_attn_indexes`), to put in a LazyConfig, and the file goes to
  `train.init_checkpoint`. The file is `{"model": state_dict}`, which DetectionCheckpointer reads as a native .pth.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ssl_vit.backbone import VisionTransformer

PREFIX = "backbone.net."
CHECKPOINT = "vitdet_backbone.pth"


def vitdet_args(encoder: VisionTransformer, img_size: int) -> dict:
    """detectron2 `ViT(...)` arguments for our encoder run at `img_size`; ValueError for what it cannot hold."""
    config = encoder.config
    problems = [f"{key}={getattr(config, key)}" for key, ok in (
        ("pos_embed", config.pos_embed in ("learned", "sincos")),
        ("parallel_block", not config.parallel_block), ("stem", config.stem == "patch"),
        ("layer_scale", config.layer_scale is None), ("qk_norm", not config.qk_norm),
        ("act_layer", config.act_layer == "gelu"), ("pre_norm", not config.pre_norm),
        ("neck_channels", not config.neck_channels), ("norm_eps", config.norm_eps == 1e-6),
    ) if not ok] + config.beyond_classic()
    if problems:
        raise ValueError(f"detectron2's ViT cannot hold {', '.join(problems)}")
    depth, patch = len(encoder.blocks), encoder.patch_embed.patch_size
    if patch[0] != patch[1]:
        raise ValueError(f"detectron2's ViT takes square patches, not {patch}")
    global_blocks = set(config.global_attn_indexes or [])
    window = config.window_size
    return {"img_size": img_size, "patch_size": patch[0], "in_chans": config.in_chans,
            "embed_dim": encoder.embed_dim, "depth": depth, "num_heads": encoder.blocks[0].attn.num_heads,
            "mlp_ratio": encoder.blocks[0].mlp.fc1.out_features / encoder.embed_dim,
            "qkv_bias": config.qkv_bias, "use_abs_pos": True,
            "use_rel_pos": bool(config.rel_pos), "rel_pos_zero_init": True, "window_size": window,
            "window_block_indexes": [i for i in range(depth) if window and i not in global_blocks],
            "pretrain_img_size": encoder.patch_embed.img_size[0], "pretrain_use_cls_token": encoder.num_pos_prefix == 1,
            "out_feature": "last_feat"}


def vitdet_state(encoder: VisionTransformer) -> dict:
    """Our weights under detectron2's names (module docstring)."""
    if encoder.num_pos_prefix > 1:
        raise ValueError(f"detectron2's pos_embed holds one class slot at most; this encoder has "
                         f"{encoder.num_pos_prefix} prefix position slots")
    skip = ("cls_token", "reg_token", "dist_token", "norm.", "fc_norm.", "head.", "norm_pre.")
    return {PREFIX + name: value.detach().float().clone() for name, value in encoder.state_dict().items()
            if not name.startswith(skip)}


def export_vitdet(encoder: VisionTransformer, out_dir, img_size: int | None = None) -> tuple[Path, str]:
    """out_dir/vitdet_backbone.pth and vitdet_args.json; (the checkpoint, a note of what was left out or "")."""
    grid_side = encoder.grid_size
    if grid_side[0] != grid_side[1]:
        raise ValueError(f"detectron2 resizes a square position grid; this encoder's is {grid_side}")
    args = vitdet_args(encoder, img_size or encoder.patch_embed.img_size[0])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CHECKPOINT
    torch.save({"model": vitdet_state(encoder)}, path)
    (out_dir / "vitdet_args.json").write_text(json.dumps(args, indent=2) + "\n")
    left = [what for what, present in (("its class token", encoder.cls_token is not None),
                                       ("its registers", encoder.reg_token is not None),
                                       ("its final norm", not isinstance(encoder.norm, torch.nn.Identity)))
            if present]
    note = (f"detectron2's ViT runs without {', '.join(left)}: left out (its patch outputs differ from this "
            "encoder's where they took part)") if left else ""
    return path, note
