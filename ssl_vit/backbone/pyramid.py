"""ViTDet's simple feature pyramid (Li et al. 2022; detectron2 `modeling/backbone/vit.py` SimpleFeaturePyramid):
multi-scale maps for dense heads built from a plain ViT's last feature map alone, with no feature from earlier
blocks. For each scale factor: 4 = two stride-2 transposed convolutions (LayerNorm + GELU between, width D/2 then
D/4), 2 = one (width D/2), 1 = the map itself, 0.5 = 2x2 max pooling; then a 1x1 and a 3x3 convolution to
`out_channels` (256), each without bias and followed by a channel LayerNorm. The last level also gives p6 by
stride-2 subsampling (detectron2's LastLevelMaxPool, kernel 1). Levels are named p<log2(stride)>: on a patch-16 ViT
p2 (stride 4) .. p6 (stride 64).

Parameter names follow detectron2's (`simfp_2.0.weight`, `simfp_2.4.norm.weight`, ...), so a pyramid's weights map
one to one onto its checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

SCALE_FACTORS = (4.0, 2.0, 1.0, 0.5)  # ViTDet's


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channels of an NCHW map (detectron2's `LayerNorm` for convolutions), eps 1e-6."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), x.shape[1:2], self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNorm(nn.Conv2d):
    """A bias-free convolution followed by a channel LayerNorm (detectron2's Conv2d with norm="LN"; torch's default
    initialisation, as ViTDet's pyramid keeps)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
        self.norm = ChannelLayerNorm(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


def _upsampling(dim: int, scale: float) -> tuple[list[nn.Module], int]:
    if scale == 4.0:
        return [nn.ConvTranspose2d(dim, dim // 2, 2, 2), ChannelLayerNorm(dim // 2), nn.GELU(),
                nn.ConvTranspose2d(dim // 2, dim // 4, 2, 2)], dim // 4
    if scale == 2.0:
        return [nn.ConvTranspose2d(dim, dim // 2, 2, 2)], dim // 2
    if scale == 1.0:
        return [], dim
    if scale == 0.5:
        return [nn.MaxPool2d(2, 2)], dim
    raise ValueError(f"scale factor {scale} is not one of {list(SCALE_FACTORS)}")


class SimpleFeaturePyramid(nn.Module):
    """(B, D, h, w) at stride `patch_size` -> {name: (B, out_channels, h x scale, w x scale)} (module docstring)."""

    def __init__(self, dim: int, patch_size: int, out_channels: int = 256,
                 scale_factors: Sequence[float] = SCALE_FACTORS, top_block: bool = True):
        super().__init__()
        self.strides, self.stages = [], []
        for scale in scale_factors:
            layers, width = _upsampling(dim, float(scale))
            stride = patch_size / scale
            if stride != int(stride) or int(stride) & (int(stride) - 1):
                raise ValueError(f"scale factor {scale} gives stride {stride} at patch size {patch_size}; the levels "
                                 "need power-of-two strides")
            stage = nn.Sequential(*layers, ConvNorm(width, out_channels, 1), ConvNorm(out_channels, out_channels, 3))
            name = f"simfp_{int(math.log2(stride))}"
            self.add_module(name, stage)
            self.stages.append(name)
            self.strides.append(int(stride))
        self.top_block = top_block
        if top_block:
            self.strides.append(2 * self.strides[-1])

    @property
    def names(self) -> list[str]:
        """p<log2 stride> per level, p6 last when `top_block`."""
        return [f"p{int(math.log2(stride))}" for stride in self.strides]

    def forward(self, feature_map: torch.Tensor) -> dict[str, torch.Tensor]:
        levels = [getattr(self, stage)(feature_map) for stage in self.stages]
        if self.top_block:
            levels.append(F.max_pool2d(levels[-1], kernel_size=1, stride=2))
        return dict(zip(self.names, levels, strict=True))
