"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2021) and its later options.

One `VisionTransformer` configured by keyword arguments; variants are data in `PRESETS`. Parameter names follow
timm's `VisionTransformer` (and its `ParallelScalingBlock` for 22B-style parallel blocks), so state dicts move
between the two without renaming. The forward pass is a chain of small steps:

    patches = vit.patch_embed(images)                 # (B, N, D), raster order
    tokens = vit.embed_patches(patches, grid, ...)    # masked patches replaced, position embeddings added, a
                                                      # subset kept, then the class token and registers in front
    tokens = vit.run_blocks(tokens, grid)             # pre-norm, the L blocks (RoPE placed by grid), final norm
    embedding = vit.pool(tokens)                      # class token or average of patch tokens (+ fc_norm)

`forward_features(images, mask=, mask_token=, keep=)` is the same in one call. The masked-token path, shared by
every masking objective: `mask` (B, N) bool replaces those patch embeddings by `mask_token` before the position
embeddings (iBOT, the ViT paper's masked patch prediction; a (B, N, D) `mask_token` gives each masked patch its own
replacement); `keep` (B, K) indices keeps only those patches after them (MAE's visible patches, I-JEPA's context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import DropPath, QuickGELU
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from ssl_vit.geometry import check_divisible, pair
from ssl_vit.init import LayerScale, Linear, PatchProjection, check_scheme, init_embeddings
from ssl_vit.naflex import NaFlexLayout, is_naflex, masked_mean, patch_valid
from ssl_vit.pyramid import ConvNorm
from ssl_vit.rope import apply_rope, build_rope
from ssl_vit.stem import HybridPatchEmbed, check_stem
from ssl_vit.windows import decomposed_rel_pos_bias, window_partition, window_unpartition

GLOBAL_POOLS = ("token", "avg")
# Interpolation modes for resampling position embeddings to a new grid (the ones F.interpolate can antialias).
# Conventions differ: timm resamples bicubic with antialiasing (its `resample_abs_pos_embed` default); DINOv2 and HF
# transformers resample bicubic without it; FlexiViT / RADIO bilinear without it.
POS_EMBED_INTERP_MODES = ("bicubic", "bilinear")
# learned: added, trained (the paper); sincos: MAE's fixed 2-D sin-cos, added, not trained; rope: DINOv3's rotary
# embeddings inside attention (ssl_vit.rope), nothing added; none: no position information
POS_EMBEDS = ("learned", "sincos", "rope", "none")
# MLP activations: exact GELU (the paper, timm, DINOv2, HF "gelu"), tanh-approximated GELU (SigLIP, HF
# "gelu_pytorch_tanh"), QuickGELU x * sigmoid(1.702 x) (OpenAI's CLIP weights, HF "quick_gelu").
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")


def make_activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"act_layer {name!r} is not one of {list(ACTIVATIONS)}")
    return QuickGELU() if name == "quick_gelu" else nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")

# Presets are plain keyword arguments; anything not given takes the VisionTransformer default.
_SHAPES: dict[str, dict] = {
    # Tiny sizes for tests and CPU smoke runs (4x4 patches on small images).
    "vit_test": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2),
    "vit_test_22b": dict(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2,
        qkv_bias=False, norm_bias=False, qk_norm=True, parallel_block=True, class_token=False, global_pool="avg",
    ),
    "vit_tiny": dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4),
    # A hybrid for tests: a one-stage ResNet-v2 (stride 4) and 2x2 patches of its map, 4x4 tokens at 32 px.
    "vit_tiny_r": dict(img_size=32, patch_size=2, embed_dim=32, depth=2, num_heads=2, stem="resnet",
                       stem_layers=[1], stem_channels=[128], stem_width=32),
    # The paper's table (Dosovitskiy et al. 2021, Table 1) plus ViT-g and ViT-22B.
    "vit_ti16": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_s16": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_b16": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_l16": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
    "vit_h14": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16),
    "vit_g14": dict(patch_size=14, embed_dim=1408, depth=40, num_heads=16, mlp_dim=6144),
    # The paper's hybrids (section 3.1): ResNet-50 with stage 4's blocks moved into stage 3 (stride 16), 1x1 patches;
    # timm's vit_base_r50_s16_224 (timm has no L/16 hybrid: its vit_large_r50_s32 keeps ResNet-50's four stages).
    "vit_b16_r50": dict(patch_size=1, embed_dim=768, depth=12, num_heads=12, stem="resnet", stem_layers=[3, 4, 9]),
    "vit_l16_r50": dict(patch_size=1, embed_dim=1024, depth=24, num_heads=16, stem="resnet", stem_layers=[3, 4, 9]),
    # Dehghani et al. 2023: parallel attention + MLP from one LayerNorm, QK-norm, no QKV / LayerNorm biases.
    "vit_22b": dict(
        patch_size=14, embed_dim=6144, depth=48, num_heads=48, mlp_dim=24576,
        qkv_bias=False, norm_bias=False, qk_norm=True, parallel_block=True, class_token=False, global_pool="avg",
    ),
}
# Every preset initialises as big_vision (`jax`: the paper's code; model.weight_init overrides). Measured with
# benchmarks/init_schemes.py (vit_tiny, supervised, synthetic shapes, 300 steps, 3 seeds; mean [min, max]; the
# supervised head then trunc-normal(0.02) in every scheme, before objective.head_init):
#   init    train acc %           k-NN acc %            train loss
#   timm    20.2 [16.8, 22.5]     21.3 [12.8, 27.9]     1.95 [1.82, 2.06]   (trunc-normal 0.02: starves width 64)
#   jax     35.8 [34.3, 38.3]     35.5 [32.4, 40.1]     1.53 [1.48, 1.55]
#   torch   26.4 [20.9, 34.2]     29.2 [25.6, 36.0]     1.78 [1.57, 1.93]
# so jax is the default of the tiny presets too. VisionTransformer(...) built directly keeps timm's init.
PRESETS: dict[str, dict] = {name: {"weight_init": "jax", **shape} for name, shape in _SHAPES.items()}


