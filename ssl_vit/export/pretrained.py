"""Encoders from every source a run can start from or evaluate: one spec string, one loader.

    outputs/<run> or .../encoder.safetensors   ours (the recorded preprocessing)
    timm:<model name>                          timm's architecture, random weights (no model hub here)
    timm:<model name>:<file>                   + weights from a timm checkpoint (.safetensors / .pth / .bin, or
                                               the original ViT AugReg .npz) through timm's own loader
    timm:<dir>                                 a timm model directory (config.json + weights; our --to timm)
    hf:<dir>                                   transformers ViTModel / Dinov2Model / CLIPVisionModel / SiglipVisionModel
    open_clip:<dir>                            an open_clip model directory (open_clip_config.json; our --to open_clip)
    open_clip:<model name>:<file>              an open_clip checkpoint file for a named open_clip architecture

Each import keeps its library's position-embedding resampling for other image sizes (recorded in the encoder's
config, used by `set_img_size` and on the fly): timm and open_clip resample bicubic with antialiasing, transformers
and DINOv2 bicubic without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ssl_vit.preprocess import INTERPOLATIONS, Preprocess
from ssl_vit.vit import VisionTransformer

SOURCES = ("<encoder file or run dir>", "timm:<name>[:<file>]", "timm:<dir>", "hf:<dir>", "open_clip:<dir>",
           "open_clip:<name>:<file>")


@dataclass
class Pretrained:
    encoder: VisionTransformer
    preprocess: Preprocess | None  # the source's own preprocessing, when it records one
    identity: dict  # what makes the weights unique (for the feature cache)


def load_pretrained(spec: str) -> Pretrained:
    """The encoder a spec names (see the module docstring); ValueError / FileNotFoundError naming the problem."""
    kind, _, rest = spec.partition(":") if spec.split(":", 1)[0] in ("timm", "hf", "open_clip") else ("", "", spec)
    if kind == "timm":
        return _from_timm_spec(rest)
    if kind == "hf":
        return _from_hf_dir(rest)
    if kind == "open_clip":
        return _from_open_clip_spec(rest)
    return _from_ours(spec)


def _fingerprint(path: Path) -> dict:
    from ssl_vit.eval.features import file_fingerprint

    return file_fingerprint(path)


def _from_ours(spec: str) -> Pretrained:
    from ssl_vit.export.safetensors import load_encoder, read_preprocess

    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "encoder.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{spec!r} is not an encoder file or a run directory with encoder.safetensors; "
                                f"valid forms: {list(SOURCES)}")
    try:
        encoder = load_encoder(path)
    except Exception as err:  # safetensors' own errors for truncated / foreign files, bad metadata
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(f"{spec!r} is not a readable ssl_vit encoder file ({first})") from err
    return Pretrained(encoder, read_preprocess(path), _fingerprint(path))


def timm_preprocess(model) -> Preprocess:
    """The eval transform timm declares for a model (pretrained_cfg: mean, std, interpolation, crop_pct)."""
    pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
    size = model.patch_embed.img_size
    interpolation = pcfg.get("interpolation", "bicubic")
    return Preprocess(img_size=int(size[0]), mean=list(pcfg.get("mean", Preprocess(1).mean)),
                      std=list(pcfg.get("std", Preprocess(1).std)),
                      interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic",
                      crop_pct=float(pcfg.get("crop_pct", 1.0)),
                      resize_mode="squash" if pcfg.get("crop_mode") == "squash" else "shortest")


def _from_timm_spec(rest: str) -> Pretrained:
    import timm

    from ssl_vit.export.timm import from_timm

    path = Path(rest).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"timm:{rest}: the directory has no config.json (a timm model directory)")
        model = timm.create_model(f"local-dir:{path}", pretrained=True, num_classes=0)
        identity = {"timm": [_fingerprint(p) for p in (path / "model.safetensors", path / "pytorch_model.bin")
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
            identity = _fingerprint(file_path) | {"timm": name}
        else:
            model = timm.create_model(name, pretrained=False, num_classes=0)
            identity = {"timm": name, "seed": torch.initial_seed()}
    return Pretrained(from_timm(model.eval()).eval(), timm_preprocess(model), identity)


def _from_hf_dir(rest: str) -> Pretrained:
    from ssl_vit.export.hf import from_hf

    path = Path(rest).expanduser()
    encoder = from_hf(path)
    preprocess = hf_preprocess(path, encoder.patch_embed.img_size[0])
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))  # every shard of a sharded model
    return Pretrained(encoder, preprocess, {"hf": [_fingerprint(w) for w in weights]})


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


def _from_open_clip_spec(rest: str) -> Pretrained:
    import open_clip

    path = Path(rest).expanduser()
    if path.is_dir():
        config_file = path / "open_clip_config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"open_clip:{rest}: no open_clip_config.json in the directory")
        model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{path}")
        vision_cfg = json.loads(config_file.read_text())["model_cfg"]["vision_cfg"]
        weights = next(iter(sorted(path.glob("open_clip_model.*"))), None)
        identity = _fingerprint(weights) if weights else {"open_clip": str(path)}
    else:
        name, _, file = rest.partition(":")
        if "/" in name:
            raise FileNotFoundError(f"open_clip:{rest}: {name!r} is not a directory (an open_clip model directory "
                                    "holds open_clip_config.json)")
        if name not in open_clip.list_models():
            raise ValueError(f"open_clip:{rest}: {name!r} is not an open_clip model name; e.g. "
                             f"{open_clip.list_models()[:6]} (or open_clip:<model directory>)")
        if not file or not Path(file).is_file():
            raise FileNotFoundError(f"open_clip:{rest}: give the checkpoint file as open_clip:{name}:<file>")
        model, _, transform = open_clip.create_model_and_transforms(name, pretrained=file)
        vision_cfg = open_clip.get_model_config(name)["vision_cfg"]
        identity = _fingerprint(Path(file)) | {"open_clip": name}
    encoder = from_open_clip_visual(model.visual, vision_cfg.get("ls_init_value"))
    return Pretrained(encoder, _open_clip_preprocess(model.visual), identity)


def _open_clip_preprocess(visual) -> Preprocess:
    """open_clip's preprocess_cfg (size, mean, std, interpolation, resize_mode shortest | squash)."""
    cfg = dict(getattr(visual, "preprocess_cfg", None) or {})
    size = cfg.get("size", visual.image_size)
    size = size[0] if isinstance(size, (tuple, list)) else size
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

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
    from open_clip.transformer import VisionTransformer as OpenClipViT

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
    config = dict(img_size=list(visual.image_size), patch_size=list(visual.patch_size),
                  in_chans=visual.conv1.in_channels, embed_dim=width, depth=len(blocks), num_heads=attn.num_heads,
                  mlp_dim=block.mlp.c_fc.out_features, act_layer=act_layer, norm_eps=block.ln_1.eps,
                  pre_norm=pre_norm, global_pool=pool, qk_norm=qk_norm, qkv_bias=qkv_bias,
                  layer_scale=(ls_init_value or 1e-5) if has_ls else None,
                  pos_embed_interp="bicubic", pos_embed_antialias=True)  # open_clip's resize_pos_embed
    state, used = visual.state_dict(), {"proj"}  # the image-text projection is not part of the encoder

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return state[key]

    def copy_layer(theirs: str, mine: str) -> None:
        for kind in ("weight", "bias"):
            ours[f"{mine}.{kind}"] = take(f"{theirs}.{kind}")

    ours = {"patch_embed.proj.weight": take("conv1.weight"), "cls_token": take("class_embedding").reshape(1, 1, -1),
            "pos_embed": take("positional_embedding")[None]}
    if pre_norm:
        copy_layer("ln_pre", "norm_pre")
    else:  # open_clip's conv1 has no bias
        ours["patch_embed.proj.bias"] = torch.zeros(width)
    copy_layer("ln_post", "fc_norm" if pool == "avg" else "norm")
    for i in range(len(blocks)):
        theirs, mine = f"transformer.resblocks.{i}.", f"blocks.{i}."
        pairs = [("ln_1", "norm1"), ("ln_2", "norm2"), ("attn.out_proj", "attn.proj"), ("mlp.c_fc", "mlp.fc1"),
                 ("mlp.c_proj", "mlp.fc2")] + ([("attn.ln_q", "attn.q_norm"), ("attn.ln_k", "attn.k_norm")]
                                                if qk_norm else [])
        for their_name, my_name in pairs:
            copy_layer(theirs + their_name, mine + my_name)
        ours[f"{mine}attn.qkv.weight"] = take(f"{theirs}attn.in_proj_weight")
        if qkv_bias:
            ours[f"{mine}attn.qkv.bias"] = take(f"{theirs}attn.in_proj_bias")
        if has_ls:
            for j in (1, 2):
                ours[f"{mine}ls{j}.gamma"] = take(f"{theirs}ls_{j}.gamma")
    unmapped = sorted(set(state) - used)
    if unmapped:  # open_clip's scale_attn / scale_fc / head scaling / cosine attention: no equivalent here
        raise ValueError(f"open_clip image tower options without an equivalent here (weights {unmapped[:4]}); "
                         "supported: open_clip's standard and custom ViT blocks, layer scale, QK-norm")
    encoder = VisionTransformer(**config)
    encoder.load_state_dict({k: v.detach().float().clone() for k, v in ours.items()}, strict=True)
    return encoder.eval()
