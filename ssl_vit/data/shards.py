"""WebDataset shards: writing them from any sample source, and reading and decoding them.

A sample in a shard: `<key>.png` or `<key>.jpg` (the image), `<key>.cls` (class index, when labelled),
`<key>.txt` (caption, when there is one) and `<key>.json` (source metadata). This is the layout open_clip and
img2dataset use, so their shards read here too. Beside the shards, `sizes.json` maps each shard's file name to its
number of samples (open_clip's convention), so a reader can tell how many samples a broken shard lost.

Reading: `read_shard` yields one shard's samples and `DecodeAndCount` turns them into views; the stream over many
shards (drawing, shuffling, batching, its position for exact resumes) is `ssl_vit.data.shard_stream.ShardStream`.
Nothing is lost silently:
- corrupt or undecodable samples and samples missing a key the objective needs are skipped and counted;
- a truncated or corrupt tar (read errors, and Python's tarfile ending an archive quietly at an invalid header) is
  logged by name and its lost samples counted: expected (sizes.json) minus delivered, else 1 per broken shard;
- a stream that cannot deliver anything (every shard unreadable, every sample bad, or a worker without shards)
  raises `NoUsableShardsError` instead of hanging.
The counts ride along with the next good sample (`skipped` in the batch), so they reach the training loop from any
worker process. The first few bad samples and shards of each process are logged with their reason.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image
from webdataset.tariterators import base_plus_ext, valid_sample

from ssl_vit.data.decode import DEFAULT_MAX_PIXELS, decode_rgb
from ssl_vit.data.errors import BadSampleError, MissingKeyError, NoUsableShardsError, SkipLog

log = logging.getLogger(__name__)
IMAGE_KEYS = ("png", "jpg", "jpeg", "webp", "ppm", "bmp", "tif", "tiff", "gif")
FORMATS = ("auto", "png", "jpg")
PNG_MAX_SIDE = 64  # "auto": lossless png up to this size, jpg above
SIZES_FILE = "sizes.json"
MAX_CONSECUTIVE_BAD = 10_000  # bad samples in a row (no good one between) after which a stream is declared unusable
SHARD_END = "__shard_end__"  # marker item a shard reader yields after each shard: its url, delivered and lost counts


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
    and their counts to out_dir/sizes.json (merged with the entries of other prefixes already there).

    Returns a summary: shard paths, sample count, bytes written, counts per class.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pattern = str(out_dir / f"{prefix}-%06d.tar")
    count, per_class, formats, sizes = 0, {}, {}, {}
    sink = wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0,
                           post=lambda fname: sizes.__setitem__(Path(fname).name, sink.count))
    with sink:
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
    _write_sizes(out_dir, sizes)
    shards = sorted(out_dir.glob(f"{prefix}-*.tar"))
    return {"out_dir": str(out_dir), "shards": [str(p) for p in shards], "samples": count,
            "bytes": sum(p.stat().st_size for p in shards), "formats": formats, "sizes": sizes,
            "classes": dict(sorted(per_class.items())), "pattern": _brace_pattern(shards)}


def _write_sizes(out_dir: Path, sizes: dict) -> None:
    path = out_dir / SIZES_FILE
    merged = {**_load_sizes_file(path), **sizes}
    tmp = path.with_name(f".{SIZES_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
    os.replace(tmp, path)


def _brace_pattern(shards: list[Path]) -> str | None:
    if not shards:
        return None
    stem = shards[0].name.rsplit("-", 1)[0]
    return str(shards[0].parent / f"{stem}-{{000000..{len(shards) - 1:06d}}}.tar")




# ----- finding shards -----
def _is_remote(url: str) -> bool:
    return "://" in url or url.startswith("pipe:")


def _local(path: str) -> str:
    """A file a directory or a glob found, as a path that stays one: a bare name such as "pipe:cmd;.tar" (found
    in ".") becomes "./pipe:cmd;.tar", never a URL that webdataset would open with the shell."""
    return path if os.sep in path else os.path.join(".", path)


def expand_urls(urls: str | list[str]) -> list[str]:
    """Brace patterns, globs (`data/shapes/*.tar`), `::`-joined lists, lists and local directories (all their *.tar,
    sorted) -> shard URLs. Local shards must exist (a clear start-up error otherwise); zero-byte shards are left out
    with a warning naming them, and only if none is left is that an error."""
    items = [urls] if isinstance(urls, str) else list(urls)
    expanded = []
    for url in (url for item in items for part in str(item).split("::") for url in braceexpand(part)):
        if not _is_remote(url) and os.path.isdir(url):
            found = sorted(_local(str(p)) for p in Path(url).glob("*.tar"))
            if not found:
                raise FileNotFoundError(f"no .tar shards in directory {url!r} (data.urls)")
            expanded.extend(found)
        elif not _is_remote(url) and glob.has_magic(url):
            found = sorted(_local(p) for p in glob.glob(url) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"no shard matches the pattern {url!r} (data.urls)")
            expanded.extend(found)
        else:
            expanded.append(url)
    if not expanded:
        raise ValueError("data.urls is empty: give a directory, a glob such as 'data/shapes/*.tar' or a brace pattern "
                         "such as 'data.urls=\"/data/shard-{000000..000099}.tar\"'")
    usable, empty = [], []
    for url in expanded:
        if _is_remote(url):
            usable.append(url)
            continue
        if not os.path.isfile(url):
            raise FileNotFoundError(f"shard {url!r} does not exist (data.urls)")
        if os.path.getsize(url) == 0:
            log.warning("shard %r is empty (0 bytes): left out", url)
            empty.append(url)
        else:
            usable.append(url)
    if not usable:
        raise NoUsableShardsError(f"every shard of data.urls is empty (0 bytes): {empty[:5]}"
                                  + (f" and {len(empty) - 5} more" if len(empty) > 5 else ""))
    return usable


def _load_sizes_file(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        sizes = json.loads(path.read_text())
        return {str(name): int(count) for name, count in sizes.items()}
    except (OSError, ValueError, TypeError, AttributeError) as err:
        log.warning("ignoring %s: not a {shard name: sample count} JSON object (%s)", path, err)
        return {}


def read_sizes(urls: list[str]) -> dict[str, int]:
    """{url: samples} for the local shards whose directory has a sizes.json naming them."""
    tables = {folder: _load_sizes_file(Path(folder) / SIZES_FILE)
              for folder in {os.path.dirname(url) for url in urls if not _is_remote(url)}}
    return {url: tables[os.path.dirname(url)][os.path.basename(url)] for url in urls
            if not _is_remote(url) and os.path.basename(url) in tables[os.path.dirname(url)]}


# ----- reading one shard -----
class _TailWatch:
    """A read-only file wrapper that remembers where the last non-zero byte read was, and the last few chunks, so
    that after tarfile stops one can tell a clean end (zero padding) from a broken header or data beyond the end."""

    def __init__(self, raw):
        self.raw, self.pos, self.last_nonzero = raw, 0, -1
        self.recent: list[tuple[int, bytes]] = []  # (start position, chunk) of the last reads

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        kept = len(data.rstrip(b"\0"))
        if kept:
            self.last_nonzero = self.pos + kept - 1
        self.recent = [*self.recent[-3:], (self.pos, data)]
        self.pos += len(data)
        return data

    def block(self, start: int) -> bytes | None:
        """The bytes [start, start + 512) if still among the recent chunks (b"" at the end of the file)."""
        data = b"".join(chunk for chunk_start, chunk in self.recent if chunk_start + len(chunk) > start)
        first = next((chunk_start for chunk_start, chunk in self.recent if chunk_start + len(chunk) > start), None)
        if first is None:
            return b"" if start >= self.pos else None
        return data[start - first: start - first + tarfile.BLOCKSIZE] if first <= start else None

    def close(self) -> None:
        self.raw.close()


def _end_problem(tar: tarfile.TarFile, watch: _TailWatch) -> str | None:
    """Why an archive that tarfile finished without an error is broken, or None. (Python's tarfile ends an archive
    quietly at an invalid or truncated header after the first member.)"""
    if getattr(tar.fileobj, "comptype", "tar") != "tar":
        return None  # compressed: offsets are in the decompressed stream; rely on read errors only
    end = tar.offset  # where tarfile stopped: the end-of-archive block, or the header it could not read
    block = watch.block(end)
    if block is not None and block.strip(b"\0"):
        return f"invalid tar header at byte {end}; the rest of the file was not read"
    if block == b"":
        return f"the file ends at byte {end} without the end-of-archive marker (truncated?)"
    while watch.last_nonzero < end and watch.read(1 << 20):
        pass  # read on: a clean end has only zero padding after the end-of-archive marker
    if watch.last_nonzero >= end:
        return (f"data after the end-of-archive marker at byte {end} (a concatenated archive or trailing junk) was "
                "not read")
    return None


def read_shard(url: str, expected: int | None = None, skip_log: SkipLog | None = None,
               skip: int = 0) -> Iterator[dict]:
    """The samples of one shard (dicts of {"__key__", "__url__", extension: bytes}, grouped by key as webdataset
    does), then a SHARD_END marker {SHARD_END: url, "delivered", "lost", "error"}. `skip`: read past the first
    samples without yielding them (a resumed stream; they count as delivered).

    Never raises for a broken shard: a read error or an early end is reported in the marker (and logged), with
    `lost` = expected - delivered when the shard's size is known, else 1 (at least one sample is cut off)."""
    delivered, error, current = 0, None, None
    raw = None
    try:
        raw = wds.gopen(url) if _is_remote(url) else open(url, "rb")
        watch = _TailWatch(raw)
        with tarfile.open(fileobj=watch, mode="r|*") as tar:
            for info in tar:
                if not info.isreg():
                    continue
                data = tar.extractfile(info).read()
                tar.members = []  # stream mode keeps every header otherwise
                prefix, suffix = base_plus_ext(info.name)
                if prefix is None or os.path.basename(info.name).startswith("__"):
                    continue  # no extension, or webdataset's __meta__ files
                if current is None or prefix != current["__key__"]:
                    if valid_sample(current):
                        if delivered >= skip:
                            yield current
                        delivered += 1
                    current = {"__key__": prefix, "__url__": url}
                current.setdefault(suffix.lower(), data)  # a duplicate file of a key: the first one wins
            error = _end_problem(tar, watch)
    except Exception as err:  # tarfile.ReadError, OSError, EOFError, zlib.error, ...: a broken shard, not a crash
        error = f"{type(err).__name__}: {err}"
    finally:
        if raw is not None:
            raw.close()
    if valid_sample(current):  # the files of the last key read (before any error): if it lacks a file the objective
        if delivered >= skip:  # needs, decoding skips and counts it
            yield current
        delivered += 1
    if expected is not None:
        lost = max(expected - delivered, 0)
        if lost and error is None:
            error = f"holds {delivered} samples but {SIZES_FILE} says {expected}"
    else:
        lost = 1 if error else 0
    if error and skip_log is not None:
        skip_log(f"{url}: {error}; {lost} sample(s) lost"
                 + ("" if expected is not None else f" (at least; no {SIZES_FILE} entry for it)"), count=1)
    yield {SHARD_END: url, "delivered": delivered, "lost": lost, "error": error}