def _check_pos_embed_interp(mode: str) -> None:
    if mode not in POS_EMBED_INTERP_MODES:
        raise ValueError(f"pos_embed_interp {mode!r} is not one of {list(POS_EMBED_INTERP_MODES)}")


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: Sequence[int],
    old_grid: Sequence[int],
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resample (1, prefix + H*W, D) position embeddings to a new (H', W') grid by 2-D interpolation.

    The prefix slots (class token, registers) are kept as they are; grids may be non-square; computed in fp32.
    The defaults (bicubic, antialiased) are timm's `resample_abs_pos_embed`; `antialias=False` is DINOv2's and HF
    transformers' `interpolate_pos_encoding` (F.interpolate to the target size, no antialiasing). The two differ when
    growing too: PyTorch's antialiased bicubic uses PIL's kernel (a = -0.5), the plain one a = -0.75.
    """
    _check_pos_embed_interp(mode)
    new_grid, old_grid = pair(tuple(new_grid)), pair(tuple(old_grid))
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    if grid.shape[1] != old_grid[0] * old_grid[1]:
        raise ValueError(f"position embedding has {grid.shape[1]} patch slots, not {old_grid[0]}x{old_grid[1]}")
    if new_grid == old_grid:
        return pos_embed
    dim = grid.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode=mode, antialias=antialias, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def sincos_pos_embed_2d(grid: Sequence[int], dim: int, num_prefix_tokens: int = 0,
                        temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings (MAE), shape (1, prefix + H*W, dim); prefix slots are zeros.

    Channel layout as in MAE's released weights: [sin(col), cos(col), sin(row), cos(row)], each of dim/4 frequencies
    1 / temperature**(i / (dim/4)). MAE's code calls the column half "emb_h" (its meshgrid puts w first); HF
    transformers builds [h | w] and swaps the halves to load those weights. Grids may be non-square.
    """
    if dim % 4:
        raise ValueError(f"sin-cos position embeddings need a width divisible by 4, got {dim}")
    rows, cols = pair(tuple(grid))
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    row, col = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                              indexing="ij")
    angle_col, angle_row = col.flatten().outer(omega), row.flatten().outer(omega)
    embed = torch.cat([angle_col.sin(), angle_col.cos(), angle_row.sin(), angle_row.cos()], dim=1)
    embed = torch.cat([torch.zeros(num_prefix_tokens, dim, dtype=torch.float64), embed])
    return embed.float().unsqueeze(0)


class PatchEmbed(nn.Module):
    """Cut images into P x P patches and map each linearly to D: exactly a Conv2d with kernel = stride = P.

    The hybrid stem (`ssl_vit.stem.HybridPatchEmbed`) has the same interface: img_size, patch_size, grid_size,
    num_patches, stride (image pixels per token side), grid_for, resize, forward -> (B, N, D)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, bias=True, weight_init="timm"):
        super().__init__()
        self.img_size, self.patch_size = pair(img_size), pair(patch_size)
        check_divisible(self.img_size, self.patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = PatchProjection(in_chans, embed_dim, self.patch_size, bias=bias, scheme=weight_init)

    @property
    def stride(self) -> tuple[int, int]:
        return self.patch_size

    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        check_divisible((height, width), self.patch_size)
        return height // self.patch_size[0], width // self.patch_size[1]

    def resize(self, img_size: tuple[int, int]) -> None:
        self.grid_size = self.grid_for(*img_size)
        self.img_size, self.num_patches = tuple(img_size), self.grid_size[0] * self.grid_size[1]

    def embed_flat(self, patches: torch.Tensor) -> torch.Tensor:
        """(B, N, P * P * C) flat patches (row, column, channel: ssl_vit.naflex) -> (B, N, D): the same
        projection as a linear layer over the flattened kernel."""
        weight = self.proj.weight
        expected = weight[0].numel()
        if patches.shape[-1] != expected:
            raise ValueError(f"NaFlex patches have {patches.shape[-1]} values each, this patch embedding takes "
                             f"{self.patch_size[0]}x{self.patch_size[1]}x{weight.shape[1]} = {expected}")
        return F.linear(patches.to(weight.dtype), weight.permute(0, 2, 3, 1).flatten(1), self.proj.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W), or a NaFlex batch's flat patches (B, N, P * P * C) (`embed_flat`)."""
        if images.ndim == 3:
            return self.embed_flat(images)
        self.grid_for(images.shape[-2], images.shape[-1])
        # In the weights' dtype (bf16 weights under DeepSpeed's bf16 mode; a no-op otherwise), as HF's ViT does.
        return self.proj(images.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)


