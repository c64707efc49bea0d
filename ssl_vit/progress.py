"""Progress bars on a terminal only: written to a log file (stderr redirected, a SLURM job, a CI log), tqdm's
carriage-return updates are noise; there the training loop logs a plain line per log step instead."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def interactive() -> bool:
    """Whether stderr, where the bars go, is a terminal."""
    return sys.stderr.isatty()


def progress_bar(iterable=None, enabled: bool = True, **kwargs) -> tqdm:
    """tqdm, disabled unless `enabled` and on a terminal."""
    return tqdm(iterable, disable=not (enabled and interactive()), **kwargs)
