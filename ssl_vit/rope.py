"""2-D rotary position embeddings (RoPE) for the patch tokens, as DINOv3 uses them (`model.pos_embed=rope`).

Each patch has coordinates in [-1, 1]: the centres of its row and column, over the grid's height and width
(`normalize="separate"`; or both over the shorter / longer side), so that the same image content gets the same
angles at every resolution. A head's dimension is split in quarters of frequencies: the first half of the pairs
rotates by the row coordinate, the second by the column, with periods theta ** (2 i / (D / 2)) (or log-spaced
between a min and a max period), laid out "rotate-half" (the pairs are x[j] and x[j + D / 2]). While training,
DINOv3 moves the coordinates: a shift of both axes by U(-shift, shift), a per-axis scale log-uniform in
[1 / jitter, jitter], and a common scale log-uniform in [1 / rescale, rescale]. Prefix tokens (class token,
registers) are not rotated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

ROPE_NORMALIZATIONS = ("separate", "min", "max")


class Rope2D(nn.Module):
    """The (sin, cos) tables of a grid, (H * W, head_dim) each; rows gathered per image for a kept subset.

    The periods stay fp32 under DeepSpeed's bf16 zero.Init (its keep-in-fp32 rule reads the attribute below), so
    the angles are computed in fp32 everywhere. FSDP2's bf16 policy casts a block's floating inputs, the tables
    among them, to bf16 at the block's boundary; the rotation then runs in bf16 there, as the rest of the block."""

    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["periods"]

    def __init__(self, head_dim: int, theta: float | None = 100.0, min_period: float | None = None,
                 max_period: float | None = None, normalize: str = "separate", shift: float | None = None,
                 jitter: float | None = None, rescale: float | None = None):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"RoPE needs a head dimension divisible by 4 (2 axes x sin / cos pairs), got {head_dim}")
        if (min_period is None) != (max_period is None) or (theta is None) == (min_period is None):
            raise ValueError("RoPE takes either rope_theta or both rope_min_period and rope_max_period, got "
                             f"theta={theta}, min_period={min_period}, max_period={max_period}")
        if normalize not in ROPE_NORMALIZATIONS:
            raise ValueError(f"rope_normalize {normalize!r} is not one of {list(ROPE_NORMALIZATIONS)}")
        for name, factor in (("rope_jitter", jitter), ("rope_rescale", rescale)):
            if factor is not None and factor < 1:
                raise ValueError(f"{name} is a factor >= 1 (log-uniform in [1/f, f]), got {factor}")
        self.head_dim, self.theta, self.min_period, self.max_period = head_dim, theta, min_period, max_period
        self.normalize, self.shift, self.jitter, self.rescale = normalize, shift, jitter, rescale
        self.register_buffer("periods", torch.empty(head_dim // 4), persistent=False)  # rebuilt from the config
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        quarter = self.head_dim // 4
        if self.theta is not None:
            periods = self.theta ** (2 * torch.arange(quarter, dtype=torch.float32) / (self.head_dim // 2))
        else:
            ratio = self.max_period / self.min_period
            periods = self.min_period * ratio ** torch.linspace(0, 1, quarter, dtype=torch.float32)
        self.periods.copy_(periods.to(self.periods.device))

    def coords(self, grid: Sequence[int]) -> torch.Tensor:
        """(H * W, 2) row / column coordinates in [-1, 1] (raster order), moved as DINOv3 does while training."""
        rows, cols = grid
        device = self.periods.device
        scale = {"separate": (rows, cols), "min": (min(rows, cols),) * 2, "max": (max(rows, cols),) * 2}[self.normalize]
        axes = [torch.arange(0.5, n, device=device, dtype=torch.float32) / s for n, s in zip(grid, scale, strict=True)]
        coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).flatten(0, 1) * 2 - 1
        if self.training:
            if self.shift is not None:
                coords = coords + torch.empty(2, device=device).uniform_(-self.shift, self.shift)
            if self.jitter is not None:
                coords = coords * torch.empty(2, device=device).uniform_(-math.log(self.jitter),
                                                                         math.log(self.jitter)).exp()
            if self.rescale is not None:
                coords = coords * torch.empty(1, device=device).uniform_(-math.log(self.rescale),
                                                                         math.log(self.rescale)).exp()
        return coords

    def forward(self, grid: Sequence[int], keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sin, cos) of the grid's patches, (H * W, head_dim) each; with `keep` (B, K) patch indices, (B, K,
        head_dim) rows of those patches."""
        angles = 2 * math.pi * self.coords(grid)[:, :, None] / self.periods  # (HW, 2, head_dim / 4)
        angles = angles.flatten(1).tile(2)  # (HW, head_dim): [rows, cols] frequencies, twice (rotate-half)
        sin, cos = angles.sin(), angles.cos()
        if keep is not None:
            sin, cos = sin[keep], cos[keep]
        return sin, cos


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
    """Rotate the last rows (the patch tokens) of q and k, (B, heads, N, head_dim), by the (sin, cos) tables
    ((P, head_dim) or (B, P, head_dim)); the N - P prefix tokens in front stay as they are. In the tables' dtype
    (fp32), cast back to q's."""
    if rope is None:
        return q, k
    sin, cos = rope
    if sin.ndim == 3:  # per image: broadcast over the heads
        sin, cos = sin[:, None], cos[:, None]
    prefix = q.shape[-2] - sin.shape[-2]

    def rotate(x):
        patches = x[..., prefix:, :].to(sin.dtype)
        rotated = (patches * cos + rotate_half(patches) * sin).to(x.dtype)
        return torch.cat([x[..., :prefix, :], rotated], dim=-2)

    return rotate(q), rotate(k)
