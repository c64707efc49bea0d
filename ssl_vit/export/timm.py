"""Import a timm VisionTransformer as an ssl_vit encoder (same parameter names, so the weights load as they are)."""

from __future__ import annotations

import torch
from torch import nn

from ssl_vit.vit import VisionTransformer

# How each family resamples its position embeddings for another grid: (interpolation mode, antialias).
# timm's own: `resample_abs_pos_embed` defaults, used by its dynamic-size `_pos_embed` and `set_input_size`.
TIMM_POS_EMBED_RESAMPLING = ("bicubic", True)
# DINOv2 (facebookresearch/dinov2 `interpolate_antialias=False`) and HF transformers' Dinov2Model.
DINOV2_POS_EMBED_RESAMPLING = ("bicubic", False)


def is_dinov2(model: nn.Module) -> bool:
    """A timm DINOv2 model (`vit_*_dinov2*`), recognised by the architecture or weights named in its pretrained_cfg."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = (cfg.get("architecture"), cfg.get("hf_hub_id"), cfg.get("url"))
    return any("dinov2" in str(name).lower() for name in names if name)


def layer_scale_init(model: nn.Module) -> float | None:
    """The layer-scale init value the timm model was built with (its `init_values`), or None without layer scale.

    Rules, first that applies: timm's `LayerScale` keeps `init_values` as an attribute (every timm release this
    package supports); else the constructor arguments timm recorded (`_model_args` / `pretrained_model_args`);
    else the gammas, when they all hold one value (an untrained model). A trained model that recorded nothing is an
    error: pass `layer_scale=` to `from_timm`.
    """
    from timm.layers import LayerScale

    scales = [m for m in model.modules() if isinstance(m, LayerScale)]
    if not scales:
        return None
    recorded = {float(m.init_values) for m in scales if getattr(m, "init_values", None) is not None}
    if len(recorded) == 1:
        return recorded.pop()
    for args in (getattr(model, "_model_args", None), getattr(model, "pretrained_model_args", None)):
        if args and args.get("init_values") is not None:
            return float(args["init_values"])
    gammas = torch.cat([m.gamma.detach().flatten().float() for m in scales])
    if gammas.numel() and bool((gammas == gammas[0]).all()):
        return float(gammas[0])
    raise ValueError("cannot tell the layer-scale init value of this timm model (no init_values recorded and the "
                     "gammas differ); pass it as from_timm(model, layer_scale=...)")


def from_timm(model: nn.Module, *, pos_embed_interp: str | None = None, pos_embed_antialias: bool | None = None,
              layer_scale: float | None = None) -> VisionTransformer:
    """Rebuild a timm `VisionTransformer` (standard or 22B-style parallel blocks) as ours, weights included.

    The encoder's `layer_scale` is the timm model's init value (`layer_scale_init`; DINOv2: 1e-5), so a fresh
    `VisionTransformer(**encoder.config)` starts as timm's would; `layer_scale` overrides it. Position embeddings are
    resampled as the imported family does (DINOv2: bicubic without antialiasing; other timm models: timm's default,
    bicubic with antialiasing) unless `pos_embed_interp` / `pos_embed_antialias` say otherwise.
    """
    from timm.models.vision_transformer import Block, ParallelScalingBlock
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    if not isinstance(model, TimmViT):
        raise ValueError(f"only timm VisionTransformer models can be imported, not {type(model).__name__}")
    block = model.blocks[0]
    parallel = isinstance(block, ParallelScalingBlock)
    if not parallel and not isinstance(block, Block):
        raise ValueError(f"unsupported timm block {type(block).__name__}; supported: Block, ParallelScalingBlock")
    if model.global_pool not in ("token", "avg"):
        raise ValueError(f"unsupported timm global_pool {model.global_pool!r}; supported: 'token', 'avg'")
    attn = block if parallel else block.attn
    norm = block.in_norm if parallel else block.norm1
    has_layer_scale = not isinstance(block.ls if parallel else block.ls1, nn.Identity)
    if layer_scale is not None and not has_layer_scale:
        raise ValueError("layer_scale was given but this timm model has no layer scale")
    family_interp, family_antialias = DINOV2_POS_EMBED_RESAMPLING if is_dinov2(model) else TIMM_POS_EMBED_RESAMPLING
    kwargs = dict(
        img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size,
        in_chans=model.patch_embed.proj.in_channels, num_classes=getattr(model, "num_classes", 0),
        embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=attn.num_heads,
        mlp_dim=(block.in_split[0] if parallel else block.mlp.fc1.out_features),
        class_token=model.cls_token is not None, global_pool=model.global_pool, num_registers=model.num_reg_tokens,
        no_embed_class=model.no_embed_class,
        pos_embed_interp=pos_embed_interp if pos_embed_interp is not None else family_interp,
        pos_embed_antialias=pos_embed_antialias if pos_embed_antialias is not None else family_antialias,
        qkv_bias=(block.in_proj.bias is not None) if parallel else (block.attn.qkv.bias is not None),
        qk_norm=not isinstance(attn.q_norm, nn.Identity), norm_bias=norm.bias is not None, norm_eps=norm.eps,
        pre_norm=not isinstance(model.norm_pre, nn.Identity), parallel_block=parallel,
        # The init value (the loaded weights then set the gammas themselves).
        layer_scale=(layer_scale if layer_scale is not None else layer_scale_init(model)) if has_layer_scale else None,
    )
    ours = VisionTransformer(**kwargs)
    ours.load_state_dict(model.state_dict(), strict=True)
    return ours
