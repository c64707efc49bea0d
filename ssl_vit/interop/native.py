"""Encoders evaluated as their own library runs them, not converted into this project's ViT: a timm ResNet,
ConvNeXt or Swin, a transformers vision backbone (AutoModel), an open_clip image tower of any kind.

A `NativeEncoder` wraps the library's model and gives what the frozen-feature evaluators read: `summary(images)`,
the image embedding as the model defines it (timm: `forward_head(forward_features(x), pre_logits=True)`;
transformers: the pooled output, else the class token or the token mean, as the model's outputs hold them;
open_clip: `encode_image`), `tokens(images)`, the last feature map as (B, N, C) tokens where the library
exposes one, and `feature_map(images)`, the same map as (B, C, h, w) for the dense protocols (linear
segmentation). Feature kinds: `pooled` (the summary), `avg` (the token mean) and `last_k` (the token means of the
last k stages or blocks, concatenated: timm's `forward_intermediates`, transformers' `hidden_states`). Only ViTs
pre-train or export.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

NATIVE_KINDS = ("pooled", "avg", "last_k")


def feature_map_tokens(output, layout: str = "NCHW") -> torch.Tensor:
    """A library's last feature map as (B, N, C) tokens: NCHW maps (ResNet, ConvNeXt) and NHWC ones (timm's Swin,
    `layout`) flattened over space, token sequences (B, N, C) as they are."""
    if output.ndim == 3:
        return output
    if output.ndim != 4:
        raise ValueError(f"a feature map of shape {tuple(output.shape)} is neither (B, N, C) tokens nor a 2-D map")
    return output.flatten(1, 2) if layout == "NHWC" else output.flatten(2).transpose(1, 2)


def as_feature_map(output, layout: str = "NCHW", prefix: int = 0) -> torch.Tensor:
    """A library's last feature map as (B, C, h, w): NCHW as it is, NHWC (timm's Swin) permuted, a token sequence
    (B, N, C) without its `prefix` tokens (class, registers) on its square grid."""
    if output.ndim == 4:
        return output.permute(0, 3, 1, 2) if layout == "NHWC" else output
    tokens = output[:, prefix:]
    side = math.isqrt(tokens.shape[1])
    if output.ndim != 3 or side * side != tokens.shape[1]:
        raise ValueError(f"a feature map of shape {tuple(output.shape)} (prefix tokens: {prefix}) is neither a 2-D map "
                         "nor tokens on a square grid")
    return tokens.transpose(1, 2).reshape(len(tokens), -1, side, side)


class NativeEncoder(nn.Module):
    """A library's vision model behind `summary` / `tokens` (see the module docstring). `library`: timm,
    transformers or open_clip; `name`: what it is (its class, for messages); `img_size`: its input size."""

    def __init__(self, model: nn.Module, library: str, name: str, img_size: int,
                 summary: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 tokens: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
                 feature_map: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
                 stages: Callable[[nn.Module, torch.Tensor, int], list[torch.Tensor]] | None = None):
        super().__init__()
        self.model, self.library, self.name, self.img_size = model.eval(), library, name, int(img_size)
        self._summary, self._tokens, self._feature_map, self._stages = summary, tokens, feature_map, stages

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("pooled", *(("avg",) if self._tokens is not None else ()),
                *(("last_k",) if self._stages is not None else ()))

    def describe(self) -> str:
        return f"{self.name} ({self.library}, evaluated through it: not a ViT)"

    def summary(self, images: torch.Tensor) -> torch.Tensor:
        return self._summary(self.model, images)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        if self._tokens is None:
            raise ValueError(f"{self.describe()} gives no feature map here; its feature kinds: {list(self.kinds)}")
        return self._tokens(self.model, images)

    @property
    def dense(self) -> bool:
        """Whether it gives a feature map (the dense protocols need one)."""
        return self._feature_map is not None

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        if self._feature_map is None:
            raise ValueError(f"{self.describe()} gives no feature map here (the dense protocols need one)")
        return self._feature_map(self.model, images)

    def set_img_size(self, size: int) -> None:
        """Run it at `size`: timm's models that fix their input size (Swin: its windows and attention masks) are
        resized by timm's own `set_input_size`; convolutional ones take any size as they are."""
        resize = getattr(self.model, "set_input_size", None)
        if size != self.img_size and callable(resize):
            resize(img_size=(size, size))
        self.img_size = int(size)

    def last_k(self, images: torch.Tensor, k: int) -> torch.Tensor:
        """The token (or spatial) means of the last `k` stages' outputs, concatenated."""
        try:
            outputs = self._stages(self.model, images, k)
        except (AssertionError, IndexError, ValueError) as err:
            raise ValueError(f"eval.last_k={k}: {self.describe()} cannot give its last {k} stages ({err})") from err
        if len(outputs) != k:
            raise ValueError(f"eval.last_k={k}: {self.describe()} has {len(outputs)} stages to give")
        return torch.cat([feature_map_tokens(output).mean(dim=1) for output in outputs], dim=-1)

    def features(self, images: torch.Tensor, kind: str, last_k: int = 4) -> torch.Tensor:
        if kind not in self.kinds:
            raise ValueError(f"feature kind {kind!r} is not one of {list(self.kinds)} for {self.describe()}")
        if kind == "last_k":
            return self.last_k(images, last_k)
        return self.summary(images) if kind == "pooled" else self.tokens(images).mean(dim=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.summary(images)


def native_kind(encoder: NativeEncoder, kind: str) -> str:
    """The feature kind a native encoder takes for `kind`: the class-token kinds of a ViT (cls, cls_avg, the
    default) become the model's own summary (`pooled`); pooled, avg and last_k stay; the rest is refused by name."""
    if kind in ("cls", "cls_avg"):
        return "pooled"
    if kind not in encoder.kinds:
        raise ValueError(f"eval.features={kind} is not one of {list(encoder.kinds)} for {encoder.describe()}")
    return kind


def from_timm_native(model: nn.Module) -> NativeEncoder:
    """timm's model as timm runs it (num_classes=0 or not: pre_logits stops before any classifier)."""
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    size = getattr(getattr(model, "patch_embed", None), "img_size", (size,))[0]  # as built (a Swin's img_size=)
    layout = str(getattr(model, "output_fmt", "NCHW"))  # timm's Swin: NHWC
    prefix = getattr(model, "num_prefix_tokens", 0)
    return NativeEncoder(model, "timm", type(model).__name__, size,
                         lambda m, x: m.forward_head(m.forward_features(x), pre_logits=True),
                         lambda m, x: feature_map_tokens(m.forward_features(x), layout),
                         lambda m, x: as_feature_map(m.forward_features(x), layout, prefix),
                         lambda m, x, k: m.forward_intermediates(x, indices=k, intermediates_only=True))


def not_a_vit(spec: str, what: str) -> ValueError:
    """The one line for a non-ViT source where a ViT is needed (pre-training, export, a teacher)."""
    return ValueError(f"{spec}: {what} is not a ViT; only ViTs pre-train, export or teach here (ssl-vit evaluate "
                      f"checkpoint={spec} evaluates it as its library runs it)")


def _hf_summary(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The pooled output where the model has one (ResNet, ConvNeXt, Swin: their pooling), else the token mean."""
    out = model(pixel_values=images)
    pooled = getattr(out, "pooler_output", None)
    if pooled is not None:
        return pooled.flatten(1)
    return feature_map_tokens(out.last_hidden_state).mean(dim=1)


def from_hf_native(model: nn.Module) -> NativeEncoder:
    config = model.config
    size = getattr(config, "image_size", 224)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return NativeEncoder(model, "transformers", type(model).__name__, size, _hf_summary,
                         lambda m, x: feature_map_tokens(m(pixel_values=x).last_hidden_state),
                         lambda m, x: as_feature_map(m(pixel_values=x).last_hidden_state),
                         lambda m, x, k: list(m(pixel_values=x, output_hidden_states=True).hidden_states[-k:]))


def from_open_clip_native(visual: nn.Module, img_size: int) -> NativeEncoder:
    """An open_clip image tower: its own forward (the projected image embedding, as `encode_image` gives it)."""
    return NativeEncoder(visual, "open_clip", type(visual).__name__, img_size, lambda m, x: m(x), None)
