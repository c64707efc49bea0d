"""Per-sample seeds: a sample's random augmentation runs under a seed that is a function of where it sits in the
stream, so a resumed or re-sharded stream augments it exactly as an uninterrupted one would."""

from __future__ import annotations

_MIX = 0x9E3779B97F4A7C15  # large odd constant to spread (seed, epoch, index) over the 63-bit seed space


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample `index` of `epoch` (for a shard stream: of the worker's shard read `epoch`)."""
    return ((seed * _MIX) ^ (epoch * 1_000_003 + index) * 6364136223846793005) % (2**63 - 1)
