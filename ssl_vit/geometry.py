"""Image and token-grid sizes: the arithmetic the patch embedding and the hybrid stem share."""

from __future__ import annotations

from collections.abc import Sequence


def pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def check_divisible(size: tuple[int, int], patch: tuple[int, int]) -> None:
    """ValueError naming the nearest usable sizes when an image does not cut into whole patches."""
    if size[0] % patch[0] or size[1] % patch[1]:
        def near(s, p):
            return sorted({max(p, s // p * p), (s // p + 1) * p})
        raise ValueError(
            f"image size {size[0]}x{size[1]} is not divisible by the patch size {patch[0]}x{patch[1]}; "
            f"use a multiple of the patch size (e.g. height {near(size[0], patch[0])}, width {near(size[1], patch[1])})"
        )
