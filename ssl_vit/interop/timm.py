"""timm both ways. Our parameter names are timm's (the name table is the identity), so weights move as they are:
`from_timm` rebuilds a timm VisionTransformer (plain, parallel-block, hybrid, distilled) as ours; `load_timm_spec`
reads the `timm:` import forms (a model name, a checkpoint file through timm's own loader, a timm model
directory); `export_timm` writes a timm model directory (model.safetensors + hub-style config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import timm
import torch
from timm.data import resolve_data_config
from timm.layers import (
    AttentionPoolLatent,
    HybridEmbed,
    RotaryEmbeddingCat,
    RotaryEmbeddingDinoV3,
    RotaryEmbeddingMixed,
    StdConv2dSame,
)
from timm.models.eva import Eva
from timm.models.resnetv2 import ResNetV2
from timm.models.vision_transformer import Block, ParallelScalingBlock
from timm.models.vision_transformer import VisionTransformer as TimmViT
from timm.models.vision_transformer_sam import VisionTransformerSAM
from torch import nn

from ssl_vit.artifacts import file_fingerprint
from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.backbone.rope import ROPE_KINDS, ROPE_THETA
from ssl_vit.backbone.stem import RESNET_CHANNELS
from ssl_vit.files import save_safetensors
from ssl_vit.interop.native import NativeEncoder, from_timm_native, not_a_vit
from ssl_vit.interop.sam import from_timm_sam
from ssl_vit.interop.timm_layers import activation_name, layer_scale_init, mlp_settings, norm_settings
from ssl_vit.interop.timm_naflex import from_timm_naflex, is_timm_naflex
from ssl_vit.preprocess import INTERPOLATIONS, Preprocess

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


# timm's hybrid ViTs, by their ResNet part: (stem_layers, stem_width) with ResNet's stage widths -> architecture.
TIMM_HYBRIDS = {((3, 4, 9), 64): "vit_base_r50_s16_224", ((), 64): "vit_tiny_r_s16_p8_224",
                ((2, 2, 2, 2), 64): "vit_small_r26_s32_224", ((3, 4, 6, 3), 64): "vit_large_r50_s32_224"}


def _timm_stem(patch_embed: nn.Module) -> dict:
    """Our stem keywords for a timm patch embedding: {} for pixel patches; for a `HybridEmbed` over the ResNet-v2
    that timm's hybrid ViTs build (stem 'same', no pre-activation, weight-standardised convs), its stages."""
    if not isinstance(patch_embed, HybridEmbed):
        return {}
    backbone = patch_embed.backbone
    stem = backbone.stem if isinstance(backbone, ResNetV2) else backbone
    conv = getattr(stem, "conv", None)
    if not isinstance(conv, StdConv2dSame) or "norm" not in dict(stem.named_children()):
        raise ValueError(f"unsupported hybrid backbone {type(backbone).__name__}: only the ResNet-v2 of timm's "
                         f"vit_*_r* / vit_tiny_r_* models (7x7 'same' stem, weight-standardised convs) imports")
    stages = list(backbone.stages) if isinstance(backbone, ResNetV2) else []
    return dict(stem="resnet", stem_layers=[len(stage.blocks) for stage in stages],
                stem_channels=[stage.blocks[-1].conv3.out_channels for stage in stages] or None,
                stem_width=conv.out_channels, in_chans=conv.in_channels)