def _attend(q, k, v, dropout_p: float, return_attention: bool, bias: torch.Tensor | None = None):
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
                 rel_pos_size: Sequence[int] | None = None):
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
        self.proj = Linear(dim, dim, scheme=weight_init)
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
        out, weights = _attend(q, k, v, self.attn_drop if self.training else 0.0, return_attention, bias)
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
            prefix_out, _ = _attend(pq, torch.cat([pk, patch_k], 2), torch.cat([pv, patch_v], 2), dropout, False)
            k = torch.cat([pk.repeat_interleave(count, 0), k], 2)
            v = torch.cat([pv.repeat_interleave(count, 0), v], 2)
        out, _ = _attend(q, k, v, dropout, False, bias)
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


class Mlp(nn.Module):
    def __init__(self, dim, hidden_dim, drop=0.0, weight_init="timm", act_layer="gelu"):
        super().__init__()
        self.fc1 = Linear(dim, hidden_dim, scheme=weight_init, role="mlp")
        self.act = make_activation(act_layer)
        self.fc2 = Linear(hidden_dim, dim, scheme=weight_init, role="mlp")
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))


# Activation checkpointing of a block: "full" keeps only its input and recomputes the whole block in backward;
# "selective" also keeps the outputs of its matmuls and attention and recomputes only the cheap element-wise ops
# (norms, GELU, residual adds: DINOv3's op list): more memory than full, no matmul recomputed.
CHECKPOINTING = ("full", "selective")
_AT = torch.ops.aten
SAVED_BY_SELECTIVE = {_AT.mm.default, _AT.addmm.default, _AT.bmm.default,
                      _AT._scaled_dot_product_flash_attention.default,
                      _AT._scaled_dot_product_efficient_attention.default,
                      _AT._scaled_dot_product_cudnn_attention.default,
                      _AT._scaled_dot_product_flash_attention_for_cpu.default}


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


_CHECKPOINT_CONTEXTS = {"full": noop_context_fn,
                        "selective": partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)}


def check_checkpointing(policy) -> str | None:
    """None / False (off), True or "full", or "selective"; anything else fails naming the choices."""
    if policy in (None, False):
        return None
    if policy is True:
        return "full"
    if policy not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing {policy!r} is not one of {[False, True, *CHECKPOINTING]}")
    return policy


class TransformerBlock(nn.Module):
    """What both block kinds share: `forward` runs `residual`, activation-checkpointed when `checkpointing` is set
    (inside the block's forward, so that a block compiled on its own, torch.compile per block, holds the
    checkpoint in its graph: the order DINOv3 and torchtitan apply them in)."""

    checkpointing: str | None = None  # None, "full" or "selective" (CHECKPOINTING)

    def forward(self, x: torch.Tensor, rope=None, return_attention: bool = False, grid: Sequence[int] | None = None,
                attn_mask: torch.Tensor | None = None):
        """`rope`: the (sin, cos) tables of the patch tokens (`VisionTransformer.rope_tables`), or None; `grid`:
        the patch grid (windowed attention and relative positions need it); `attn_mask`: a NaFlex batch's key
        mask (ssl_vit.naflex.NaFlexLayout.attention_mask), or None."""
        if self.checkpointing and torch.is_grad_enabled() and not return_attention:
            return checkpoint(self.residual, x, rope, False, grid, attn_mask, use_reentrant=False,
                              context_fn=_CHECKPOINT_CONTEXTS[self.checkpointing])
        return self.residual(x, rope, return_attention, grid, attn_mask)

    def residual(self, x: torch.Tensor, rope=None, return_attention: bool = False, grid=None, attn_mask=None):
        raise NotImplementedError


def _layer_scale(dim, init_value):
    return LayerScale(dim, init_value) if init_value is not None else nn.Identity()


class Block(TransformerBlock):
    """Pre-norm block of the paper: z = z + MSA(LN(z)); z = z + MLP(LN(z))."""

    def __init__(self, dim, num_heads, mlp_dim, qkv_bias=True, qk_norm=False, norm_layer=nn.LayerNorm,
                 layer_scale=None, drop_path=0.0, attn_drop=0.0, proj_drop=0.0, weight_init="timm", act_layer="gelu",
                 mask_k_bias=False, window: int = 0, rel_pos_size: Sequence[int] | None = None):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, qk_norm, norm_layer, attn_drop, proj_drop, weight_init,
                              mask_k_bias, window, rel_pos_size)
        self.ls1 = _layer_scale(dim, layer_scale)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, mlp_dim, proj_drop, weight_init, act_layer)
        self.ls2 = _layer_scale(dim, layer_scale)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def residual(self, x: torch.Tensor, rope=None, return_attention: bool = False, grid=None, attn_mask=None):
        attn = self.attn(self.norm1(x), rope, return_attention, grid, attn_mask)
        attn, weights = attn if return_attention else (attn, None)
        x = x + self.drop_path1(self.ls1(attn))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return (x, weights) if return_attention else x


