"""Transformer blocks: the paper's pre-norm block, ViT-22B's parallel block, their activation checkpointing, and
the per-block window layout of ViTDet / SAM."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from timm.layers import DropPath
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from ssl_vit.backbone.attention import Attention, KeyMaskedLinear, attend
from ssl_vit.backbone.init import LayerScale, Linear
from ssl_vit.backbone.mlp import build_mlp, make_activation
from ssl_vit.backbone.rope import apply_rope

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
    """Pre-norm block of the paper: z = z + MSA(LN(z)); z = z + MLP(LN(z)); the MLP of any `mlp_kind`."""

    def __init__(self, dim, num_heads, mlp_dim, qkv_bias=True, qk_norm=False, norm_layer=nn.LayerNorm,
                 layer_scale=None, drop_path=0.0, attn_drop=0.0, proj_drop=0.0, weight_init="timm", act_layer="gelu",
                 mask_k_bias=False, window: int = 0, rel_pos_size: Sequence[int] | None = None, mlp_kind="mlp",
                 proj_bias=True):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, qk_norm, norm_layer, attn_drop, proj_drop, weight_init,
                              mask_k_bias, window, rel_pos_size, proj_bias)
        self.ls1 = _layer_scale(dim, layer_scale)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = build_mlp(mlp_kind, dim, mlp_dim, proj_drop, weight_init, act_layer, bias=proj_bias)
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
        attn, weights = attend(q, k, v, self.attn_drop if self.training else 0.0, return_attention, attn_mask)
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
    if (window_size or rel_pos) and pos_embed in ("rope", "learned_rope"):
        raise ValueError(f"{'rel_pos' if rel_pos else 'window_size'} with pos_embed={pos_embed}: rotary embeddings "
                         "place the tokens already (rel_pos) / windowed RoPE is not built here; use pos_embed=learned "
                         "or sincos")
    if (window_size or rel_pos) and parallel_block:
        raise ValueError("window_size / rel_pos with parallel_block=true (ViT-22B's block) is not built here")
    return [0 if i in indexes else window_size for i in range(depth)]