def from_timm(model: nn.Module, *, pos_embed_interp: str | None = None, pos_embed_antialias: bool | None = None,
              layer_scale: float | None = None) -> VisionTransformer:
    """Rebuild a timm `VisionTransformer` (standard or 22B-style parallel blocks) as ours, weights included.

    The encoder's `layer_scale` is the timm model's init value (`layer_scale_init`; DINOv2: 1e-5), so a fresh
    `VisionTransformer(encoder.config)` starts as timm's would; `layer_scale` overrides it. Position embeddings are
    resampled as the imported family does (DINOv2: bicubic without antialiasing; other timm models: timm's default,
    bicubic with antialiasing) unless `pos_embed_interp` / `pos_embed_antialias` say otherwise.
    """
    if isinstance(model, Eva):
        return _from_timm_eva(model, layer_scale)
    if isinstance(model, VisionTransformerSAM):
        return from_timm_sam(model)
    if is_timm_naflex(model):
        return from_timm_naflex(model)
    if not isinstance(model, TimmViT):
        raise ValueError(f"only timm VisionTransformer models and its RoPE models (Eva with DINOv3's or RoPE-ViT's "
                         f"RoPE) can be imported, not {type(model).__name__}")
    block = model.blocks[0]
    parallel = isinstance(block, ParallelScalingBlock)
    if not parallel and not isinstance(block, Block):
        raise ValueError(f"unsupported timm block {type(block).__name__}; supported: Block, ParallelScalingBlock")
    if model.global_pool not in ("token", "avg", "map"):
        raise ValueError(f"unsupported timm global_pool {model.global_pool!r}; supported: 'token', 'avg', 'map'")
    attn = block if parallel else block.attn
    norm = block.in_norm if parallel else block.norm1
    if isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity):
        raise ValueError("this timm model has no final norm (final_norm=False), which ssl-vit's ViT always has")
    has_layer_scale = not isinstance(block.ls if parallel else block.ls1, nn.Identity)
    if layer_scale is not None and not has_layer_scale:
        raise ValueError("layer_scale was given but this timm model has no layer scale")
    family_interp, family_antialias = DINOV2_POS_EMBED_RESAMPLING if is_dinov2(model) else TIMM_POS_EMBED_RESAMPLING
    if is_dinov2(model) and model.num_reg_tokens:  # DINOv2's register models: interpolate_antialias=True
        family_antialias = True
    kwargs = dict(
        img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size,
        in_chans=model.patch_embed.proj.in_channels, num_classes=getattr(model, "num_classes", 0),
        embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=attn.num_heads,
        class_token=model.cls_token is not None, global_pool=model.global_pool, num_registers=model.num_reg_tokens,
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        **_attn_pool_settings(model.attn_pool, getattr(model, "pool_include_prefix", False)),
        no_embed_class=model.no_embed_class,
        pos_embed_interp=pos_embed_interp if pos_embed_interp is not None else family_interp,
        pos_embed_antialias=pos_embed_antialias if pos_embed_antialias is not None else family_antialias,
        qkv_bias=(block.in_proj.bias is not None) if parallel else (block.attn.qkv.bias is not None),
        qk_norm=not isinstance(attn.q_norm, nn.Identity), **norm_settings(norm),
        pre_norm=not isinstance(model.norm_pre, nn.Identity), parallel_block=parallel,
        patch_norm=not isinstance(getattr(model.patch_embed, "norm", nn.Identity()), nn.Identity),
        **({"act_layer": activation_name(block.mlp_act), "mlp_dim": block.in_split[0]} if parallel
           else mlp_settings(block.mlp)),
        # The init value (the loaded weights then set the gammas themselves).
        layer_scale=(layer_scale if layer_scale is not None else layer_scale_init(model)) if has_layer_scale else None,
    )
    kwargs.update(_timm_stem(model.patch_embed))
    kwargs["dist_token"] = getattr(model, "dist_token", None) is not None  # timm's VisionTransformerDistilled (DeiT)
    ours = VisionTransformer(**kwargs)
    ours.load_state_dict(model.state_dict(), strict=True)
    return ours


def _attn_pool_settings(pool: nn.Module | None, include_prefix: bool = False) -> dict:
    """pool_heads / pool_mlp_dim / pool_include_prefix of a timm MAP head (`AttentionPoolLatent`), checked to be the
    one ssl-vit builds; {} without one. `include_prefix`: whether the model pools the prefix tokens too (timm's
    VisionTransformer pool_include_prefix; Eva always does)."""
    if pool is None:
        return {}
    if not isinstance(pool, AttentionPoolLatent):
        raise ValueError(f"unsupported timm attention pool {type(pool).__name__}; supported: AttentionPoolLatent")
    odd = [what for what, present in (
        ("several latents", pool.latent_len != 1), ("a position embedding", pool.pos_embed is not None),
        ("no query projection", isinstance(pool.q, nn.Identity)), ("QK-norm", not isinstance(pool.q_norm, nn.Identity)),
        ("no output MLP", pool.mlp is None)) if present]
    if odd:
        raise ValueError(f"this timm model's attention pool has {', '.join(odd)}, which ssl-vit's MAP head does not "
                         "build")
    return dict(pool_heads=pool.num_heads, pool_mlp_dim=pool.mlp.fc1.out_features,
                pool_include_prefix=bool(include_prefix))


# timm's DINOv3 port (Eva) -> ours: per-block layer-scale gammas, and separate q / v biases into the fused qkv bias
# (k's is a zero buffer in timm, and ours is masked to zero for RoPE: with RoPE a key bias would rotate with the
# key's position and change the output, so nothing is lost).
DINOV3_LAYER_SCALE = 1e-5  # DINOv3's init value (timm's vit_*_dinov3 init_values), for a fresh rebuild


