"""Pooling the output tokens into one embedding, as `global_pool` says:

    token  the class token (with DeiT's distillation token: the mean of the two, timm's pre-logits)
    avg    the mean of the patch tokens (padding left out in a NaFlex batch)
    map    multi-head attention pooling: a learned latent query attends over the patch tokens, then a residual MLP
           (Lee et al. 2019's PMA; SigLIP's "MAP" head, Perception Encoder's attention pool), timm's
           `AttentionPoolLatent` names (latent, q, kv, proj, norm, mlp.fc1, mlp.fc2); with pool_include_prefix
           over the prefix tokens too (Perception Encoder's class token)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone.init import Linear
from ssl_vit.backbone.mlp import Mlp
from ssl_vit.naflex import masked_mean


class AttentionPool(nn.Module):
    """One latent query, `num_heads`-head attention over the tokens, output projection, then x + MLP(norm(x)).

    `valid` (B, N): a NaFlex batch's mask, so that padding is never attended."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, norm_layer, act_layer: str = "gelu",
                 weight_init: str = "timm"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the attention pool's width {dim} is not divisible by pool_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.latent = nn.Parameter(torch.empty(1, 1, dim))
        self.q = Linear(dim, dim, scheme=weight_init)
        self.kv = Linear(dim, 2 * dim, scheme=weight_init, role="fused", splits=[dim, dim])
        self.proj = Linear(dim, dim, scheme=weight_init)
        self.norm = norm_layer(dim)
        self.mlp = Mlp(dim, mlp_hidden, weight_init=weight_init, act_layer=act_layer)
        self.reset_parameters()

    def no_weight_decay(self) -> set[str]:
        return {"latent"}  # a learned token, as the class token

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The latent as timm draws it: truncated normal with std 1/sqrt(width) (its layers initialise themselves)."""
        std = self.latent.shape[-1] ** -0.5
        nn.init.trunc_normal_(self.latent, std=std, a=-2 * std, b=2 * std)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        B, N, C = tokens.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(tokens).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        mask = None if valid is None else valid[:, None, None, :]
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, 1, C)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


def pool_tokens(vit, tokens: torch.Tensor, patch_valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, n, D) output tokens of `vit` -> (B, D) by its `global_pool`."""
    patches = tokens[:, vit.num_prefix_tokens:]
    if vit.global_pool == "map":
        if vit.config.pool_include_prefix:  # Perception Encoder: the class token is attended too
            valid = None if patch_valid is None else F.pad(patch_valid, (vit.num_prefix_tokens, 0), value=True)
            return vit.fc_norm(vit.attn_pool(tokens, valid))
        return vit.fc_norm(vit.attn_pool(patches, patch_valid))
    if vit.global_pool == "avg":
        return vit.fc_norm(masked_mean(patches, patch_valid))
    if vit.dist_token is not None:
        return vit.fc_norm((tokens[:, 0] + tokens[:, 1]) / 2)
    return vit.fc_norm(tokens[:, 0])
