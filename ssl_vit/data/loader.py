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
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ssl_vit.data.errors import BadSampleError, NoUsableSamplesError
from ssl_vit.data.naflex import NaFlexBatchSampler, NaFlexSchedule, NaFlexViews
from ssl_vit.data.seeds import sample_seed
from ssl_vit.data.shard_stream import ShardStream
from ssl_vit.data.workers import ignore_stop_signals

log = logging.getLogger(__name__)
MAX_SUBSTITUTE_SEARCH = 64  # how many following indices a bad sample's substitute is looked for among
class StepBatchSampler(Sampler):
    """Infinite batch sampler yielding lists of (index, sample_seed) for one rank, from micro-step `start`.

    `repeats` > 1 is repeated augmentation (Hoffer et al. 2020; DeiT's RASampler): an epoch takes N / repeats
    images of the permutation, each `repeats` times in a row, every copy with its own seed (its own augmentation);
    an epoch still has N samples. As RASampler, each global batch is dealt to the ranks in turn (rank r takes
    positions r, r + world, ...), so the copies of an image land on different ranks."""

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 start: int = 0, shuffle: bool = True, repeats: int = 1):
        global_batch = batch_size * world_size
        if num_samples < global_batch:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch} "
                f"(data.batch_size={batch_size} x {world_size} processes); lower data.batch_size"
            )
        self.num_samples, self.batch_size, self.rank, self.world_size = num_samples, batch_size, rank, world_size
        self.seed, self.start, self.shuffle = seed, start, shuffle
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.repeats = repeats
        self.batches_per_epoch = num_samples // global_batch

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            order = torch.arange(self.num_samples)
        else:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        if self.repeats > 1:
            order = order[:-(-self.num_samples // self.repeats)].repeat_interleave(self.repeats)[:self.num_samples]
        return order

    def _seed(self, epoch: int, position: int, index: int) -> int:
        if self.repeats == 1:
            return sample_seed(self.seed, epoch, index)
        return sample_seed(self.seed, epoch, index * self.repeats + position % self.repeats)  # copy = position % r

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start
        epoch, order = None, None
        while True:
            if step // self.batches_per_epoch != epoch:
                epoch = step // self.batches_per_epoch
                order = self._order(epoch)
            global_batch = self.batch_size * self.world_size
            if self.repeats > 1:  # dealt in turn: positions rank, rank + world, ... of the global batch
                start = (step % self.batches_per_epoch) * global_batch
                positions = range(start + self.rank, start + global_batch, self.world_size)
            else:  # a contiguous slice per rank
                first = (step % self.batches_per_epoch) * global_batch + self.rank * self.batch_size
                positions = range(first, first + self.batch_size)
            yield [(int(order[p]), self._seed(epoch, p, int(order[p]))) for p in positions]
            step += 1


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
    if isinstance(views, NaFlexViews):  # the batch shape of each step from the schedule (ssl_vit.data.naflex)
        sampler = NaFlexBatchSampler(len(dataset), NaFlexSchedule(views.settings, seed, world_size), rank, seed, start)
    else:
        sampler = StepBatchSampler(len(dataset), batch_size, rank, world_size, seed, start, repeats=repeats)
    return DataLoader(
        SeededViews(dataset, views),
        batch_sampler=sampler,
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
                              schedule=NaFlexSchedule(views.settings, seed, world_size)
                              if isinstance(views, NaFlexViews) else None)
    return build_loader(dataset, views, batch_size, rank=rank, world_size=world_size, seed=seed, start=start,
                        num_workers=num_workers, pin_memory=pin_memory, repeats=repeats)
