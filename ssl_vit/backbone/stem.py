"""The hybrid stem of the ViT paper (section 3.1): tokens from a ResNet feature map instead of raw image patches.

Built from timm's parts as timm's hybrid ViTs (`vit_base_r50_s16_224`, `vit_tiny_r_s16_p8_224`, ...) build it, so
state dicts move between the two without renaming (`patch_embed.backbone.*`, `patch_embed.proj.*`): a ResNet-v2
without pre-activation, GroupNorm(32) + ReLU, weight-standardised convolutions with TF "same" padding, whose last
stage's map is cut into `patch_size` patches (1x1 in the paper) and projected to the width. The paper's R50 hybrid
drops ResNet-50's stage 4 and moves its blocks into stage 3: stages (3, 4, 9), a stride-16 map of 1024 channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from timm.layers import Format, HybridEmbed, StdConv2dSame
from timm.models.resnetv2 import ResNetV2, create_resnetv2_stem
from torch import nn

from ssl_vit.backbone.init import PatchProjection, rng_devices, writable
from ssl_vit.geometry import check_divisible, pair

STEMS = ("patch", "resnet")
# timm's ResNetV2 stage widths (bottleneck outputs); a stem with k stages uses the first k unless told otherwise.
RESNET_CHANNELS = (256, 512, 1024, 2048)
GROUPS = 32  # GroupNorm groups in timm's hybrids (ResNetV2's default norm layer)


def check_stem(stem: str, layers: Sequence[int], channels: Sequence[int] | None, width: int) -> None:
    """A clear error for a stem timm's parts cannot build (before building anything)."""
    if stem not in STEMS:
        raise ValueError(f"stem {stem!r} is not one of {list(STEMS)}")
    if stem == "patch":
        return
    if len(layers) > 4 or any(n < 1 for n in layers):
        raise ValueError(f"stem_layers={list(layers)}: give 0 to 4 stages of >= 1 block each (R50 hybrid: [3, 4, 9])")
    channels = list(channels) if channels else list(RESNET_CHANNELS[:len(layers)])
    if len(channels) != len(layers):
        raise ValueError(f"stem_channels={channels} needs one width per stage of stem_layers={list(layers)}")
    bad = [c for c in channels if (c // 4) % GROUPS] + ([width] if width % GROUPS else [])
    if bad:
        raise ValueError(f"stem widths {bad} do not fit GroupNorm({GROUPS}): stem_width must be a multiple of {GROUPS} "
                         f"and every stem_channels value a multiple of {4 * GROUPS} (its bottleneck is a quarter)")


def stem_stride(layers: Sequence[int]) -> int:
    """Pixels per feature-map cell: the 7x7/2 stem conv and 3x3/2 pool (4), then x2 per stage after the first."""
    return 4 * 2 ** max(len(layers) - 1, 0)


def build_resnet(layers: Sequence[int], channels: Sequence[int] | None, width: int, in_chans: int) -> nn.Module:
    """timm's hybrid backbone (`vision_transformer_hybrid._resnetv2`): ResNetV2, or only its stem for 0 stages,
    initialised as timm's hybrid ViTs initialise it (their ViT init calls `ResNetV2.init_weights()`: kaiming-normal
    convolutions, and the last GroupNorm of every bottleneck at zero, as in the original JAX ResNet; the stem alone
    keeps PyTorch's default).

    That pass runs after construction, where DeepSpeed's zero.Init has already partitioned the convolutions: it is
    run on the gathered weights under a seed drawn before construction, all forked from the run's random stream, so
    that every strategy starts from the same weights and continues with the same stream.
    """
    conv_layer = partial(StdConv2dSame, eps=1e-8)
    seed = int(torch.randint(2**62, (), device="cpu"))  # (also when building on the meta device)
    with torch.random.fork_rng(devices=rng_devices()):
        if not layers:
            return create_resnetv2_stem(in_chans, width, stem_type="same", preact=False, conv_layer=conv_layer)
        channels = tuple(channels) if channels else RESNET_CHANNELS[:len(layers)]
        backbone = ResNetV2(layers=list(layers), channels=channels, stem_chs=width, num_classes=0, global_pool="",
                            in_chans=in_chans, preact=False, stem_type="same", conv_layer=conv_layer)
        with writable(*backbone.parameters()):
            torch.manual_seed(seed)
            backbone.init_weights(zero_init_last=True)
    return backbone


class HybridPatchEmbed(HybridEmbed):
    """timm's `HybridEmbed` over `build_resnet`, with our patch-embedding interface (`grid_for`, `stride`).

    The feature-map size is computed from the stride rather than by timm's dummy forward pass, which cannot run on
    the meta device or on zero.Init's empty shards. Images must be multiples of the total stride (stem x patch).
    """

    def __init__(self, img_size, patch_size=1, in_chans=3, embed_dim=768, bias=True, weight_init="timm",
                 layers: Sequence[int] = (3, 4, 9), channels: Sequence[int] | None = None, width: int = 64):
        check_stem("resnet", layers, channels, width)
        self._feature_dim = (list(channels)[-1] if channels else RESNET_CHANNELS[len(layers) - 1]) if layers else width
        self._feature_stride = stem_stride(layers)
        # HybridEmbed's constructor, without its throwaway projection (ours initialises by `weight_init`).
        nn.Module.__init__(self)
        self.backbone = build_resnet(layers, channels, width, in_chans)
        self.in_chans = in_chans
        (self.img_size, self.patch_size, self.feature_size, self.feature_ratio, self.feature_dim, self.grid_size,
         self.num_patches) = self._init_backbone(img_size, patch_size)
        self.flatten, self.output_fmt = True, Format.NCHW
        self.strict_img_size, self.dynamic_img_pad = True, False
        self.proj = PatchProjection(self.feature_dim, embed_dim, self.patch_size, bias=bias, scheme=weight_init)

    def _init_backbone(self, img_size=224, patch_size=1, feature_size=None, feature_ratio=None, feature_dim=None,
                       **_):
        img_size, patch_size = pair(img_size), pair(patch_size)
        stride = (self._feature_stride * patch_size[0], self._feature_stride * patch_size[1])
        check_divisible(img_size, stride)
        feature_size = (img_size[0] // self._feature_stride, img_size[1] // self._feature_stride)
        grid_size = (feature_size[0] // patch_size[0], feature_size[1] // patch_size[1])
        ratio = (self._feature_stride, self._feature_stride)
        return img_size, patch_size, feature_size, ratio, self._feature_dim, grid_size, grid_size[0] * grid_size[1]

    @property
    def stride(self) -> tuple[int, int]:
        """Image pixels per token side (the ResNet's stride times the patch size)."""
        return self.feature_ratio[0] * self.patch_size[0], self.feature_ratio[1] * self.patch_size[1]

    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        check_divisible((height, width), self.stride)
        return height // self.stride[0], width // self.stride[1]

    def resize(self, img_size: tuple[int, int]) -> None:
        self.set_input_size(img_size=img_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.grid_for(images.shape[-2], images.shape[-1])
        return super().forward(images.to(self.proj.weight.dtype))