def _rope_kwargs(rope: nn.Module) -> dict:
    """Our RoPE options for an Eva's rope module (DINOv3's, or RoPE-ViT's axial / mixed); ValueError for others."""
    if isinstance(rope, RotaryEmbeddingDinoV3):
        if rope.grid_offset != 0 or not rope.rotate_half:
            raise ValueError("this timm DINOv3 model has a rope grid offset or an interleaved rope layout, which "
                             "ssl-vit's ViT does not build")
        return dict(rope_kind="dinov3", rope_theta=rope.temperature if rope.min_period is None else None,
                    rope_min_period=rope.min_period, rope_max_period=rope.max_period,
                    rope_normalize=rope.normalize_coords, rope_shift=rope.shift_coords,
                    rope_jitter=rope.jitter_coords, rope_rescale=rope.rescale_coords)
    # timm < 1.0.31 has no coordinate augmentation on RoPE-ViT's modules (the attributes are absent: none)
    augment = {ours: getattr(rope, theirs, None) for ours, theirs in (
        ("rope_shift", "shift_coords"), ("rope_jitter", "jitter_coords"), ("rope_rescale", "rescale_coords"))}
    if isinstance(rope, RotaryEmbeddingMixed) and rope.grid_indexing == "xy":
        return dict(rope_kind="mixed", rope_theta=rope.temperature, **augment)
    if (isinstance(rope, RotaryEmbeddingCat) and rope.grid_indexing == "xy"
            and getattr(rope, "grid_type", "index") == "index"  # timm < 1.0.31: index grids, interleaved pairs only
            and not rope.in_pixels and not getattr(rope, "rotate_half", False)):
        ref = rope.ref_feat_shape
        return dict(rope_kind="axial", rope_theta=rope.temperature, rope_offset=float(rope.grid_offset),
                    rope_ref_grid=None if ref is None else tuple(int(v) for v in ref), **augment)
    settings = ", ".join(f"{key}={getattr(rope, key, None)!r}" for key in ("grid_indexing", "in_pixels", "rotate_half"))
    raise ValueError(f"of timm's Eva models, those with DINOv3's RoPE (vit_*_dinov3), RoPE-ViT's axial / mixed ones "
                     f"(vit_*_rope[_mixed]_*) and Perception Encoder's (vit_pe_core_*: 'xy' patch-index grids, "
                     f"interleaved pairs) import; this one has {type(rope).__name__} ({settings})")


