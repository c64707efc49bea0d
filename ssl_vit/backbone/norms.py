"""The normalisation layers of the blocks, the pre-norm and the final norm, as the config names them."""

from __future__ import annotations

from functools import partial

from torch import nn

from ssl_vit.backbone.config import ViTConfig


def norm_factory(config: ViTConfig):
    """`dim -> norm layer` for this config: LayerNorm with the config's eps and bias switch."""
    return partial(nn.LayerNorm, eps=config.norm_eps, bias=config.norm_bias)
