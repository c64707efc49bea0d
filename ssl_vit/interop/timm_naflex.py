"""timm's NaFlex ViT (`timm.models.naflexvit.NaFlexVit`, the `naflexvit_*` models) both ways.

NaFlexVit is timm's classic ViT with a linear patch embedding over flat (row, column, channel) patches, position
embeddings stored as a (1, h, w, D) grid without prefix slots, and the prefix tokens in front; its blocks carry the
classic names. So the mapping is three tensors: the patch projection (a Conv2d kernel flattened channel-last), the
position grid, and a class-token position slot folded into the class token (timm's own `checkpoint_filter_fn` does
the same for classic checkpoints). SigLIP 2's NaFlex family (a MAP head, tanh GELU, bilinear position resampling)
moves both ways. What it cannot hold is refused in one line: RoPE, factorized position embeddings, grid-sampled or
aspect-preserving position resampling, Eva (SwiGLU) blocks (import); parallel blocks, hybrids, bias-free norms,
SwiGLU, a MAP head unlike the blocks, distillation tokens, windows (export).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from timm.layers import AttentionPoolLatent
from timm.models.naflexvit import NaFlexVit
from timm.models.vision_transformer import Block
from torch import nn

from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.files import save_safetensors
from ssl_vit.interop.timm_layers import layer_scale_init, mlp_settings, norm_settings

_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}


def _import_refusals(model: NaFlexVit) -> list[str]:
    embeds = model.embeds
    problems = []
    if model.global_pool not in ("token", "avg", "map"):
        problems.append(f"global_pool={model.global_pool!r} (ours pools the class token, the average or by MAP)")
    if not isinstance(model.blocks[0], Block):
        problems.append(f"{type(model.blocks[0]).__name__} blocks (timm's classic Block imports: SwiGLU NaFlexVits "
                        "are built of Eva blocks)")
    if getattr(model, "rope", None) is not None:
        problems.append("RoPE (use timm's Eva / vit_*_rope models, which import)")
    if getattr(embeds, "pos_embed_type", "learned") not in ("learned", "none"):
        problems.append(f"pos_embed={embeds.pos_embed_type!r}")
    if embeds.pos_embed_ar_preserving or embeds.pos_embed_align_corners or embeds.pos_embed_use_grid_sample:
        problems.append("pos_embed_ar_preserving / align_corners / use_grid_sample (ours resamples each image's grid "
                        "with F.interpolate, timm's default)")
    if embeds.norm_input is not None:
        problems.append("an input norm")
    if not isinstance(embeds.proj, nn.Linear):
        problems.append("a convolutional patch embedding (embed_proj_type='conv')")
    if model.pool_include_prefix:
        problems.append("pool_include_prefix=True")
    return problems


def _attn_pool_settings(model: NaFlexVit) -> dict:
    pool = model.attn_pool
    if pool is None:
        return {}
    if not isinstance(pool, AttentionPoolLatent) or pool.latent_len != 1 or pool.pos_embed is not None \
            or isinstance(pool.q, nn.Identity) or not isinstance(pool.q_norm, nn.Identity) or pool.mlp is None:
        raise ValueError("this timm NaFlexVit's attention pool is not the one-latent MAP head (with its query "
                         "projection and MLP) that ssl-vit builds")
    return dict(pool_heads=pool.num_heads, pool_mlp_dim=pool.mlp.fc1.out_features)


def from_timm_naflex(model: NaFlexVit) -> VisionTransformer:
    """Rebuild a timm NaFlexVit as ours (learned or no position embeddings; class-token, average or MAP pooling,
    the final norm before or after it), weights included; it then reads NaFlex batches (ssl_vit.naflex) and
    images."""
    problems = _import_refusals(model)
    if problems:
        raise ValueError("this timm NaFlexVit cannot be imported: " + "; ".join(problems))
    embeds, block = model.embeds, model.blocks[0]
    patch = embeds.patch_size
    grid = embeds.pos_embed_grid_size or (16, 16)
    has_ls = not isinstance(block.ls1, nn.Identity)
    kwargs = dict(
        img_size=[grid[0] * patch[0], grid[1] * patch[1]], patch_size=list(patch), in_chans=embeds.in_chans,
        embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=block.attn.num_heads,
        **mlp_settings(block.mlp), class_token=model.has_class_token, global_pool=model.global_pool,
        fc_norm=not isinstance(model.fc_norm, nn.Identity), patch_norm=not isinstance(embeds.norm, nn.Identity),
        **_attn_pool_settings(model),
        num_registers=model.num_reg_tokens, no_embed_class=True,
        pos_embed="learned" if getattr(embeds, "pos_embed", None) is not None else "none",
        pos_embed_interp=embeds.pos_embed_interp_mode, pos_embed_antialias=embeds.pos_embed_antialias,
        qkv_bias=block.attn.qkv.bias is not None, qk_norm=not isinstance(block.attn.q_norm, nn.Identity),
        **norm_settings(block.norm1), pre_norm=not isinstance(model.norm_pre, nn.Identity),
        layer_scale=layer_scale_init(model) if has_ls else None,
    )
    ours = VisionTransformer(**kwargs)
    state = {}
    for name, value in model.state_dict().items():
        if name == "embeds.proj.weight":
            value = value.reshape(len(value), patch[0], patch[1], embeds.in_chans).permute(0, 3, 1, 2)
            name = "patch_embed.proj.weight"
        elif name == "embeds.proj.bias":
            name = "patch_embed.proj.bias"
        elif name == "embeds.pos_embed":
            value = value.flatten(1, 2)
            name = "pos_embed"
        elif name.startswith("embeds.norm."):
            name = name.replace("embeds.norm.", "patch_embed.norm.")
        elif name.startswith("embeds."):
            name = name.removeprefix("embeds.")
        state[name] = value
    if "head.weight" in state and not isinstance(ours.head, nn.Linear):
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    ours.load_state_dict(state, strict=True)
    return ours.train(model.training)


def _export_refusals(config: ViTConfig) -> list[str]:
    problems = []
    for key, default, why in (("parallel_block", False, "ViT-22B's parallel block"), ("dist_token", False,
                              "a distillation token"), ("window_size", 0, "windowed attention"),
                              ("rel_pos", False, "relative positions"), ("neck_channels", 0, "SAM's neck")):
        if getattr(config, key) != default:
            problems.append(f"{key}={getattr(config, key)!r} ({why})")
    if config.stem != "patch":
        problems.append(f"stem={config.stem!r} (NaFlexVit embeds pixel patches)")
    if config.has_rope:
        problems.append(f"pos_embed={config.pos_embed!r} (--to timm writes timm's RoPE models)")
    if not config.norm_bias and config.norm_layer == "layernorm":
        problems.append("norm_bias=False")
    if config.mlp_kind != "mlp":
        problems.append(f"mlp_kind={config.mlp_kind!r} (NaFlexVit builds SwiGLU as Eva blocks, with other names)")
    if config.norm_eps != 1e-6:
        problems.append(f"norm_eps={config.norm_eps} (NaFlexVit's named norms have eps 1e-6)")
    if config.has_patch_bias == config.pre_norm:
        problems.append(f"patch_bias={config.has_patch_bias} with pre_norm={config.pre_norm}")
    if config.global_pool == "map" and (config.pool_mlp_dim or config.mlp_hidden) != config.mlp_hidden:
        problems.append(f"pool_mlp_dim={config.pool_mlp_dim} (NaFlexVit sizes its MAP head by a ratio: give the "
                        "blocks' width)")
    return problems


def naflex_model_args(config: ViTConfig) -> dict:
    """timm NaFlexVit keyword arguments (classic ones plus NaFlexVitCfg fields) that rebuild our encoder."""
    problems = _export_refusals(config)
    if problems:
        raise ValueError("timm's NaFlexVit cannot hold: " + "; ".join(problems)
                         + ". --to timm (classic), onnx or safetensors take these.")
    width = config.embed_dim
    mlp_dim = config.mlp_hidden
    size = config.img_size
    size = list(size) if isinstance(size, (list, tuple)) else [size, size]
    patch = config.patch_size
    patch = list(patch) if isinstance(patch, (list, tuple)) else [patch, patch]
    pool = config.global_pool
    return dict(img_size=size, patch_size=patch, in_chans=config.in_chans, embed_dim=width,
                depth=config.depth, num_heads=config.num_heads, mlp_ratio=mlp_dim / width,
                qkv_bias=config.qkv_bias, qk_norm=config.qk_norm,
                init_values=config.layer_scale, class_token=config.class_token,
                reg_tokens=config.num_registers, global_pool=pool, fc_norm=config.has_fc_norm,
                proj_bias=config.proj_bias, norm_layer=config.norm_layer,
                embed_norm_layer=config.norm_layer if config.patch_norm else None,
                attn_pool_num_heads=config.pool_heads,
                pos_embed="none" if config.pos_embed == "none" else "learned",
                pos_embed_grid_size=[size[0] // patch[0], size[1] // patch[1]],
                pos_embed_interp_mode=config.pos_embed_interp,
                pos_embed_antialias=config.pos_embed_antialias, pre_norm=config.pre_norm,
                act_layer=_ACTIVATIONS[config.act_layer], num_classes=0)


def naflex_state(encoder: VisionTransformer) -> dict[str, torch.Tensor]:
    """Our encoder's weights under NaFlexVit's names (position slots of prefix tokens folded into the tokens)."""
    state = {k: v.detach().float() for k, v in encoder.state_dict().items() if not k.startswith("head.")}
    out = {}
    prefix = encoder.num_pos_prefix
    for name, value in state.items():
        if name == "patch_embed.proj.weight":
            out["embeds.proj.weight"] = value.permute(0, 2, 3, 1).flatten(1)
        elif name == "patch_embed.proj.bias":
            out["embeds.proj.bias"] = value
        elif name == "pos_embed":
            grid = encoder.grid_size
            out["embeds.pos_embed"] = value[:, prefix:].reshape(1, *grid, -1)
        elif name in ("cls_token", "reg_token"):
            out[f"embeds.{name}"] = value
        elif name.startswith("patch_embed.norm."):
            out[name.replace("patch_embed.norm.", "embeds.norm.")] = value
        else:
            out[name] = value
    if prefix:  # a prefix token's position embedding is a constant: fold it into the token
        pos = state["pos_embed"][:, :prefix]
        tokens = [name for name in ("cls_token", "reg_token") if name in state]
        folded = torch.cat([state[name] for name in tokens], dim=1) + pos
        start = 0
        for name in tokens:
            count = state[name].shape[1]
            out[f"embeds.{name}"] = folded[:, start:start + count]
            start += count
    return {k: v.contiguous().clone() for k, v in out.items()}


def export_timm_naflex(encoder: VisionTransformer, out_dir, preprocess=None) -> Path:
    """A timm model directory of `naflexvit_base_patch16_gap` rebuilt at our sizes (model_args): load with
    `timm.create_model("local-dir:DIR", pretrained=True)`; it takes NaFlex dicts and images."""
    config = encoder.config
    args = naflex_model_args(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pretrained_cfg = {"input_size": [args["in_chans"], *args["img_size"]], "num_classes": 0,
                      "fixed_input_size": False, "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center"}
    if preprocess is not None:
        pretrained_cfg.update(mean=list(preprocess.mean), std=list(preprocess.std),
                              interpolation=preprocess.interpolation, crop_pct=preprocess.crop_pct)
    hub = {"architecture": "naflexvit_base_patch16_gap", "num_classes": 0, "num_features": config.embed_dim,
           "global_pool": args["global_pool"], "model_args": args, "pretrained_cfg": pretrained_cfg}
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    save_safetensors(naflex_state(encoder), out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def is_timm_naflex(model: nn.Module) -> bool:
    return isinstance(model, NaFlexVit)

