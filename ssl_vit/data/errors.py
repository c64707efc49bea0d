"""The data layer's exceptions. Each has a single-message constructor, so a DataLoader worker re-raises it in the
main process as the same type with the message intact.

- `DataError(RuntimeError)`: the base; the training loop / CLI can catch it to stop with the message (no traceback).
- `BadSampleError`: one sample is unusable (undecodable image, missing key); the loaders skip and count these, so
  they only escape from direct dataset access (`dataset[i]`).
- `NoUsableSamplesError`: a map-style dataset (an image folder) has no readable sample to stand in for a bad one.
- `NoUsableShardsError`: a shard stream cannot deliver any sample (every shard of a worker failed, every sample of
  every shard is bad, or a worker got no shard at all with `data.resampled=false`).
"""

from __future__ import annotations


class DataError(RuntimeError):
    """The data cannot be read as configured; the message says what and how to fix it."""


class BadSampleError(DataError, ValueError):
    """One sample cannot be used (skipped and counted by the loaders)."""


class MissingKeyError(BadSampleError):
    """A shard sample lacks a key the objective needs (its image, `cls` or `txt`)."""


class MissingTextError(MissingKeyError):
    """A sample without a caption (an empty caption file) where the objective reads text."""


class NoUsableSamplesError(DataError):
    """No readable sample could be found to replace a bad one."""


class NoUsableShardsError(DataError):
    """A shard stream cannot deliver any sample."""


class SkipLog:
    """Reports skipped samples of this process on `logger`: the first `first` one by one with their reason (a bad
    file's path, a shard's name), then a running total at 10, 100, 1000, ... (DataLoader workers each keep their own
    count, so the log stays a handful of lines per process however bad the data is)."""

    def __init__(self, logger, what: str = "sample", first: int = 5):
        self.logger, self.what, self.first = logger, what, first
        self.count = 0

    def __call__(self, reason: str, count: int = 1) -> None:
        before, self.count = self.count, self.count + count
        if before < self.first:
            self.logger.warning("skipped bad %s: %s", self.what, reason)
            if self.count >= self.first:
                self.logger.warning("further bad %ss are skipped and counted without a message here; a running total "
                                    "follows at 10, 100, 1000, ...", self.what)
            return
        milestone = 10 ** len(str(self.count)) // 10  # the largest power of ten <= count
        if before < milestone <= self.count and milestone >= 10:
            self.logger.warning("%d bad %ss skipped so far in this process (last: %s)", self.count, self.what, reason)