def _from_timm_eva(model: Eva, layer_scale: float | None = None) -> VisionTransformer:
    """Rebuild timm's RoPE ViTs (Eva) as ours: `vit_*_patch16_dinov3[_qkvb]` (DINOv3's RoPE), RoPE-ViT's
    `vit_*_patch16_rope[_mixed]_224` (axial / mixed) with pos_embed=rope, and Perception Encoder's `vit_pe_core_*`
    (a learned table and axial RoPE: pos_embed=learned_rope, a pre-norm, the attention pool over every token).
    Without an attention pool, pooled as upstream DINOv3 does (the class token after the final norm), whatever
    timm's global_pool says."""
    if model.rope is None:
        raise ValueError("of timm's Eva models only the RoPE ones import (vit_*_dinov3, vit_*_rope[_mixed]_*, "
                         "vit_pe_core_*); this one has no rotary position embeddings")
    rope = _rope_kwargs(model.rope)
    block = model.blocks[0]
    unsupported = [name for name, present in (
        ("post-norm blocks", not hasattr(block, "norm1")),
        ("attention gates or separate q / k / v projections", block.attn.qkv is None
         or getattr(block.attn, "gate", None) is not None),
        ("a norm inside the attention", not isinstance(getattr(block.attn, "norm", nn.Identity()), nn.Identity)),
        ("a norm after pooling", not isinstance(model.fc_norm, nn.Identity)),
        ("no final norm (vit_pe_lang_*, vit_pe_spatial_*)", isinstance(model.norm, nn.Identity))) if present]
    if unsupported:
        raise ValueError(f"this timm Eva model has {', '.join(unsupported)}, which ssl-vit's ViT does not build")
    has_layer_scale = getattr(block, "gamma_1", None) is not None
    pooled = model.attn_pool is not None
    kwargs = dict(
        img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size,
        in_chans=model.patch_embed.proj.in_channels, embed_dim=model.embed_dim, depth=len(model.blocks),
        num_heads=block.attn.num_heads, **mlp_settings(block.mlp), class_token=model.cls_token is not None,
        global_pool="map" if pooled else ("token" if model.cls_token is not None else "avg"),
        **_attn_pool_settings(model.attn_pool, include_prefix=True),  # Eva pools every token
        num_registers=0 if model.reg_token is None else model.reg_token.shape[1],
        pos_embed="rope" if model.pos_embed is None else "learned_rope", no_embed_class=model.no_embed_class, **rope,
        pre_norm=not isinstance(model.norm_pre, nn.Identity), patch_bias=model.patch_embed.proj.bias is not None,
        qkv_bias=block.attn.q_bias is not None if hasattr(block.attn, "q_bias") else block.attn.qkv.bias is not None,
        qk_norm=not isinstance(block.attn.q_norm, nn.Identity),
        **norm_settings(block.norm1),
        layer_scale=(layer_scale or DINOV3_LAYER_SCALE) if has_layer_scale else None)
    # a learned table (PE) resamples as Eva's dynamic-size path does: timm's default, which is also the config's
    ours = VisionTransformer(**kwargs)
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith("attn.k_bias") or name.startswith("head."):  # an encoder: no classifier
            continue
        if name.endswith((".attn.q_bias", ".attn.v_bias")):
            prefix = name.rsplit(".", 1)[0]
            if name.endswith("q_bias"):
                state[f"{prefix}.qkv.bias"] = torch.cat([value, torch.zeros_like(value), model.state_dict()[
                    f"{prefix}.v_bias"]])
            continue
        state[name.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")] = value
    ours.load_state_dict(state, strict=True)
    return ours


# Our presets' timm architectures: (embed_dim, depth, num_heads, mlp_dim) -> timm name stem (+ _patch{P}_{size}).
TIMM_NAMES = {(192, 12, 3, 768): "vit_tiny", (384, 12, 6, 1536): "vit_small", (768, 12, 12, 3072): "vit_base",
              (1024, 24, 16, 4096): "vit_large", (1280, 32, 16, 5120): "vit_huge", (1408, 40, 16, 6144): "vit_giant"}
_TIMM_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "silu": "silu"}
# The timm entry points that build the layers a config file cannot name (mlp_layer, an eps of a norm), by mlp_kind:
# model_args then set every size. (entry point, the norm it builds: (norm_layer, eps), whether its patches are normed)
TIMM_FAMILIES = {"swiglu_packed": ("vit_giant_patch14_dinov2", ("layernorm", 1e-6), False),  # SwiGLUPacked
                 "swiglu": ("aimv2_large_patch14_224", ("rmsnorm", 1e-5), True)}  # SwiGLU, RmsNorm(1e-5)
# Named family members: (mlp_kind, embed_dim, depth, num_heads, mlp_dim, patch) -> timm name (sizes as timm's).
TIMM_FAMILY_NAMES = {("swiglu_packed", 1536, 40, 24, 4096, 14): "vit_giant_patch14_dinov2",
                     ("swiglu", 1024, 24, 8, 2816, 14): "aimv2_large_patch14_224",
                     ("swiglu", 1536, 24, 12, 4096, 14): "aimv2_huge_patch14_224",
                     ("mlp", 1152, 27, 16, 4304, 14): "vit_so400m_patch14_siglip_224",
                     ("mlp", 1152, 27, 16, 4304, 16): "vit_so400m_patch16_siglip_256"}


def timm_architecture(config: ViTConfig) -> str:
    """The timm model name of an encoder config: the preset's (vit_base_patch16_224, ...) or, for sizes timm has no
    name for (the test presets), the base architecture whose `model_args` then set every size."""
    width, depth, heads = config.embed_dim, config.depth, config.num_heads
    mlp_dim = config.mlp_hidden
    patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    if config.stem == "resnet":
        return _timm_hybrid(config)
    named = TIMM_FAMILY_NAMES.get((config.mlp_kind, width, depth, heads, mlp_dim, patch))
    if named is not None:
        return named
    if config.mlp_kind in TIMM_FAMILIES:
        return TIMM_FAMILIES[config.mlp_kind][0]
    stem = TIMM_NAMES.get((width, depth, heads, mlp_dim))
    if config.dist_token:  # DeiT's distilled models (model_args set every size)
        name = f"deit_{(stem or 'vit_tiny').removeprefix('vit_')}_distilled_patch16_224"
        return name if timm.is_model(name) else "deit_tiny_distilled_patch16_224"

    for name in (f"{stem}_patch{patch}_224", f"{stem}_patch{patch}_clip_224") if stem else ():
        if timm.is_model(name):
            return name
    return "vit_base_patch16_224"


