"""2-D rotary position embeddings (RoPE) for the patch tokens, as DINOv3 uses them (`model.pos_embed=rope`).

Each patch has coordinates in [-1, 1]: the centres of its row and column, over the grid's height and width
(`normalize="separate"`; or both over the shorter / longer side), so that the same image content gets the same
angles at every resolution. A head's dimension is split in quarters of frequencies: the first half of the pairs
rotates by the row coordinate, the second by the column, with periods theta ** (2 i / (D / 2)) (or log-spaced
between a min and a max period), laid out "rotate-half" (the pairs are x[j] and x[j + D / 2]). While training,
DINOv3 moves the coordinates: a shift of both axes by U(-shift, shift), a per-axis scale log-uniform in
[1 / jitter, jitter], and a common scale log-uniform in [1 / rescale, rescale]. Prefix tokens (class token,
registers) are not rotated.

`kind` picks the variant (`model.rope_kind`): "dinov3" (above), or the two of the RoPE-ViT paper (Heo et al. 2024,
naver-ai/rope-vit) that timm carries, on patch-index coordinates (column, row) with the pairs interleaved (x[2j],
x[2j + 1]): "axial" (timm's RotaryEmbeddingCat: frequency theta ** (-j / (D / 4)) per axis, the first half of the
pairs rotated by the column, the second by the row; theta 100 in timm's vit_*_rope models; Perception Encoder's:
theta 10000, each index plus an offset of 1 and rescaled onto the pre-training grid, (index + offset) x ref / size,
EVA's scheme, timm's grid_offset and ref_feat_shape) and "mixed" (timm's
RotaryEmbeddingMixed: learned frequencies per block and head for both axes together, started at magnitudes
theta ** (-4j / D) (theta 10) along a random direction per block and head, no weight decay). The coordinate
augmentations apply to each variant's own coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

ROPE_NORMALIZATIONS = ("separate", "min", "max")
ROPE_KINDS = ("dinov3", "axial", "mixed")
ROPE_THETA = {"dinov3": 100.0, "axial": 100.0, "mixed": 10.0}  # each reference's base where unset


def augment_coords(coords: torch.Tensor, shift=None, jitter=None, rescale=None) -> torch.Tensor:
    """(N, 2) coordinates shifted by U(-shift, shift) per axis, scaled log-uniformly in [1 / jitter, jitter] per axis
    and in [1 / rescale, rescale] together (DINOv3's training-time augmentations; each when set)."""
    device = coords.device
    if shift is not None:
        coords = coords + torch.empty(2, device=device).uniform_(-shift, shift)
    if jitter is not None:
        coords = coords * torch.empty(2, device=device).uniform_(-math.log(jitter), math.log(jitter)).exp()
    if rescale is not None:
        coords = coords * torch.empty(1, device=device).uniform_(-math.log(rescale), math.log(rescale)).exp()
    return coords


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
        return self.augmented(coords)

    def augmented(self, coords: torch.Tensor) -> torch.Tensor:
        return augment_coords(coords, self.shift, self.jitter, self.rescale) if self.training else coords

    def point_coords(self, points: Sequence[torch.Tensor]) -> torch.Tensor:
        """(N, 2) coordinates of patches given one by one: `points` = (rows, cols, heights, widths), each (N,), a
        patch's place and its own image's grid (NaFlex batches), as `coords` gives a whole grid's."""
        rows, cols, heights, widths = (t.to(self.periods.device, torch.float32) for t in points)
        scale = {"separate": (heights, widths), "min": (torch.minimum(heights, widths),) * 2,
                 "max": (torch.maximum(heights, widths),) * 2}[self.normalize]
        return torch.stack([(rows + 0.5) / scale[0], (cols + 0.5) / scale[1]], dim=-1) * 2 - 1

    def forward(self, grid: Sequence[int] | None, keep: torch.Tensor | None = None,
                points: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sin, cos) of the grid's patches, (H * W, head_dim) each; with `keep` (B, K) patch indices, (B, K,
        head_dim) rows of those patches; with `points` instead of a grid (see `point_coords`), (N, head_dim) rows of
        those patches, moved by one draw of the training augmentation for all of them."""
        coords = self.augmented(self.point_coords(points)) if points is not None else self.coords(grid)
        angles = 2 * math.pi * coords[:, :, None] / self.periods  # (HW, 2, head_dim / 4)
        angles = angles.flatten(1).tile(2)  # (HW, head_dim): [rows, cols] frequencies, twice (rotate-half)
        sin, cos = angles.sin(), angles.cos()
        if keep is not None:
            sin, cos = sin[keep], cos[keep]
        return sin, cos


def index_coords(grid: Sequence[int], device=None, offset: float = 0.0,
                 ref_grid: Sequence[int] | None = None) -> torch.Tensor:
    """(H * W, 2) (column, row) patch indices in raster order (timm's 'xy' grid of the RoPE-ViT models), plus
    `offset`, rescaled onto `ref_grid` (rows, cols) when given: (index + offset) x ref / size."""
    rows, cols = grid
    row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    row, col = row.flatten(), col.flatten()
    return point_index_coords((row, col, torch.full_like(row, rows), torch.full_like(col, cols)), device, offset,
                              ref_grid)


def point_index_coords(points: Sequence[torch.Tensor], device=None, offset: float = 0.0,
                       ref_grid: Sequence[int] | None = None) -> torch.Tensor:
    """(N, 2) (column, row) patch indices of patches given one by one (rows, cols, heights, widths), as
    `index_coords` places a whole grid's (each patch rescaled by its own image's grid)."""
    rows, cols, heights, widths = (t.to(device, torch.float32) for t in points)
    rows, cols = rows + offset, cols + offset
    if ref_grid is not None:
        rows, cols = rows / heights * ref_grid[0], cols / widths * ref_grid[1]
    return torch.stack([cols, rows], dim=-1)


class AxialRope(Rope2D):
    """RoPE-ViT's axial variant (timm's RotaryEmbeddingCat): (sin, cos, "interleaved") tables; `offset` and
    `ref_grid` place the indices (see `index_coords`: Perception Encoder's 1 and its pre-training grid)."""

    def __init__(self, head_dim: int, theta: float = 100.0, shift=None, jitter=None, rescale=None,
                 offset: float = 0.0, ref_grid: Sequence[int] | None = None):
        super().__init__(head_dim, theta, shift=shift, jitter=jitter, rescale=rescale)
        self.offset, self.ref_grid = float(offset), (tuple(ref_grid) if ref_grid is not None else None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        quarter = self.head_dim // 4
        self.periods.copy_((self.theta ** (torch.arange(quarter, dtype=torch.float32) / quarter)).to(
            self.periods.device))  # 1 / frequency

    def forward(self, grid, keep=None, points=None):
        device = self.periods.device
        coords = (point_index_coords(points, device, self.offset, self.ref_grid) if points is not None
                  else index_coords(grid, device, self.offset, self.ref_grid))
        angles = (self.augmented(coords)[:, :, None] / self.periods).flatten(1)
        # (HW, head_dim): [column, row] frequencies, each twice (a stack, not repeat_interleave: ONNX exports it)
        angles = torch.stack([angles, angles], dim=-1).flatten(-2)
        sin, cos = angles.sin(), angles.cos()
        if keep is not None:
            sin, cos = sin[keep], cos[keep]
        return sin, cos, "interleaved"


class MixedRope(nn.Module):
    """RoPE-ViT's mixed variant (timm's RotaryEmbeddingMixed): `freqs` (2, depth, heads, head_dim / 2), learned;
    per block, (sin, cos, "interleaved") tables of shape (1, heads, HW, head_dim) (or (B, heads, K, head_dim) rows)."""

    def __init__(self, head_dim: int, depth: int, num_heads: int, theta: float = 10.0, shift=None, jitter=None,
                 rescale=None):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"RoPE needs a head dimension divisible by 4 (2 axes x sin / cos pairs), got {head_dim}")
        self.head_dim, self.depth, self.num_heads, self.theta = head_dim, depth, num_heads, theta
        self.shift, self.jitter, self.rescale = shift, jitter, rescale
        self.freqs = nn.Parameter(torch.empty(2, depth, num_heads, head_dim // 2))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        magnitude = self.theta ** (-torch.arange(0, self.head_dim, 4, dtype=torch.float32) / self.head_dim)
        angle = torch.rand(self.depth, self.num_heads, 1) * 2 * math.pi
        x = torch.cat([magnitude * angle.cos(), magnitude * (angle + math.pi / 2).cos()], dim=-1)
        y = torch.cat([magnitude * angle.sin(), magnitude * (angle + math.pi / 2).sin()], dim=-1)
        self.freqs.copy_(torch.stack([x, y]).to(self.freqs.device, self.freqs.dtype))

    def no_weight_decay(self) -> set[str]:
        return {"freqs"}

    def forward(self, grid, keep=None, points=None):
        """One table set per block: a list of `depth` (sin, cos, "interleaved"); `points` as Rope2D's."""
        coords = point_index_coords(points, self.freqs.device) if points is not None else \
            index_coords(grid, self.freqs.device)  # (HW, 2) column, row
        if self.training:
            coords = augment_coords(coords, self.shift, self.jitter, self.rescale)
        freqs = self.freqs.float()
        angles = coords[:, 0, None] * freqs[0, :, :, None] + coords[:, 1, None] * freqs[1, :, :, None]
        angles = torch.stack([angles, angles], dim=-1).flatten(-2)[:, None]  # (depth, 1, heads, HW, head_dim)
        sin, cos = angles.sin(), angles.cos()
        if keep is not None:  # (depth, B, heads, K, head_dim)
            index = keep[None, :, None, :, None].expand(self.depth, -1, self.num_heads, -1, self.head_dim)
            sin = sin.expand(-1, keep.shape[0], -1, -1, -1).gather(3, index)
            cos = cos.expand(-1, keep.shape[0], -1, -1, -1).gather(3, index)
        return [(sin[i], cos[i], "interleaved") for i in range(self.depth)]


def build_rope(kind: str, head_dim: int, depth: int, num_heads: int, theta=None, min_period=None, max_period=None,
               normalize="separate", shift=None, jitter=None, rescale=None, offset: float = 0.0,
               ref_grid: Sequence[int] | None = None) -> nn.Module:
    """The `kind` variant; theta defaults to its reference's (DINOv3 100, axial 100, mixed 10); `offset`,
    `ref_grid`: the axial variant's index placement."""
    if (offset or ref_grid is not None) and kind != "axial":
        raise ValueError(f"rope_offset / rope_ref_grid place rope_kind='axial' patch indices, not rope_kind={kind!r}")
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope_kind {kind!r} is not one of {list(ROPE_KINDS)}")
    if kind != "dinov3":
        if min_period is not None or max_period is not None or normalize != "separate":
            raise ValueError(f"rope_kind={kind!r} takes rope_theta (patch-index coordinates): rope_min_period, "
                             "rope_max_period and rope_normalize are the dinov3 variant's")
        if kind == "axial":
            return AxialRope(head_dim, theta or ROPE_THETA[kind], shift, jitter, rescale, offset, ref_grid)
        return MixedRope(head_dim, depth, num_heads, theta or ROPE_THETA[kind], shift, jitter, rescale)
    if theta is None and min_period is None:
        theta = ROPE_THETA[kind]
    return Rope2D(head_dim, theta, min_period, max_period, normalize, shift, jitter, rescale)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the pairs (x[2j], x[2j + 1]) turned a quarter."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: tuple | None):
    """Rotate the last rows (the patch tokens) of q and k, (B, heads, N, head_dim), by the (sin, cos) tables
    ((P, head_dim) or (B, P, head_dim); the mixed variant's (1 or B, heads, P, head_dim)); the
    N - P prefix tokens in front stay as they are. Pairs laid out rotate-half, or interleaved when the tables say
    so (a third entry). In the tables' dtype (fp32), cast back to q's."""
    if rope is None:
        return q, k
    sin, cos = rope[:2]
    turn = rotate_interleaved if len(rope) > 2 else rotate_half
    if sin.ndim == 3:  # per image: broadcast over the heads
        sin, cos = sin[:, None], cos[:, None]
    prefix = q.shape[-2] - sin.shape[-2]

    def rotate(x):
        patches = x[..., prefix:, :].to(sin.dtype)
        rotated = (patches * cos + turn(patches) * sin).to(x.dtype)
        return torch.cat([x[..., :prefix, :], rotated], dim=-2)

    return rotate(q), rotate(k)
