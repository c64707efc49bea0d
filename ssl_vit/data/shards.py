"""WebDataset shards: writing them from any sample source, and streaming them into training batches.

A sample in a shard: `<key>.png` or `<key>.jpg` (the image), `<key>.cls` (class index, when labelled),
`<key>.txt` (caption, when there is one) and `<key>.json` (source metadata). This is the layout open_clip and
img2dataset use, so their shards read here too.

Reading (`ShardStream`): `resampled=True` draws shards with replacement for step-based training, seeded per
rank and per worker so no two workers feed the same sample order; a shuffle buffer mixes samples; corrupt or
undecodable samples and samples missing a key the objective needs are skipped and counted. The count rides along
with the next good sample (`skipped` in the batch), so it reaches the training loop from any worker process.
"""

from __future__ import annotations

import io
import logging
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image
from torch.utils.data import DataLoader, default_collate
from torchvision.io import ImageReadMode, decode_image

log = logging.getLogger(__name__)
IMAGE_KEYS = ("png", "jpg", "jpeg", "webp", "ppm", "bmp")
FORMATS = ("auto", "png", "jpg")
PNG_MAX_SIDE = 64  # "auto": lossless png up to this size, jpg above


# ----- writing -----
def encode_image(image: torch.Tensor | np.ndarray, image_format: str = "auto", quality: int = 95) -> tuple[str, bytes]:
    """uint8 (3, H, W) tensor or (H, W, 3) array -> (extension, encoded bytes)."""
    if image_format not in FORMATS:
        raise ValueError(f"unknown image format {image_format!r}; valid choices: {list(FORMATS)}")
    array = image.permute(1, 2, 0).numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if image_format == "auto":
        image_format = "png" if max(array.shape[:2]) <= PNG_MAX_SIDE else "jpg"
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG" if image_format == "png" else "JPEG", quality=quality)
    return image_format, buffer.getvalue()


def write_shards(samples: Iterable[dict], out_dir: str | Path, *, source: str, prefix: str = "shard",
                 samples_per_shard: int = 1000, image_format: str = "auto", classes=None) -> dict:
    """Write samples ({"image": uint8 (3, H, W), "label"?, "text"?, "meta"?}) to out_dir/prefix-000000.tar, ...

    Returns a summary: shard paths, sample count, bytes written, counts per class.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pattern = str(out_dir / f"{prefix}-%06d.tar")
    count, per_class, formats = 0, {}, {}
    with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as sink:
        for index, sample in enumerate(samples):
            extension, data = encode_image(sample["image"], image_format)
            meta = {"source": source, "index": index, **sample.get("meta", {})}
            record = {"__key__": f"{index:09d}", extension: data}
            if sample.get("label") is not None:
                record["cls"] = int(sample["label"])
                per_class[int(sample["label"])] = per_class.get(int(sample["label"]), 0) + 1
                if classes is not None:
                    meta["class_name"] = classes[int(sample["label"])]
            if sample.get("text") is not None:
                record["txt"] = sample["text"]
            record["json"] = meta
            sink.write(record)
            count += 1
            formats[extension] = formats.get(extension, 0) + 1
    shards = sorted(out_dir.glob(f"{prefix}-*.tar"))
    return {"out_dir": str(out_dir), "shards": [str(p) for p in shards], "samples": count,
            "bytes": sum(p.stat().st_size for p in shards), "formats": formats,
            "classes": dict(sorted(per_class.items())), "pattern": _brace_pattern(shards)}


def _brace_pattern(shards: list[Path]) -> str | None:
    if not shards:
        return None
    stem = shards[0].name.rsplit("-", 1)[0]
    return str(shards[0].parent / f"{stem}-{{000000..{len(shards) - 1:06d}}}.tar")


def caption_pairs(root: str | Path) -> Iterator[dict]:
    """Images with a caption file of the same stem (photo.jpg + photo.txt), found recursively, sorted by path."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"caption folder {str(root)!r} does not exist")
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_KEYS):
        caption = path.with_suffix(".txt")
        if not caption.exists():
            continue
        yield {"image": decode_image(str(path), mode=ImageReadMode.RGB), "text": caption.read_text().strip(),
               "meta": {"path": str(path.relative_to(root))}}


# ----- reading -----
def expand_urls(urls: str | list[str]) -> list[str]:
    """Brace patterns, lists and local directories (all their *.tar, sorted) -> shard URLs. Local shards must exist
    and be non-empty: a clear start-up error otherwise."""
    items = [urls] if isinstance(urls, str) else list(urls)
    expanded = []
    for url in (url for item in items for part in str(item).split("::") for url in braceexpand(part)):
        if os.path.isdir(url):
            found = sorted(str(p) for p in Path(url).glob("*.tar"))
            if not found:
                raise FileNotFoundError(f"no .tar shards in directory {url!r} (data.urls)")
            expanded.extend(found)
        else:
            expanded.append(url)
    if not expanded:
        raise ValueError("data.urls is empty: give a brace pattern such as /data/shard-{000000..000099}.tar")
    for url in expanded:
        if "://" in url or url.startswith("pipe:"):
            continue
        if not os.path.isfile(url):
            raise FileNotFoundError(f"shard {url!r} does not exist (data.urls)")
        if os.path.getsize(url) == 0:
            raise ValueError(f"shard {url!r} is empty (data.urls)")
    return expanded