def _timm_hybrid(config: ViTConfig) -> str:
    """The timm hybrid whose ResNet part is this encoder's (timm builds it from the name; model_args set the ViT)."""
    layers = tuple(config.stem_layers)
    channels = config.stem_channels
    name = TIMM_HYBRIDS.get((layers, config.stem_width))
    if name is None or (channels and list(channels) != list(RESNET_CHANNELS[:len(layers)])):
        known = ", ".join(f"stem_layers={list(k[0])}, stem_width={k[1]} ({v})" for k, v in TIMM_HYBRIDS.items())
        raise ValueError(f"timm has no hybrid with stem_layers={list(layers)}, stem_channels={channels}, stem_width="
                         f"{config.stem_width}; its hybrids: {known}. --to onnx / safetensors take any stem")
    return name


def timm_model_args(config: ViTConfig) -> dict:
    """timm `VisionTransformer` keyword arguments that rebuild our encoder exactly (JSON-serialisable, as in a timm
    hub config.json); ValueError naming what plain keyword arguments cannot express."""
    problems = []
    if config.pos_embed == "none":
        problems.append("pos_embed='none' (timm's config files build learned position embeddings)")
    if config.parallel_block:
        problems.append("parallel_block=True (timm takes block_fn=ParallelScalingBlock, not expressible in a config "
                        "file: build timm's model yourself and load model.safetensors)")
    if not config.norm_bias and config.norm_layer == "layernorm":
        problems.append("norm_bias=False (timm's VisionTransformer has no bias-free LayerNorm argument)")
    width = config.embed_dim
    mlp_dim = config.mlp_hidden
    fc1 = 2 * mlp_dim if config.mlp_kind == "swiglu_packed" else mlp_dim  # what timm's mlp_ratio sizes
    if int(width * (fc1 / width)) != fc1:
        problems.append(f"mlp_dim={mlp_dim} (timm rebuilds int(width x mlp_ratio) = {int(width * (fc1 / width))})")
    if config.has_patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.has_patch_bias} with pre_norm={config.pre_norm} (timm's patch embedding "
                        "has a bias exactly when there is no pre-norm)")
    if config.global_pool == "map" and ((config.pool_heads or config.num_heads) != config.num_heads
                                        or (config.pool_mlp_dim or mlp_dim) != mlp_dim):
        problems.append(f"pool_heads={config.pool_heads}, pool_mlp_dim={config.pool_mlp_dim} (timm's MAP head has "
                        "the blocks' heads and MLP width)")
    if config.dist_token and (config.stem != "patch" or config.num_registers
                                     or config.no_embed_class):
        problems.append("dist_token=True with a hybrid stem, registers or no_embed_class (timm's distilled DeiT has "
                        "none of them)")
    family = TIMM_FAMILIES.get(config.mlp_kind)
    norm = (config.norm_layer, config.norm_eps)
    family_norm = family is not None and norm == family[1]
    if config.norm_eps != 1e-6 and not family_norm:
        problems.append(f"norm_eps={config.norm_eps} (timm's config files build {config.norm_layer} with eps 1e-6"
                        + (f"; its {config.mlp_kind} entry point {family[0]} {family[1][0]} with {family[1][1]}"
                           if family else "") + ")")
    if problems:
        raise ValueError("a timm config cannot express: " + "; ".join(problems)
                         + ". --to hf / onnx / safetensors take these.")
    size = config.img_size
    args = dict(img_size=size if isinstance(size, int) else list(size), patch_size=config.patch_size,
                in_chans=config.in_chans, embed_dim=width, depth=config.depth,
                num_heads=config.num_heads, mlp_ratio=mlp_dim / width, qkv_bias=config.qkv_bias,
                qk_norm=config.qk_norm, init_values=config.layer_scale,
                class_token=config.class_token, global_pool=config.global_pool,
                reg_tokens=config.num_registers, no_embed_class=config.no_embed_class,
                pre_norm=config.pre_norm, act_layer=_TIMM_ACTIVATIONS[config.act_layer],
                num_classes=0)
    # only what differs from timm's defaults (or the entry point's), so that the file reads as timm writes its own
    args["mlp_ratio"] = fc1 / width
    if config.has_fc_norm != (config.global_pool == "avg"):
        args["fc_norm"] = config.has_fc_norm
    if not config.proj_bias:
        args["proj_bias"] = False
    if config.pool_include_prefix:
        args["pool_include_prefix"] = True
    if not family_norm and norm != ("layernorm", 1e-6):  # timm's by name (eps 1e-6)
        args["norm_layer"] = config.norm_layer
    entry_patch_norm = bool(family and family[2])
    if config.patch_norm and not (entry_patch_norm and family_norm):
        args["embed_norm_layer"] = config.norm_layer
    elif not config.patch_norm and entry_patch_norm:
        args["embed_norm_layer"] = None
    return args