# ----- the stream -----
def decode_sample(sample: dict, need_label: bool, need_text: bool,
                  max_pixels: int | None = DEFAULT_MAX_PIXELS) -> dict:
    """A raw shard sample -> {"image": uint8 (3, H, W), "key", "label"?, "text"?}; raises BadSampleError (or its
    MissingKeyError) naming the sample and its shard on anything unusable."""
    key, where = sample.get("__key__"), f"sample {sample.get('__key__')} of {sample.get('__url__')}"
    image_key = next((k for k in IMAGE_KEYS if k in sample), None)
    if image_key is None:
        raise MissingKeyError(f"{where} has no image (keys: {sorted(k for k in sample if not k.startswith('__'))})")
    if need_label and "cls" not in sample:
        raise MissingKeyError(f"{where} has no 'cls' (keys: {sorted(k for k in sample if not k.startswith('__'))})")
    if need_text and "txt" not in sample:
        raise MissingKeyError(f"{where} has no 'txt' (keys: {sorted(k for k in sample if not k.startswith('__'))})")
    try:
        out = {"image": decode_rgb(sample[image_key], max_pixels=max_pixels), "key": key}
        if "cls" in sample:
            out["label"] = int(sample["cls"])
        if "txt" in sample:
            out["text"] = sample["txt"].decode("utf-8") if isinstance(sample["txt"], bytes) else sample["txt"]
    except ValueError as err:  # BadSampleError from the decoder, a bad cls number, a caption that is not utf-8
        raise BadSampleError(f"{where}: {err}") from None
    return out


