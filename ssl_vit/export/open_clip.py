"""An image-text model (objectives/clip.py) as an open_clip model directory:
`open_clip.create_model_and_transforms('local-dir:DIR')` rebuilds it offline from `open_clip_config.json` and
`open_clip_model.safetensors`, and its `encode_image` / `encode_text` equal ours (tested to 1e-5 in fp32).

The image tower becomes open_clip's `VisionTransformer` (block_type "custom": attention from a fused in-projection,
as our qkv): conv1 has no bias, so a patch-embedding bias (models without CLIP's pre-norm) is folded into the
patch slots of the position embedding (exact); no qkv bias is written as zeros, as is a norm without bias; layer
scale and QK-norm map to open_clip's `ls_*` / `ln_q`, `ln_k`; our norm eps goes in `norm_kwargs`. Token pooling
normalises every token before pooling (ln_post), average pooling after (`final_ln_after_pool`), as ours. Refused
(open_clip's ViT cannot represent them): no class token, registers, parallel blocks, position embeddings without the
class slot. The text tower is written as open_clip's custom-text layout (`text.` + the tower's own names), which
holds both open_clip's text transformer and a transformers model (`hf_text/` beside the weights: its config, and its
tokenizer when it came from a directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"


def _refusals(config: dict) -> list[str]:
    problems = []
    if config.get("stem", "patch") != "patch":
        problems.append(f"stem={config['stem']!r} (open_clip's ViT tower cuts pixel patches)")
    if config.get("dist_token"):
        problems.append("dist_token=True (open_clip's ViT has no distillation token)")
    if not config.get("class_token", True):
        problems.append("class_token=false (open_clip's ViT always has a class token)")
    if config.get("num_registers", 0):
        problems.append(f"num_registers={config['num_registers']} (open_clip's ViT has no registers)")
    if config.get("parallel_block"):
        problems.append("parallel_block=true (open_clip's blocks are sequential)")
    if config.get("no_embed_class"):
        problems.append("no_embed_class=true (open_clip's position embedding has the class slot)")
    width = config["embed_dim"]
    mlp_dim = config.get("mlp_dim") or int(width * config.get("mlp_ratio", 4.0))
    if int(width * (mlp_dim / width)) != mlp_dim:
        problems.append(f"mlp_dim={mlp_dim} (not width x a ratio open_clip can reproduce)")
    return problems


def vision_config(config: dict) -> dict:
    """open_clip's CLIPVisionCfg for our encoder config (raises ValueError naming what open_clip cannot hold)."""
    problems = _refusals(config)
    if problems:
        raise ValueError("open_clip cannot represent this image tower: " + "; ".join(problems)
                         + ". Export the encoder through the timm or safetensors paths instead.")
    width = config["embed_dim"]
    mlp_dim = config.get("mlp_dim") or int(width * config.get("mlp_ratio", 4.0))
    size = config["img_size"]
    patch = config["patch_size"]
    return {
        "image_size": size if isinstance(size, int) else list(size), "patch_size": patch if isinstance(patch, int)
        else list(patch), "width": width, "layers": config["depth"], "head_width": width // config["num_heads"],
        "mlp_ratio": mlp_dim / width, "ls_init_value": config.get("layer_scale"),
        "no_ln_pre": not config.get("pre_norm", False), "pool_type": "avg" if config["global_pool"] == "avg" else "tok",
        "final_ln_after_pool": config["global_pool"] == "avg", "norm_kwargs": {"eps": config.get("norm_eps", 1e-6)},
        "block_type": "custom", "qk_norm": bool(config.get("qk_norm")),
    }


