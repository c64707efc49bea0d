"""Named sample sources for writing shards: each yields {"image": uint8 (3, H, W), "label"?, "text"?, "meta"?}.
Samples that cannot be read (a corrupt image file) are left out, logged and counted (`samples.skipped`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import fields

from omegaconf import OmegaConf

from ssl_vit.data.errors import BadSampleError, SkipLog
from ssl_vit.data.registry import DATASETS

log = logging.getLogger(__name__)
SOURCES = tuple(name for name, kind in DATASETS.items() if not kind.stream)  # every kind but shard streams


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
    """(samples, class names or None) of a named source; `samples.skipped` counts unreadable ones left out. The
    options fill the dataset kind's own config (those it has)."""
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r}; valid choices: {list(SOURCES)}")
    kind = DATASETS[name]
    options = {f.name: f for f in fields(kind.config)}
    given = {"root": root, "split": split, "num_samples": num_samples, "seed": seed}
    cfg = OmegaConf.merge(OmegaConf.structured(kind.config),
                          {k: v for k, v in given.items() if k in options and v is not None})
    if "root" in options and OmegaConf.is_missing(cfg, "root"):
        example = options["root"].metadata.get("example", "")
        raise ValueError(f"the {name} source needs --root ({example.removeprefix('data.root=')})")
    dataset = kind.build(cfg, img_size)
    return ReadableSamples(dataset), tuple(dataset.classes) or None