class MissingKeyError(KeyError):
    pass


def decode_sample(sample: dict, need_label: bool, need_text: bool) -> dict:
    """A raw shard sample -> {"image": uint8 (3, H, W), "key", "label"?, "text"?}; raises on anything unusable."""
    image_key = next((k for k in IMAGE_KEYS if k in sample), None)
    if image_key is None:
        raise MissingKeyError(f"sample {sample.get('__key__')} has no image (keys: {sorted(sample)})")
    data = torch.frombuffer(bytearray(sample[image_key]), dtype=torch.uint8)
    out = {"image": decode_image(data, mode=ImageReadMode.RGB), "key": sample.get("__key__")}
    if "cls" in sample:
        out["label"] = int(sample["cls"])
    elif need_label:
        raise MissingKeyError(f"sample {sample.get('__key__')} has no 'cls' (keys: {sorted(sample)})")
    if "txt" in sample:
        out["text"] = sample["txt"].decode("utf-8") if isinstance(sample["txt"], bytes) else sample["txt"]
    elif need_text:
        raise MissingKeyError(f"sample {sample.get('__key__')} has no 'txt' (keys: {sorted(sample)})")
    return out


class DecodeAndCount:
    """Pipeline stage: decode every sample; skip and count the bad ones. Each good sample carries `skipped`, the
    number of bad samples seen since the previous good one (so totals survive worker processes); `skipped` and
    `trailing` on this object hold the in-process totals (num_workers=0)."""

    def __init__(self, views, need_label: bool, need_text: bool):
        self.views, self.need_label, self.need_text = views, need_label, need_text
        self.skipped = self.trailing = 0

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        pending = 0
        for sample in samples:
            try:
                out = self.views(decode_sample(sample, self.need_label, self.need_text))
            except (MissingKeyError, RuntimeError, ValueError, OSError) as err:
                pending += 1
                self.skipped += 1
                log.debug("skipping bad sample: %s", err)
                continue
            out["skipped"] = pending
            pending = 0
            yield out
        self.trailing = pending


def _worker_seed(seed: int) -> int:
    rank, _, worker, _ = wds.utils.pytorch_worker_info()
    return seed * 1_000_003 + rank * 1000 + worker


def _shuffle(samples: Iterator, buffer_size: int, seed: int) -> Iterator:
    """Shuffle through a buffer, seeded per rank and worker (webdataset's own shuffle seeds all workers alike)."""
    rng = random.Random(_worker_seed(seed))
    buffer = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= buffer_size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer


class ShardStream:
    """Training batches from WebDataset shards (see the module docstring)."""

    def __init__(self, urls, num_classes: int | None = None, resampled: bool = True, shuffle_buffer: int = 1000):
        self.urls = expand_urls(urls)
        self.classes = tuple(range(num_classes)) if num_classes else ()
        self.resampled, self.shuffle_buffer = resampled, shuffle_buffer

    def pipeline(self, views, batch_size: int | None, seed: int = 0, need_label: bool = False,
                 need_text: bool = False) -> tuple[wds.DataPipeline, DecodeAndCount]:
        decode = DecodeAndCount(views, need_label, need_text)
        if self.resampled:
            stages = [wds.ResampledShards(self.urls, seed=seed, deterministic=True)]
        else:
            stages = [wds.SimpleShardList(self.urls), wds.split_by_node, wds.split_by_worker]
        stages.append(wds.tarfile_to_samples(handler=wds.warn_and_continue))  # a broken tar: logged, skipped
        if self.shuffle_buffer > 1:
            stages.append(lambda samples: _shuffle(samples, self.shuffle_buffer, seed))
        stages.append(decode)
        if batch_size:
            stages.append(wds.batched(batch_size, collation_fn=default_collate, partial=not self.resampled))
        return wds.DataPipeline(*stages), decode

    def loader(self, views, batch_size: int, *, seed: int = 0, start: int = 0, num_workers: int = 0,
               pin_memory: bool = False, need_label: bool = False, need_text: bool = False) -> DataLoader:
        # A resumed run continues with fresh draws (seeded by the step) rather than replaying the start.
        pipeline, _ = self.pipeline(views, batch_size, seed * 1_000_003 + start, need_label, need_text)
        return DataLoader(pipeline, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                          persistent_workers=num_workers > 0)
