"""NaFlex batches: images at their own aspect ratio and resolution, as flat patches padded to one sequence length.

A NaFlex batch is the dict timm's NaFlex collator makes (and `timm.models.naflexvit.NaFlexVit` reads), so the
same batch runs in both:

    patches      (B, N, P * P * C) float   each patch flattened (row, column, channel): channel fastest, as timm
                                           (`batch_patchify`) and transformers' SigLIP 2 processor lay them out
    patch_coord  (B, N, 2) int64           the patch's (row, column) on its image's grid
    patch_valid  (B, N) bool               false for the padding after an image's h x w patches

An image of h x w patches fills the first h * w rows in raster order; the rest is padding (zeros, coordinate 0).
`NaFlexLayout` is what the backbone derives from a batch once per forward (its token placement, as
`ssl_vit.backbone.embeddings.GridPlacement` is a dense batch's): each image's grid (read from the coordinates, one
host sync, as timm does), the flat position of every patch on its grid, the rotary tables and the attention mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ssl_vit.geometry import pair

NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")


def is_naflex(images) -> bool:
    """Whether `images` is a NaFlex batch (a dict with flat patches) rather than an image tensor."""
    return isinstance(images, dict) and "patches" in images


def patch_valid(images) -> torch.Tensor | None:
    """The batch's valid-patch mask (B, N), or None for a dense image batch."""
    return images["patch_valid"] if is_naflex(images) else None


