"""Our ViT to and from transformers' `Aimv2VisionModel` (`--to hf --hf-arch aimv2`, `hf:<dir>`), exact in fp32.

AIMv2's vision tower (apple/ml-aim; transformers 4.54+): a conv patch embedding followed by RMSNorm, a learned
position table (no class token, no registers), pre-norm blocks with RMSNorm, separate q / k / v / out projections
sharing one bias switch (`qkv_bias`), a SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`, `mlp_bias`), and the final
RMSNorm on every token. So it holds our `vit_*_aimv2` presets: mlp_kind swiglu (or swiglu_packed, split on export),
norm_layer rmsnorm, patch_norm, average pooling with the final norm on the tokens (fc_norm false). Layer scale folds
into out_proj / down_proj exactly. Its attention-pooling head (`use_head`, a classification probe with its own query)
is not an encoder part: written off on export, dropped on import (our pooled output is the token mean). The native-
resolution variant (`is_native`: 2-D sin-cos positions computed per image) is refused on import.
"""

from __future__ import annotations

import torch

from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.interop.hf_mlp import GATED, gated_parts, ours_from_gated

_REQUIRED = {"class_token": (False, "no class token"), "num_registers": (0, "no registers"),
             "global_pool": ("avg", "the mean of the tokens"), "has_fc_norm": (False, "the final norm on every token"),
             "norm_layer": ("rmsnorm", "RMSNorm"), "patch_norm": (True, "an RMSNorm after the patch projection"),
             "pos_embed": ("learned", "a learned position table"), "stem": ("patch", "pixel patches"),
             "pre_norm": (False, "no norm before the blocks"), "qk_norm": (False, "no QK-norm"),
             "parallel_block": (False, "no parallel blocks"), "dist_token": (False, "no distillation token")}


def aimv2_refusals(config: ViTConfig) -> list[str]:
    """What of an encoder config Aimv2VisionModel cannot hold (empty: it can)."""
    problems = [f"{key}={getattr(config, key)!r} (Aimv2VisionModel has {why})" for key, (wanted, why) in
                _REQUIRED.items() if getattr(config, key) != wanted]
    if config.mlp_kind not in GATED:
        problems.append(f"mlp_kind={config.mlp_kind!r} (Aimv2VisionModel has a SwiGLU MLP)")
    if config.qkv_bias != config.proj_bias:
        problems.append(f"qkv_bias={config.qkv_bias}, proj_bias={config.proj_bias} (Aimv2VisionModel's qkv_bias "
                        "switches the q, k, v and output biases together)")
    for key in ("img_size", "patch_size"):
        value = getattr(config, key)
        if isinstance(value, (list, tuple)) and len(set(value)) > 1:
            problems.append(f"{key}={list(value)} (square sizes only)")
    return problems


