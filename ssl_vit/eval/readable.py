"""The evaluation datasets' shared shape: prepare each sample for an evaluator, leave out the ones that cannot be
read (BadSampleError: a corrupt or empty file, a sample without the caption it needs), and collate what was
readable, counting what was left out."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.utils.data import Dataset, default_collate

from ssl_vit.data.errors import BadSampleError, SkipLog

log = logging.getLogger(__name__)


class ReadableSamples(Dataset):
    """`prepare(sample, index)` for each sample of `dataset`, or None for one that cannot be read or that `prepare`
    refuses with a BadSampleError (the first few are logged by name, as left out of `what`). `prepare` should be
    picklable (a module-level function or a functools.partial of one) for loader workers."""

    def __init__(self, dataset, prepare: Callable, what: str):
        self.dataset, self.prepare, self.what = dataset, prepare, what
        self.skip_log = SkipLog(log, "sample")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            return self.prepare(self.dataset[index], index)
        except BadSampleError as err:
            self.skip_log(f"{err} (left out of {self.what})")
            return None


def collate_readable(items, collate: Callable = default_collate):
    """(the batch of the readable items, or None when none is; how many were left out)."""
    readable = [item for item in items if item is not None]
    return (collate(readable) if readable else None), len(items) - len(readable)