class ParallelBlock(TransformerBlock):
    """ViT-22B block: z = z + MLP(LN(z)) + MSA(LN(z)), with QKV and fc1 fused into one input projection.

    Parameter names and the [mlp, q, k, v] split follow timm's `ParallelScalingBlock`, so weights load there as is.
    """

    def __init__(self, dim, num_heads, mlp_dim, qkv_bias=False, qk_norm=True, norm_layer=nn.LayerNorm,
                 layer_scale=None, drop_path=0.0, attn_drop=0.0, proj_drop=0.0, weight_init="timm", act_layer="gelu",
                 mask_k_bias=False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.in_split = [mlp_dim, dim, dim, dim]
        self.weight_init = weight_init
        self.in_norm = norm_layer(dim)
        self.in_proj = (KeyMaskedLinear(dim, mlp_dim + 3 * dim, qkv_bias, scheme=weight_init, splits=self.in_split,
                                        key_index=2) if mask_k_bias else
                        Linear(dim, mlp_dim + 3 * dim, bias=qkv_bias, scheme=weight_init, role="fused",
                               splits=self.in_split))
        # Without a QKV bias the MLP still has its own fc1 bias (as in the paper and timm).
        self.mlp_bias = None if qkv_bias else nn.Parameter(torch.empty(mlp_dim))
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.mlp_act = make_activation(act_layer)
        self.mlp_drop = nn.Dropout(proj_drop)
        self.attn_out_proj = Linear(dim, dim, scheme=weight_init)
        self.mlp_out_proj = Linear(mlp_dim, dim, scheme=weight_init, role="mlp")
        self.ls = _layer_scale(dim, layer_scale)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This block's own parameter (the MLP's input bias); its layers initialise themselves."""
        if self.mlp_bias is not None:
            if self.weight_init == "jax":
                nn.init.normal_(self.mlp_bias, std=1e-6)
            else:
                nn.init.zeros_(self.mlp_bias)

    def residual(self, x: torch.Tensor, rope=None, return_attention: bool = False, grid=None, attn_mask=None):
        B, N, C = x.shape
        hidden, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            hidden = hidden + self.mlp_bias
        q, k, v = (t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(self.q_norm(q), self.k_norm(k), rope)
        attn, weights = _attend(q, k, v, self.attn_drop if self.training else 0.0, return_attention, attn_mask)
        attn = self.attn_out_proj(attn.transpose(1, 2).reshape(B, N, C))
        mlp = self.mlp_out_proj(self.mlp_drop(self.mlp_act(hidden)))
        x = x + self.drop_path(self.ls(attn + mlp))
        return (x, weights) if return_attention else x


def block_windows(depth: int, window_size: int, global_attn_indexes: Sequence[int], rel_pos: bool, pos_embed: str,
                  parallel_block: bool, grid: Sequence[int]) -> list[int]:
    """Each block's window (0: global attention), ViTDet / SAM's layout: `window_size` everywhere but the blocks
    `global_attn_indexes` names; ValueError naming a setting that does not fit."""
    indexes = [int(i) for i in global_attn_indexes]
    if window_size < 0:
        raise ValueError(f"window_size={window_size} must be >= 0 (0: global attention in every block)")
    if indexes and not window_size:
        raise ValueError(f"global_attn_indexes={indexes} needs window_size > 0 (without windows every block is global)")
    past = [i for i in indexes if not 0 <= i < depth]
    if past:
        raise ValueError(f"global_attn_indexes={indexes}: {past} not a block of this depth-{depth} ViT "
                         f"(valid: 0..{depth - 1})")
    if window_size > max(grid):
        raise ValueError(f"window_size={window_size} is larger than the {grid[0]}x{grid[1]} patch grid; one window "
                         f"would cover it (window_size=0 is global attention; windows fit a larger img_size)")
    if (window_size or rel_pos) and pos_embed == "rope":
        raise ValueError(f"{'rel_pos' if rel_pos else 'window_size'} with pos_embed=rope: rotary embeddings place the "
                         "tokens already (rel_pos) / windowed RoPE is not built here; use pos_embed=learned or sincos")
    if (window_size or rel_pos) and parallel_block:
        raise ValueError("window_size / rel_pos with parallel_block=true (ViT-22B's block) is not built here")
    return [0 if i in indexes else window_size for i in range(depth)]


class VisionTransformer(nn.Module):
    """ViT backbone. `num_classes=0` (the default) gives an encoder whose `forward` returns the pooled embedding."""

    def __init__(
        self,
        img_size: int | Sequence[int] = 224,
        patch_size: int | Sequence[int] = 16,
        in_chans: int = 3,
        num_classes: int = 0,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        mlp_dim: int | None = None,
        class_token: bool = True,
        global_pool: str = "token",
        dist_token: bool = False,
        num_registers: int = 0,
        pos_embed: str = "learned",
        rope_theta: float | None = None,
        rope_min_period: float | None = None,
        rope_max_period: float | None = None,
        rope_normalize: str = "separate",
        rope_shift: float | None = None,
        rope_jitter: float | None = None,
        rope_rescale: float | None = None,
        rope_kind: str = "dinov3",
        no_embed_class: bool = False,
        pos_embed_interp: str = "bicubic",
        pos_embed_antialias: bool = True,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        norm_bias: bool = True,
        norm_eps: float = 1e-6,
        pre_norm: bool = False,
        parallel_block: bool = False,
        layer_scale: float | None = None,
        drop_path: float = 0.0,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        weight_init: str = "timm",
        act_layer: str = "gelu",
        stem: str = "patch",
        stem_layers: Sequence[int] = (3, 4, 9),
        stem_channels: Sequence[int] | None = None,
        stem_width: int = 64,
        window_size: int = 0,
        global_attn_indexes: Sequence[int] = (),
        rel_pos: bool = False,
        neck_channels: int = 0,
    ):
        super().__init__()
        # The constructor arguments, so that a saved encoder can be rebuilt (ssl_vit.artifacts).
        self.config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in locals().items()
                       if k not in ("self", "__class__")}
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool {global_pool!r} is not one of {list(GLOBAL_POOLS)}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without one")
        if dist_token and not (class_token and global_pool == "token"):
            raise ValueError("dist_token=True (DeiT) needs class_token=True and global_pool='token'")
        _check_pos_embed_interp(pos_embed_interp)
        if pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed {pos_embed!r} is not one of {list(POS_EMBEDS)}")
        check_scheme(weight_init)
        make_activation(act_layer)  # a bad name fails here, naming the choices
        check_stem(stem, stem_layers, stem_channels, stem_width)

        def norm_layer(dim):
            return nn.LayerNorm(dim, eps=norm_eps, bias=norm_bias)

        self.embed_dim = self.num_features = embed_dim
        self.global_pool = global_pool
        self.num_prefix_tokens = int(class_token) + int(dist_token) + num_registers
        self.num_pos_prefix = 0 if no_embed_class or pos_embed in ("rope", "none") else self.num_prefix_tokens
        self.pos_embed_kind = pos_embed
        # How position embeddings are resampled for another grid (set_img_size and on the fly): timm's default is
        # bicubic + antialias; DINOv2 / HF transformers weights expect bicubic without antialiasing.
        self.pos_embed_interp, self.pos_embed_antialias = pos_embed_interp, bool(pos_embed_antialias)
        self.weight_init = weight_init

        # CLIP-style pre-norm models have no patch-embedding bias (as in timm).
        if stem == "resnet":
            self.patch_embed = HybridPatchEmbed(img_size, patch_size, in_chans, embed_dim, bias=not pre_norm,
                                                weight_init=weight_init, layers=stem_layers, channels=stem_channels,
                                                width=stem_width)
        else:
            self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, bias=not pre_norm,
                                          weight_init=weight_init)
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim)) if class_token else None
        # DeiT's distillation token (timm's VisionTransformerDistilled: right after the class token)
        self.dist_token = nn.Parameter(torch.empty(1, 1, embed_dim)) if dist_token else None
        self.reg_token = nn.Parameter(torch.empty(1, num_registers, embed_dim)) if num_registers else None
        self.pos_embed = (nn.Parameter(torch.empty(1, self.num_pos_prefix + self.patch_embed.num_patches, embed_dim),
                                       requires_grad=pos_embed == "learned")
                          if pos_embed in ("learned", "sincos") else None)
        self.rope = (build_rope(rope_kind, embed_dim // num_heads, depth, num_heads, rope_theta, rope_min_period,
                                rope_max_period, rope_normalize, rope_shift, rope_jitter, rope_rescale)
                     if pos_embed == "rope" else None)
        # DINOv3 holds the key bias at zero (with RoPE it would rotate with the key's position); RoPE-ViT keeps it
        mask_k_bias = pos_embed == "rope" and rope_kind == "dinov3"
        self.norm_pre = norm_layer(embed_dim) if pre_norm else nn.Identity()

        mlp_dim = mlp_dim or int(embed_dim * mlp_ratio)
        drop_rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows linearly
        windows = block_windows(depth, window_size, global_attn_indexes, rel_pos, pos_embed, parallel_block,
                                self.patch_embed.grid_size)
        self.windowed = bool(window_size or rel_pos)  # blocks that need every patch token on its grid

        def spatial(window: int) -> dict:  # a block's window and relative-position table size (ViTDet / SAM)
            if not self.windowed:
                return {}
            table = ((window, window) if window else self.patch_embed.grid_size) if rel_pos else None
            return {"window": window, "rel_pos_size": table}

        self.blocks = nn.Sequential(*[
            (ParallelBlock if parallel_block else Block)(
                embed_dim, num_heads, mlp_dim, qkv_bias=qkv_bias, qk_norm=qk_norm, norm_layer=norm_layer,
                layer_scale=layer_scale, drop_path=rate, attn_drop=attn_drop, proj_drop=proj_drop,
                weight_init=weight_init, act_layer=act_layer, mask_k_bias=mask_k_bias, **spatial(window))
            for rate, window in zip(drop_rates, windows, strict=True)
        ])
        # As in timm: average pooling normalises after pooling (fc_norm), token pooling before (norm).
        use_fc_norm = global_pool == "avg"
        self.norm = nn.Identity() if use_fc_norm else norm_layer(embed_dim)
        self.fc_norm = norm_layer(embed_dim) if use_fc_norm else nn.Identity()
        # SAM's neck (segment-anything's image encoder): 1x1 then 3x3 convolution, each bias-free with a channel
        # LayerNorm, over the last patch map (`forward_neck`); 0: none
        self.neck = (nn.Sequential(ConvNorm(embed_dim, neck_channels, 1), ConvNorm(neck_channels, neck_channels, 3))
                     if neck_channels else None)
        # A classification head starts at zero (the paper's fine-tuning head, section 3.2).
        self.head = Linear(embed_dim, num_classes, role="zero") if num_classes > 0 else nn.Identity()
        self.reset_parameters()

    # ----- construction helpers -----
    def reset_parameters(self) -> None:
        """Initialise this module's own parameters (position embeddings, tokens) by `weight_init`; every layer
        initialises itself in its own constructor (see ssl_vit.init: this survives DeepSpeed's zero.Init)."""
        learned = self.pos_embed if self.pos_embed_kind == "learned" else None
        init_embeddings(learned, (self.cls_token, self.dist_token, self.reg_token), self.weight_init)
        if self.pos_embed_kind == "sincos":
            with torch.no_grad():
                self.pos_embed.copy_(sincos_pos_embed_2d(self.grid_size, self.embed_dim, self.num_pos_prefix))

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """Activation checkpointing per block: True / "full", "selective" (see CHECKPOINTING), or False."""
        policy = check_checkpointing(enable)
        for block in self.blocks:
            block.checkpointing = policy
        if hasattr(self.patch_embed, "set_grad_checkpointing"):  # a hybrid's ResNet: per stage (timm's), full
            self.patch_embed.set_grad_checkpointing(policy is not None)

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    def _resample_pos_embed(self, pos_embed: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        return resample_pos_embed(pos_embed, grid, self.grid_size, self.num_pos_prefix,
                                  mode=self.pos_embed_interp, antialias=self.pos_embed_antialias)

    def set_img_size(self, img_size: int | Sequence[int]) -> None:
        """Permanently resample the position embeddings for a new image size (fine-tuning at higher resolution)."""
        img_size = pair(img_size)
        new_grid = self.patch_embed.grid_for(*img_size)
        if self.pos_embed is not None:
            self.pos_embed = nn.Parameter(self._resample_pos_embed(self.pos_embed.data, new_grid),
                                          requires_grad=self.pos_embed.requires_grad)
        self.patch_embed.resize(img_size)
        self.config["img_size"] = list(img_size)  # so that a saved encoder rebuilds with this grid

    # ----- composable forward steps -----
    def patch_pos_embed(self, grid: Sequence[int] | None = None) -> torch.Tensor | None:
        """(1, H*W, D) position embeddings of the patch slots, resampled when `grid` differs from the native one;
        None without added position embeddings (pos_embed rope or none)."""
        pos = self.pos_embed
        if pos is None:
            return None
        if grid is not None and tuple(grid) != self.grid_size:
            pos = self._resample_pos_embed(pos, grid)
        return pos[:, self.num_pos_prefix:]

    def add_pos(self, tokens: torch.Tensor, grid: Sequence[int] | None = None) -> torch.Tensor:
        pos = self.patch_pos_embed(grid)
        return tokens if pos is None else tokens + pos

    def prepend_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Put the class token, the distillation token and registers (each with its position embedding, if it has
        one) in front."""
        prefix = [t for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if not prefix:
            return tokens
        prefix = torch.cat(prefix, dim=1)
        if self.num_pos_prefix:
            prefix = prefix + self.pos_embed[:, : self.num_pos_prefix]
        return torch.cat([prefix.expand(tokens.shape[0], -1, -1), tokens], dim=1)

    def rope_tables(self, grid: Sequence[int] | None, keep: torch.Tensor | None = None):
        """What each block's attention rotates the patch tokens by (pos_embed=rope), one entry per block: the (sin,
        cos) tables of the `grid`'s patches, or of those at `keep` (B, K) (the same for every block, or the mixed
        variant's own per block); None for the other kinds of position embedding."""
        if self.rope is None:
            return None
        if grid is None:
            raise ValueError("this backbone has rotary position embeddings (pos_embed='rope'): the blocks need the "
                             "patch grid, run_blocks(tokens, grid, keep)")
        tables = self.rope(grid, keep)
        return tables if isinstance(tables, list) else [tables] * len(self.blocks)

    def run_blocks(self, tokens: torch.Tensor, grid: Sequence[int] | None = None,
                   keep: torch.Tensor | None = None, layout: NaFlexLayout | None = None) -> torch.Tensor:
        """Pre-norm, all blocks (each activation-checkpointed when set), then the final norm. `grid` and `keep`
        (as given to `embed_patches`) place the patch tokens for rotary position embeddings; `layout`, for a
        NaFlex batch instead, places each image's tokens and masks its padding."""
        x = self.norm_pre(tokens)
        for block, rope, spatial, mask in self._block_inputs(grid, keep, layout):
            x = block(x, rope, grid=spatial, attn_mask=mask)
        return self.norm(x)

    def _block_inputs(self, grid, keep=None, layout: NaFlexLayout | None = None):
        """(block, its rope tables, the grid windows need, the attention mask) for each block."""
        if layout is not None:
            ropes, spatial, mask = self.naflex_rope_tables(layout), None, layout.attention_mask(self.num_prefix_tokens)
        else:
            ropes, spatial, mask = self.rope_tables(grid, keep), self.spatial_grid(grid, keep), None
        ropes = ropes or [None] * len(self.blocks)
        return [(block, rope, spatial, mask) for block, rope in zip(self.blocks, ropes, strict=True)]

    def spatial_grid(self, grid: Sequence[int] | None, keep: torch.Tensor | None = None) -> tuple[int, int] | None:
        """The grid windowed blocks and relative positions partition (None where no block needs one); ValueError
        when patches were dropped (`keep`: MAE's encoder), which leaves no grid to partition."""
        if not self.windowed:
            return None
        if keep is not None or grid is None:
            raise ValueError("windowed attention (window_size) and relative positions (rel_pos) need every patch "
                             "token on its grid; run them without dropping patches (as ViTDet fine-tunes an MAE "
                             "encoder)")
        return tuple(grid)

    def embed_patches(self, patches: torch.Tensor, grid: Sequence[int], mask: torch.Tensor | None = None,
                      mask_token: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Patch embeddings (B, N, D) of a `grid` -> the input token sequence: patches where `mask` (B, N) is true
        replaced by `mask_token` ((1, 1, D), or (B, N, D) per patch), position embeddings added, only the patches at
        `keep` (B, K) indices kept, the prefix tokens in front."""
        if mask is not None:
            patches = torch.where(mask[..., None], mask_token.to(patches.dtype), patches)
        tokens = self.add_pos(patches, grid)
        if keep is not None:
            tokens = torch.gather(tokens, 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
        return self.prepend_tokens(tokens)

    def embed(self, images: torch.Tensor, mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> torch.Tensor:
        """Images -> the input token sequence (`embed_patches` of their patch embeddings)."""
        grid = self.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        return self.embed_patches(self.patch_embed(images), grid, mask, mask_token, keep)

    def forward_features(self, images: torch.Tensor | dict, mask: torch.Tensor | None = None,
                         mask_token: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Output tokens (B, prefix + N or K, D), after the final norm; `mask`, `keep`: see `embed_patches`.
        `images` may be a NaFlex batch (ssl_vit.naflex): the tokens then follow its patches, padding included."""
        if is_naflex(images):
            layout = self.naflex_layout(images)
            tokens = self.embed_naflex(images, layout, mask, mask_token)
            if keep is not None:  # a token drop: the kept slots keep their places and validity (padding stays masked)
                prefix = self.num_prefix_tokens
                kept = torch.gather(tokens[:, prefix:], 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
                tokens, layout = torch.cat([tokens[:, :prefix], kept], dim=1), layout.kept(keep)
            return self.run_blocks(tokens, layout=layout)
        grid = self.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        return self.run_blocks(self.embed(images, mask, mask_token, keep), grid, keep)

    # ----- NaFlex batches: images at their own sizes as padded flat patches (ssl_vit.naflex) -----
    def naflex_layout(self, batch: dict) -> NaFlexLayout:
        """The batch's layout; ValueError where this backbone cannot read NaFlex batches."""
        refusal = self.naflex_refusal()
        if refusal:
            raise ValueError(refusal)
        return NaFlexLayout.of(batch)

    def naflex_refusal(self) -> str | None:
        """Why this backbone cannot read NaFlex batches, or None."""
        if not isinstance(self.patch_embed, PatchEmbed):
            return "NaFlex batches need the patch stem (model.stem=patch): a hybrid's ResNet reads whole images"
        if self.windowed:
            return ("NaFlex batches with windowed attention or relative positions (window_size, rel_pos) are not "
                    "built: windows partition one grid")
        return None

    def naflex_pos_embed(self, layout: NaFlexLayout) -> torch.Tensor | None:
        """(B, N, D): each patch's position embedding from its image's own grid (resampled once per distinct
        grid, as a dense batch of that grid gets them), zero on padding; None without added ones. The parameter is
        read once: under ZeRO-3 a read may gather it, and the count of distinct grids differs between ranks."""
        table = self.pos_embed
        if table is None:
            return None

        def rows(grid, index):
            grid_table = table if tuple(grid) == self.grid_size else self._resample_pos_embed(table, grid)
            # index_select, not table[index]: the backward of advanced indexing (index_put_ with accumulate) sums
            # the many images of one grid in a thread-dependent order on the CPU (runs differed by 1 ulp)
            flat = grid_table[0, self.num_pos_prefix:].index_select(0, index.reshape(-1))
            return flat.reshape(*index.shape, -1)

        pos = layout.per_image(rows)
        return pos * layout.valid[..., None].to(pos.dtype)

    def naflex_rope_tables(self, layout: NaFlexLayout):
        """`rope_tables` for a NaFlex batch: each patch's rows from its place on its own image's grid, in one call
        of the rope module (one augmentation draw per batch, as DINOv3's; one parameter gather under ZeRO-3)."""
        if self.rope is None:
            return None
        batch, length = layout.index.shape
        tables = self.rope(None, points=layout.points())

        def per_image(table):  # (B x N, d) -> (B, N, d); the mixed kind's (1, heads, B x N, d) -> (B, heads, N, d)
            if table.ndim == 2:
                return table.reshape(batch, length, -1)
            return table[0].reshape(table.shape[1], batch, length, -1).transpose(0, 1)

        if isinstance(tables, list):
            return [(per_image(sin), per_image(cos), *rest) for sin, cos, *rest in tables]
        sin, cos, *rest = tables
        return [(per_image(sin), per_image(cos), *rest)] * len(self.blocks)

    def embed_naflex(self, batch: dict, layout: NaFlexLayout, mask: torch.Tensor | None = None,
                     mask_token: torch.Tensor | None = None) -> torch.Tensor:
        """A NaFlex batch -> its input token sequence (B, prefix + N, D): `embed_patches` with per-image
        positions."""
        patches = self.patch_embed(batch["patches"])  # through the module: ZeRO-3 gathers its weights as usual
        if mask is not None:
            patches = torch.where(mask[..., None], mask_token.to(patches.dtype), patches)
        pos = self.naflex_pos_embed(layout)
        return self.prepend_tokens(patches if pos is None else patches + pos)  # promoted as add_pos is (autocast)

    def _input_tokens(self, images):
        """(input tokens, per-block inputs) of images or a NaFlex batch, nothing dropped."""
        if is_naflex(images):
            layout = self.naflex_layout(images)
            return self.embed_naflex(images, layout), self._block_inputs(None, layout=layout)
        grid = self.patch_embed.grid_for(*images.shape[-2:])
        return self.embed(images), self._block_inputs(grid)

    def forward_neck(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w): the last patch tokens on their grid, through SAM's neck where the encoder has one (what
        segment-anything's image encoder and timm's samvit forward_features give)."""
        grid = self.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        tokens = self.forward_features(images)[:, self.num_prefix_tokens:]
        patch_map = tokens.transpose(1, 2).reshape(len(images), -1, *grid)
        return self.neck(patch_map) if self.neck is not None else patch_map

    def pool(self, tokens: torch.Tensor, patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n, D) output tokens -> (B, D) image embedding (with a distillation token: the mean of the class and
        distillation tokens, as timm's DeiT pre-logits). `patch_valid` (B, N): a NaFlex batch's mask, so that the
        average leaves the padding out."""
        if self.global_pool == "avg":
            return self.fc_norm(masked_mean(tokens[:, self.num_prefix_tokens:], patch_valid))
        if self.dist_token is not None:
            return (tokens[:, 0] + tokens[:, 1]) / 2
        return tokens[:, 0]

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False,
                     patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        pooled = self.pool(tokens, patch_valid)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, images: torch.Tensor | dict) -> torch.Tensor:
        return self.forward_head(self.forward_features(images), patch_valid=patch_valid(images))

    def forward_intermediates(self, images: torch.Tensor, last_k: int = 1) -> list[torch.Tensor]:
        """Token outputs (B, n, D) of the last `last_k` blocks, each through the final norm (DINO's eval features)."""
        if not 1 <= last_k <= len(self.blocks):
            raise ValueError(f"last_k must be in [1, {len(self.blocks)}], got {last_k}")
        x, inputs = self._input_tokens(images)
        x, outputs = self.norm_pre(x), []
        for index, (block, rope, spatial, mask) in enumerate(inputs):
            x = block(x, rope, grid=spatial, attn_mask=mask)
            if index >= len(self.blocks) - last_k:
                outputs.append(self.norm(x))
        return outputs

    @torch.no_grad()
    def attention_maps(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Softmax attention weights (B, heads, n, n) of every block, through the explicit attention path."""
        x, inputs = self._input_tokens(images)
        x, maps = self.norm_pre(x), []
        for block, rope, spatial, mask in inputs:
            x, weights = block(x, rope, return_attention=True, grid=spatial, attn_mask=mask)
            maps.append(weights)
        return maps


WINDOW_SETTINGS = ("window_size", "global_attn_indexes", "rel_pos")


def with_windows(encoder: VisionTransformer, window_size: int = 0, global_attn_indexes: Sequence[int] = (),
                 rel_pos: bool | None = None) -> VisionTransformer:
    """`encoder` rebuilt with ViTDet / SAM's windows (its weights; relative-position tables it lacks start at zero,
    as ViTDet adds them to an MAE encoder), so that a globally pre-trained encoder runs windowed at a higher
    resolution. ValueError for settings that do not fit (`block_windows`)."""
    rel_pos = encoder.config.get("rel_pos", False) if rel_pos is None else rel_pos
    settings = {"window_size": int(window_size), "global_attn_indexes": [int(i) for i in global_attn_indexes],
                "rel_pos": bool(rel_pos)}
    if all(encoder.config.get(key, default) == settings[key]
           for key, default in zip(WINDOW_SETTINGS, (0, [], False), strict=True)):
        return encoder
    windowed = VisionTransformer(**{**encoder.config, **settings})
    state = encoder.state_dict()
    fresh = [name for name in windowed.state_dict() if name not in state]
    if any("rel_pos" not in name for name in fresh) or any(name not in windowed.state_dict() for name in state
                                                             if "rel_pos" not in name):
        raise ValueError(f"windows change more than the relative-position tables: {fresh[:4]}")
    target = windowed.state_dict()
    for name, value in state.items():  # a table made for another window keeps its length: resampled when used
        if "rel_pos" in name and name in target and target[name].shape != value.shape:
            module, _, param = name.rpartition(".")
            setattr(windowed.get_submodule(module), param, nn.Parameter(value.clone()))
    windowed.load_state_dict({name: value for name, value in state.items() if name in target}, strict=False)
    return windowed.train(encoder.training)


def build_vit(name: str, **overrides) -> VisionTransformer:
    """A preset by name, with keyword overrides (e.g. img_size=384, drop_path=0.1)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid choices: {sorted(PRESETS)}")
    return VisionTransformer(**{**PRESETS[name], **overrides})


def count_parameters(module: nn.Module) -> int:
    """Parameter count; a DeepSpeed ZeRO-3 partitioned parameter counts at its full size (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())

