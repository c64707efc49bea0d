"""The blocks' feed-forward networks, one `mlp_kind` each, under timm's parameter names:

    mlp            the paper's two-layer MLP: fc2(act(fc1(x)))                          (timm `Mlp`)
    swiglu         gated, two input projections: fc2(act(fc1_g(x)) * fc1_x(x))          (timm `SwiGLU`: AIMv2,
                                                                                         DINOv3 H+ / 7B, Eva)
    swiglu_packed  gated, one packed input projection [gate | value]:                   (timm `GluMlp` with
                   fc2(act(fc1(x)[:h]) * fc1(x)[h:])                                     gate_last=False, its
                                                                                         `SwiGLUPacked`: DINOv2's
                                                                                         `SwiGLUFFNFused`)

`hidden` is the width fc2 reads (the gated product's); a packed fc1 writes 2 x hidden. DINOv2 sizes its SwiGLU from
the MLP ratio by `dinov2_swiglu_hidden` (2/3 of width x ratio, rounded up to a multiple of 8).
"""

from __future__ import annotations

from timm.layers import QuickGELU
from torch import nn

from ssl_vit.backbone.config import ACTIVATIONS, MLP_KINDS
from ssl_vit.backbone.init import Linear


def make_activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"act_layer {name!r} is not one of {list(ACTIVATIONS)}")
    if name == "quick_gelu":
        return QuickGELU()
    if name == "silu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


def dinov2_swiglu_hidden(width: int, mlp_ratio: float) -> int:
    """The hidden width of DINOv2's SwiGLUFFNFused (and transformers' Dinov2SwiGLUFFN) for `width` x `mlp_ratio`:
    2/3 of it, rounded up to a multiple of 8 (ViT-g/14: 1536 x 4 -> 4096)."""
    return (int(int(width * mlp_ratio) * 2 / 3) + 7) // 8 * 8


class Mlp(nn.Module):
    def __init__(self, dim, hidden_dim, drop=0.0, weight_init="timm", act_layer="gelu", bias=True):
        super().__init__()
        self.fc1 = Linear(dim, hidden_dim, bias=bias, scheme=weight_init, role="mlp")
        self.act = make_activation(act_layer)
        self.fc2 = Linear(hidden_dim, dim, bias=bias, scheme=weight_init, role="mlp")
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))


class SwiGLU(nn.Module):
    """fc2(act(fc1_g(x)) * fc1_x(x)) (Shazeer 2020), timm's `SwiGLU` names."""

    def __init__(self, dim, hidden_dim, drop=0.0, weight_init="timm", act_layer="silu", bias=True):
        super().__init__()
        self.fc1_g = Linear(dim, hidden_dim, bias=bias, scheme=weight_init, role="mlp")
        self.fc1_x = Linear(dim, hidden_dim, bias=bias, scheme=weight_init, role="mlp")
        self.act = make_activation(act_layer)
        self.fc2 = Linear(hidden_dim, dim, bias=bias, scheme=weight_init, role="mlp")
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1_g(x)) * self.fc1_x(x)))


class PackedSwiGLU(nn.Module):
    """SwiGLU with the gate and value projections packed in one fc1 (gate first): timm's `GluMlp(gate_last=False)`
    as `SwiGLUPacked`, DINOv2's `SwiGLUFFNFused` (its w12 / w3 are fc1 / fc2)."""

    def __init__(self, dim, hidden_dim, drop=0.0, weight_init="timm", act_layer="silu", bias=True):
        super().__init__()
        self.fc1 = Linear(dim, 2 * hidden_dim, bias=bias, scheme=weight_init, role="fused",
                          splits=[hidden_dim, hidden_dim])
        self.act = make_activation(act_layer)
        self.fc2 = Linear(hidden_dim, dim, bias=bias, scheme=weight_init, role="mlp")
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.drop(self.fc2(self.act(gate) * value))


MLPS = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": PackedSwiGLU}
assert tuple(MLPS) == MLP_KINDS


def build_mlp(kind: str, dim: int, hidden_dim: int, drop: float, weight_init: str, act_layer: str,
              bias: bool = True) -> nn.Module:
    return MLPS[kind](dim, hidden_dim, drop, weight_init, act_layer, bias)


def mlp_hidden_width(mlp: nn.Module) -> int:
    """The hidden width fc2 reads, of any kind (what `ViTConfig.mlp_dim` records)."""
    return mlp.fc2.in_features
