"""SAM's image encoder (segment-anything `modeling/image_encoder.py`, timm's `samvit_*`) as ours: a plain ViT
without a class token, windowed attention in all blocks but the global ones, decomposed relative positions in every
block, absolute positions on the pre-training grid (timm: NHWC, resampled bicubic with antialiasing for another
grid), and the 256-channel neck (`VisionTransformer.forward_neck`). Importing keeps every weight; the pooled
embedding of an import is ours (LayerNorm of the token mean), SAM defining none.

Exporting our windowed encoders to timm's SAM ViT (`export_timm_sam`, `ssl-vit export --to timm` for an encoder with
windows, relative positions or a neck): the position grid reshaped to timm's (1, H, W, D), class and register tokens
dropped (said in one line: the patch outputs then differ, having attended to them), our final norm as timm's
LayerNorm2d neck where there is no convolutional one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from timm.models.vision_transformer_sam import VisionTransformerSAM

from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.backbone.windows import resample_rel_pos
from ssl_vit.files import save_safetensors

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


SAM_ARCHITECTURE = "samvit_base_patch16"  # timm builds any size from it with model_args
SAM_NORM_EPS = 1e-5  # timm's VisionTransformerSAM: nn.LayerNorm's default


def sam_model_args(config: ViTConfig) -> dict:
    """timm `VisionTransformerSAM` keyword arguments for our encoder; ValueError for what it cannot hold."""
    problems = [f"{key}={getattr(config, key)}" for key, ok in (
        ("pos_embed", config.pos_embed in ("learned", "sincos")),
        ("parallel_block", not config.parallel_block), ("stem", config.stem == "patch"),
        ("layer_scale", config.layer_scale is None), ("qk_norm", not config.qk_norm),
        ("act_layer", config.act_layer == "gelu"),
        ("norm_bias", config.norm_bias),
        # a final norm before a neck (token pooling and a neck) has no place in timm's SAM
        ("neck_channels", not (config.neck_channels and config.global_pool == "token")),
    ) if not ok] + config.beyond_classic()
    if problems:
        raise ValueError(f"timm's SAM ViT cannot hold {', '.join(problems)}; --to onnx / safetensors take them")
    width, size = config.embed_dim, config.img_size
    mlp_dim = config.mlp_hidden
    return dict(img_size=size if isinstance(size, int) else list(size)[0], patch_size=config.patch_size,
                in_chans=config.in_chans, embed_dim=width, depth=config.depth,
                num_heads=config.num_heads, mlp_ratio=mlp_dim / width, qkv_bias=config.qkv_bias,
                pre_norm=config.pre_norm, use_abs_pos=True, use_rel_pos=bool(config.rel_pos),
                window_size=config.window_size,
                global_attn_indexes=list(config.global_attn_indexes),
                neck_chans=config.neck_channels, global_pool="avg", num_classes=0)


def sam_state(encoder: VisionTransformer, args: dict) -> dict:
    """timm's SAM state dict of our encoder: the position grid as (1, H, W, D) without prefix slots, relative-position
    tables at the lengths timm builds (resampled linearly, as both resample at run time), the neck's names, our
    final norm as timm's LayerNorm2d neck where there is no convolutional neck."""
    state = {name: value.detach().float().clone() for name, value in encoder.state_dict().items()
             if not name.startswith(("cls_token", "reg_token", "dist_token", "fc_norm", "head"))}
    grid = encoder.grid_size
    state["pos_embed"] = state["pos_embed"][:, encoder.num_pos_prefix:].reshape(1, *grid, -1)
    for index, window in enumerate(encoder.blocks[i].attn.window for i in range(len(encoder.blocks))):
        for axis, side in (("h", 0), ("w", 1)):
            name = f"blocks.{index}.attn.rel_pos_{axis}"
            if name in state:
                state[name] = resample_rel_pos(state[name], 2 * (window or grid[side]) - 1)
    inverse = {ours: theirs for theirs, ours in _NECK.items()}
    state = {inverse.get(name, name): value for name, value in state.items()}
    if not args["neck_chans"]:  # timm's neck is then a LayerNorm2d: our final norm (token pooling) or none
        norm = {"neck.weight": state.pop("norm.weight", None), "neck.bias": state.pop("norm.bias", None)}
        if norm["neck.weight"] is None:
            raise ValueError("timm's SAM ViT without a neck normalises the last map (LayerNorm2d); this encoder has "
                             "neither a neck nor a final norm")
        state.update(norm)
    return state


def export_timm_sam(encoder: VisionTransformer, out_dir, preprocess=None) -> tuple[Path, str]:
    """A timm model directory of timm's SAM ViT (`timm.create_model("local-dir:DIR", pretrained=True)`) holding our
    windowed encoder; (the directory, a note: what timm's model leaves out, or "")."""
    args = sam_model_args(encoder.config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    size = [args["img_size"]] * 2
    pretrained_cfg = {"input_size": [args["in_chans"], *size], "num_classes": 0, "fixed_input_size": False,
                      "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center"}
    if preprocess is not None:
        pretrained_cfg.update(mean=list(preprocess.mean), std=list(preprocess.std),
                              interpolation=preprocess.interpolation, crop_pct=preprocess.crop_pct)
    hub = {"architecture": SAM_ARCHITECTURE, "num_classes": 0, "global_pool": "avg", "model_args": args,
           "pretrained_cfg": pretrained_cfg}
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    save_safetensors({k: v.contiguous() for k, v in sam_state(encoder, args).items()}, out_dir / "model.safetensors",
                     metadata={"format": "pt"})
    notes = []
    if encoder.num_prefix_tokens:
        notes.append(f"timm's SAM ViT has no class or register tokens: the {encoder.num_prefix_tokens} prefix "
                     "token(s) were dropped, so its patch outputs differ from this encoder's (they attended to them)")
    if encoder.config.norm_eps != SAM_NORM_EPS:
        notes.append(f"timm's SAM ViT built from a config normalises with eps {SAM_NORM_EPS}, this encoder with "
                     f"{encoder.config.norm_eps}: outputs differ by float rounding (~1e-5)")
    return out_dir, "; ".join(notes)
