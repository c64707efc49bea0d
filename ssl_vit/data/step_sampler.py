"""The batches of fixed-size steps: which samples (and under which seeds) each rank's micro-step takes, a pure
function of (seed, step, rank) (ssl_vit.data.loader). NaFlex's steps vary in shape: ssl_vit.data.naflex."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ssl_vit.data.seeds import sample_seed


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
