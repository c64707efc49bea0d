"""Named sample sources for writing shards: each yields {"image": uint8 (3, H, W), "label"?, "text"?, "meta"?}.
Samples that cannot be read (a corrupt image file) are left out, logged and counted (`samples.skipped`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from ssl_vit.data.captions import TUXPAINT_DIR, CaptionFolder, TuxPaintStamps
from ssl_vit.data.errors import BadSampleError, SkipLog
from ssl_vit.data.folder import FolderDataset
from ssl_vit.data.real import FASHION_MNIST_DIR, Digits, FashionMNIST
from ssl_vit.data.synthetic import SyntheticShapes

log = logging.getLogger(__name__)
SOURCES = ("synthetic", "folder", "captions", "tuxpaint", "fashion_mnist", "digits")


class ReadableSamples:
    """dataset[0], dataset[1], ... without the samples that cannot be read (logged, the first few by name; counted
    in `skipped`)."""

    def __init__(self, dataset):
        self.dataset, self.skipped = dataset, 0

    def __iter__(self) -> Iterator[dict]:
        skip_log = SkipLog(log, "image")
        for index in range(len(self.dataset)):
            try:
                yield self.dataset[index]
            except BadSampleError as err:
                self.skipped += 1
                skip_log(str(err))


def open_source(name: str, *, root=None, split: str = "train", num_samples: int = 10000, img_size: int = 64,
                seed: int = 0) -> tuple[Iterable[dict], tuple | None]:
    """(samples, class names or None) of a named source; `samples.skipped` counts unreadable ones left out."""
    if name == "synthetic":
        dataset = SyntheticShapes(num_samples, img_size, seed)
    elif name == "folder":
        if not root:
            raise ValueError("the folder source needs --root (a directory of class subfolders)")
        dataset = FolderDataset(root)
    elif name == "captions":
        if not root:
            raise ValueError("the captions source needs --root (images with same-named .txt captions)")
        dataset = CaptionFolder(root, split)
    elif name == "tuxpaint":
        dataset = TuxPaintStamps(root or TUXPAINT_DIR, split)
    elif name == "fashion_mnist":
        dataset = FashionMNIST(root or FASHION_MNIST_DIR, split)
    elif name == "digits":
        dataset = Digits(split)
    else:
        raise ValueError(f"unknown source {name!r}; valid choices: {list(SOURCES)}")
    return ReadableSamples(dataset), tuple(dataset.classes) or None
