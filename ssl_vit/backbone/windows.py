"""Windowed attention and decomposed relative positions, as ViTDet and SAM run a plain ViT at high resolution.

A windowed block attends within non-overlapping `window x window` squares of the patch grid; a grid that is not a
multiple of the window is padded with zeros at the bottom and right (after the block's first norm, as SAM and
ViTDet do: padded tokens take part in their window's attention as zeros) and cropped back after it.

Decomposed relative positions (MViTv2, used by ViTDet and SAM): per block two tables, one row per relative offset
along the height (2h - 1 rows) and the width (2w - 1); the attention logit of query q at (y, x) for a key at (y', x')
gains <q, R_h[y - y']> + <q, R_w[x - x']>, added to SDPA as a bias. A table made for another size is resampled
linearly along its offsets (`rel_pos_table`); queries and keys of different sizes are compared on a common scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_partition(x: torch.Tensor, window: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(B, H, W, C) -> (B x windows, window, window, C), zero-padded to multiples of `window`; also the padded
    (H, W)."""
    batch, height, width, channels = x.shape
    pad_h, pad_w = -height % window, -width % window
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    padded = (height + pad_h, width + pad_w)
    x = x.view(batch, padded[0] // window, window, padded[1] // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window, window, channels), padded


def window_unpartition(windows: torch.Tensor, window: int, size: tuple[int, int],
                       padded: tuple[int, int]) -> torch.Tensor:
    """The inverse of `window_partition`: (B x windows, window, window, C) -> (B, H, W, C), the padding cropped."""
    rows, cols = padded[0] // window, padded[1] // window
    batch = windows.shape[0] // (rows * cols)
    x = windows.view(batch, rows, cols, window, window, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, padded[0], padded[1], -1)[:, :size[0], :size[1]]


def resample_rel_pos(table: torch.Tensor, offsets: int) -> torch.Tensor:
    """A (2L - 1, C) relative-position table resampled linearly along its offsets to `offsets` rows (as it is when
    used at another size, or loaded where a table of another length is expected)."""
    if table.shape[0] == offsets:
        return table
    return F.interpolate(table.T[None], size=offsets, mode="linear")[0].T


def rel_pos_table(query_size: int, key_size: int, table: torch.Tensor) -> torch.Tensor:
    """(query_size, key_size, C): the row of `table` ((2L - 1, C), offsets -L+1 .. L-1) for each query-key pair,
    the table resampled linearly to 2 max(q, k) - 1 offsets when it was made for another size; sizes that differ
    are compared on the longer one's scale."""
    table = resample_rel_pos(table, 2 * max(query_size, key_size) - 1)
    q_scale, k_scale = max(key_size / query_size, 1.0), max(query_size / key_size, 1.0)
    relative = (torch.arange(query_size, device=table.device)[:, None] * q_scale
                - torch.arange(key_size, device=table.device)[None, :] * k_scale + (key_size - 1) * k_scale)
    return table[relative.long()]


def decomposed_rel_pos_bias(q: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor,
                            query_grid: tuple[int, int], key_grid: tuple[int, int]) -> torch.Tensor:
    """The attention bias (..., Hq x Wq, Hk x Wk) of queries `q` (..., Hq x Wq, C) on their grid (unscaled q, as
    SAM): <q, R_h[dy]> + <q, R_w[dx]>."""
    r_h = rel_pos_table(query_grid[0], key_grid[0], table_h).to(q.dtype)
    r_w = rel_pos_table(query_grid[1], key_grid[1], table_w).to(q.dtype)
    grid_q = q.reshape(*q.shape[:-2], *query_grid, q.shape[-1])
    bias_h = torch.einsum("...hwc,hkc->...hwk", grid_q, r_h)
    bias_w = torch.einsum("...hwc,wkc->...hwk", grid_q, r_w)
    bias = bias_h[..., :, None] + bias_w[..., None, :]
    return bias.reshape(*q.shape[:-2], query_grid[0] * query_grid[1], key_grid[0] * key_grid[1])
