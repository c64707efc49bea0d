"""Step-indexed, resumable loading: the batch of micro-step m is a pure function of (seed, m, rank).

Each epoch is a seeded permutation of the dataset cut into global batches of batch_size x world_size; rank r takes
its slice. Every sample also gets its own seed, under which its random augmentation runs, so the stream is the
same with any number of workers and a resumed run continues exactly where an uninterrupted one would be.

A sample that cannot be read or used (a corrupt or empty image file, no caption for the text view: `BadSampleError`)
is replaced by the next readable index, augmented under the bad sample's seed, and marked `skipped=1`; the batch
stays full and remains a pure function of (seed, m, rank). Every sample carries `skipped` (0 or 1), `skip_index`
and `skip_reason` (the bad index it stands in for and why, or -1 and ""), and `key`, the index read; the training
loop pops them, and counts and names each bad sample the run met once (the workers say nothing: they also read
samples the run never trains on, while searching for a substitute or prefetching).
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, Dataset

from ssl_vit.data.errors import BadSampleError, NoUsableSamplesError
from ssl_vit.data.shard_stream import ShardStream
from ssl_vit.data.workers import ignore_stop_signals

log = logging.getLogger(__name__)
MAX_SUBSTITUTE_SEARCH = 64  # how many following indices a bad sample's substitute is looked for among
class SeededViews(Dataset):
    """Apply `views` to `dataset[index]` under the sample's own torch seed (keys are (index, seed) pairs); a bad
    sample is replaced by the next readable one (see the module docstring) and the output carries `skipped`."""

    def __init__(self, dataset: Dataset, views, max_search: int = MAX_SUBSTITUTE_SEARCH):
        self.dataset, self.views, self.max_search = dataset, views, max_search
        self.bad: dict[int, str] = {}  # index -> reason, known in this process (each bad file is read once)

    def __len__(self) -> int:
        return len(self.dataset)

    def _read(self, index: int) -> dict | None:
        if index in self.bad:
            return None
        try:
            return self.dataset[index]
        except BadSampleError as err:
            self.bad[index] = str(err)
            return None

    def __getitem__(self, key: tuple[int, ...]) -> dict:
        """`key`: (index, seed), or (index, seed, seq_len) from the NaFlex sampler (the sample carries its batch's
        sequence length to the collate)."""
        index, seed, *batch_shape = key
        size = len(self.dataset)
        searched = min(size, self.max_search)
        with torch.random.fork_rng(devices=[]):
            for offset in range(searched):
                # the CPU generator alone (what the augmentations draw from): torch.manual_seed also queues a
                # seed for every accelerator with a stack trace, ~150 us, a fifth of a small sample's cost
                torch.default_generator.manual_seed(seed)
                position = (index + offset) % size
                sample = self._read(position)
                if sample is None:
                    continue
                try:
                    out = self.views(sample)  # a sample can lack what the views need (no caption for `text`)
                except BadSampleError as err:
                    self.bad[position] = str(err)
                    continue
                out["skipped"] = int(offset > 0)
                out["skip_index"] = index if offset > 0 else -1
                out["skip_reason"] = self.bad.get(index, "") if offset > 0 else ""
                out["key"] = position  # the index read (trainer.record_sample_keys)
                out["seed"] = seed  # for batch-level augmentation (ViewBuilder.collate removes it)
                if batch_shape:
                    out["seq_len"] = batch_shape[0]
                return out
        describe = getattr(self.dataset, "describe", lambda: type(self.dataset).__name__)()
        scope = ("no sample of it is readable" if searched == size else
                 f"samples {index}..{(index + searched - 1) % size} (of {size}) are all unreadable")
        raise NoUsableSamplesError(f"{describe}: {scope}; first error: {self.bad.get(index, '?')}")


def build_loader(dataset: Dataset, views, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 start: int = 0, num_workers: int = 0, pin_memory: bool = False, repeats: int = 1) -> DataLoader:
    return DataLoader(
        SeededViews(dataset, views),
        batch_sampler=views.batch_sampler(len(dataset), batch_size, rank, world_size, seed, start, repeats),
        collate_fn=getattr(views, "collate", None),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_stop_signals,
        generator=torch.Generator().manual_seed(seed),  # keep the global RNG untouched (exact resume)
    )


def make_loader(dataset, views, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                start: int = 0, num_workers: int = 0, pin_memory: bool = False, repeats: int = 1):
    """Batches for one rank from micro-step `start` on (exactly resumable for map-style datasets), from a map-style
    dataset or a shard stream. `repeats`: repeated augmentation, for map-style datasets (a shard stream has no
    epochs to repeat within)."""
    if isinstance(dataset, ShardStream):
        return dataset.loader(views, batch_size, seed=seed, start=start, num_workers=num_workers,
                              pin_memory=pin_memory, need_label="label" in views.views,
                              need_text="text" in views.views,
                              schedule=views.schedule(seed, world_size))
    return build_loader(dataset, views, batch_size, rank=rank, world_size=world_size, seed=seed, start=start,
                        num_workers=num_workers, pin_memory=pin_memory, repeats=repeats)
