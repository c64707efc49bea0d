"""open_clip both ways, through one name table (`_name_table`: our image-tower names against open_clip's under
`visual.`):

- import: `from_open_clip_visual` rebuilds an open_clip `VisionTransformer` (`model.visual`) as our encoder;
  `load_open_clip_spec` reads the `open_clip:` import forms (a model directory, or a named architecture + its
  checkpoint file) with open_clip's own preprocessing;
- export: `export_open_clip` writes an image-text model (objectives/clip.py) as an open_clip model directory:
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

from ssl_vit.artifacts import file_fingerprint
from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.files import save_safetensors
from ssl_vit.interop.native import NativeEncoder, from_open_clip_native, not_a_vit
from ssl_vit.preprocess import INTERPOLATIONS, Preprocess

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
# open_clip keeps these without the leading singleton dimensions of ours ((1, 1, D) -> (D,), (1, N, D) -> (N, D))
_THEIR_NDIM = {"class_embedding": 1, "positional_embedding": 2}


def _name_table(config: ViTConfig) -> list[tuple[str, str]]:
    """(our name, open_clip's name in `visual`) of every image-tower tensor, for an encoder config; used both ways."""
    pool_norm = "fc_norm" if config.global_pool == "avg" else "norm"
    pairs = [("patch_embed.proj.weight", "conv1.weight"), ("cls_token", "class_embedding"),
             ("pos_embed", "positional_embedding")]
    layers = [(pool_norm, "ln_post")] + ([("norm_pre", "ln_pre")] if config.pre_norm else [])
    for i in range(config.depth):
        ours, theirs = f"blocks.{i}.", f"transformer.resblocks.{i}."
        block = [("norm1", "ln_1"), ("norm2", "ln_2"), ("attn.qkv", "attn.in_proj"), ("attn.proj", "attn.out_proj"),
                 ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")]
        block += [("attn.q_norm", "attn.ln_q"), ("attn.k_norm", "attn.ln_k")] if config.qk_norm else []
        layers += [(ours + mine, theirs + their) for mine, their in block]
        if config.layer_scale is not None:
            pairs += [(f"{ours}ls{j}.gamma", f"{theirs}ls_{j}.gamma") for j in (1, 2)]
    for mine, their in layers:  # open_clip's fused in-projection is named in_proj_weight / in_proj_bias
        joint = "_" if their.endswith("in_proj") else "."
        pairs += [(f"{mine}.weight", f"{their}{joint}weight"), (f"{mine}.bias", f"{their}{joint}bias")]
    return pairs


def _refusals(config: ViTConfig) -> list[str]:
    problems = []
    if config.stem != "patch":
        problems.append(f"stem={config.stem!r} (open_clip's ViT tower cuts pixel patches)")
    if config.dist_token:
        problems.append("dist_token=True (open_clip's ViT has no distillation token)")
    if not config.class_token:
        problems.append("class_token=false (open_clip's ViT always has a class token)")
    if config.num_registers:
        problems.append(f"num_registers={config.num_registers} (open_clip's ViT has no registers)")
    if config.parallel_block:
        problems.append("parallel_block=true (open_clip's blocks are sequential)")
    if config.pos_embed in ("rope", "learned_rope", "none"):
        problems.append(f"pos_embed={config.pos_embed!r} (open_clip's ViT adds an absolute position embedding)")
    if config.no_embed_class:
        problems.append("no_embed_class=true (open_clip's position embedding has the class slot)")
    width = config.embed_dim
    mlp_dim = config.mlp_hidden
    if int(width * (mlp_dim / width)) != mlp_dim:
        problems.append(f"mlp_dim={mlp_dim} (not width x a ratio open_clip can reproduce)")
    beyond = config.beyond_classic()
    if beyond:
        problems.append(f"{', '.join(beyond)} (open_clip's own ViT tower has the classic block and pooling; "
                        "--to timm / hf hold these families)")
    return problems


def vision_config(config: ViTConfig) -> dict:
    """open_clip's CLIPVisionCfg for our encoder config (raises ValueError naming what open_clip cannot hold)."""
    problems = _refusals(config)
    if problems:
        raise ValueError("open_clip cannot represent this image tower: " + "; ".join(problems)
                         + ". Export the encoder through the timm or safetensors paths instead.")
    width = config.embed_dim
    mlp_dim = config.mlp_hidden
    size = config.img_size
    patch = config.patch_size
    return {
        "image_size": size if isinstance(size, int) else list(size), "patch_size": patch if isinstance(patch, int)
        else list(patch), "width": width, "layers": config.depth, "head_width": width // config.num_heads,
        "mlp_ratio": mlp_dim / width, "ls_init_value": config.layer_scale,
        "no_ln_pre": not config.pre_norm, "pool_type": "avg" if config.global_pool == "avg" else "tok",
        "final_ln_after_pool": config.global_pool == "avg", "norm_kwargs": {"eps": config.norm_eps},
        "block_type": "custom", "qk_norm": bool(config.qk_norm),
    }


def vision_state(encoder_state: dict, config: ViTConfig, projection: torch.Tensor) -> dict:
    """Our encoder's weights under open_clip's `visual.` names; `projection` is our (out, in) projection weight. A
    tensor our encoder lacks (a bias-free norm or qkv) is written as zeros; a patch-embedding bias, which open_clip's
    conv1 lacks, is folded into the patch slots of the position embedding (the same constant on each)."""
    out = {}
    for mine, theirs in _name_table(config):
        value = encoder_state.get(mine)
        if value is None:
            value = torch.zeros(encoder_state[mine.replace(".bias", ".weight")].shape[0])
        ndim = _THEIR_NDIM.get(theirs)
        out[theirs] = value.reshape(value.shape[-ndim:]) if ndim else value
    if "patch_embed.proj.bias" in encoder_state:
        out["positional_embedding"] = out["positional_embedding"].clone()
        out["positional_embedding"][1:] += encoder_state["patch_embed.proj.bias"]
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
        from transformers import AutoTokenizer  # heavy: only for a transformers text tower from a directory

        AutoTokenizer.from_pretrained(cfg.hf_model).save_pretrained(hf_dir)
        text["hf_tokenizer_name"] = str(hf_dir)
    return text


def export_open_clip(model, out_dir: str | Path, preprocess=None) -> Path:
    """Write `model` (a CLIP / SigLIP objective: `ssl_vit.objectives.load_trained(run)`) as an open_clip model
    directory."""
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
    save_safetensors(state, out_dir / WEIGHTS_FILE)
    return out_dir


def load_open_clip_spec(rest: str, native: str = "never") -> tuple[VisionTransformer | NativeEncoder, Preprocess,
                                                                   dict]:
    """(encoder, open_clip's preprocessing, identity) of `open_clip:<rest>` (ssl_vit.interop.sources names the
    forms); `native` as load_pretrained's (an image tower that does not convert runs as open_clip runs it)."""
    from open_clip.transformer import VisionTransformer as OpenClipViT  # heavy: open_clip models only

    model, vision_cfg, identity, _ = load_open_clip_model(rest)
    preprocess = open_clip_preprocess(model.visual)
    converts = isinstance(model.visual, OpenClipViT)
    if native == "always" or (native == "fallback" and not converts):
        return from_open_clip_native(model.visual, preprocess.img_size), preprocess, {**identity, "native": True}
    if not converts:
        raise not_a_vit(f"open_clip:{rest}", f"an open_clip {type(model.visual).__name__} image tower")
    return from_open_clip_visual(model.visual, vision_cfg.get("ls_init_value")), preprocess, identity


def load_open_clip_model(rest: str):
    """(open_clip model, its vision config, identity, the name open_clip.get_tokenizer takes) of
    `open_clip:<rest>`: a model directory, or <model name>:<checkpoint file>."""
    import open_clip  # heavy: open_clip models only

    path = Path(rest).expanduser()
    if path.is_dir():
        config_file = path / "open_clip_config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"open_clip:{rest}: no open_clip_config.json in the directory")
        model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{path}")
        vision_cfg = json.loads(config_file.read_text())["model_cfg"]["vision_cfg"]
        weights = next(iter(sorted(path.glob("open_clip_model.*"))), None)
        identity = file_fingerprint(weights) if weights else {"open_clip": str(path)}
        return model, vision_cfg, identity, f"local-dir:{path}"
    name, _, file = rest.partition(":")
    if "/" in name:
        raise FileNotFoundError(f"open_clip:{rest}: {name!r} is not a directory (an open_clip model directory "
                                "holds open_clip_config.json)")
    if name not in open_clip.list_models():
        raise ValueError(f"open_clip:{rest}: {name!r} is not an open_clip model name; e.g. "
                         f"{open_clip.list_models()[:6]} (or open_clip:<model directory>)")
    if not file or not Path(file).is_file():
        raise FileNotFoundError(f"open_clip:{rest}: give the checkpoint file as open_clip:{name}:<file>")
    model, _, _ = open_clip.create_model_and_transforms(name, pretrained=file)
    return model, open_clip.get_model_config(name)["vision_cfg"], file_fingerprint(Path(file)) | {"open_clip": name}, \
        name


def open_clip_preprocess(visual) -> Preprocess:
    """open_clip's preprocess_cfg (size, mean, std, interpolation, resize_mode shortest | squash)."""
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD  # heavy: open_clip models only

    cfg = dict(getattr(visual, "preprocess_cfg", None) or {})
    size = cfg.get("size", visual.image_size)
    size = size[0] if isinstance(size, (tuple, list)) else size
    mode = cfg.get("resize_mode", "shortest")
    if mode not in ("shortest", "squash"):
        raise ValueError(f"open_clip resize_mode {mode!r} has no equivalent here (supported: shortest, squash)")
    interpolation = cfg.get("interpolation", "bicubic")
    return Preprocess(img_size=int(size), mean=list(cfg.get("mean") or OPENAI_DATASET_MEAN),
                      std=list(cfg.get("std") or OPENAI_DATASET_STD),
                      interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic", resize_mode=mode)


def from_open_clip_visual(visual, ls_init_value: float | None = None) -> VisionTransformer:
    """Our encoder from an open_clip `VisionTransformer` (`model.visual`): class token pooling (ln_post on every
    token) or average pooling (ln_post after pooling); the projection `proj` is not part of the encoder."""
    from open_clip.transformer import VisionTransformer as OpenClipViT  # heavy: open_clip models only

    if not isinstance(visual, OpenClipViT):
        raise ValueError(f"only open_clip VisionTransformer image towers import, not {type(visual).__name__}")
    if visual.attn_pool is not None:
        raise ValueError("open_clip attentional pooling (CoCa) has no equivalent here")
    if visual.pool_type == "tok" and not visual.final_ln_after_pool:
        pool = "token"
    elif visual.pool_type == "avg" and visual.final_ln_after_pool:
        pool = "avg"
    else:
        raise ValueError(f"open_clip pool_type={visual.pool_type!r} with final_ln_after_pool="
                         f"{visual.final_ln_after_pool} has no equivalent here (supported: tok, avg + ln after pool)")
    blocks = visual.transformer.resblocks
    block = blocks[0]
    attn = block.attn
    width = visual.conv1.out_channels
    act = block.mlp.gelu
    act_layer = "quick_gelu" if type(act).__name__ == "QuickGELU" else \
        "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    has_ls = not isinstance(block.ls_1, torch.nn.Identity)
    qk_norm = hasattr(attn, "ln_q") and not isinstance(attn.ln_q, torch.nn.Identity)
    pre_norm = not isinstance(visual.ln_pre, torch.nn.Identity)
    qkv_bias = getattr(attn, "in_proj_bias", None) is not None
    config = ViTConfig(img_size=list(visual.image_size), patch_size=list(visual.patch_size),
                       in_chans=visual.conv1.in_channels, embed_dim=width, depth=len(blocks),
                       num_heads=attn.num_heads, mlp_dim=block.mlp.c_fc.out_features, act_layer=act_layer,
                       norm_eps=block.ln_1.eps, pre_norm=pre_norm, global_pool=pool, qk_norm=qk_norm,
                       qkv_bias=qkv_bias, layer_scale=(ls_init_value or 1e-5) if has_ls else None,
                       pos_embed_interp="bicubic", pos_embed_antialias=True)  # open_clip's resize_pos_embed
    state, used = visual.state_dict(), {"proj"}  # the image-text projection is not part of the encoder
    encoder = VisionTransformer(config)
    target = encoder.state_dict()
    ours = {}
    for mine, theirs in _name_table(config):
        if mine in target and theirs in state:
            ours[mine] = state[theirs].reshape(target[mine].shape)
            used.add(theirs)
    if "patch_embed.proj.bias" in target:  # open_clip's conv1 has no bias
        ours["patch_embed.proj.bias"] = torch.zeros(width)
    unmapped = sorted(set(state) - used)
    if unmapped:  # open_clip's scale_attn / scale_fc / head scaling / cosine attention: no equivalent here
        raise ValueError(f"open_clip image tower options without an equivalent here (weights {unmapped[:4]}); "
                         "supported: open_clip's standard and custom ViT blocks, layer scale, QK-norm")
    encoder.load_state_dict({k: v.detach().float().clone() for k, v in ours.items()}, strict=True)
    return encoder.eval()