def _side(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def aimv2_config(config: ViTConfig, hidden_act: str):
    """The Aimv2VisionConfig of an encoder config (`aimv2_refusals` empty); `hidden_act` transformers' name."""
    from transformers import Aimv2VisionConfig  # heavy: transformers models only

    return Aimv2VisionConfig(
        hidden_size=config.embed_dim, intermediate_size=config.mlp_hidden, num_hidden_layers=config.depth,
        num_attention_heads=config.num_heads, num_channels=config.in_chans, image_size=_side(config.img_size),
        patch_size=_side(config.patch_size), hidden_act=hidden_act, rms_norm_eps=config.norm_eps,
        qkv_bias=config.qkv_bias, mlp_bias=config.proj_bias, use_head=False, is_native=False,
        attention_dropout=0.0, architectures=["Aimv2VisionModel"])


def aimv2_state(state: dict, config: ViTConfig) -> dict:
    """Our state dict -> Aimv2VisionModel's (layer scale folded into the output projections)."""
    width = config.embed_dim
    out = {"embeddings.patch_embed.weight": state["patch_embed.proj.weight"],
           "embeddings.patch_embed.bias": state.get("patch_embed.proj.bias", torch.zeros(width)),
           "embeddings.rms_norm.weight": state["patch_embed.norm.weight"],
           "embeddings.position_embedding.weight": state["pos_embed"][0],
           "rms_norm.weight": state["norm.weight"]}
    for i in range(config.depth):
        ours, theirs = f"blocks.{i}.", f"encoder.layers.{i}."
        out[f"{theirs}rms_norm1.weight"] = state[f"{ours}norm1.weight"]
        out[f"{theirs}rms_norm2.weight"] = state[f"{ours}norm2.weight"]
        for part, value in zip("qkv", state[f"{ours}attn.qkv.weight"].chunk(3), strict=True):
            out[f"{theirs}attention.{part}_proj.weight"] = value
        if f"{ours}attn.qkv.bias" in state:
            for part, value in zip("qkv", state[f"{ours}attn.qkv.bias"].chunk(3), strict=True):
                out[f"{theirs}attention.{part}_proj.bias"] = value
        gammas = [state.get(f"{ours}ls{j}.gamma") for j in (1, 2)]
        out.update(_scaled(f"{theirs}attention.out_proj", state, f"{ours}attn.proj", gammas[0]))
        parts = gated_parts(state, f"{ours}mlp.", config.mlp_kind)
        for part in ("gate", "up"):
            out.update({f"{theirs}ffn.{part}_proj.{kind}": parts[f"{part}.{kind}"] for kind in ("weight", "bias")
                        if f"{part}.{kind}" in parts})
        down = {f"down.{kind}": parts[f"down.{kind}"] for kind in ("weight", "bias") if f"down.{kind}" in parts}
        out.update(_scaled(f"{theirs}ffn.down_proj", {f"x.{k}": v for k, v in down.items()}, "x.down", gammas[1]))
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def _scaled(target: str, state: dict, source: str, gamma) -> dict:
    """A Linear's weight (and bias) with a layer-scale gamma folded in: gamma (W x + b) = (gamma W) x + gamma b."""
    out = {}
    for kind in ("weight", "bias"):
        if f"{source}.{kind}" in state:
            value = state[f"{source}.{kind}"]
            if gamma is not None:
                value = value * (gamma[:, None] if kind == "weight" else gamma)
            out[f"{target}.{kind}"] = value
    return out


def from_aimv2(module, hf_cfg, act_layer: str) -> VisionTransformer:
    """Our encoder from an Aimv2VisionModel, weights included (its pooling head dropped); `act_layer` ours."""
    if getattr(hf_cfg, "is_native", False):
        raise ValueError("is_native=True (AIMv2's native-resolution model: 2-D sin-cos positions per image) is not "
                         "imported; the fixed-resolution models are")
    if bool(hf_cfg.qkv_bias) != bool(hf_cfg.mlp_bias):
        raise ValueError(f"qkv_bias={hf_cfg.qkv_bias}, mlp_bias={hf_cfg.mlp_bias}: transformers' qkv_bias also "
                         "switches the attention output's bias, and ssl-vit switches that one with the MLP's "
                         "(proj_bias); this combination is not built")
    side, patch = _side(hf_cfg.image_size), _side(hf_cfg.patch_size)
    encoder = VisionTransformer(
        img_size=side, patch_size=patch, in_chans=hf_cfg.num_channels, embed_dim=hf_cfg.hidden_size,
        depth=hf_cfg.num_hidden_layers, num_heads=hf_cfg.num_attention_heads, mlp_dim=hf_cfg.intermediate_size,
        mlp_kind="swiglu", act_layer=act_layer, norm_layer="rmsnorm", norm_eps=hf_cfg.rms_norm_eps, patch_norm=True,
        qkv_bias=bool(hf_cfg.qkv_bias), proj_bias=bool(hf_cfg.mlp_bias), class_token=False, global_pool="avg",
        fc_norm=False,
        # transformers' Aimv2 does not resample its table; timm's aimv2 models do, bicubic antialiased
        pos_embed_interp="bicubic", pos_embed_antialias=True)
    state = module.state_dict()
    ours = {"patch_embed.proj.weight": state["embeddings.patch_embed.weight"],
            "patch_embed.proj.bias": state["embeddings.patch_embed.bias"],
            "patch_embed.norm.weight": state["embeddings.rms_norm.weight"],
            "pos_embed": state["embeddings.position_embedding.weight"][None], "norm.weight": state["rms_norm.weight"]}
    for i in range(hf_cfg.num_hidden_layers):
        theirs, mine = f"encoder.layers.{i}.", f"blocks.{i}."
        ours[f"{mine}norm1.weight"] = state[f"{theirs}rms_norm1.weight"]
        ours[f"{mine}norm2.weight"] = state[f"{theirs}rms_norm2.weight"]
        for kind in ("weight", "bias"):
            if f"{theirs}attention.q_proj.{kind}" in state:
                ours[f"{mine}attn.qkv.{kind}"] = torch.cat([state[f"{theirs}attention.{p}_proj.{kind}"]
                                                           for p in "qkv"])
            if f"{theirs}attention.out_proj.{kind}" in state:
                ours[f"{mine}attn.proj.{kind}"] = state[f"{theirs}attention.out_proj.{kind}"]
        parts = {f"{part}.{kind}": state[f"{theirs}ffn.{part}_proj.{kind}"] for part in ("gate", "up", "down")
                 for kind in ("weight", "bias") if f"{theirs}ffn.{part}_proj.{kind}" in state}
        ours.update(ours_from_gated(parts, f"{mine}mlp.", "swiglu"))
    encoder.load_state_dict({k: v.detach().float().clone() for k, v in ours.items()}, strict=True)
    return encoder.eval()

