"""Our RoPE ViT to and from transformers' `DINOv3ViTModel` (`--to hf --hf-arch dinov3`, `hf:<dir>`), exact in fp32.

DINOv3ViTModel has separate q / k / v projections (k without bias, as ours: a RoPE model here masks the key part of the
fused qkv bias, so it is dropped on export; a checkpoint with a nonzero key bias is refused on import, since with RoPE a
key bias rotates with the key's position and changes the output), layer scale in every block (ones where ours has none:
exact), a mask token in its embeddings (ours is the objective's: written as zeros, dropped on import), the class token
then the registers in front, the final norm on every token and the class token as `pooler_output`. Its RoPE is DINOv3's
with periods from `rope_theta` and coordinates over each side; the training-time shift / jitter / rescale are its
`pos_embed_*`.
"""

from __future__ import annotations

import torch
from packaging.version import Version

from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.interop.hf_mlp import GATED, gated_parts, ours_from_gated

MIN_TRANSFORMERS = "5.4"

# ours -> transformers, per block (Linear weights and biases alike); the MLP: a plain one's fc1 / fc2 are up_proj /
# down_proj, a gated one (use_gated_mlp: DINOv3 ViT-H+ / 7B) ssl_vit.interop.hf_mlp's gate / up / down
_BLOCK = (("norm1", "norm1"), ("norm2", "norm2"), ("attn.proj", "attention.o_proj"))
_PLAIN_MLP = (("mlp.fc1", "mlp.up_proj"), ("mlp.fc2", "mlp.down_proj"))
# What DINOv3ViTModel requires of an encoder config: key -> (value, why); the encoder's defaults where unset.
_REQUIRED = {"pos_embed": ("rope", "DINOv3ViTModel has rotary position embeddings only"),
             "class_token": (True, "DINOv3ViTModel has a class token"),
             "global_pool": ("token", "DINOv3ViTModel pools the class token"),
             "rope_normalize": ("separate", "DINOv3ViTModel normalises the coordinates over each side"),
             "rope_kind": ("dinov3", "DINOv3ViTModel has DINOv3's RoPE"),
             "stem": ("patch", "DINOv3ViTModel embeds pixel patches"),
             "dist_token": (False, "no distillation token"), "parallel_block": (False, "no parallel blocks"),
             "qk_norm": (False, "no QK-norm"), "pre_norm": (False, "no norm before the blocks"),
             "norm_bias": (True, "LayerNorms with biases"), "no_embed_class": (False, "nothing to place"),
             "norm_layer": ("layernorm", "LayerNorm"), "patch_norm": (False, "no norm of the patch embeddings"),
             "has_patch_bias": (True, "a patch-embedding bias"),
             "has_fc_norm": (False, "the final norm on every token")}


def dinov3_refusals(config: ViTConfig) -> list[str]:
    """What of an encoder config DINOv3ViTModel cannot hold (empty: it can)."""
    problems = [f"{key}={getattr(config, key)!r} ({why})" for key, (wanted, why) in _REQUIRED.items()
                if getattr(config, key) != wanted]
    if config.rope_min_period is not None:
        problems.append("rope_min_period / rope_max_period (DINOv3ViTConfig takes rope_theta periods only)")
    for key in ("img_size", "patch_size"):
        value = getattr(config, key)
        if isinstance(value, (list, tuple)) and len(set(value)) > 1:
            problems.append(f"{key}={list(value)} (square sizes only)")
    return problems


def check_layout() -> None:
    """transformers 5.4 moved DINOv3's blocks under `model.layer` (4.56-5.3: `layer`); only that layout is mapped."""
    import transformers  # heavy: transformers models only

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ValueError(f"DINOv3 transformers models need transformers>={MIN_TRANSFORMERS} (installed: "
                         f"{transformers.__version__}); pip install -U 'transformers>={MIN_TRANSFORMERS}'")


def dinov3_config(config: ViTConfig, hidden_act: str):
    """The DINOv3ViTConfig of an encoder config (`dinov3_refusals` empty); `hidden_act` transformers' name."""
    check_layout()
    from transformers import DINOv3ViTConfig  # heavy: transformers models only

    width = config.embed_dim
    side = config.img_size if isinstance(config.img_size, int) else config.img_size[0]
    patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    bias = config.qkv_bias
    return DINOv3ViTConfig(
        hidden_size=width, intermediate_size=config.mlp_hidden,
        num_hidden_layers=config.depth, num_attention_heads=config.num_heads, patch_size=patch, image_size=side,
        num_channels=config.in_chans, layer_norm_eps=config.norm_eps,
        hidden_act=hidden_act, rope_theta=config.rope_theta or 100.0,
        query_bias=bias, key_bias=False, value_bias=bias, proj_bias=config.proj_bias, mlp_bias=config.proj_bias,
        layerscale_value=config.layer_scale or 1.0, num_register_tokens=config.num_registers,
        pos_embed_shift=config.rope_shift, pos_embed_jitter=config.rope_jitter,
        pos_embed_rescale=config.rope_rescale, use_gated_mlp=config.mlp_kind in GATED)


