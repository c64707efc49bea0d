"""Real labelled data that ships through package registries (nothing is downloaded at run time).

- Fashion-MNIST from Debian's `dataset-fashion-mnist` (idx files, 60k train / 10k test, 28x28 grey, MIT licence):
  `apt-get update && apt-get install -y dataset-fashion-mnist` (or `scripts/get_data.sh`).
- scikit-learn's bundled `load_digits` (1,797 8x8 grey digits): the fast tier for tests.

Grey images are repeated to 3 channels; resizing to the model's size is the view builder's job.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ssl_vit.data.config import DataConfig, DatasetKind
from ssl_vit.schema import checked

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
FASHION_MNIST_INSTALL = "apt-get update && apt-get install -y dataset-fashion-mnist   (or: bash scripts/get_data.sh)"
SPLITS = ("train", "test")

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file (the MNIST format), gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an idx file (magic bytes {data[:4].hex()})")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    array = np.frombuffer(data, dtype=_IDX_DTYPES[data[2]], offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {array.size} values")
    return array.reshape(shape)


def _grey_to_rgb(image: np.ndarray) -> torch.Tensor:
    return torch.tensor(image, dtype=torch.uint8).unsqueeze(0).expand(3, -1, -1).contiguous()


class FashionMNIST(Dataset):
    classes = FASHION_MNIST_CLASSES

    def __init__(self, root: str | Path = FASHION_MNIST_DIR, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid choices: {list(SPLITS)}")
        prefix = "train" if split == "train" else "t10k"
        root = Path(root)
        paths = [root / f"{prefix}-{kind}-idx{dim}-ubyte{ext}" for kind, dim in (("images", 3), ("labels", 1))
                 for ext in (".gz", "")]
        images = next((p for p in paths[:2] if p.exists()), None)
        labels = next((p for p in paths[2:] if p.exists()), None)
        if images is None or labels is None:
            raise FileNotFoundError(
                f"Fashion-MNIST {split} files not found under {root} (looked for {paths[0].name} and "
                f"{paths[2].name}); install them with: {FASHION_MNIST_INSTALL}"
            )
        self.images, self.labels = read_idx(images), read_idx(labels)
        if len(self.images) != len(self.labels):
            raise ValueError(f"{images} has {len(self.images)} images but {labels} {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"image": _grey_to_rgb(self.images[index]), "label": int(self.labels[index])}


class Digits(Dataset):
    """sklearn's 8x8 digits (values 0-16 scaled to 0-255); a fixed, stratified-enough split: every 5th sample is
    test (359 images), the rest train (1,438)."""

    classes = tuple(str(d) for d in range(10))

    def __init__(self, split: str = "train"):
        from sklearn.datasets import load_digits  # heavy (scikit-learn): only for data=digits

        if split not in (*SPLITS, "all"):
            raise ValueError(f"unknown split {split!r}; valid choices: {[*SPLITS, 'all']}")
        digits = load_digits()
        images = np.round(digits.images * (255 / 16)).astype(np.uint8)
        index = np.arange(len(images))
        keep = index if split == "all" else index[(index % 5 == 4) == (split == "test")]
        self.images, self.labels = images[keep], digits.target[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"image": _grey_to_rgb(self.images[index]), "label": int(self.labels[index])}


@dataclass
class FashionMNISTDataConfig(DataConfig):
    name: str = "fashion_mnist"
    root: str = FASHION_MNIST_DIR
    split: str = checked("train", choices=SPLITS)


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    split: str = checked("train", choices=(*SPLITS, "all"))


FASHION_MNIST = DatasetKind(
    name="fashion_mnist", config=FashionMNISTDataConfig,
    build=lambda cfg, img_size: FashionMNIST(cfg.root, cfg.split),
    eval_splits=lambda cfg, img_size: (FashionMNIST(cfg.root, "train"), FashionMNIST(cfg.root, "test")),
    mean=(0.286,) * 3, std=(0.353,) * 3,
    templates=("a photo of a {}.", "a black and white photo of a {}.", "a low resolution photo of a {}.",
               "a photo of the {}, a type of clothing."))
DIGITS = DatasetKind(
    name="digits", config=DigitsDataConfig, build=lambda cfg, img_size: Digits(cfg.split),
    eval_splits=lambda cfg, img_size: (Digits("train"), Digits("test")), mean=(0.3,) * 3, std=(0.4,) * 3,
    templates=("a photo of the number {}.", "a low resolution photo of the digit {}.", "the digit {}."))
