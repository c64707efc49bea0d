"""Datasets, views and loaders. `build_dataset(cfg)` maps a data config to a dataset by its name, and
`make_loader` gives the training batches of either kind (map-style datasets, or WebDataset shard streams).

Bad samples are skipped and counted (the batch's `skipped` entry), never silently lost; data that cannot be used at
all raises a `DataError` (see ssl_vit/data/errors.py) with a message that names the problem."""

from __future__ import annotations

from ssl_vit.data.captions import CaptionFolder, TuxPaintStamps
from ssl_vit.data.decode import decode_rgb
from ssl_vit.data.errors import BadSampleError, DataError, NoUsableSamplesError, NoUsableShardsError
from ssl_vit.data.folder import FolderDataset
from ssl_vit.data.loader import StepBatchSampler, build_loader
from ssl_vit.data.real import Digits, FashionMNIST
from ssl_vit.data.shards import ShardStream
from ssl_vit.data.synthetic import SyntheticShapes
from ssl_vit.data.views import VIEW_KINDS, ViewBuilder

DATASETS = ("synthetic", "folder", "captions", "tuxpaint", "fashion_mnist", "digits", "wds")


def build_dataset(cfg, img_size: int):
    """The dataset a data config names; images are rendered (synthetic) or resized (others) to img_size."""
    if cfg.name == "synthetic":
        return SyntheticShapes(cfg.num_samples, img_size, cfg.seed)
    if cfg.name == "folder":
        return FolderDataset(cfg.root)
    if cfg.name == "captions":
        return CaptionFolder(cfg.root, cfg.split, cfg.test_fraction)
    if cfg.name == "tuxpaint":
        return TuxPaintStamps(cfg.root, cfg.split, cfg.test_fraction)
    if cfg.name == "fashion_mnist":
        return FashionMNIST(cfg.root, cfg.split)
    if cfg.name == "digits":
        return Digits(cfg.split)
    if cfg.name == "wds":
        return ShardStream(cfg.urls, cfg.num_classes, cfg.resampled, cfg.shuffle_buffer)
    raise ValueError(f"unknown dataset {cfg.name!r}; valid choices: {list(DATASETS)}")


def make_loader(dataset, views: ViewBuilder, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                start: int = 0, num_workers: int = 0, pin_memory: bool = False, repeats: int = 1):
    """Batches for one rank from micro-step `start` on (exactly resumable for map-style datasets). `repeats`:
    repeated augmentation, for map-style datasets (a shard stream has no epochs to repeat within)."""
    if isinstance(dataset, ShardStream):
        return dataset.loader(views, batch_size, seed=seed, start=start, num_workers=num_workers,
                              pin_memory=pin_memory, need_label="label" in views.views,
                              need_text="text" in views.views)
    return build_loader(dataset, views, batch_size, rank=rank, world_size=world_size, seed=seed, start=start,
                        num_workers=num_workers, pin_memory=pin_memory, repeats=repeats)


__all__ = [
    "DATASETS", "VIEW_KINDS", "BadSampleError", "CaptionFolder", "DataError", "Digits", "FashionMNIST", "FolderDataset",
    "NoUsableSamplesError", "NoUsableShardsError", "ShardStream", "StepBatchSampler", "SyntheticShapes",
    "TuxPaintStamps", "ViewBuilder", "build_dataset", "build_loader", "decode_rgb", "make_loader",
]