def patchify(image: torch.Tensor, patch_size: int | Sequence[int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """(C, H, W) or (B, C, H, W) -> ((..., h * w, P * P * C) patches in raster order, (h, w)); H and W must be
    multiples of the patch size."""
    ph, pw = pair(patch_size)
    *lead, channels, height, width = image.shape
    if height % ph or width % pw:
        raise ValueError(f"a {height}x{width} image does not divide into {ph}x{pw} patches")
    rows, cols = height // ph, width // pw
    grid = image.reshape(*lead, channels, rows, ph, cols, pw)
    order = (*range(len(lead)), len(lead) + 1, len(lead) + 3, len(lead) + 2, len(lead) + 4, len(lead))
    return grid.permute(order).reshape(*lead, rows * cols, ph * pw * channels), (rows, cols)


def unpatchify(patches: torch.Tensor, grid: Sequence[int], patch_size: int | Sequence[int],
               channels: int = 3) -> torch.Tensor:
    """The inverse of `patchify` for one image: (h * w, P * P * C) -> (C, h * P, w * P)."""
    ph, pw = pair(patch_size)
    rows, cols = grid
    image = patches[: rows * cols].reshape(rows, cols, ph, pw, channels)
    return image.permute(4, 0, 2, 1, 3).reshape(channels, rows * ph, cols * pw)


def grid_coords(grid: Sequence[int], device=None) -> torch.Tensor:
    """(h * w, 2) (row, column) of a grid's patches in raster order."""
    rows, cols = grid
    row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    return torch.stack([row, col], dim=-1).flatten(0, 1)


def pack(images: Sequence[torch.Tensor], patch_size: int | Sequence[int], seq_len: int | None = None) -> dict:
    """Images (C, H_i, W_i) of any sizes (multiples of the patch size) -> one NaFlex batch padded to `seq_len`
    (None: the longest image's patch count). ValueError when an image has more patches than `seq_len`."""
    flat = [patchify(image, patch_size) for image in images]
    longest = max(len(patches) for patches, _ in flat)
    seq_len = longest if seq_len is None else int(seq_len)
    if longest > seq_len:
        raise ValueError(f"an image of {longest} patches does not fit a sequence of {seq_len}")
    first = flat[0][0]
    patches = first.new_zeros(len(flat), seq_len, first.shape[-1])
    coords = torch.zeros(len(flat), seq_len, 2, dtype=torch.long, device=first.device)
    valid = torch.zeros(len(flat), seq_len, dtype=torch.bool, device=first.device)
    for i, (image_patches, grid) in enumerate(flat):
        n = len(image_patches)
        patches[i, :n], coords[i, :n], valid[i, :n] = image_patches, grid_coords(grid, first.device), True
    return {"patches": patches, "patch_coord": coords, "patch_valid": valid}


def drop_patches(batch: dict, keep_ratio: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, K) slots to keep of a NaFlex batch, K = ceil(keep_ratio x N): each image's valid patches in a random order
    first, then its padding (timm's patch dropout keeps the validity of what it keeps; here the valid patches are
    kept before any padding). Pass as `keep` to the backbone, and `batch["patch_valid"].gather(1, keep)` to `pool`."""
    valid = batch["patch_valid"]
    device = generator.device if generator is not None else valid.device
    scores = torch.rand(valid.shape, generator=generator, device=device).to(valid.device) + (~valid).float() * 2
    count = max(1, math.ceil(keep_ratio * valid.shape[1]))
    return scores.argsort(dim=1)[:, :count]


def masked_mean(tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """(B, N, D) -> (B, D): the mean over the tokens `valid` (B, N) marks (all of them for None), padding left out."""
    if valid is None:
        return tokens.mean(dim=1)
    weights = valid.to(tokens.dtype)[..., None]
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def batch_grids(batch: dict) -> list[tuple[int, int]]:
    """Each image's (h, w) patch grid, read from its coordinates (one host sync)."""
    coords = batch["patch_coord"].masked_fill(~batch["patch_valid"][..., None], 0)
    return [(int(h) + 1, int(w) + 1) for h, w in coords.amax(dim=1).tolist()]


def unpack(tokens: torch.Tensor, batch: dict) -> list[torch.Tensor]:
    """(B, N, D) patch-token outputs of a NaFlex batch -> each image's (n_i, D) valid tokens, in batch order."""
    return [row[mask] for row, mask in zip(tokens, batch["patch_valid"], strict=True)]


def from_siglip2(pixel_values: torch.Tensor, spatial_shapes: torch.Tensor, pixel_attention_mask: torch.Tensor) -> dict:
    """transformers' SigLIP 2 inputs (Siglip2ImageProcessor: each image's patches in raster order, then padding)
    -> a NaFlex batch."""
    position = torch.arange(pixel_values.shape[1], device=pixel_values.device)[None]
    widths = spatial_shapes[:, 1:2].to(position.device)
    valid = pixel_attention_mask.bool()
    coords = torch.stack([position // widths, position % widths], dim=-1).masked_fill(~valid[..., None], 0)
    return {"patches": pixel_values, "patch_coord": coords, "patch_valid": valid}


def to_siglip2(batch: dict) -> dict:
    """A NaFlex batch in raster order (`pack`'s) -> transformers' Siglip2VisionModel keyword arguments."""
    return {"pixel_values": batch["patches"], "pixel_attention_mask": batch["patch_valid"].long(),
            "spatial_shapes": torch.tensor(batch_grids(batch), device=batch["patches"].device)}


@dataclass
class NaFlexLayout:
    """Where a NaFlex batch's patches sit: each image's grid, and every patch's flat index on its own grid
    (row * w + column; 0 for padding), grouped by grid so that a table is built once per distinct grid."""

    grids: list[tuple[int, int]]
    index: torch.Tensor  # (B, N) int64
    valid: torch.Tensor  # (B, N) bool

    @classmethod
    def of(cls, batch: dict) -> NaFlexLayout:
        grids = batch_grids(batch)
        coords, valid = batch["patch_coord"], batch["patch_valid"]
        widths = torch.tensor([w for _, w in grids], device=coords.device)[:, None]
        index = (coords[..., 0] * widths + coords[..., 1]).masked_fill(~valid, 0)
        return cls(grids, index, valid)

    def groups(self) -> dict[tuple[int, int], list[int]]:
        """grid -> the batch rows on it, in order of first appearance."""
        groups: dict[tuple[int, int], list[int]] = {}
        for row, grid in enumerate(self.grids):
            groups.setdefault(grid, []).append(row)
        return groups

    def per_image(self, table_of) -> torch.Tensor:
        """`table_of(grid, index)` (a tensor whose first dimension is the rows of that grid's images; `index` their
        (b, N) flat indices) for the whole batch, built once per distinct grid."""
        groups = self.groups()
        if len(groups) == 1:
            return table_of(next(iter(groups)), self.index)
        out = None
        for grid, rows in groups.items():
            table = table_of(grid, self.index[rows])
            out = table.new_empty(len(self.grids), *table.shape[1:]) if out is None else out
            out[torch.tensor(rows, device=out.device)] = table
        return out

    def kept(self, keep: torch.Tensor) -> NaFlexLayout:
        """The layout of the slots at `keep` (B, K) (a token drop): their places and validity, the grids as they
        were."""
        return NaFlexLayout(self.grids, self.index.gather(1, keep), self.valid.gather(1, keep))

    def points(self) -> tuple[torch.Tensor, ...]:
        """(rows, cols, heights, widths), each (B x N,): every patch's place and its image's grid (padding: row 0,
        column 0 of its image), for rotary tables built patch by patch (ssl_vit.backbone.rope)."""
        sizes = torch.tensor(self.grids, device=self.index.device)  # (B, 2)
        heights, widths = (sizes[:, i, None].expand_as(self.index) for i in (0, 1))
        rows, cols = self.index // widths, self.index % widths
        return tuple(t.reshape(-1) for t in (rows, cols, heights, widths))

    def rope_tables(self, rope, depth: int) -> list:
        """Each block's rotary (sin, cos) tables: every patch's rows from its place on its own image's grid, in one
        call of the rope module (one augmentation draw per batch, as DINOv3's; one parameter gather under ZeRO-3)."""
        batch, length = self.index.shape
        tables = rope(None, points=self.points())

        def per_image(table):  # (B x N, d) -> (B, N, d); the mixed kind's (1, heads, B x N, d) -> (B, heads, N, d)
            if table.ndim == 2:
                return table.reshape(batch, length, -1)
            return table[0].reshape(table.shape[1], batch, length, -1).transpose(0, 1)

        if isinstance(tables, list):
            return [(per_image(sin), per_image(cos), *rest) for sin, cos, *rest in tables]
        sin, cos, *rest = tables
        return [(per_image(sin), per_image(cos), *rest)] * depth

    def spatial_grid(self) -> None:
        """No one grid to partition (the backbone refuses windows for NaFlex batches: `naflex_refusal`)."""
        return None

    def attention_mask(self, num_prefix_tokens: int) -> torch.Tensor:
        """(B, 1, 1, prefix + N) bool, true for keys a query may attend (the prefix tokens and valid patches):
        SDPA's boolean mask. Key-only, as timm's `use_key_only_attn_mask`: a padding query still attends the valid
        keys, so no row is empty; the valid tokens' outputs are those of the image alone."""
        prefix = self.valid.new_ones(len(self.grids), num_prefix_tokens)
        return torch.cat([prefix, self.valid], dim=1)[:, None, None, :]
