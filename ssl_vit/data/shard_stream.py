"""The training stream over WebDataset shards, with a position that checkpoints hold, so a resumed run sees exactly
the samples (and augmentations) an uninterrupted one would.

Each loader worker of each rank runs its own stream (`WorkerStream`): shard reads ("draws") numbered 0, 1, 2, ...,
then a shuffle buffer, decoding (`shards.DecodeAndCount`) and batching.
- `resampled=True` (step-based training, as open_clip): draw d reads a shard chosen by a seed of (stream seed, rank,
  worker, d), so shards come with replacement and no two workers feed the same order.
- `resampled=False`: every shard once per epoch, the epoch's shuffled order split over ranks, then workers; draw d
  is shard d % n of this worker's share of epoch d // n. It starts the next epoch by itself, so both are endless.
- A sample's augmentation runs under a seed of (stream seed, draw, index in its shard), not under the worker
  process's generator, so it does not depend on how far the process has run.

Its position is a small state (`WorkerStream.state_dict`): the draw and how many samples of it were taken, the
shuffle buffer as (draw, index) references and the shuffle generator's state. torchdata's `StatefulDataLoader`
collects each worker's state as of the last batch the training loop took (it knows which worker made which batch),
and the trainer saves it per rank in the checkpoint; resuming re-reads the buffered samples from their shards and
skips into the current one.
"""

from __future__ import annotations

import itertools
import logging
import random
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import webdataset as wds
from omegaconf import MISSING
from torch.utils.data import IterableDataset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from ssl_vit.data.config import DataConfig, DatasetKind
from ssl_vit.data.decode import DEFAULT_MAX_PIXELS
from ssl_vit.data.errors import NoUsableShardsError, SkipLog
from ssl_vit.data.seeds import sample_seed
from ssl_vit.data.shards import MAX_CONSECUTIVE_BAD, SHARD_END, DecodeAndCount, expand_urls, read_shard, read_sizes
from ssl_vit.data.workers import ignore_stop_signals
from ssl_vit.schema import checked

log = logging.getLogger(__name__)


def _examples(errors: dict[str, str], limit: int = 3) -> str:
    shown = "; ".join(f"{url}: {error}" for url, error in list(errors.items())[:limit])
    return shown + (f"; and {len(errors) - limit} more" if len(errors) > limit else "")


class ShardStream:
    """Training batches from WebDataset shards (see the module docstring)."""

    def __init__(self, urls, num_classes: int | None = None, resampled: bool = True, shuffle_buffer: int = 1000,
                 max_consecutive_bad: int = MAX_CONSECUTIVE_BAD, max_pixels: int | None = DEFAULT_MAX_PIXELS):
        self.urls = expand_urls(urls)
        self.sizes = read_sizes(self.urls)
        self.classes = tuple(range(num_classes)) if num_classes else ()
        self.resampled, self.shuffle_buffer = resampled, shuffle_buffer
        self.max_consecutive_bad, self.max_pixels = max_consecutive_bad, max_pixels

    def describe(self) -> str:
        samples = f", {sum(self.sizes.values())} samples in the {len(self.sizes)} listed in sizes.json" \
            if self.sizes else ""
        classes = f", {len(self.classes)} classes" if self.classes else ""
        return f"{len(self.urls)} WebDataset shard(s){samples}{classes}"

    def pipeline(self, views, batch_size: int | None, seed: int = 0, need_label: bool = False,
                 need_text: bool = False, epochs: int | None = None, schedule=None,
                 start: int = 0) -> tuple[ShardBatches, DecodeAndCount]:
        """The sample (batch_size None) or batch stream; endless unless `epochs` (resampled=False only) is given.
        `schedule`: NaFlex batch shapes per micro-step (ssl_vit.data.naflex), from micro-step `start`."""
        if epochs is not None and self.resampled:
            raise ValueError("epochs applies to resampled=False only (resampled draws have no epochs)")
        decode = DecodeAndCount(views, need_label, need_text, self.max_consecutive_bad, self.max_pixels)
        return ShardBatches(self, decode, batch_size, seed, getattr(views, "collate", default_collate), epochs,
                            schedule, start), decode

    def loader(self, views, batch_size: int, *, seed: int = 0, start: int = 0, num_workers: int = 0,
               pin_memory: bool = False, need_label: bool = False, need_text: bool = False,
               schedule=None) -> StatefulDataLoader:
        """Endless batches, from a loader whose `state_dict` is the stream's position (`load_state_dict` before
        iterating resumes exactly). Without a saved position, a run started at micro-step `start` > 0 continues
        with fresh draws (seeded by the step) rather than replaying the start. `schedule`: NaFlex batch shapes."""
        batches, _ = self.pipeline(views, batch_size, seed * 1_000_003 + start, need_label, need_text,
                                   schedule=schedule, start=start)
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.14: harmless
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(batches, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                                      persistent_workers=num_workers > 0, worker_init_fn=ignore_stop_signals)