class DecodeAndCount:
    """Stream stage: decode every sample and make its views under its own seed; skip and count the bad ones, and the
    samples lost in broken shards (SHARD_END markers). Its input: markers and (seed, raw sample) pairs. Each good
    sample carries `seed`, `key` (when the views drop the sample's own: "<shard file name>/<key>") and `skipped`,
    the number of bad or lost samples since the previous good one (so totals survive worker processes); `skipped`
    and `trailing` on this object hold the in-process totals (num_workers=0). `max_consecutive_bad` bad samples in a
    row raise NoUsableShardsError."""

    def __init__(self, views, need_label: bool, need_text: bool, max_consecutive_bad: int = MAX_CONSECUTIVE_BAD,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS):
        self.views, self.need_label, self.need_text, self.max_pixels = views, need_label, need_text, max_pixels
        self.max_consecutive_bad = max_consecutive_bad
        self.skipped = self.trailing = 0
        self.skip_log = SkipLog(log, "sample")

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        pending = in_a_row = 0
        for item in samples:
            if isinstance(item, dict):  # a SHARD_END marker
                pending += item["lost"]
                self.skipped += item["lost"]
                continue
            seed, sample = item
            try:
                decoded = decode_sample(sample, self.need_label, self.need_text, self.max_pixels)
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(seed)  # the CPU generator alone (see loader.SeededViews)
                    out = self.views(decoded)
            except BadSampleError as err:
                pending += 1
                self.skipped += 1
                in_a_row += 1
                self.skip_log(str(err))
                if in_a_row >= self.max_consecutive_bad:
                    raise NoUsableShardsError(
                        f"the last {in_a_row} samples of the shard stream were all unusable (the last: {err}); check "
                        "data.urls, and that the shards hold what the objective needs (labels: 'cls', captions: "
                        "'txt')") from None
                continue
            out.setdefault("key", f"{os.path.basename(sample['__url__'])}/{sample['__key__']}")
            out["seed"], out["skipped"] = seed, pending
            pending = in_a_row = 0
            yield out
        self.trailing = pending
