"""Training checkpoints of the reference DINO and DINOv2 code, to continue pre-training from (`model.init_from`):

    dino:<checkpoint.pth>     facebookresearch/dino's checkpoint: {"student", "teacher", "dino_loss", ...}
    dinov2:<file>             facebookresearch/dinov2's model_<iteration>.rank_0.pth ({"model": ...}) written by one
                              process with full tensors (FSDP's per-rank files hold flat shards: refused), or
                              its eval/<tag>/teacher_checkpoint.pth ({"teacher": ...}: the teacher alone)

The encoder is the teacher's backbone, as the reference evaluates it; with `model.init_heads=true` the rest
(student backbone, DINO and iBOT heads of both, centres) comes under our DINO objective's state names, mapped by
NAME_TABLE. The checkpoints do not record the architecture: it is the run's `model=` (preset and model.* options),
at the checkpoint's grid (then resampled to data.img_size). The backbones go through timm's own filter for these
layouts (DINOv2's mask token, registers and SwiGLU names) into a timm ViT of that architecture, then into ours, so a
key or shape that does not fit is refused by name.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from pathlib import Path

import timm
import torch
from timm.models.vision_transformer import checkpoint_filter_fn

from ssl_vit.artifacts import file_fingerprint
from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.interop.timm import from_timm, timm_architecture, timm_model_args
from ssl_vit.untrusted import RESAVE_HINT, UntrustedFile, load_tensors

log = logging.getLogger(__name__)

# (the reference's name prefix, ours): DINO's checkpoint flattened as "<top-level key>.<name>" (its student is
# DDP-wrapped: "module."; its teacher only with batch norms), DINOv2's "model" state dict as it is. Longest first.
NAME_TABLE = (
    ("student.module.backbone.", "backbone."), ("student.module.head.", "head."), ("student.head.", "head."),
    ("teacher.module.backbone.", "teacher.backbone."), ("teacher.module.head.", "teacher.head."),
    ("teacher.backbone.", "teacher.backbone."), ("teacher.head.", "teacher.head."),
    ("dino_loss.center", "centre"),
    ("student.backbone.", "backbone."), ("student.dino_head.", "head."), ("student.ibot_head.", "patch_head."),
    ("teacher.dino_head.", "teacher.head."), ("teacher.ibot_head.", "teacher.patch_head."),
    ("ibot_patch_loss.center", "patch_centre"),
)
# What holds the state in each file kind: top-level key -> prefix added when flattening.
TOP_LEVEL = {"dino": {"student": "student.", "teacher": "teacher.", "dino_loss": "dino_loss."},
             "dinov2": {"model": "", "teacher": "teacher."}}
# torch's weight_norm parametrization names (newer torch) for the weight_norm hook's weight_g / weight_v
_PARAMETRIZED = {"parametrizations.weight.original0": "weight_g", "parametrizations.weight.original1": "weight_v"}


def load_reference_checkpoint(kind: str, file: str, architecture: ViTConfig, heads: bool = False):
    """(teacher encoder, None, identity, the rest by our names and the kind, or None unless `heads`) of
    `dino:<file>` / `dinov2:<file>`; `architecture`: our encoder config of the run's `model=`."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{kind}:{file}: no such checkpoint file")
    entries = _flatten(kind, path)
    state, unknown = {}, []
    for name, value in entries.items():
        ours = _our_name(name)
        if ours is None:
            unknown.append(name)
        else:
            state[ours] = value
    if unknown:
        raise ValueError(f"{kind}:{file}: entries outside the {kind} layout: {unknown[:4]}"
                         + (f" (and {len(unknown) - 4} more)" if len(unknown) > 4 else "")
                         + "; a multi-process FSDP checkpoint holds flat shards: use eval/<tag>/teacher_checkpoint.pth"
                           " or a one-process checkpoint")
    teacher = {k.removeprefix("teacher.backbone."): v for k, v in state.items() if k.startswith("teacher.backbone.")}
    if not teacher:
        raise ValueError(f"{kind}:{file} holds no teacher backbone (keys: {sorted(entries)[:4]})")
    encoder = _backbone(teacher, architecture, f"{kind}:{file} (teacher backbone)")
    identity = file_fingerprint(path) | {"reference": kind}
    if not heads:
        return encoder, None, identity, None
    rest = {k: v for k, v in state.items() if not k.startswith(("teacher.backbone.", "backbone."))}
    student = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    if "mask_token" in student:  # DINOv2 keeps iBOT's mask token in the student backbone (1, D); ours is (1, 1, D)
        rest["mask_token"] = student["mask_token"].reshape(1, 1, -1)
    if student:
        converted = _backbone(student, architecture, f"{kind}:{file} (student backbone)").state_dict()
        rest.update({f"backbone.{k}": v for k, v in converted.items()})
    return encoder, None, identity, (_heads_as_ours(rest, kind), kind)