def dinov3_state(state: dict, config: ViTConfig) -> dict:
    """Our state dict -> DINOv3ViTModel's."""
    width = config.embed_dim
    out = {"embeddings.cls_token": state["cls_token"], "embeddings.mask_token": torch.zeros(1, 1, width),
           "embeddings.register_tokens": state.get("reg_token", torch.zeros(1, 0, width)),
           "embeddings.patch_embeddings.weight": state["patch_embed.proj.weight"],
           "embeddings.patch_embeddings.bias": state["patch_embed.proj.bias"],
           "norm.weight": state["norm.weight"], "norm.bias": state["norm.bias"]}
    for i in range(config.depth):
        ours, theirs = f"blocks.{i}.", f"model.layer.{i}."
        for name, hf_name in _BLOCK + (() if config.mlp_kind in GATED else _PLAIN_MLP):
            for kind in ("weight", "bias"):
                if f"{ours}{name}.{kind}" in state:
                    out[f"{theirs}{hf_name}.{kind}"] = state[f"{ours}{name}.{kind}"]
        if config.mlp_kind in GATED:
            out.update({f"{theirs}mlp.{part.replace('.', '_proj.')}": value
                        for part, value in gated_parts(state, f"{ours}mlp.", config.mlp_kind).items()})
        q, k, v = state[f"{ours}attn.qkv.weight"].chunk(3)
        out.update({f"{theirs}attention.q_proj.weight": q, f"{theirs}attention.k_proj.weight": k,
                    f"{theirs}attention.v_proj.weight": v})
        if f"{ours}attn.qkv.bias" in state:
            q_bias, _, v_bias = state[f"{ours}attn.qkv.bias"].chunk(3)
            out.update({f"{theirs}attention.q_proj.bias": q_bias, f"{theirs}attention.v_proj.bias": v_bias})
        for index in (1, 2):
            out[f"{theirs}layer_scale{index}.lambda1"] = state.get(f"{ours}ls{index}.gamma", torch.ones(width))
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def from_dinov3(module, hf_cfg, act_layer: str) -> VisionTransformer:
    check_layout()
    """Our encoder from a DINOv3ViTModel, weights included (its mask token dropped); `act_layer` ours."""
    proj_bias, mlp_bias = getattr(hf_cfg, "proj_bias", True), getattr(hf_cfg, "mlp_bias", True)
    if proj_bias != mlp_bias:
        raise ValueError(f"proj_bias={proj_bias}, mlp_bias={mlp_bias}: ssl-vit's blocks have both biases or neither "
                         "(proj_bias)")
    gated = bool(getattr(hf_cfg, "use_gated_mlp", False))
    if hf_cfg.query_bias != hf_cfg.value_bias:
        raise ValueError(f"query_bias={hf_cfg.query_bias}, value_bias={hf_cfg.value_bias}: ssl-vit's qkv has all "
                         f"three biases or none")
    width, depth = hf_cfg.hidden_size, hf_cfg.num_hidden_layers
    state = module.state_dict()
    encoder = VisionTransformer(
        img_size=hf_cfg.image_size, patch_size=hf_cfg.patch_size, in_chans=hf_cfg.num_channels, embed_dim=width,
        depth=depth, num_heads=hf_cfg.num_attention_heads, mlp_dim=hf_cfg.intermediate_size,
        mlp_kind="swiglu" if gated else "mlp", proj_bias=bool(proj_bias),
        act_layer=act_layer, norm_eps=hf_cfg.layer_norm_eps, class_token=True,
        global_pool="token", num_registers=hf_cfg.num_register_tokens, pos_embed="rope", rope_theta=hf_cfg.rope_theta,
        rope_shift=hf_cfg.pos_embed_shift, rope_jitter=hf_cfg.pos_embed_jitter, rope_rescale=hf_cfg.pos_embed_rescale,
        qkv_bias=bool(hf_cfg.query_bias), layer_scale=float(hf_cfg.layerscale_value))
    ours = {"cls_token": state["embeddings.cls_token"], "norm.weight": state["norm.weight"],
            "norm.bias": state["norm.bias"], "patch_embed.proj.weight": state["embeddings.patch_embeddings.weight"],
            "patch_embed.proj.bias": state["embeddings.patch_embeddings.bias"]}
    if hf_cfg.num_register_tokens:
        ours["reg_token"] = state["embeddings.register_tokens"]
    for i in range(depth):
        theirs, mine = f"model.layer.{i}.", f"blocks.{i}."
        for name, hf_name in _BLOCK + (() if gated else _PLAIN_MLP):
            for kind in ("weight", "bias"):
                if f"{theirs}{hf_name}.{kind}" in state:
                    ours[f"{mine}{name}.{kind}"] = state[f"{theirs}{hf_name}.{kind}"]
        if gated:
            parts = {f"{part}.{kind}": state[f"{theirs}mlp.{part}_proj.{kind}"] for part in ("gate", "up", "down")
                     for kind in ("weight", "bias") if f"{theirs}mlp.{part}_proj.{kind}" in state}
            ours.update(ours_from_gated(parts, f"{mine}mlp.", "swiglu"))
        ours[f"{mine}attn.qkv.weight"] = torch.cat([state[f"{theirs}attention.{p}_proj.weight"] for p in "qkv"])
        if hf_cfg.query_bias:
            k_bias = state.get(f"{theirs}attention.k_proj.bias", torch.zeros(width))
            if k_bias.count_nonzero():
                raise ValueError(f"{theirs}attention.k_proj.bias is nonzero (key_bias=True): ssl-vit's RoPE "
                                 "attention has no key bias (DINOv3's), so this checkpoint cannot be imported exactly")
            ours[f"{mine}attn.qkv.bias"] = torch.cat([state[f"{theirs}attention.q_proj.bias"], k_bias,
                                                      state[f"{theirs}attention.v_proj.bias"]])
        for index in (1, 2):
            ours[f"{mine}ls{index}.gamma"] = state[f"{theirs}layer_scale{index}.lambda1"]
    encoder.load_state_dict(ours, strict=True)
    return encoder.eval()
