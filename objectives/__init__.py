"""The objective registry: config name -> class (`OBJECTIVES`), and the two ways an objective comes to life: built
for training (`build_objective`), or rebuilt from a run's artifacts (`load_trained`).

Adding an objective = one file here, one line below, one config under configs/objective/, tests. An objective kept
outside this package is named `module:Class` in its config (`name: my_package.probe:Probe`) and imported from the
Python path, nothing registered.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import is_dataclass

from omegaconf import DictConfig, OmegaConf

from objectives.base import Artifacts, DataInfo, Objective, ObjectiveConfig, Requirements
from objectives.clip import CLIP, SigLIP
from objectives.deit import DeiT
from objectives.dino import DINO, DINOv2
from objectives.dinov3 import DINOv3
from objectives.ijepa import IJEPA
from objectives.mae import MAE
from objectives.masked_patch import MaskedPatch
from objectives.mocov3 import MoCoV3
from objectives.supervised import Supervised
from ssl_vit.artifacts import load_encoder, load_heads, read_preprocess, run_files
from ssl_vit.schema import ConfigError, validate_config

OBJECTIVES: dict[str, type[Objective]] = {
    "supervised": Supervised,
    "deit": DeiT,
    "masked_patch": MaskedPatch,
    "mae": MAE,
    "dino": DINO,
    "dinov2": DINOv2,
    "dinov3": DINOv3,
    "mocov3": MoCoV3,
    "ijepa": IJEPA,
    "clip": CLIP,
    "siglip": SigLIP,
}


def objective_class(name: str) -> type[Objective]:
    """The class `objective.name` names: a registered name, or `module:Class` on the Python path."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    module_name, _, class_name = name.partition(":")
    if not class_name:
        raise ValueError(f"unknown objective {name!r}; valid choices: {sorted(OBJECTIVES)}, or module:Class for one "
                         "outside this package")
    try:
        found = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError as err:
        raise ValueError(f"objective {name!r}: cannot import {module_name!r} ({err})") from err
    if not (isinstance(found, type) and issubclass(found, Objective)):
        raise ValueError(f"objective {name!r}: {module_name} has no Objective subclass {class_name!r}")
    return found


def typed_config(cls: type[Objective], cfg):
    """`cfg` on the objective's schema: a key it lacks or a wrong type fails, its range rules are checked. A config
    typed already (by Hydra from the registered schema, or built from it) is taken as it is; an untyped one (an
    objective named module:Class, a config read back from a run's metadata) is typed here."""
    if is_dataclass(cfg) or (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is cls.config_class):
        return cfg
    typed = OmegaConf.merge(OmegaConf.structured(cls.config_class), cfg)
    validate_config(typed, prefix="objective.")
    return typed


def build_objective(cfg, backbone, data: DataInfo) -> Objective:
    cls = objective_class(cfg.name)
    try:
        cfg = typed_config(cls, cfg)
    except (ValueError, KeyError, AttributeError) as err:  # OmegaConf's errors name the key and the value
        raise ConfigError(f"objective={cfg.name}: {str(err).splitlines()[0]}") from err
    return cls(backbone, cfg, data)


def load_trained(run, image_text: bool = False) -> Objective:
    """The objective a run trained, rebuilt from its encoder.safetensors and heads.safetensors (which record the
    objective's name and config), in eval mode; ValueError naming what is missing. `image_text`: refuse, before
    building anything, a run whose objective is not an image-text model (zero-shot, retrieval, open_clip)."""
    model, backbone, heads, heads_path = _rebuild(run, image_text)
    # copies: `backbone` is also the objective's own backbone, which heads.safetensors may overwrite (DINO's student,
    # I-JEPA's context encoder) before the encoder's values reach the teacher / target encoder
    encoder = {name: value.clone() for name, value in backbone.state_dict().items()}
    missing, unexpected = model.load_state_dict(model.state_from_artifacts(encoder, heads), strict=False)
    if missing or unexpected:
        raise ValueError(f"{heads_path} does not fit its objective config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    return model.eval()


def rebuild_untrained(run) -> Objective:
    """The objective of a run, built from what its artifacts record but holding none of its weights beyond the
    encoder's (for filling from a checkpoint: scripts/consolidate.py)."""
    return _rebuild(run, False)[0]


def _rebuild(run, image_text: bool):
    encoder_path, heads_path = run_files(run)
    if not (encoder_path.is_file() and heads_path.is_file()):
        raise ValueError(f"{str(run)!r} is not a run directory with encoder.safetensors and heads.safetensors")
    heads, meta = load_heads(heads_path)
    if "objective_config" not in meta:
        raise ValueError(f"{heads_path} records no objective config (written before it was recorded); train again")
    cls = objective_class(meta.get("objective", ""))
    cfg = cls.rebuild_config(typed_config(cls, json.loads(meta["objective_config"])))
    if image_text and not cls.requirements(cfg).image_text:
        raise ValueError(f"{str(run)!r} was trained with objective={cfg.name}; this needs an image-text model "
                         f"(one of {sorted(n for n, c in OBJECTIVES.items() if c.needs.image_text)})")
    backbone, preprocess = load_encoder(encoder_path), read_preprocess(encoder_path)
    if "data_info" in meta:
        data = DataInfo(**json.loads(meta["data_info"]))
    else:  # written before it was recorded: image-text runs, which need no class count
        data = DataInfo(0, backbone.patch_embed.img_size[0], *((preprocess.mean, preprocess.std) if preprocess else
                                                              ([], [])))
    return cls(backbone, cfg, data), backbone, heads, heads_path


__all__ = ["OBJECTIVES", "Artifacts", "DataInfo", "Objective", "ObjectiveConfig", "Requirements", "build_objective",
           "load_trained", "objective_class", "rebuild_untrained", "typed_config"]
