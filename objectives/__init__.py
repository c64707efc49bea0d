"""The objective registry: config name -> class. Adding an objective = one file here, one config, tests."""

from __future__ import annotations

from objectives.base import DataInfo, Objective, ObjectiveConfig
from objectives.clip import CLIP, SigLIP
from objectives.deit import DeiT
from objectives.dino import DINO, DINOv2
from objectives.mae import MAE
from objectives.masked_patch import MaskedPatch
from objectives.supervised import Supervised

OBJECTIVES: dict[str, type[Objective]] = {
    "supervised": Supervised,
    "deit": DeiT,
    "masked_patch": MaskedPatch,
    "mae": MAE,
    "dino": DINO,
    "dinov2": DINOv2,
    "clip": CLIP,
    "siglip": SigLIP,
}


def build_objective(cfg, backbone, data: DataInfo) -> Objective:
    name = cfg.name
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid choices: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name](backbone, cfg, data)


__all__ = ["OBJECTIVES", "DataInfo", "Objective", "ObjectiveConfig", "build_objective"]
