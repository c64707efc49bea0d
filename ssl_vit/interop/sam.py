"""SAM's image encoder (segment-anything `modeling/image_encoder.py`, timm's `samvit_*`) as ours: a plain ViT
without a class token, windowed attention in all blocks but the global ones, decomposed relative positions in every
block, absolute positions on the pre-training grid (timm: NHWC, resampled bicubic with antialiasing for another
grid), and the 256-channel neck (`VisionTransformer.forward_neck`). Importing keeps every weight; the pooled
embedding of an import is ours (LayerNorm of the token mean), SAM defining none.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer_sam import VisionTransformerSAM

from ssl_vit.vit import VisionTransformer

# timm's neck (Conv2d, LayerNorm2d, Conv2d, LayerNorm2d) -> ours (ConvNorm, ConvNorm)
_NECK = {"neck.0.weight": "neck.0.weight", "neck.1.weight": "neck.0.norm.weight", "neck.1.bias": "neck.0.norm.bias",
         "neck.2.weight": "neck.1.weight", "neck.3.weight": "neck.1.norm.weight", "neck.3.bias": "neck.1.norm.bias"}


def sam_settings(model: VisionTransformerSAM) -> dict:
    """Our VisionTransformer arguments for timm's SAM ViT; ValueError for the variants not built here."""
    if model.rope_global is not None:
        raise ValueError("timm's SAM ViT with RoPE (use_rope=True) is not imported here; the relative-position "
                         "variant (segment-anything's) is")
    if model.pos_embed is None:
        raise ValueError("timm's SAM ViT without absolute positions (use_abs_pos=False) is not imported here")
    if not isinstance(model.neck, torch.nn.Sequential):
        raise ValueError("timm's SAM ViT without its convolutional neck (neck_chans=0) is not imported here")
    blocks = list(model.blocks)
    windows = [block.window_size for block in blocks]
    window = max(windows)
    first = blocks[0]
    return dict(
        img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size,
        in_chans=model.patch_embed.proj.in_channels, embed_dim=model.embed_dim, depth=len(blocks),
        num_heads=first.attn.num_heads, mlp_dim=first.mlp.fc1.out_features, class_token=False, global_pool="avg",
        qkv_bias=first.attn.qkv.bias is not None, norm_eps=first.norm1.eps,
        pre_norm=not isinstance(model.norm_pre, torch.nn.Identity), window_size=window,
        global_attn_indexes=[i for i, w in enumerate(windows) if w == 0] if window else [],
        rel_pos=bool(first.attn.use_rel_pos), neck_channels=model.neck[0].out_channels,
    )


def from_timm_sam(model: VisionTransformerSAM) -> VisionTransformer:
    """timm's `samvit_*` (SAM's image encoder) rebuilt as ours with its weights."""
    ours = VisionTransformer(**sam_settings(model))
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("head"):
            continue
        if name == "pos_embed":  # (1, H, W, D) -> (1, H x W, D), row-major as our patch order
            value = value.flatten(1, 2)
        state[_NECK.get(name, name)] = value
    fresh = ours.load_state_dict(state, strict=False)
    missing = [name for name in fresh.missing_keys if not name.startswith("fc_norm")]
    if missing or fresh.unexpected_keys:
        raise ValueError(f"timm's SAM ViT does not map onto ours: missing {missing[:4]}, unexpected "
                         f"{fresh.unexpected_keys[:4]}")
    return ours