def _flatten(kind: str, path: Path) -> dict[str, torch.Tensor]:
    try:  # DINO saves its argparse arguments; mmap: the optimizer stays on disk
        raw = load_tensors(path, RESAVE_HINT, allowed=[argparse.Namespace], name=f"{kind}:{path}", mmap=True)
    except UntrustedFile:
        raise
    except Exception as err:  # pickle / zip errors
        raise ValueError(f"{kind}:{path}: not a readable checkpoint ({type(err).__name__}: "
                         f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}); "
                         f"{kind} files of several FSDP processes hold sharded tensors: use a one-process checkpoint"
                         + (" or eval/<tag>/teacher_checkpoint.pth" if kind == "dinov2" else "")) from err
    tops = {key: prefix for key, prefix in TOP_LEVEL[kind].items() if isinstance(raw, dict) and key in raw}
    if not tops:
        found = sorted(raw)[:6] if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{kind}:{path} has none of the top-level entries of a {kind} checkpoint "
                         f"({sorted(TOP_LEVEL[kind])}); it has {found}")
    return {prefix + name: value for key, prefix in tops.items() for name, value in raw[key].items()
            if isinstance(value, torch.Tensor)}


def _our_name(name: str) -> str | None:
    for theirs, ours in NAME_TABLE:
        if name == theirs or (theirs.endswith(".") and name.startswith(theirs)):
            return ours + name[len(theirs):]
    return None


def _backbone(state: dict[str, torch.Tensor], architecture: ViTConfig, what: str) -> VisionTransformer:
    """A reference backbone state as our encoder: the preset's architecture at the checkpoint's grid, through timm."""
    state = {re.sub(r"^blocks\.\d+\.(\d+)\.", r"blocks.\1.", k) if _chunked(state) else k: v
             for k, v in state.items()}  # DINOv2's block chunks: blocks.<chunk>.<i> -> blocks.<i>
    config = architecture
    if "pos_embed" in state:
        prefix = 0 if config.no_embed_class else int(config.class_token)
        grid = math.isqrt(state["pos_embed"].shape[1] - prefix)
        patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
        config = config.replace(img_size=grid * patch)
    model = timm.create_model(timm_architecture(config), pretrained=False, **timm_model_args(config))
    try:
        model.load_state_dict(checkpoint_filter_fn(state, model), strict=True)
    except RuntimeError as err:  # torch names the missing / unexpected keys and the shapes that differ
        raise ValueError(f"{what} does not fit the model= preset's architecture: "
                         f"{' '.join(str(err).split())[:600]}") from err
    return from_timm(model.eval())


def _chunked(state: dict) -> bool:
    return any(re.match(r"^blocks\.\d+\.\d+\.", k) for k in state)


def _heads_as_ours(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Weight-norm names as ours, a learned-norm gain of exactly 1 left out (ours starts there, and a fixed norm has
    none), DINOv2's (1, 1, K) patch centre as (1, K), and DINOv2's head shared by DINO and iBOT as two heads that
    start equal."""
    out = {}
    for name, value in state.items():
        for theirs, ours in _PARAMETRIZED.items():
            name = name.replace(theirs, ours)
        if name.endswith("last_layer.weight_g") and torch.all(value == 1):
            continue
        out[name] = value.reshape(1, -1) if name == "patch_centre" else value
    centres = {"centre", "patch_centre"} & set(out)
    shared = not any(k.startswith(("patch_head.", "teacher.patch_head.")) for k in out)
    if kind == "dinov2" and shared and centres != {"centre"}:  # iBOT on (its centre), or no centres saved at all
        log.info("dinov2: iBOT shares the DINO head in this checkpoint; both heads start from it")
        for network in ("", "teacher."):
            out.update({f"{network}patch_head.{k.removeprefix(network + 'head.')}": v for k, v in list(out.items())
                        if k.startswith(f"{network}head.")})
    return out
