"""The normalisation layers (the blocks', the pre-norm, the final norm, QK-norm, the attention pool's), as the
config's `norm_layer` names them."""

from __future__ import annotations

from functools import partial

from torch import nn

from ssl_vit.backbone.config import ViTConfig


def norm_factory(config: ViTConfig):
    """`dim -> norm layer` for this config: LayerNorm with the config's eps and bias switch, or RMSNorm with its eps
    (torch's `nn.RMSNorm`: one `weight`, as timm's `RmsNorm`)."""
    if config.norm_layer == "rmsnorm":
        return partial(nn.RMSNorm, eps=config.norm_eps)
    return partial(nn.LayerNorm, eps=config.norm_eps, bias=config.norm_bias)
