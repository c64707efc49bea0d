"""The objective registry: config name -> class (`OBJECTIVES`), and the two ways an objective comes to life: built
for training (`build_objective`), or rebuilt from a run's artifacts (`load_trained`).

Adding an objective = one file here, one line below, one config under configs/objective/, tests. An objective kept
outside this package is named `module:Class` in its config (`name: my_package.probe:Probe`) and imported from the
Python path, nothing registered.
"""

from __future__ import annotations

import importlib
import os
import sys

from ssl_vit.objectives.base import (
    Artifacts,
    DataInfo,
    Objective,
    ObjectiveConfig,
    Requirements,
    load_run,
    typed_config,
)
from ssl_vit.objectives.clip import CLIP, SigLIP
from ssl_vit.objectives.deit import DeiT
from ssl_vit.objectives.dino import DINO, DINOv2
from ssl_vit.objectives.dinov3 import DINOv3
from ssl_vit.objectives.distill import Distill
from ssl_vit.objectives.ijepa import IJEPA
from ssl_vit.objectives.mae import MAE
from ssl_vit.objectives.masked_patch import MaskedPatch
from ssl_vit.objectives.mocov3 import MoCoV3
from ssl_vit.objectives.supervised import Supervised
from ssl_vit.schema import ConfigError

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
    "distill": Distill,
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


def recorded_objective_class(name: str) -> type[Objective]:
    """`objective_class` of a name read from a run's files: a `module:Class` there is imported without the working
    directory on the path, so a run directory (or a folder it came in) cannot bring the module it names."""
    cwd = os.path.realpath(os.getcwd())
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or ".") != cwd]
    try:
        return objective_class(name)
    finally:
        sys.path[:] = saved


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
    return load_run(run, recorded_objective_class, image_text)


def rebuild_untrained(run) -> Objective:
    """The objective of a run, built from what its artifacts record but holding none of its weights beyond the
    encoder's (for filling from a checkpoint: scripts/consolidate.py)."""
    return load_run(run, recorded_objective_class, weights=False)


__all__ = ["OBJECTIVES", "Artifacts", "DataInfo", "Objective", "ObjectiveConfig", "Requirements", "build_objective",
           "load_trained", "objective_class", "rebuild_untrained", "recorded_objective_class",
           "typed_config"]