# What timm's RoPE models (Eva) require of an encoder config: key -> (value, the encoder's default where unset).
# Every kind: pixel patches, LayerNorm with biases, no norm after pooling; the pooling (class token or attention
# pool), a pre-norm and a learned table beside RoPE are written as Eva's arguments.
_TIMM_ROPE_REQUIRED = {"stem": ("patch", "patch"), "dist_token": (False, False), "parallel_block": (False, False),
                       "qk_norm": (False, False), "norm_bias": (True, True), "norm_layer": ("layernorm", None),
                       "proj_bias": (True, None), "patch_norm": (False, None), "has_fc_norm": (False, None)}
# Per kind: the DINOv3 port (vit_*_dinov3: periods over each side, eps 1e-5, q / v biases) or RoPE-ViT's
# (vit_*_rope[_mixed]_224: rope_theta on patch indices, eps 1e-6, a fused qkv bias with its key part).
_TIMM_ROPE_KINDS = {
    "dinov3": ({"norm_eps": (1e-5, 1e-6), "rope_normalize": ("separate", "separate"),
                "rope_min_period": (None, None)}, dict(rope_type="dinov3", rope_rotate_half=True)),
    "axial": ({"norm_eps": (1e-6, 1e-6)}, dict(rope_type="cat", attn_type="rope", rope_grid_indexing="xy")),
    "mixed": ({"norm_eps": (1e-6, 1e-6)}, dict(rope_type="mixed", attn_type="rope", rope_grid_indexing="xy")),
}
# The entry point of each kind, by the norm eps it builds (a config file cannot name an eps): RoPE-ViT's 1e-6,
# Perception Encoder's 1e-5 (same axial RoPE; model_args then set everything else).
_TIMM_ROPE_ENTRIES = {("dinov3", 1e-5): "vit_small_patch16_dinov3", ("axial", 1e-6): "vit_small_patch16_rope_224",
                      ("axial", 1e-5): "vit_pe_core_base_patch16_224",
                      ("mixed", 1e-6): "vit_small_patch16_rope_mixed_224"}


