"""Named sample sources for writing shards: each yields {"image": uint8 (3, H, W), "label"?, "text"?, "meta"?}."""

from __future__ import annotations

from collections.abc import Iterator

from ssl_vit.data.folder import FolderDataset
from ssl_vit.data.real import FASHION_MNIST_DIR, Digits, FashionMNIST
from ssl_vit.data.shards import caption_pairs
from ssl_vit.data.synthetic import SyntheticShapes

SOURCES = ("synthetic", "folder", "captions", "fashion_mnist", "digits")


def _indexed(dataset) -> Iterator[dict]:
    for index in range(len(dataset)):
        yield dataset[index]


def open_source(name: str, *, root=None, split: str = "train", num_samples: int = 10000, img_size: int = 64,
                seed: int = 0) -> tuple[Iterator[dict], tuple | None]:
    """(samples, class names or None) of a named source."""
    if name == "synthetic":
        dataset = SyntheticShapes(num_samples, img_size, seed)
    elif name == "folder":
        if not root:
            raise ValueError("the folder source needs --root (a directory of class subfolders)")
        dataset = FolderDataset(root)
    elif name == "captions":
        if not root:
            raise ValueError("the captions source needs --root (images with same-named .txt captions)")
        return caption_pairs(root), None
    elif name == "fashion_mnist":
        dataset = FashionMNIST(root or FASHION_MNIST_DIR, split)
    elif name == "digits":
        dataset = Digits(split)
    else:
        raise ValueError(f"unknown source {name!r}; valid choices: {list(SOURCES)}")
    return _indexed(dataset), tuple(dataset.classes)
