"""The dataset registry: `data=<name>` -> its `DatasetKind` (ssl_vit.data.config), each kind defined once beside its
dataset. Every question the rest of the project asks about a dataset by its name (how to build it, its evaluation
splits, its pixel statistics, whether it has captions, its zero-shot prompts, its config schema) is answered here.
Adding a dataset = its module (the dataset class, its config schema, its DatasetKind), a line below, and
configs/data/<name>.yaml."""

from __future__ import annotations

import os

from ssl_vit.data.captions import CAPTIONS, TUXPAINT
from ssl_vit.data.config import DatasetKind
from ssl_vit.data.folder import FOLDER
from ssl_vit.data.real import DIGITS, FASHION_MNIST
from ssl_vit.data.segmentation import SEGFOLDER, TUXPAINT_SEG
from ssl_vit.data.shard_stream import SHARDS
from ssl_vit.data.subset import limit_samples
from ssl_vit.data.synthetic import SYNTHETIC
from ssl_vit.schema import ConfigError

DATASETS: dict[str, DatasetKind] = {kind.name: kind for kind in (
    SYNTHETIC, FOLDER, CAPTIONS, TUXPAINT, FASHION_MNIST, DIGITS, SHARDS, TUXPAINT_SEG, SEGFOLDER)}


def dataset_kind(name: str) -> DatasetKind:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid choices: {list(DATASETS)}")
    return DATASETS[name]


MAX_AUTO_WORKERS = 16


def loader_workers(cfg, device_type: str, processes_on_node: int = 1) -> int:
    """data.num_workers, or when it is None (auto): on a GPU every core of this process's share but one (at most
    MAX_AUTO_WORKERS), on CPU the dataset kind's `cpu_workers`."""
    if cfg.num_workers is not None:
        return int(cfg.num_workers)
    if device_type == "cpu":
        return dataset_kind(cfg.name).cpu_workers
    cores = len(os.sched_getaffinity(0)) // max(processes_on_node, 1)
    return max(1, min(MAX_AUTO_WORKERS, cores - 1))


def build_dataset(cfg, img_size: int):
    """The training set a data config names; images are rendered (synthetic) or resized (others) to img_size."""
    return dataset_kind(cfg.name).build(cfg, img_size)


def describe_dataset(dataset) -> str:
    """What a data set found, for the start-up log: its own description where it has one (folders, shards,
    captions), else its size and classes."""
    if hasattr(dataset, "describe"):
        return dataset.describe()
    size = f"{len(dataset)} samples" if hasattr(dataset, "__len__") else "a stream of samples"
    classes = getattr(dataset, "classes", None)
    return f"{size}, {len(classes)} classes" if classes else size


def eval_datasets(cfg, img_size: int, seed: int = 0):
    """(train, test) datasets for evaluating on a data config, limited to stratified subsets of
    data.max_train_samples / data.max_test_samples; ConfigError for a kind that cannot be evaluated."""
    kind = dataset_kind(cfg.name)
    if kind.eval_splits is None:
        evaluable = [name for name, other in DATASETS.items() if other.eval_splits is not None]
        raise ConfigError(f"data={cfg.name} cannot be evaluated ({kind.eval_refusal}); valid choices: {evaluable}")
    train, test = kind.eval_splits(cfg, img_size)
    return limit_samples(train, cfg.max_train_samples, seed), limit_samples(test, cfg.max_test_samples, seed)
