"""Multi-head self-attention over the token sequence: SDPA, an explicit path that returns the weights (analysis),
DINOv3's key-bias mask, and ViTDet / SAM's windows and relative positions (ssl_vit.backbone.windows)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone.init import Linear
from ssl_vit.backbone.rope import apply_rope
from ssl_vit.backbone.windows import decomposed_rel_pos_bias, window_partition, window_unpartition


def attend(q, k, v, dropout_p: float, return_attention: bool, bias: torch.Tensor | None = None):
    """SDPA, or the explicit softmax(q k^T / sqrt(d) + bias) v that also returns the weights (for analysis).
    `bias`: an additive float bias, or a boolean mask (true: attend)."""
    if not return_attention:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p), None
    weights = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if bias is not None and bias.dtype == torch.bool:  # a NaFlex batch's key mask: true where attended
        weights = weights.masked_fill(~bias, float("-inf"))
    elif bias is not None:
        weights = weights + bias
    weights = weights.softmax(dim=-1)
    return weights @ v, weights


class KeyMaskedLinear(Linear):
    """A fused projection whose key outputs get no bias (DINOv3's `LinearKMaskedBias`): the bias is multiplied by a
    mask, 0 on the `splits[key_index]` outputs, in this module's own forward (so that ZeRO-3 gathers its weights as
    for any Linear). The mask is rebuilt in `reset_parameters`, so a model materialised from the meta device has it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, scheme: str, splits: Sequence[int],
                 key_index: int):
        self.key_index = key_index
        super().__init__(in_features, out_features, bias, scheme=scheme, role="fused", splits=splits)
        self.register_buffer("bias_mask", torch.ones(out_features) if bias else None, persistent=False)
        self._fill_mask()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._fill_mask()

    @torch.no_grad()
    def _fill_mask(self) -> None:
        if getattr(self, "bias_mask", None) is not None:  # not yet there when nn.Linear's constructor resets
            self.bias_mask.fill_(1.0)
            start = sum(self.splits[:self.key_index])
            self.bias_mask[start:start + self.splits[self.key_index]] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, None if self.bias is None else self.bias * self.bias_mask.to(self.bias.dtype))


class Attention(nn.Module):
    """Multi-head self-attention. `mask_k_bias` (RoPE backbones, as DINOv3): the key bias is held at zero, since
    after the rotation it would shift each logit by a position-dependent amount (without RoPE a key bias changes no
    output at all).

    `window` > 0 (ViTDet / SAM, ssl_vit.windows): the patch tokens attend within `window x window` squares of their
    grid (zero-padded to a multiple, cropped after), each window also seeing the prefix tokens (class, registers),
    which attend to every token. `rel_pos_size` (h, w): decomposed relative-position tables for that query grid
    (the window, or the whole grid), zero at the start, added to the patch-to-patch logits as a bias."""

    def __init__(self, dim, num_heads, qkv_bias=True, qk_norm=False, norm_layer=nn.LayerNorm, attn_drop=0.0,
                 proj_drop=0.0, weight_init="timm", mask_k_bias=False, window: int = 0,
                 rel_pos_size: Sequence[int] | None = None, proj_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = (KeyMaskedLinear(dim, dim * 3, qkv_bias, scheme=weight_init, splits=[dim] * 3, key_index=1)
                    if mask_k_bias else
                    Linear(dim, dim * 3, bias=qkv_bias, scheme=weight_init, role="fused", splits=[dim] * 3))
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = Linear(dim, dim, bias=proj_bias, scheme=weight_init)
        self.proj_drop = nn.Dropout(proj_drop)
        self.window = int(window)
        self.rel_pos_h = self.rel_pos_w = None
        if rel_pos_size is not None:
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * rel_pos_size[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * rel_pos_size[1] - 1, self.head_dim))

    @property
    def needs_grid(self) -> bool:
        return bool(self.window) or self.rel_pos_h is not None

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, C) -> q, k, v (B, heads, N, head_dim), q and k normed."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def _rel_bias(self, q: torch.Tensor, grid: Sequence[int], prefix: int, query_prefix: int) -> torch.Tensor | None:
        """The relative-position bias of the patch queries (the rows after `query_prefix`) over the patch keys of
        the same grid, zero for the `prefix` keys in front (and the prefix queries)."""
        if self.rel_pos_h is None:
            return None
        bias = decomposed_rel_pos_bias(q[..., query_prefix:, :], self.rel_pos_h, self.rel_pos_w, grid, grid)
        return F.pad(bias, (prefix, 0, query_prefix, 0))

    def forward(self, x: torch.Tensor, rope=None, return_attention: bool = False, grid: Sequence[int] | None = None,
                attn_mask: torch.Tensor | None = None):
        """`grid`: the patch tokens' (h, w), which windows and relative positions need (the last h x w tokens);
        `attn_mask`: a NaFlex batch's (B, 1, 1, n) boolean key mask (ssl_vit.naflex), or None."""
        if self.needs_grid and grid is None:
            raise ValueError("windowed attention and relative positions need the patch grid (all patch tokens, none "
                             "dropped)")
        if self.window:
            if return_attention:
                raise ValueError("attention maps are not given for windowed blocks (window_size > 0)")
            return self._windowed(x, tuple(grid))
        B, N, C = x.shape
        q, k, v = self._heads(x)
        q, k = apply_rope(q, k, rope)
        prefix = N - math.prod(grid) if grid is not None else 0
        bias = self._rel_bias(q, grid, prefix, prefix) if attn_mask is None else attn_mask
        out, weights = attend(q, k, v, self.attn_drop if self.training else 0.0, return_attention, bias)
        out = self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))
        return (out, weights) if return_attention else out

    def _windowed(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        prefix = N - grid[0] * grid[1]
        dropout = self.attn_drop if self.training else 0.0
        windows, padded = window_partition(x[:, prefix:].reshape(B, *grid, C), self.window)
        count = windows.shape[0] // B
        q, k, v = self._heads(windows.reshape(windows.shape[0], -1, C))  # (B x windows, heads, w x w, d)
        bias = self._rel_bias(q, (self.window, self.window), prefix, 0)
        if prefix:
            pq, pk, pv = self._heads(x[:, :prefix])
            patch_k, patch_v = (self._unwindow(t, B, grid, padded) for t in (k, v))
            prefix_out, _ = attend(pq, torch.cat([pk, patch_k], 2), torch.cat([pv, patch_v], 2), dropout, False)
            k = torch.cat([pk.repeat_interleave(count, 0), k], 2)
            v = torch.cat([pv.repeat_interleave(count, 0), v], 2)
        out, _ = attend(q, k, v, dropout, False, bias)
        out = self._unwindow(out, B, grid, padded).transpose(1, 2).reshape(B, -1, C)
        if prefix:
            out = torch.cat([prefix_out.transpose(1, 2).reshape(B, prefix, C), out], 1)
        return self.proj_drop(self.proj(out))

    def _unwindow(self, t: torch.Tensor, batch: int, grid: tuple[int, int], padded: tuple[int, int]) -> torch.Tensor:
        """(B x windows, heads, w x w, d) per window -> (B, heads, h x w, d) on the grid, the padding cropped."""
        w = self.window
        flat = t.transpose(1, 2).reshape(t.shape[0], w, w, -1)
        full = window_unpartition(flat, w, grid, padded).reshape(batch, -1, self.num_heads, self.head_dim)
        return full.transpose(1, 2)

