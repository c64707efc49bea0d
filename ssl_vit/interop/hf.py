"""Our ViT to and from transformers: `ViTModel`, `Dinov2Model` (`Dinov2WithRegistersModel` with registers),
`CLIPVisionModel(WithProjection)`, `SiglipVisionModel` and `DINOv3ViTModel` (RoPE encoders: ssl_vit.interop.hf_dinov3),
exact in fp32 both ways.

Export writes a `save_pretrained` directory (config.json, model.safetensors, preprocessor_config.json) whose weights
carry transformers 4.x names (`vision_model.` for CLIP / SigLIP, `encoder.layer.i.attention.attention.query` for
ViT / DINOv2): 4.37+ and 5.x load them exactly (5.x converts them on load; 5.x's own `save_pretrained` names load
in 4.x as random weights with only a warning). eps and the activation are written explicitly (HF's defaults
differ: ViTConfig eps 1e-12, CLIPVisionConfig quick_gelu, SigLIP tanh-GELU). What each target holds:

    target  class token  registers  pre-norm  final norm                      layer scale     pooler_output
    vit     required     no         no        all tokens (`layernorm`)        folded (exact)  our embedding (*)
    dinov2  required     yes        no        all tokens (`layernorm`)        `lambda1`       our embedding
    clip    required     no         required  pooled class token only         folded (exact)  our embedding
    siglip  none         no         no        all tokens (our `fc_norm`) (**) folded (exact)  none (no MAP head)
    siglip2 as siglip; NaFlex: flat patches (`Siglip2VisionModel`), bilinear antialiased position resampling

(*) ViT's pooler is written as the identity (dense = I, `pooler_act` linear). (**) Our average-pooling models
normalise after pooling; SigLIP normalises every token: its `last_hidden_state` is `fc_norm` of each token, and
`hidden_states` are exactly ours. QK-norm and parallel blocks fit none of them (timm, ONNX and safetensors take
every option). A patch-embedding bias folds into CLIP's position embeddings; position embeddings without the class
slot (`no_embed_class`) become a zero class slot, register position embeddings fold into the register tokens.

Import (`from_hf`) loads a directory with the installed transformers (any saved version, sharded or not) and maps
its weights back; the result resamples position embeddings as transformers does (bicubic; antialiased only for
Dinov2WithRegisters).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ssl_vit.artifacts import file_fingerprint
from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.backbone.mlp import dinov2_swiglu_hidden
from ssl_vit.extras import require
from ssl_vit.files import save_safetensors
from ssl_vit.interop.hf_aimv2 import aimv2_config, aimv2_refusals, aimv2_state, from_aimv2
from ssl_vit.interop.hf_dinov3 import dinov3_config, dinov3_refusals, dinov3_state, from_dinov3
from ssl_vit.interop.hf_mlp import GATED, gated_parts, ours_from_gated
from ssl_vit.interop.native import NativeEncoder, from_hf_native, not_a_vit
from ssl_vit.preprocess import Preprocess

HF_ARCHS = ("vit", "dinov2", "clip", "siglip", "siglip2", "dinov3", "aimv2")
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu", "silu": "silu"}
# transformers activation names -> ours (gelu_new is the same tanh formula as gelu_pytorch_tanh)
FROM_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                       "gelu_new": "gelu_tanh", "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"}

# Per-block names: (ours, transformers 4.x, transformers 5.x in-memory); q / k / v are the thirds of our qkv.
_VIT_ATTENTION = (("q", "attention.attention.query", "attention.q_proj"),
                  ("k", "attention.attention.key", "attention.k_proj"),
                  ("v", "attention.attention.value", "attention.v_proj"),
                  ("attn.proj", "attention.output.dense", "attention.o_proj"))
_VIT_BLOCK = (("norm1", "layernorm_before", "layernorm_before"), ("norm2", "layernorm_after", "layernorm_after"),
              *_VIT_ATTENTION, ("mlp.fc1", "intermediate.dense", "mlp.fc1"), ("mlp.fc2", "output.dense", "mlp.fc2"))
_DINOV2_BLOCK = (("norm1", "norm1", "norm1"), ("norm2", "norm2", "norm2"), *_VIT_ATTENTION,
                 ("mlp.fc1", "mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2", "mlp.fc2"))
_CLIP_BLOCK = (("norm1", "layer_norm1", "layer_norm1"), ("norm2", "layer_norm2", "layer_norm2"),
               ("q", "self_attn.q_proj", "self_attn.q_proj"), ("k", "self_attn.k_proj", "self_attn.k_proj"),
               ("v", "self_attn.v_proj", "self_attn.v_proj"), ("attn.proj", "self_attn.out_proj", "self_attn.out_proj"),
               ("mlp.fc1", "mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2", "mlp.fc2"))
# arch -> (block names, 4.x block prefix, 5.x block prefix, 4.x global prefix)
_LAYOUTS = {
    "vit": (_VIT_BLOCK, "encoder.layer.{i}.", "layers.{i}.", ""),
    "dinov2": (_DINOV2_BLOCK, "encoder.layer.{i}.", "encoder.layer.{i}.", ""),
    "clip": (_CLIP_BLOCK, "encoder.layers.{i}.", "encoder.layers.{i}.", "vision_model."),
    "siglip": (_CLIP_BLOCK, "encoder.layers.{i}.", "encoder.layers.{i}.", "vision_model."),
    "siglip2": (_CLIP_BLOCK, "encoder.layers.{i}.", "encoder.layers.{i}.", "vision_model."),
}
_OTHER_TARGETS = "timm, onnx and safetensors export every option"


def _side(value) -> int:
    """The side of a square size given as an int or a pair (refusals() has checked it is square)."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def refusals(config: ViTConfig, arch: str) -> list[str]:
    """What `arch` cannot represent in an encoder config, each naming the option and the targets that take it."""
    if arch == "dinov3":
        return dinov3_refusals(config)
    if arch == "aimv2":
        return aimv2_refusals(config)
    problems = []
    if config.mlp_kind != "mlp" and arch != "dinov2":
        problems.append(f"mlp_kind={config.mlp_kind!r} ({arch} has a plain MLP; SwiGLU models export as --hf-arch "
                        "dinov2, dinov3 or aimv2)")
    if config.norm_layer != "layernorm":
        problems.append(f"norm_layer={config.norm_layer!r} ({arch} has LayerNorms; RMSNorm models export as --hf-arch "
                        "aimv2)")
    if not config.proj_bias or config.patch_norm:
        problems.append(f"proj_bias={config.proj_bias}, patch_norm={config.patch_norm} ({arch} has output and MLP "
                        "biases and no norm of the patch embeddings; --hf-arch aimv2 has neither)")
    if config.global_pool == "map" and arch not in ("siglip", "siglip2"):
        problems.append("global_pool='map' (of these, only --hf-arch siglip / siglip2 have a MAP head)")
    if config.global_pool == "map" and ((config.pool_heads or config.num_heads) != config.num_heads
                                        or (config.pool_mlp_dim or config.mlp_hidden) != config.mlp_hidden):
        problems.append(f"pool_heads={config.pool_heads}, pool_mlp_dim={config.pool_mlp_dim} (SigLIP's head has the "
                        "blocks' heads and MLP width)")
    if config.pos_embed in ("rope", "none"):
        problems.append(f"pos_embed={config.pos_embed!r} ({arch} adds learned position embeddings; a RoPE encoder "
                        "exports as --hf-arch dinov3)")
    if config.pos_embed == "learned_rope":
        problems.append("pos_embed='learned_rope' (Perception Encoder: transformers has no vision model with a "
                        "learned table and RoPE together, PerceptionLM loads PE through timm; --to timm holds it)")
    if config.stem != "patch":
        problems.append(f"stem={config.stem!r} (transformers 5 has no hybrid ViT: 4.x moved ViTHybrid to "
                        "deprecated; --to timm takes timm's hybrids, onnx and safetensors any stem)")
    if config.parallel_block:
        problems.append("parallel_block=True (no transformers vision model has parallel blocks)")
    if config.dist_token:
        problems.append("dist_token=True (transformers' DeiT with a distillation token is not an export target here)")
    if config.qk_norm:
        problems.append("qk_norm=True (no transformers ViT-family model has QK-norm; open_clip does)")
    if config.num_registers and arch != "dinov2":
        problems.append(f"num_registers={config.num_registers} (of these, only --hf-arch dinov2 has registers)")
    class_token, pool = config.class_token, config.global_pool
    if arch == "siglip2" and (config.pos_embed_interp != "bilinear"
                              or not config.pos_embed_antialias):
        problems.append(f"pos_embed_interp={config.pos_embed_interp!r}, pos_embed_antialias="
                        f"{config.pos_embed_antialias} (SigLIP 2 resamples its position grid bilinear "
                        "antialiased for each image: train with model.pos_embed_interp=bilinear)")
    if arch in ("siglip", "siglip2"):
        if class_token:
            problems.append("class_token=True (SigLIP has no class token; use --hf-arch vit, dinov2 or clip)")
    elif not class_token or pool != "token":
        problems.append(f"class_token={class_token}, global_pool={pool!r} ({arch} pools the class token; an "
                        "average-pooled model without class token exports as --hf-arch siglip)")
    elif config.has_fc_norm:
        problems.append(f"fc_norm=True ({arch} normalises every token before it pools the class token)")
    if arch == "clip" and not config.pre_norm:
        problems.append("pre_norm=False (CLIP normalises before the blocks: pre_layrnorm; use --hf-arch vit or dinov2)")
    if arch != "clip" and config.pre_norm:
        problems.append(f"pre_norm=True ({arch} has no norm before the blocks; use --hf-arch clip)")
    if arch == "dinov2" and config.mlp_kind in GATED:
        if _dinov2_swiglu_ratio(config) is None:
            problems.append(f"mlp_dim={config.mlp_hidden} (Dinov2's SwiGLU is 2/3 of width x an integer mlp_ratio, "
                            "rounded up to a multiple of 8)")
        if config.act_layer != "silu" or not config.proj_bias:
            problems.append(f"act_layer={config.act_layer!r} (Dinov2's SwiGLU gates with SiLU, with biases)")
    elif arch == "dinov2" and config.mlp_hidden % config.embed_dim:
        problems.append(f"mlp_dim={config.mlp_hidden} (Dinov2Config takes width x an integer mlp_ratio)")
    for key in ("img_size", "patch_size"):
        value = getattr(config, key)
        if isinstance(value, (list, tuple)) and len(set(value)) > 1:
            problems.append(f"{key}={list(value)} (transformers' vision configs take square sizes)")
    return problems