class ShardBatches(IterableDataset):
    """What a DataLoader iterates: each worker process gets its own `WorkerStream`."""

    def __init__(self, stream: ShardStream, decode: DecodeAndCount, batch_size: int | None, seed: int, collate,
                 epochs: int | None, schedule=None, start: int = 0):
        self.stream, self.decode, self.batch_size, self.seed = stream, decode, batch_size, seed
        self.collate, self.epochs, self.schedule, self.start = collate, epochs, schedule, start

    def __iter__(self) -> WorkerStream:
        return WorkerStream(self)


class WorkerStream:
    """One worker's stream of one rank; a torchdata `Stateful` iterator (see the module docstring)."""

    def __init__(self, source: ShardBatches):
        self.source, self.stream = source, source.stream
        self.rank, self.world, self.worker, self.workers = wds.utils.pytorch_worker_info()
        self._seed_from(source.seed)
        self.draws = self.offset = 0  # shard reads started before the current one; samples taken from it
        self.batches, self.first_step = 0, source.start  # batches this worker gave; the micro-step it began at
        self.buffer: list[tuple[tuple[int, int], dict]] = []  # ((draw, index), raw sample)
        self.rng = random.Random(self.seed)  # the shuffle buffer's
        self.shard_log = SkipLog(log, "shard")
        self._epoch_shares: dict[int, list[str]] = {}
        self._batches: Iterator | None = None

    def _seed_from(self, base: int) -> None:
        """The stream's seeds: `base` orders the epochs (shared by ranks and workers), `seed` this worker's draws,
        shuffle and augmentation."""
        self.base, self.seed = base, base * 1_000_003 + self.rank * 1000 + self.worker

    # ----- position -----
    def _stream_settings(self) -> list:
        """What the position refers to: the shard list (a checksum), resampling, the buffer size."""
        return [zlib.crc32("\n".join(self.stream.urls).encode()), len(self.stream.urls), self.stream.resampled,
                self.stream.shuffle_buffer]

    def state_dict(self) -> dict:
        return {"where": [self.rank, self.world, self.worker, self.workers], "stream": self._stream_settings(),
                "base": self.base, "draws": self.draws,
                "offset": self.offset, "buffer": [ref for ref, _ in self.buffer], "rng": self.rng.getstate(),
                "batches": self.batches, "first_step": self.first_step}

    def load_state_dict(self, state: dict) -> None:
        where = [self.rank, self.world, self.worker, self.workers]
        if list(state["where"]) != where:
            raise ValueError(f"the saved shard-stream position is of rank {state['where'][0]} of {state['where'][1]}, "
                             f"worker {state['where'][2]} of {state['where'][3]}; this stream is rank {where[0]} of "
                             f"{where[1]}, worker {where[2]} of {where[3]}")
        saved, now = list(state["stream"]), self._stream_settings()
        if saved != now:
            raise ValueError(f"the saved shard-stream position is of another stream: {saved[1]} shards (checksum "
                             f"{saved[0]}), resampled={saved[2]}, shuffle_buffer={saved[3]}; this one has {now[1]} "
                             f"(checksum {now[0]}), resampled={now[2]}, shuffle_buffer={now[3]}: resume with that "
                             "run's data.urls, data.resampled and data.shuffle_buffer, or start a new run from its "
                             "files (model.init_from=<run> model.init_heads=true)")
        self._seed_from(int(state["base"]))  # the seed the stream began with, not this loader's (seeded by the step)
        self._epoch_shares = {}
        self.draws, self.offset = int(state["draws"]), int(state["offset"])
        self.batches, self.first_step = int(state.get("batches", 0)), int(state.get("first_step", self.first_step))
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.buffer = self._reread([tuple(ref) for ref in state["buffer"]])
        self._batches = None

    def _reread(self, refs: list[tuple[int, int]]) -> list[tuple[tuple[int, int], dict]]:
        """The buffered samples again, from their shards (each read once)."""
        wanted: dict[int, set[int]] = {}
        for draw, index in refs:
            wanted.setdefault(draw, set()).add(index)
        found = {}
        for draw, indices in wanted.items():
            url = self._url(draw)
            samples = (item for item in read_shard(url, self.stream.sizes.get(url)) if SHARD_END not in item)
            for index, sample in itertools.islice(enumerate(samples), max(indices) + 1):
                if index in indices:
                    found[draw, index] = sample
        missing = [ref for ref in refs if ref not in found]
        if missing:
            log.warning("resuming the shard stream: %d buffered sample(s) are no longer in their shards (changed "
                        "since the checkpoint?), e.g. sample %d of %s; left out", len(missing), missing[0][1],
                        self._url(missing[0][0]))
        return [(ref, found[ref]) for ref in refs if ref in found]

    # ----- the stream -----
    def __iter__(self) -> WorkerStream:
        return self

    def __next__(self):
        if self._batches is None:
            decoded = self.source.decode(self._seeded(self._shuffled(self._raw())))
            self._batches = self._batched(decoded) if self.source.batch_size else decoded
        return next(self._batches)

    def _url(self, draw: int) -> str | None:
        """The shard of a draw; None past the last epoch (`epochs`)."""
        if self.stream.resampled:
            urls = self.stream.urls
            return urls[random.Random(self.seed * 1_000_003 + draw).randrange(len(urls))]
        epoch, position = divmod(draw, self._share_size())
        if self.source.epochs is not None and epoch >= self.source.epochs:
            return None
        return self._share(epoch)[position]

    def _share_size(self) -> int:
        """How many shards this worker reads per epoch (resampled=False; the same every epoch)."""
        return len(range(len(self.stream.urls))[self.rank::self.world][self.worker::self.workers])

    def _share(self, epoch: int) -> list[str]:
        """This worker's shards of an epoch (resampled=False): the epoch's shuffled order, split over ranks then
        workers."""
        if epoch not in self._epoch_shares:
            order = list(self.stream.urls)
            random.Random(self.base * 1_000_003 + epoch).shuffle(order)
            of_rank = order[self.rank::self.world]
            if not of_rank:
                raise NoUsableShardsError(
                    f"data.resampled=false splits the {len(order)} shard(s) over {self.world} ranks, and rank "
                    f"{self.rank} got none (each rank needs at least one shard, each of its {self.workers} worker(s) "
                    "one too to be busy); set data.resampled=true (shards drawn with replacement) or write more shards")
            self._epoch_shares = {epoch: of_rank[self.worker::self.workers]}  # one epoch at a time
        return self._epoch_shares[epoch]

    def _raw(self) -> Iterator:
        """(draw, index) references with raw samples, and SHARD_END markers. The position moves before each item
        leaves, so between batches it counts exactly what went downstream."""
        if not self.stream.resampled:
            self._share(0)  # raises when this rank got no shard at all
            if not self._share_size() and self.source.schedule is not None:
                raise NoUsableShardsError(
                    f"data.resolution=naflex with data.resampled=false: worker {self.worker} of rank {self.rank} has "
                    f"no shard ({len(self.stream.urls)} shard(s) for {self.world} rank(s) x {self.workers} "
                    "worker(s)), and an idle worker would put the ranks' batch shapes out of step; set "
                    "data.resampled=true, fewer data.num_workers or write more shards")
            if not self._share_size():
                log.warning("data.resampled=false: rank %d has fewer shards than its %d workers; worker %d idles (set "
                            "data.resampled=true or write more shards)", self.rank, self.workers, self.worker)
                return
        failed: dict[str, str] = {}  # resampled: shards that delivered nothing since the last sample came through
        epoch_delivered, epoch_errors = 0, {}
        while (url := self._url(self.draws)) is not None:
            draw, index = self.draws, self.offset
            for item in read_shard(url, self.stream.sizes.get(url), self.shard_log, skip=index):
                if SHARD_END not in item:
                    self.offset = index + 1
                    failed.clear()
                    yield (draw, index), item
                    index += 1
                    continue
                self.draws, self.offset = draw + 1, 0
                epoch_delivered += item["delivered"]
                if item["error"]:
                    epoch_errors[url] = item["error"]
                if item["delivered"] == 0:
                    failed[url] = item["error"] or "no samples"
                yield item
            if self.stream.resampled and len(failed) == len(set(self.stream.urls)):
                raise NoUsableShardsError(f"none of the {len(failed)} shard(s) of data.urls delivered a sample: "
                                          f"{_examples(failed)}")
            if not self.stream.resampled and self.draws % self._share_size() == 0:  # this worker's epoch ended
                if epoch_delivered == 0:
                    raise NoUsableShardsError(
                        f"epoch {draw // self._share_size()}: none of the {self._share_size()} shard(s) of rank "
                        f"{self.rank} worker {self.worker} delivered a sample "
                        f"({_examples(epoch_errors) or 'they hold no samples'})")
                epoch_delivered, epoch_errors = 0, {}

    def _shuffled(self, items: Iterator) -> Iterator:
        """Through the shuffle buffer (seeded per rank and worker; markers pass straight through)."""
        size = max(self.stream.shuffle_buffer, 1)
        for item in items:
            if isinstance(item, dict):
                yield item
                continue
            self.buffer.append(item)
            if len(self.buffer) >= size:
                yield self.buffer.pop(self.rng.randrange(len(self.buffer)))
        while self.buffer:  # the end of a finite stream (`epochs`)
            yield self.buffer.pop(self.rng.randrange(len(self.buffer)))

    def _seeded(self, items: Iterator) -> Iterator:
        for item in items:
            yield item if isinstance(item, dict) else (sample_seed(self.seed, *item[0]), item[1])

    def _batched(self, samples: Iterator) -> Iterator:
        """Batches of the fixed batch size, or NaFlex batches whose shape the schedule gives this worker's micro-step
        (the loader takes the workers' batches in turn: worker w gives steps w, w + workers, ...)."""
        collate, schedule = self.source.collate, self.source.schedule
        while True:
            batch_size, seq_len = self.source.batch_size, None
            if schedule is not None:
                seq_len, batch_size = schedule.at(self.first_step + self.batches * self.workers + self.worker)
            batch = list(itertools.islice(samples, batch_size))
            if not batch:
                return
            if len(batch) == batch_size or self.source.epochs is not None:  # a finite stream keeps its last part
                for sample in batch if seq_len is not None else ():
                    sample["seq_len"] = seq_len
                self.batches += 1
                yield collate(batch)


@dataclass
class ShardDataConfig(DataConfig):
    name: str = "wds"
    urls: Any = checked(MISSING, example="data.urls=data/shapes (a directory of .tar shards)")
    num_classes: int | None = checked(None, ge=2)  # for objectives that use labels (shards carry no class list)
    resampled: bool = True  # draw shards with replacement (step-based training, as open_clip)
    shuffle_buffer: int = checked(1000, ge=0)


SHARDS = DatasetKind(
    name="wds", config=ShardDataConfig,
    build=lambda cfg, img_size: ShardStream(cfg.urls, cfg.num_classes, cfg.resampled, cfg.shuffle_buffer,
                                            max_pixels=cfg.max_pixels),
    eval_refusal="a shard stream has no held-out split: write the shards' images to a folder for data=folder",
    # captions: the samples that have a `txt` (the others are skipped and counted)
    captioned=True, stream=True, cpu_workers=2)
