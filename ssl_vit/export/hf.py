"""Our ViT as a transformers `CLIPVisionModelWithProjection` directory (`from_pretrained` in transformers 5.x and 4.x).

CLIP's vision layout has a norm before the blocks (`pre_layrnorm`: our `model.pre_norm`, which the clip objectives
turn on; it also drops the patch-embedding bias) and a final norm on the pooled class token only (`post_layernorm`):
layer scale is folded into `out_proj` / `fc2` (exact); no qkv bias or norm bias is written as zeros; eps and the
activation (exact GELU, where CLIP's default is quick_gelu) are set explicitly. The weights are written under the
`vision_model.` names, which 4.x and 5.x both load exactly (5.x's own `save_pretrained` names load in 4.x as random
weights with only a warning). `pooler_output` is our pooled embedding (class token after the final norm) and
`image_embeds` our image-text embedding before normalisation. Refused, naming the option: no pre-norm (CLIP always
normalises before the blocks), registers, parallel blocks, QK-norm, no class token or average pooling, position
embeddings without the class slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _refusals(config: dict) -> list[str]:
    problems = [] if config.get("pre_norm") else ["pre_norm=False (CLIP normalises before the blocks: pre_layrnorm)"]
    for key, allowed, why in (("num_registers", 0, "registers"), ("parallel_block", False, "parallel blocks"),
                              ("qk_norm", False, "QK-norm"), ("no_embed_class", False, "no class-slot position")):
        if config.get(key, allowed) != allowed:
            problems.append(f"{key}={config[key]} ({why})")
    for key in ("img_size", "patch_size"):
        value = config.get(key)
        if isinstance(value, (list, tuple)) and len(set(value)) > 1:
            problems.append(f"{key}={list(value)} (CLIPVisionConfig takes square sizes)")
    if not config.get("class_token", True) or config.get("global_pool", "token") != "token":
        problems.append(f"class_token={config.get('class_token', True)}, global_pool={config.get('global_pool')} "
                        "(CLIP pools the class token)")
    return problems


def clip_vision_config(config: dict, projection_dim: int | None = None):
    from transformers import CLIPVisionConfig

    problems = _refusals(config)
    if problems:
        raise ValueError("CLIPVisionModel cannot represent this encoder: " + "; ".join(problems)
                         + ". The open_clip export (scripts/export.py --to open_clip) takes layer scale and QK-norm.")
    width = config["embed_dim"]
    size, patch = config["img_size"], config["patch_size"]
    return CLIPVisionConfig(
        hidden_size=width, intermediate_size=config.get("mlp_dim") or int(width * config.get("mlp_ratio", 4.0)),
        num_hidden_layers=config["depth"], num_attention_heads=config["num_heads"], num_channels=3,
        image_size=size if isinstance(size, int) else size[0], patch_size=patch if isinstance(patch, int) else patch[0],
        hidden_act="gelu", layer_norm_eps=config.get("norm_eps", 1e-6), attention_dropout=0.0,
        projection_dim=projection_dim or width, architectures=["CLIPVisionModelWithProjection"])


def clip_vision_state(state: dict, config: dict, projection: torch.Tensor | None = None) -> dict:
    """Our encoder state dict (and (out, in) projection weight) under transformers' CLIP vision names."""
    width, prefix = config["embed_dim"], "vision_model."
    out = {}

    def norm(target: str, source: str) -> None:
        out[f"{target}.weight"] = state[f"{source}.weight"]
        out[f"{target}.bias"] = state.get(f"{source}.bias", torch.zeros(width))

    out["embeddings.class_embedding"] = state["cls_token"].reshape(width)
    out["embeddings.patch_embedding.weight"] = state["patch_embed.proj.weight"]
    out["embeddings.position_embedding.weight"] = state["pos_embed"][0]
    norm("pre_layrnorm", "norm_pre")
    for i in range(config["depth"]):
        ours, theirs = f"blocks.{i}", f"encoder.layers.{i}"
        qkv_w = state[f"{ours}.attn.qkv.weight"]
        qkv_b = state.get(f"{ours}.attn.qkv.bias", torch.zeros(3 * width))
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{theirs}.self_attn.{name}.weight"] = qkv_w[j * width:(j + 1) * width]
            out[f"{theirs}.self_attn.{name}.bias"] = qkv_b[j * width:(j + 1) * width]
        gamma1 = state.get(f"{ours}.ls1.gamma", torch.ones(width))
        gamma2 = state.get(f"{ours}.ls2.gamma", torch.ones(width))
        out[f"{theirs}.self_attn.out_proj.weight"] = state[f"{ours}.attn.proj.weight"] * gamma1[:, None]
        out[f"{theirs}.self_attn.out_proj.bias"] = state[f"{ours}.attn.proj.bias"] * gamma1
        out[f"{theirs}.mlp.fc1.weight"] = state[f"{ours}.mlp.fc1.weight"]
        out[f"{theirs}.mlp.fc1.bias"] = state[f"{ours}.mlp.fc1.bias"]
        out[f"{theirs}.mlp.fc2.weight"] = state[f"{ours}.mlp.fc2.weight"] * gamma2[:, None]
        out[f"{theirs}.mlp.fc2.bias"] = state[f"{ours}.mlp.fc2.bias"] * gamma2
        norm(f"{theirs}.layer_norm1", f"{ours}.norm1")
        norm(f"{theirs}.layer_norm2", f"{ours}.norm2")
    norm("post_layernorm", "norm")
    tensors = {prefix + k: v.detach().float().contiguous().clone() for k, v in out.items()}
    tensors["visual_projection.weight"] = (projection if projection is not None else torch.eye(width)).detach() \
        .float().contiguous().clone()
    return tensors


def export_clip_vision(encoder, out_dir: str | Path, projection: torch.Tensor | None = None,
                       preprocess=None) -> Path:
    """Write `encoder` (+ an image-text projection) as a CLIPVisionModelWithProjection directory: config.json,
    model.safetensors and, with `preprocess`, preprocessor_config.json (CLIPImageProcessor: shortest side resized
    to the image size, centre crop, the encoder's mean and std)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = encoder.config
    hf_config = clip_vision_config(config, projection.shape[0] if projection is not None else None)
    hf_config.save_pretrained(out_dir)
    save_file(clip_vision_state(encoder.state_dict(), config, projection), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    if preprocess is not None:
        resample = {"bilinear": 2, "bicubic": 3, "nearest": 0}[preprocess.interpolation]
        processor = {"image_processor_type": "CLIPImageProcessor", "do_resize": True,
                     "size": {"shortest_edge": int(preprocess.img_size / preprocess.crop_pct)}, "do_center_crop": True,
                     "crop_size": {"height": preprocess.img_size, "width": preprocess.img_size},
                     "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                     "image_mean": list(preprocess.mean), "image_std": list(preprocess.std), "resample": resample,
                     "do_convert_rgb": True}
        (out_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return out_dir