def vision_state(encoder_state: dict, config: dict, projection: torch.Tensor) -> dict:
    """Our encoder's weights under open_clip's `visual.` names; `projection` is our (out, in) projection weight."""
    width = config["embed_dim"]
    out = {}

    def norm(target: str, source: str) -> None:
        out[f"{target}.weight"] = encoder_state[f"{source}.weight"]
        out[f"{target}.bias"] = encoder_state.get(f"{source}.bias", torch.zeros(width))

    out["conv1.weight"] = encoder_state["patch_embed.proj.weight"]
    out["class_embedding"] = encoder_state["cls_token"].reshape(width)
    pos = encoder_state["pos_embed"][0].clone()
    if "patch_embed.proj.bias" in encoder_state:
        pos[1:] += encoder_state["patch_embed.proj.bias"]  # conv1 has no bias: the same constant per patch slot
    out["positional_embedding"] = pos
    if config.get("pre_norm"):
        norm("ln_pre", "norm_pre")
    for i in range(config["depth"]):
        ours, theirs = f"blocks.{i}", f"transformer.resblocks.{i}"
        norm(f"{theirs}.ln_1", f"{ours}.norm1")
        norm(f"{theirs}.ln_2", f"{ours}.norm2")
        out[f"{theirs}.attn.in_proj_weight"] = encoder_state[f"{ours}.attn.qkv.weight"]
        out[f"{theirs}.attn.in_proj_bias"] = encoder_state.get(f"{ours}.attn.qkv.bias", torch.zeros(3 * width))
        out[f"{theirs}.attn.out_proj.weight"] = encoder_state[f"{ours}.attn.proj.weight"]
        out[f"{theirs}.attn.out_proj.bias"] = encoder_state[f"{ours}.attn.proj.bias"]
        if config.get("qk_norm"):
            head = width // config["num_heads"]
            for ours_norm, their_norm in (("q_norm", "ln_q"), ("k_norm", "ln_k")):
                out[f"{theirs}.attn.{their_norm}.weight"] = encoder_state[f"{ours}.attn.{ours_norm}.weight"]
                out[f"{theirs}.attn.{their_norm}.bias"] = encoder_state.get(f"{ours}.attn.{ours_norm}.bias",
                                                                            torch.zeros(head))
        for layer, target in (("fc1", "c_fc"), ("fc2", "c_proj")):
            out[f"{theirs}.mlp.{target}.weight"] = encoder_state[f"{ours}.mlp.{layer}.weight"]
            out[f"{theirs}.mlp.{target}.bias"] = encoder_state[f"{ours}.mlp.{layer}.bias"]
        if config.get("layer_scale") is not None:
            out[f"{theirs}.ls_1.gamma"] = encoder_state[f"{ours}.ls1.gamma"]
            out[f"{theirs}.ls_2.gamma"] = encoder_state[f"{ours}.ls2.gamma"]
    norm("ln_post", "fc_norm" if config["global_pool"] == "avg" else "norm")
    out["proj"] = projection.T
    return {f"visual.{k}": v.detach().float().contiguous().clone() for k, v in out.items()}


def text_config(model, out_dir: Path) -> dict:
    cfg = model.cfg
    if cfg.text_tower == "open_clip":
        return {"context_length": cfg.context_length, "vocab_size": model.text.vocab_size, "width": cfg.text_width,
                "heads": cfg.text_heads, "layers": cfg.text_layers, "mlp_ratio": cfg.text_mlp_ratio,
                "block_type": "custom"}
    hf_dir = (out_dir / "hf_text").resolve()
    model.text.config.save_pretrained(hf_dir)
    text = {"context_length": cfg.context_length, "hf_model_name": str(hf_dir), "hf_model_pretrained": False,
            "hf_proj_type": cfg.hf_proj, "hf_pooler_type": cfg.hf_pooler}
    if cfg.hf_model:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(cfg.hf_model).save_pretrained(hf_dir)
        text["hf_tokenizer_name"] = str(hf_dir)
    return text


def export_open_clip(model, out_dir: str | Path, preprocess=None) -> Path:
    """Write `model` (a CLIP / SigLIP objective, or a run directory of one) as an open_clip model directory."""
    if isinstance(model, (str, Path)):
        from objectives.clip import load_clip
        from ssl_vit.export import read_preprocess

        run = Path(model)
        model = load_clip(run)
        preprocess = preprocess or read_preprocess((run if run.is_dir() else run.parent) / "encoder.safetensors")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder_config = model.backbone.config
    model_cfg = {"embed_dim": model.cfg.embed_dim, "quick_gelu": False, "custom_text": True,
                 "vision_cfg": vision_config(encoder_config), "text_cfg": text_config(model, out_dir),
                 "init_logit_scale": float(model.logit_scale.detach().reshape(()).clamp(max=model.cfg.max_logit_scale))}
    state = vision_state(model.backbone.state_dict(), encoder_config, model.image_proj.weight)
    state.update({k: v.detach().float().contiguous().clone() for k, v in model.state_dict().items()
                  if k.startswith("text.")})
    # open_clip does not clamp in its forward: write the scale training used (ours is clamped in the forward)
    state["logit_scale"] = model.logit_scale.detach().reshape(()).clamp(max=model.cfg.max_logit_scale).clone()
    if model.logit_bias is not None:
        model_cfg["init_logit_bias"] = float(model.logit_bias.detach().reshape(()))
        state["logit_bias"] = model.logit_bias.detach().reshape(()).clone()
    preprocess_cfg = {}
    if preprocess is not None:
        preprocess_cfg = {"size": preprocess.img_size, "mean": list(preprocess.mean), "std": list(preprocess.std),
                          "interpolation": preprocess.interpolation, "resize_mode": preprocess.resize_mode}
    (out_dir / CONFIG_FILE).write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg},
                                                  indent=2) + "\n")
    save_file(state, str(out_dir / WEIGHTS_FILE))
    return out_dir
