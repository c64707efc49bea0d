"""Stratified subsets of labelled map-style datasets (`data.max_train_samples`, `data.max_test_samples`)."""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset


def labels_of(dataset) -> np.ndarray | None:
    """Every sample's label without decoding images, when the dataset exposes them (`targets` or `labels`)."""
    for attr in ("targets", "labels"):
        if getattr(dataset, attr, None) is not None:
            return np.asarray(getattr(dataset, attr))
    return None


def stratified_indices(labels: np.ndarray | None, total: int, size: int, seed: int = 0) -> np.ndarray:
    """`size` sorted indices of `total` samples, each class keeping its share (largest remainders round), drawn at
    random within each class; plain random draws when labels are unknown."""
    rng = np.random.default_rng(seed)
    if size >= total:
        return np.arange(total)
    if labels is None:
        return np.sort(rng.permutation(total)[:size])
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * size / total
    quota = np.floor(exact).astype(int)
    quota[np.argsort(quota - exact)[: size - quota.sum()]] += 1  # largest fractional parts get the remainder
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:q] for c, q in zip(classes, quota, strict=True)]
    return np.sort(np.concatenate(chosen))


class SubsetDataset(Dataset):
    """The samples at `indices`, keeping the dataset's `classes`, `segmentation_classes` and `targets`."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, [int(i) for i in indices]
        self.classes = dataset.classes
        self.segmentation_classes = getattr(dataset, "segmentation_classes", ())
        labels = labels_of(dataset)
        self.targets = None if labels is None else labels[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return self.dataset[self.indices[index]]


def limit_samples(dataset, max_samples: int | None, seed: int = 0):
    """A stratified subset of at most max_samples (the dataset itself when it is small enough or no limit)."""
    if max_samples is None or len(dataset) <= max_samples:
        return dataset
    return SubsetDataset(dataset, stratified_indices(labels_of(dataset), len(dataset), max_samples, seed))
