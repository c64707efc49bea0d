"""The blocks' feed-forward networks: the paper's two-layer MLP with its activation (GELU, tanh GELU, QuickGELU)."""

from __future__ import annotations

from timm.layers import QuickGELU
from torch import nn

from ssl_vit.backbone.config import ACTIVATIONS
from ssl_vit.backbone.init import Linear


def make_activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"act_layer {name!r} is not one of {list(ACTIVATIONS)}")
    return QuickGELU() if name == "quick_gelu" else nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class Mlp(nn.Module):
    def __init__(self, dim, hidden_dim, drop=0.0, weight_init="timm", act_layer="gelu"):
        super().__init__()
        self.fc1 = Linear(dim, hidden_dim, scheme=weight_init, role="mlp")
        self.act = make_activation(act_layer)
        self.fc2 = Linear(hidden_dim, dim, scheme=weight_init, role="mlp")
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))