def timm_rope_args(config: ViTConfig) -> tuple[str, dict]:
    """(architecture, Eva keyword arguments) that rebuild a RoPE encoder as timm's DINOv3 port (rope_kind dinov3),
    its RoPE-ViT models (axial, mixed) or Perception Encoder (axial with a learned table, eps 1e-5); ValueError
    naming what they cannot express. RoPE's training-time shift / jitter / rescale are not written (they change
    nothing at inference)."""
    kind = config.rope_kind
    if kind not in _TIMM_ROPE_KINDS:
        raise ValueError(f"rope_kind {kind!r} is not one of {list(ROPE_KINDS)}")
    required, rope_args = _TIMM_ROPE_KINDS[kind]
    if kind == "axial" and config.norm_eps == 1e-5:  # Perception Encoder's entry point
        required = {"norm_eps": (1e-5, 1e-6)}
    problems = [f"{key}={getattr(config, key)!r}" for key, (wanted, default)
                in (_TIMM_ROPE_REQUIRED | required).items() if getattr(config, key) != wanted]
    if config.act_layer != ("gelu" if config.mlp_kind == "mlp" else "silu"):  # Eva's MLP: GELU; its SwiGLU: SiLU
        problems.append(f"act_layer={config.act_layer!r} with mlp_kind={config.mlp_kind!r}")
    if config.global_pool == "avg":
        problems.append("global_pool='avg' (Eva's average pool norms after pooling; here: token or map)")
    width = config.embed_dim
    pool_mlp = config.pool_mlp_dim or config.mlp_hidden
    if config.global_pool == "map" and (config.act_layer != "gelu" or int(width * (pool_mlp / width)) != pool_mlp
                                        or (config.num_prefix_tokens and not config.pool_include_prefix)):
        problems.append(f"global_pool='map' with act_layer={config.act_layer!r}, pool_mlp_dim={pool_mlp}, "
                        f"pool_include_prefix={config.pool_include_prefix} (Eva's attention pool: a GELU MLP of "
                        "int(width x ratio), over every token)")
    if config.has_patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.has_patch_bias} with pre_norm={config.pre_norm} (Eva's patch "
                        "embedding has a bias exactly when there is no pre-norm)")
    if config.pos_embed == "learned_rope" and config.no_embed_class:
        problems.append("no_embed_class=True with pos_embed='learned_rope'")
    if problems:
        eps = "1e-6 (RoPE-ViT) or 1e-5 (Perception Encoder)" if kind == "axial" else required["norm_eps"][0]
        raise ValueError(f"timm's RoPE models of rope_kind={kind!r} (Eva: pixel patches, LayerNorm eps {eps} with "
                         f"biases, a GELU MLP or a SiLU SwiGLU, class-token or "
                         "attention pooling"
                         + (", rope_theta periods over each side" if kind == "dinov3" else "")
                         + ") cannot express: " + ", ".join(problems)
                         + ". --to hf --hf-arch dinov3 / onnx / safetensors take what transformers / ONNX can.")
    mlp_dim = config.mlp_hidden
    if int(width * (mlp_dim / width)) != mlp_dim:
        raise ValueError(f"mlp_dim={mlp_dim} is not int(width x a ratio) for width {width}: timm's Eva rebuilds its "
                         "MLP from mlp_ratio. --to hf --hf-arch dinov3 / onnx / safetensors keep it exactly.")
    # Eva's SwiGLU: separate gate and value projections when aligned (align_to 1 changes no width), packed without
    mlp = {"mlp": {}, "swiglu": dict(swiglu_mlp=True, swiglu_align_to=1),
           "swiglu_packed": dict(swiglu_mlp=True, swiglu_align_to=0)}[config.mlp_kind]
    size = config.img_size
    args = dict(img_size=size if isinstance(size, int) else list(size), patch_size=config.patch_size,
                in_chans=config.in_chans, embed_dim=width, depth=config.depth,
                num_heads=config.num_heads, mlp_ratio=mlp_dim / width, qkv_bias=config.qkv_bias,
                init_values=config.layer_scale, rope_temperature=config.rope_theta or ROPE_THETA[kind],
                use_rot_pos_emb=True, use_abs_pos_emb=config.pos_embed == "learned_rope",
                class_token=config.class_token, num_reg_tokens=config.num_registers,
                use_pre_transformer_norm=config.pre_norm, use_fc_norm=False, global_pool=config.global_pool,
                dynamic_img_size=True, num_classes=0, **rope_args, **mlp)
    if kind == "axial":
        args.update(rope_grid_offset=config.rope_offset,
                    ref_feat_shape=None if config.rope_ref_grid is None else list(config.rope_ref_grid))
    if config.global_pool == "map":
        args.update(attn_pool_num_heads=config.pool_heads or config.num_heads, attn_pool_mlp_ratio=pool_mlp / width)
    entry = _TIMM_ROPE_ENTRIES[(kind, config.norm_eps)]
    return (entry + "_qkvb" if kind == "dinov3" and args["qkv_bias"] else entry), args


def _timm_rope_state(state: dict, kind: str) -> dict:
    """Our state dict under timm's Eva names: ls gammas -> gamma_1/2; for DINOv3's port the fused qkv bias ->
    q_bias, v_bias (its key part is masked: Eva's k_bias is a zero buffer)."""
    out = {}
    for name, value in state.items():
        if kind == "dinov3" and name.endswith("attn.qkv.bias"):
            q_bias, _, v_bias = value.chunk(3)
            prefix = name.removesuffix("qkv.bias")
            out.update({f"{prefix}q_bias": q_bias, f"{prefix}v_bias": v_bias})
            continue
        out[name.replace(".ls1.gamma", ".gamma_1").replace(".ls2.gamma", ".gamma_2")] = value
    return out


