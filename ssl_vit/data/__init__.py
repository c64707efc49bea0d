"""Datasets, views and loaders: the registry of dataset kinds (`ssl_vit.data.registry`: build, splits, statistics,
captions, templates, schema per `data=<name>`), the views an objective reads (`views`, `multicrop`, `augreg`), and
step-indexed loaders for map-style datasets and WebDataset shard streams (`loader`, `shards`).

Bad samples are skipped and counted (the batch's `skipped` entry), never silently lost; data that cannot be used at
all raises a `DataError` (see ssl_vit/data/errors.py) with a message that names the problem."""

from ssl_vit.data.captions import CaptionFolder, TuxPaintStamps
from ssl_vit.data.decode import decode_rgb
from ssl_vit.data.errors import BadSampleError, DataError, NoUsableSamplesError, NoUsableShardsError
from ssl_vit.data.folder import FolderDataset
from ssl_vit.data.loader import build_loader, make_loader
from ssl_vit.data.real import Digits, FashionMNIST
from ssl_vit.data.registry import (
    DATASETS,
    build_dataset,
    dataset_kind,
    describe_dataset,
    eval_datasets,
    loader_workers,
)
from ssl_vit.data.shard_stream import ShardStream
from ssl_vit.data.step_sampler import StepBatchSampler
from ssl_vit.data.synthetic import SyntheticShapes
from ssl_vit.data.views import VIEW_KINDS, ViewBuilder

__all__ = [
    "DATASETS", "VIEW_KINDS", "BadSampleError", "CaptionFolder", "DataError", "Digits", "FashionMNIST", "FolderDataset",
    "NoUsableSamplesError", "NoUsableShardsError", "ShardStream", "StepBatchSampler", "SyntheticShapes",
    "TuxPaintStamps", "ViewBuilder", "build_dataset", "build_loader", "dataset_kind", "decode_rgb", "describe_dataset",
    "eval_datasets",
    "loader_workers", "make_loader",
]
