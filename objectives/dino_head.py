"""DINO's projection head (Caron et al. 2021): an MLP to a bottleneck, L2 normalisation, then K prototypes through a
weight-normalised last layer; DINOv2 / DINOv3 and iBOT's patch heads use the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone.init import Linear


class WeightNormLinear(nn.Module):
    """A bias-free linear layer with weight normalisation, W = g * V / ||V|| per output row (DINO's last layer).
    With `fixed_norm` (DINO's `norm_last_layer`), g is 1 and not learned. Written out rather than with torch's
    parametrization so that its two parameters shard like any other under ZeRO-3 and FSDP2."""

    def __init__(self, in_features: int, out_features: int, fixed_norm: bool = True):
        super().__init__()
        self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_g = None if fixed_norm else nn.Parameter(torch.empty(out_features, 1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight_v, std=0.02)
        if self.weight_g is not None:
            self.weight_g.fill_(1.0)  # as DINO: every prototype starts at norm 1, then g is learned

    def weight(self) -> torch.Tensor:
        direction = F.normalize(self.weight_v, dim=1)
        return direction if self.weight_g is None else self.weight_g * direction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


class DINOHead(nn.Module):
    """MLP (nlayers, GELU, hidden width) -> bottleneck -> L2 normalisation -> K prototypes, the last layer
    weight-normalised (`weight_norm=True`, DINO) or a plain linear layer (as DINOv2 offers)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 nlayers: int = 3, norm_last_layer: bool = True, weight_norm: bool = True):
        super().__init__()
        if nlayers < 1:
            raise ValueError(f"nlayers={nlayers} is invalid: must be >= 1")
        dims = [in_dim] + [hidden_dim] * (nlayers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(Linear(a, b, scheme="timm"))  # DINO: trunc-normal(0.02) weights, zero biases
            if i < nlayers - 1:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        self.last_layer = (WeightNormLinear(bottleneck_dim, out_dim, fixed_norm=norm_last_layer) if weight_norm
                           else Linear(bottleneck_dim, out_dim, bias=False, scheme="timm"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, eps=1e-6 if x.dtype == torch.float32 else 1e-3))