def export_timm(encoder, out_dir, preprocess=None):
    """A timm model directory: model.safetensors (our names are timm's) and a hub-style config.json
    (architecture, model_args, pretrained_cfg with the preprocessing). Load with
    `timm.create_model("local-dir:DIR", pretrained=True)` or
    `timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file="DIR/model.safetensors"), **args)`."""
    config = encoder.config
    rope = config.has_rope
    architecture, args = timm_rope_args(config) if rope else (timm_architecture(config), timm_model_args(config))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    size = args["img_size"] if isinstance(args["img_size"], list) else [args["img_size"]] * 2
    # our eval transform's defaults where nothing was recorded (timm's architecture defaults crop 87.5% bicubic)
    pretrained_cfg = {"input_size": [args["in_chans"], *size], "num_classes": 0, "fixed_input_size": False,
                      "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center"}
    if preprocess is not None:
        pretrained_cfg.update(mean=list(preprocess.mean), std=list(preprocess.std),
                              interpolation=preprocess.interpolation, crop_pct=preprocess.crop_pct,
                              crop_mode="squash" if preprocess.resize_mode == "squash" else "center")
    hub = {"architecture": architecture, "num_classes": 0, "num_features": config.embed_dim,
           "global_pool": args["global_pool"], "model_args": args, "pretrained_cfg": pretrained_cfg}
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    state = {k: v.detach().float().contiguous().clone() for k, v in encoder.state_dict().items()}
    if rope:
        state = _timm_rope_state(state, config.rope_kind)
    save_safetensors(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def timm_preprocess(model) -> Preprocess:
    """The eval transform timm declares for a model (pretrained_cfg: mean, std, interpolation, crop_pct)."""
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    if hasattr(model, "patch_embed"):
        size = model.patch_embed.img_size
    else:  # NaFlexVit: the size its position grid was made for
        size = model.embeds.default_img_size or pcfg.get("input_size", (3, 224, 224))[1:]
    interpolation = pcfg.get("interpolation", "bicubic")
    return Preprocess(img_size=int(size[0]), mean=list(pcfg.get("mean", Preprocess(1).mean)),
                      std=list(pcfg.get("std", Preprocess(1).std)),
                      interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic",
                      crop_pct=float(pcfg.get("crop_pct", 1.0)),
                      resize_mode="squash" if pcfg.get("crop_mode") == "squash" else "shortest")


def timm_native_preprocess(model) -> Preprocess:
    """timm's own data config for a model (timm.data.resolve_data_config: input size, interpolation, mean, std,
    crop_pct, crop_mode), as our Preprocess."""
    cfg = resolve_data_config({}, model=model)
    interpolation = cfg.get("interpolation", "bicubic")
    return Preprocess(img_size=int(cfg["input_size"][-1]), mean=list(cfg["mean"]), std=list(cfg["std"]),
                      interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic",
                      crop_pct=float(cfg.get("crop_pct", 1.0)),
                      resize_mode="squash" if cfg.get("crop_mode") == "squash" else "shortest")


def converts(model: nn.Module) -> bool:
    """Whether timm's model is one of the ViTs that become ours (VisionTransformer, hybrids, the RoPE Eva models,
    SAM's image encoder)."""
    return isinstance(model, (TimmViT, Eva, VisionTransformerSAM)) or is_timm_naflex(model)


def load_timm_spec(rest: str, native: str = "never") -> tuple[VisionTransformer | NativeEncoder, Preprocess, dict]:
    """(encoder, timm's preprocessing, identity) of `timm:<rest>` (ssl_vit.interop.sources names the forms);
    `native` as load_pretrained's."""
    path = Path(rest).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"timm:{rest}: the directory has no config.json (a timm model directory)")
        model = timm.create_model(f"local-dir:{path}", pretrained=True, num_classes=0)
        identity = {"timm": [file_fingerprint(p) for p in (path / "model.safetensors", path / "pytorch_model.bin")
                             if p.is_file()]}
    else:
        name, _, file = rest.partition(":")
        if not timm.is_model(name):
            close = timm.list_models(f"*{name.split('_')[0]}*")[:8] if name else []
            raise ValueError(f"timm:{rest}: {name!r} is not a timm model name (e.g. {close or 'vit_base_patch16_224'})")
        if file:
            file_path = Path(file).expanduser()
            if not file_path.is_file():
                raise FileNotFoundError(f"timm:{rest}: no checkpoint file {file!r}")
            overlay = {"file": str(file_path), "custom_load": file_path.suffix == ".npz"}  # big_vision npz: timm's own
            model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0)
            identity = file_fingerprint(file_path) | {"timm": name}
        else:
            model = timm.create_model(name, pretrained=False, num_classes=0)
            identity = {"timm": name, "seed": torch.initial_seed()}
    if native == "always" or (native == "fallback" and not converts(model)):
        return from_timm_native(model.eval()), timm_native_preprocess(model), {**identity, "native": True}
    if not converts(model):
        raise not_a_vit(f"timm:{rest}", f"a {type(model).__name__}")
    return from_timm(model.eval()).eval(), timm_preprocess(model), identity
