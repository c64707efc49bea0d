"""Datasets, views and loaders. `build_dataset(cfg)` maps a data config to a dataset by its name."""

from __future__ import annotations

from ssl_vit.data.folder import FolderDataset
from ssl_vit.data.loader import StepBatchSampler, build_loader
from ssl_vit.data.synthetic import SyntheticShapes
from ssl_vit.data.views import VIEW_KINDS, ViewBuilder

DATASETS = ("synthetic", "folder")


def build_dataset(cfg, img_size: int):
    """The dataset a data config names; images are rendered (synthetic) or resized (others) to img_size."""
    if cfg.name == "synthetic":
        return SyntheticShapes(cfg.num_samples, img_size, cfg.seed)
    if cfg.name == "folder":
        return FolderDataset(cfg.root)
    raise ValueError(f"unknown dataset {cfg.name!r}; valid choices: {list(DATASETS)}")


__all__ = [
    "DATASETS", "VIEW_KINDS", "FolderDataset", "StepBatchSampler", "SyntheticShapes", "ViewBuilder",
    "build_dataset", "build_loader",
]