def _dinov2_swiglu_ratio(config: ViTConfig) -> int | None:
    """The (integer) Dinov2Config mlp_ratio whose SwiGLU width (dinov2_swiglu_hidden) is ours, or None."""
    return next((ratio for ratio in range(1, 17)
                 if dinov2_swiglu_hidden(config.embed_dim, ratio) == config.mlp_hidden), None)


def default_arch(config: ViTConfig) -> str:
    """The transformers class an encoder maps to most directly: DINOv3 for RoPE, AIMv2 for RMSNorm, CLIP for
    pre-norm models, DINOv2 for layer scale, registers or SwiGLU, SigLIP without a class token, ViT otherwise."""
    if config.pos_embed == "rope":
        return "dinov3"
    if config.norm_layer == "rmsnorm":
        return "aimv2"
    if config.mlp_kind in GATED:
        return "dinov2"
    if config.pre_norm:
        return "clip"
    if not config.class_token:
        return "siglip"
    if config.num_registers or config.layer_scale is not None:
        return "dinov2"
    return "vit"


def hf_config(config: ViTConfig, arch: str, projection_dim: int | None = None):
    """The transformers config of our encoder as `arch` (ValueError naming everything `arch` cannot hold)."""
    transformers = require("transformers", "a transformers export (--to hf)")

    if arch not in HF_ARCHS:
        raise ValueError(f"unknown transformers target {arch!r}; valid choices: {list(HF_ARCHS)}")
    problems = refusals(config, arch)
    if problems:
        raise ValueError(f"transformers {arch} cannot represent this encoder: " + "; ".join(problems)
                         + f". {_OTHER_TARGETS}.")
    if arch == "dinov3":
        return dinov3_config(config, HF_ACTIVATIONS[config.act_layer])
    if arch == "aimv2":
        return aimv2_config(config, HF_ACTIVATIONS[config.act_layer])
    width = config.embed_dim
    mlp_dim = config.mlp_hidden
    common = dict(hidden_size=width, num_hidden_layers=config.depth, num_attention_heads=config.num_heads,
                  num_channels=config.in_chans, image_size=_side(config.img_size),
                  patch_size=_side(config.patch_size),
                  hidden_act=HF_ACTIVATIONS[config.act_layer],
                  layer_norm_eps=config.norm_eps)
    if arch == "vit":
        return transformers.ViTConfig(**common, intermediate_size=mlp_dim, qkv_bias=True, pooler_act="linear",
                                      pooler_output_size=width, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, architectures=["ViTModel"])
    if arch == "dinov2":
        registers = config.num_registers
        swiglu = config.mlp_kind in GATED
        kwargs = dict(common, mlp_ratio=_dinov2_swiglu_ratio(config) if swiglu else mlp_dim // width, qkv_bias=True,
                      use_swiglu_ffn=swiglu,
                      layerscale_value=config.layer_scale or 1.0, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
        if registers:
            if not hasattr(transformers, "Dinov2WithRegistersConfig"):
                raise ValueError(f"num_registers={registers}: this transformers {transformers.__version__} has no "
                                 "Dinov2WithRegistersModel (4.48+)")
            return transformers.Dinov2WithRegistersConfig(**kwargs, num_register_tokens=registers,
                                                           architectures=["Dinov2WithRegistersModel"])
        return transformers.Dinov2Config(**kwargs, architectures=["Dinov2Model"])
    if arch == "clip":
        return transformers.CLIPVisionConfig(**common, intermediate_size=mlp_dim, attention_dropout=0.0,
                                             projection_dim=projection_dim or width,
                                             architectures=["CLIPVisionModelWithProjection" if projection_dim
                                                            else "CLIPVisionModel"])
    if arch == "siglip2":
        common.pop("image_size")
        return transformers.Siglip2VisionConfig(**common, intermediate_size=mlp_dim, attention_dropout=0.0,
                                                num_patches=(_side(config.img_size) // common["patch_size"]) ** 2,
                                                vision_use_head=config.global_pool == "map",
                                                architectures=["Siglip2VisionModel"])
    return transformers.SiglipVisionConfig(**common, intermediate_size=mlp_dim, attention_dropout=0.0,
                                           vision_use_head=config.global_pool == "map",
                                           architectures=["SiglipVisionModel"])


def hf_state(state: dict, config: ViTConfig, arch: str, projection: torch.Tensor | None = None) -> dict:
    """Our encoder state dict under `arch`'s transformers 4.x names (which 5.x loads too)."""
    width, depth = config.embed_dim, config.depth
    block_names, block4, _, prefix = _LAYOUTS[arch]
    registers = config.num_registers
    out = {}

    def get(name: str, size: int | None = None, fill: float = 0.0) -> torch.Tensor:
        return state[name] if name in state else torch.full((size or width,), fill)

    def norm(target: str, source: str) -> None:
        out[f"{target}.weight"], out[f"{target}.bias"] = state[f"{source}.weight"], get(f"{source}.bias")

    # position embeddings with exactly one (class) prefix slot, or none (SigLIP)
    pos = state["pos_embed"][0].clone()
    pos_prefix = 0 if config.no_embed_class else int(config.class_token) + registers
    patch_pos = pos[pos_prefix:]
    class_pos = pos[:1] if pos_prefix else torch.zeros(1, width)
    reg_pos = pos[1:pos_prefix] if pos_prefix else torch.zeros(registers, width)
    patch_bias = state.get("patch_embed.proj.bias")
    for i in range(depth):
        ours, theirs = f"blocks.{i}.", block4.format(i=i)
        qkv_w, qkv_b = state[f"{ours}attn.qkv.weight"], get(f"{ours}attn.qkv.bias", 3 * width)
        gammas = [get(f"{ours}ls{j}.gamma", fill=1.0) for j in (1, 2)]
        fold = arch != "dinov2"
        gated = config.mlp_kind in GATED
        if gated:  # DINOv2's SwiGLU under its 4.x names: weights_in = [gate | up] (5.x splits it on load)
            parts = gated_parts(state, f"{ours}mlp.", config.mlp_kind)
            for kind in ("weight", "bias"):
                out[f"{theirs}mlp.weights_in.{kind}"] = torch.cat([parts[f"gate.{kind}"], parts[f"up.{kind}"]])
                out[f"{theirs}mlp.weights_out.{kind}"] = parts[f"down.{kind}"]
        for mine, hf, _ in block_names:
            if gated and mine.startswith("mlp."):
                continue
            if mine in ("q", "k", "v"):
                j = "qkv".index(mine)
                out[f"{theirs}{hf}.weight"] = qkv_w[j * width:(j + 1) * width]
                out[f"{theirs}{hf}.bias"] = qkv_b[j * width:(j + 1) * width]
            elif mine.startswith("norm"):
                norm(theirs + hf, ours + mine)
            else:
                weight, bias = state[f"{ours}{mine}.weight"], state[f"{ours}{mine}.bias"]
                gamma = gammas[0] if mine == "attn.proj" else gammas[1] if mine == "mlp.fc2" else None
                if fold and gamma is not None:  # gamma * (W x + b) = (gamma W) x + gamma b
                    weight, bias = weight * gamma[:, None], bias * gamma
                out[f"{theirs}{hf}.weight"], out[f"{theirs}{hf}.bias"] = weight, bias
        if not fold:
            out[f"{theirs}layer_scale1.lambda1"], out[f"{theirs}layer_scale2.lambda1"] = gammas
    if arch in ("vit", "dinov2"):
        out["embeddings.cls_token"] = state["cls_token"]
        out["embeddings.position_embeddings"] = torch.cat([class_pos, patch_pos])[None]
        out["embeddings.patch_embeddings.projection.weight"] = state["patch_embed.proj.weight"]
        out["embeddings.patch_embeddings.projection.bias"] = patch_bias
        norm("layernorm", "norm")
        if arch == "vit":  # the pooler as the identity: pooler_output = the class token after the final norm
            out["pooler.dense.weight"], out["pooler.dense.bias"] = torch.eye(width), torch.zeros(width)
        else:
            out["embeddings.mask_token"] = torch.zeros(1, width)
            if registers:
                out["embeddings.register_tokens"] = state["reg_token"] + reg_pos[None]
    elif arch == "clip":
        out["embeddings.class_embedding"] = state["cls_token"].reshape(width)
        out["embeddings.patch_embedding.weight"] = state["patch_embed.proj.weight"]
        if patch_bias is not None:  # CLIP's conv has no bias: the same constant on every patch slot
            patch_pos = patch_pos + patch_bias
        out["embeddings.position_embedding.weight"] = torch.cat([class_pos, patch_pos])
        norm("pre_layrnorm", "norm_pre")
        norm("post_layernorm", "norm")
    else:  # SigLIP 2's patch embedding is a linear layer over flat (row, column, channel) patches
        weight = state["patch_embed.proj.weight"]
        flat = arch == "siglip2"
        out["embeddings.patch_embedding.weight"] = weight.permute(0, 2, 3, 1).flatten(1) if flat else weight
        out["embeddings.patch_embedding.bias"] = patch_bias if patch_bias is not None else torch.zeros(width)
        out["embeddings.position_embedding.weight"] = patch_pos
        norm("post_layernorm", "fc_norm" if config.has_fc_norm else "norm")
        if config.global_pool == "map":
            out.update(_siglip_head(state, width))
    tensors = {prefix + k: v.detach().float().contiguous().clone() for k, v in out.items()}
    if projection is not None:  # CLIPVisionModelWithProjection's image_embeds
        tensors["visual_projection.weight"] = projection.detach().float().contiguous().clone()
    return tensors


# Our MAP head's names -> SigLIP's `head` (its q and kv are the thirds of nn.MultiheadAttention's in_proj)
_SIGLIP_HEAD = (("latent", "probe"), ("proj.weight", "attention.out_proj.weight"),
                ("proj.bias", "attention.out_proj.bias"),
                *((f"{ours}.{kind}", f"{theirs}.{kind}") for ours, theirs in
                  (("norm", "layernorm"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"))
                  for kind in ("weight", "bias")))


def _siglip_head(state: dict, width: int) -> dict:
    """Our MAP head -> SigLIP's `head`."""
    head = {f"head.{theirs}": state[f"attn_pool.{ours}"] for ours, theirs in _SIGLIP_HEAD}
    for kind in ("weight", "bias"):
        head[f"head.attention.in_proj_{kind}"] = torch.cat([state[f"attn_pool.q.{kind}"],
                                                            state[f"attn_pool.kv.{kind}"]])
    return head


def _our_map_head(state: dict, width: int) -> dict:
    """SigLIP's `head` -> our MAP head."""
    ours = {f"attn_pool.{mine}": state[f"head.{theirs}"] for mine, theirs in _SIGLIP_HEAD}
    for kind in ("weight", "bias"):
        packed = state[f"head.attention.in_proj_{kind}"]
        ours[f"attn_pool.q.{kind}"], ours[f"attn_pool.kv.{kind}"] = packed[:width], packed[width:]
    return ours


def processor_config(preprocess) -> dict:
    """CLIPImageProcessor settings that reproduce our eval transform (shorter side to img_size / crop_pct, centre
    crop, rescale, normalise; or, with resize_mode "squash", both sides to img_size without a crop) for every target:
    ViT's and SigLIP's own processors have no centre crop."""
    size = preprocess.img_size
    if preprocess.resize_mode == "squash":
        resize = {"size": {"height": size, "width": size}, "do_center_crop": False}
    else:
        resize = {"size": {"shortest_edge": int(size / preprocess.crop_pct) if preprocess.crop_pct < 1 else size},
                  "do_center_crop": True}
    return {"image_processor_type": "CLIPImageProcessor", "do_resize": True, **resize,
            "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(preprocess.mean), "image_std": list(preprocess.std),
            "resample": {"bilinear": 2, "bicubic": 3, "nearest": 0}[preprocess.interpolation], "do_convert_rgb": True}


def export_hf(encoder, out_dir: str | Path, arch: str | None = None, projection: torch.Tensor | None = None,
              preprocess=None) -> Path:
    """Write `encoder` as a transformers `arch` directory (default: `default_arch`); `projection` (CLIP only) becomes
    `visual_projection`, `preprocess` (default: ours at the encoder's size) the preprocessor_config.json."""
    config = encoder.config
    arch = arch or default_arch(config)
    if projection is not None and arch != "clip":
        raise ValueError(f"an image-text projection goes into --hf-arch clip only, not {arch}")
    hf = hf_config(config, arch, projection.shape[0] if projection is not None else None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out_dir)
    writer = {"dinov3": dinov3_state, "aimv2": aimv2_state}.get(arch)
    state = writer(encoder.state_dict(), config) if writer else hf_state(encoder.state_dict(), config, arch, projection)
    save_safetensors(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    if preprocess is None:  # nothing recorded: our eval transform's defaults at the encoder's size
        preprocess = Preprocess(img_size=_side(config.img_size))
    processor = (siglip2_processor_config(preprocess, hf.patch_size, hf.num_patches) if arch == "siglip2"
                 else processor_config(preprocess))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return out_dir


def siglip2_processor_config(preprocess, patch_size: int, max_num_patches: int) -> dict:
    """Siglip2ImageProcessor settings: each image resized (aspect kept) to at most `max_num_patches` patches and
    patchified, normalised with our statistics."""
    resample = {"nearest": 0, "bilinear": 2, "bicubic": 3}[preprocess.interpolation]
    return {"image_processor_type": "Siglip2ImageProcessor", "patch_size": patch_size,
            "max_num_patches": max_num_patches, "do_resize": True, "resample": resample, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(preprocess.mean),
            "image_std": list(preprocess.std), "do_convert_rgb": True}


# ----- import -----
_MODEL_TYPES = {"vit": "vit", "dinov2": "dinov2", "dinov2_with_registers": "dinov2", "clip_vision_model": "clip",
                "clip": "clip", "siglip_vision_model": "siglip", "siglip": "siglip", "dinov3_vit": "dinov3",
                "siglip2_vision_model": "siglip2", "siglip2": "siglip2", "aimv2_vision_model": "aimv2",
                "aimv2": "aimv2"}


def _arch_of(hf_cfg) -> str:
    arch = _MODEL_TYPES.get(hf_cfg.model_type)
    if arch is None:
        raise ValueError(f"transformers model_type {hf_cfg.model_type!r} cannot be imported; supported: "
                         f"{sorted(_MODEL_TYPES)}")
    return arch


def load_hf_vision(path: str | Path):
    """(the vision transformer module, its config, our arch name) of a transformers directory; CLIP / SigLIP
    image-text directories give their vision tower."""
    transformers = require("transformers", "a transformers model (hf:)")

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a transformers model directory (no config.json)")
    hf_cfg = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)  # never a directory's own code
    arch = _arch_of(hf_cfg)
    if hf_cfg.model_type in ("clip", "siglip", "siglip2", "clip_vision_model", "aimv2"):  # an image-text model's tower
        with_projection = "CLIPVisionModelWithProjection" in (hf_cfg.architectures or [])
        cls = transformers.CLIPVisionModelWithProjection if with_projection else \
            transformers.CLIPVisionModel if arch == "clip" else transformers.Aimv2VisionModel if arch == "aimv2" \
            else transformers.Siglip2VisionModel if arch == "siglip2" else transformers.SiglipVisionModel
        model = cls.from_pretrained(path)
    else:
        model = transformers.AutoModel.from_pretrained(path, trust_remote_code=False)
    model = model.eval()
    return getattr(model, "vision_model", model), model.config, arch


def from_hf(path: str | Path):
    """Our encoder from a transformers ViTModel / Dinov2Model / Dinov2WithRegistersModel / CLIPVisionModel /
    SiglipVisionModel directory (or a CLIP / SigLIP model's vision tower), weights included. Dropped: ViT's pooler
    (dense + tanh on the class token) and SigLIP's attention-pooling head; every token output is exact."""
    module, hf_cfg, arch = load_hf_vision(path)
    state = module.state_dict()
    act = FROM_HF_ACTIVATIONS.get(hf_cfg.hidden_act)
    if act is None:
        raise ValueError(f"{path}: hidden_act {hf_cfg.hidden_act!r} has no equivalent here; supported: "
                         f"{sorted(FROM_HF_ACTIVATIONS)}")
    if arch in ("dinov3", "aimv2"):
        try:
            return (from_dinov3 if arch == "dinov3" else from_aimv2)(module, hf_cfg, act)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    swiglu = bool(getattr(hf_cfg, "use_swiglu_ffn", False))  # DINOv2-g: SiLU-gated, its packed layout
    head = arch in ("siglip", "siglip2") and bool(getattr(hf_cfg, "vision_use_head", False))
    width, depth = hf_cfg.hidden_size, hf_cfg.num_hidden_layers
    registers = getattr(hf_cfg, "num_register_tokens", 0) if arch == "dinov2" else 0
    mlp_dim = (dinov2_swiglu_hidden(width, hf_cfg.mlp_ratio) if swiglu else int(width * hf_cfg.mlp_ratio)
               if arch == "dinov2" else hf_cfg.intermediate_size)
    patch = hf_cfg.patch_size
    siglip = arch in ("siglip", "siglip2")
    # SigLIP 2 keeps a square grid of num_patches position embeddings
    size = int(round(hf_cfg.num_patches ** 0.5)) * _side(patch) if arch == "siglip2" else hf_cfg.image_size
    kwargs = dict(img_size=size, patch_size=patch, in_chans=hf_cfg.num_channels, embed_dim=width, depth=depth,
                  num_heads=hf_cfg.num_attention_heads, mlp_dim=mlp_dim, norm_eps=hf_cfg.layer_norm_eps,
                  mlp_kind="swiglu_packed" if swiglu else "mlp", act_layer="silu" if swiglu else act,
                  # SigLIP: post_layernorm on every token, then its MAP head (ours: the final norm, global_pool=map);
                  # without a head, the token mean normalised after pooling (fc_norm) gives its tokens exactly
                  class_token=not siglip, global_pool="map" if head else "avg" if siglip else "token",
                  num_registers=registers, pre_norm=arch == "clip", layer_scale=None,
                  # transformers' interpolate_pos_encoding: bicubic, antialiased only in Dinov2WithRegisters (as the
                  # original DINOv2 register models: interpolate_antialias=True)
                  pos_embed_interp="bicubic", pos_embed_antialias=hf_cfg.model_type == "dinov2_with_registers")
    if arch == "dinov2":
        kwargs["layer_scale"] = float(hf_cfg.layerscale_value)
    if arch == "siglip2":  # resize_positional_embeddings: F.interpolate bilinear, antialiased, per image
        kwargs.update(pos_embed_interp="bilinear", pos_embed_antialias=True)
    try:
        ours = _our_state(state, arch, width, depth, registers, swiglu)
        if head:
            ours.update(_our_map_head(state, width))
            ours["norm.weight"], ours["norm.bias"] = ours.pop("fc_norm.weight"), ours.pop("fc_norm.bias")
    except KeyError as err:
        raise ValueError(f"{path}: a {type(module).__name__} without the weight {err} (a layout this import does "
                         f"not know; supported: {sorted(_MODEL_TYPES)})") from None
    encoder = VisionTransformer(**kwargs)
    if arch == "siglip2":  # a linear layer over flat (row, column, channel) patches -> our conv kernel
        kernel = encoder.patch_embed.proj.weight
        ours["patch_embed.proj.weight"] = ours["patch_embed.proj.weight"].reshape(
            len(kernel), *kernel.shape[2:], kernel.shape[1]).permute(0, 3, 1, 2)
    if "patch_embed.proj.bias" in encoder.state_dict() and "patch_embed.proj.bias" not in ours:
        ours["patch_embed.proj.bias"] = torch.zeros(width)
    encoder.load_state_dict(ours, strict=True)
    return encoder.eval()


def _our_state(state: dict, arch: str, width: int, depth: int, registers: int, swiglu: bool = False) -> dict:
    """transformers weights (5.x in-memory names, or 4.x names) -> ours; `swiglu`: DINOv2's SwiGLU MLP."""
    block_names, block4, block5, _ = _LAYOUTS[arch]

    def pick(i: int, hf4: str, hf5: str, kind: str) -> torch.Tensor:
        new, old = f"{block5.format(i=i)}{hf5}.{kind}", f"{block4.format(i=i)}{hf4}.{kind}"
        return state[new] if new in state else state[old]

    ours = {}
    for i in range(depth):
        mine_prefix = f"blocks.{i}."
        if swiglu:
            parts = {f"{part}.{kind}": state[f"{block5.format(i=i)}mlp.{part}_proj.{kind}"]
                     for part in ("gate", "up", "down") for kind in ("weight", "bias")}
            ours.update(ours_from_gated(parts, f"{mine_prefix}mlp.", "swiglu_packed"))
        for mine, hf4, hf5 in block_names:
            if swiglu and mine.startswith("mlp."):
                continue
            if mine not in ("q", "k", "v"):
                for kind in ("weight", "bias"):
                    ours[f"{mine_prefix}{mine}.{kind}"] = pick(i, hf4, hf5, kind)
        qkv = [(hf4, hf5) for mine, hf4, hf5 in block_names if mine in ("q", "k", "v")]
        for kind in ("weight", "bias"):
            ours[f"{mine_prefix}attn.qkv.{kind}"] = torch.cat([pick(i, hf4, hf5, kind) for hf4, hf5 in qkv])
        if arch == "dinov2":
            for j in (1, 2):
                ours[f"{mine_prefix}ls{j}.gamma"] = pick(i, f"layer_scale{j}", f"layer_scale{j}", "lambda1")
    if arch in ("vit", "dinov2"):
        ours["cls_token"] = state["embeddings.cls_token"]
        pos = state["embeddings.position_embeddings"]
        if registers:  # our register slots get zero position embeddings (DINOv2 adds none to them)
            pos = torch.cat([pos[:, :1], torch.zeros(1, registers, width), pos[:, 1:]], dim=1)
            ours["reg_token"] = state["embeddings.register_tokens"]
        ours["pos_embed"] = pos
        ours["patch_embed.proj.weight"] = state["embeddings.patch_embeddings.projection.weight"]
        ours["patch_embed.proj.bias"] = state["embeddings.patch_embeddings.projection.bias"]
        ours["norm.weight"], ours["norm.bias"] = state["layernorm.weight"], state["layernorm.bias"]
    elif arch == "clip":
        ours["cls_token"] = state["embeddings.class_embedding"].reshape(1, 1, width)
        ours["pos_embed"] = state["embeddings.position_embedding.weight"][None]
        ours["patch_embed.proj.weight"] = state["embeddings.patch_embedding.weight"]
        ours["norm_pre.weight"], ours["norm_pre.bias"] = state["pre_layrnorm.weight"], state["pre_layrnorm.bias"]
        ours["norm.weight"], ours["norm.bias"] = state["post_layernorm.weight"], state["post_layernorm.bias"]
    else:
        ours["pos_embed"] = state["embeddings.position_embedding.weight"][None]
        ours["patch_embed.proj.weight"] = state["embeddings.patch_embedding.weight"]
        ours["patch_embed.proj.bias"] = state["embeddings.patch_embedding.bias"]
        ours["fc_norm.weight"], ours["fc_norm.bias"] = state["post_layernorm.weight"], state["post_layernorm.bias"]
    return {k: v.detach().float().clone() for k, v in ours.items()}


def load_hf_dir(rest: str, native: str = "never") -> tuple[VisionTransformer | NativeEncoder, Preprocess | None,
                                                          dict]:
    """(encoder, its preprocessing from preprocessor_config.json, identity) of `hf:<dir>`; `native` as
    load_pretrained's (a model type that does not convert runs through transformers' AutoModel)."""
    path = Path(rest).expanduser()
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))  # every shard of a sharded model
    identity = {"hf": [file_fingerprint(w) for w in weights]}
    model_type = _model_type(path)
    if native == "always" or (native == "fallback" and model_type not in _MODEL_TYPES):
        transformers = require("transformers", "a transformers model (hf:)")
        encoder = from_hf_native(transformers.AutoModel.from_pretrained(path, trust_remote_code=False).eval())
        return encoder, hf_preprocess(path, encoder.img_size), {**identity, "native": True}
    if model_type not in _MODEL_TYPES:
        raise not_a_vit(f"hf:{rest}", f"a transformers {model_type!r} model (supported ViTs: {sorted(_MODEL_TYPES)})")
    encoder = from_hf(path)
    return encoder, hf_preprocess(path, encoder.patch_embed.img_size[0]), identity


def _model_type(path: Path) -> str:
    """The model_type of a transformers directory's config.json (FileNotFoundError without one)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a transformers model directory (no config.json)")
    return json.loads((path / "config.json").read_text()).get("model_type", "?")


def hf_preprocess(path: Path, img_size: int) -> Preprocess | None:
    """Our Preprocess from a transformers preprocessor_config.json (resize the shorter side, centre crop, mean, std);
    None without one."""
    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        return None
    cfg = json.loads(file.read_text())
    size, crop = cfg.get("size") or {}, cfg.get("crop_size") or {}
    # older files hold plain numbers (transformers' get_size_dict: size -> shortest edge, crop -> square)
    size = {"shortest_edge": size} if isinstance(size, (int, float)) else size
    crop = {"height": crop, "width": crop} if isinstance(crop, (int, float)) else crop
    resample = {0: "nearest", 2: "bilinear", 3: "bicubic"}.get(cfg.get("resample", 3), "bicubic")
    mean, std = cfg.get("image_mean", Preprocess(1).mean), cfg.get("image_std", Preprocess(1).std)
    if "shortest_edge" not in size and not cfg.get("do_center_crop"):  # ViT / SigLIP: both sides resized, no crop
        return Preprocess(img_size=int(size.get("height", img_size)), mean=mean, std=std, interpolation=resample,
                          resize_mode="squash")
    crop_size = crop.get("height", img_size) if cfg.get("do_center_crop") else size.get("height", img_size)
    shortest = size.get("shortest_edge", size.get("height", crop_size))
    # our resize is int(img_size / crop_pct): crop_size / (shortest + 0.5) gives exactly `shortest` back
    crop_pct = 1.0 if shortest <= crop_size else crop_size / (shortest + 0.5)
    return Preprocess(img_size=int(crop_size), mean=mean, std=std, interpolation=resample, crop_pct=crop_pct)
