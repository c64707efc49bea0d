"""The objective interface: a module that owns the backbone (and its heads) and turns a batch into a loss."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ssl_vit.vit import Block, ParallelBlock, VisionTransformer


@dataclass
class ObjectiveConfig:
    name: str = "???"


@dataclass
class DataInfo:
    """What an objective may need to know about its data."""

    num_classes: int
    img_size: int
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)


class Objective(nn.Module, ABC):
    """Built from (backbone, objective config, data info); `forward(batch)` returns a dict with a scalar `loss` and
    any other scalar metrics to log.

    `views` names the batch entries the objective reads; the data layer builds exactly those (see
    `ssl_vit.data.views.VIEW_KINDS`). `encoder` is the backbone that evaluation and export use.
    """

    config_class: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    views: ClassVar[tuple[str, ...]] = ("image",)
    # State-dict prefixes of heads saved beside the encoder (heads.safetensors), to continue training from them.
    saved_heads: ClassVar[tuple[str, ...]] = ()
    # Whether the model holds an EMA teacher updated shard by shard (DeepSpeed then persists no parameter whole).
    has_ema_teacher: ClassVar[bool] = False
    # Contrastive objectives: gradient accumulation embeds every micro-batch first and recomputes each against the
    # cached features of all (`forward(batch, cached=..., index=i)`, `forward(batch, embed_only=True)`), so the
    # negatives are the whole accumulated batch (objectives/clip.py).
    caches_features: ClassVar[bool] = False
    # Backbone options this objective's method uses (CLIP: pre_norm), applied where the model config leaves them unset.
    model_defaults: ClassVar[dict] = {}
    # Buffers that stay fp32 whatever the training precision (DINO's centres).
    fp32_buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, backbone: VisionTransformer, cfg, data: DataInfo):
        super().__init__()
        self.backbone = backbone
        self.cfg = cfg
        self.data = data

    @property
    def encoder(self) -> VisionTransformer:
        return self.backbone

    @property
    def _no_split_modules(self) -> list[str]:
        """The transformer-block classes in this model (backbone, decoders, heads): FSDP2's auto-wrap shards each
        block as one unit (accelerate reads this when the accelerate config names no layer class)."""
        return sorted({type(m).__name__ for m in self.modules() if isinstance(m, (Block, ParallelBlock))})

    @property
    def _keep_in_fp32_modules_strict(self) -> list[str]:
        """DeepSpeed's zero.Init turns every float tensor made during construction into the training dtype except
        the buffers named here (its keep_in_fp32 rule, after transformers' attribute of this name)."""
        return list(self.fp32_buffers)

    @abstractmethod
    def forward(self, batch: dict) -> dict[str, torch.Tensor]: ...

    @classmethod
    def fixed_backbone(cls, cfg) -> tuple[dict, object] | None:
        """(encoder config, its recorded Preprocess or None) when the objective's config fixes the backbone (a
        locked, pre-trained image tower): the run builds that architecture instead of `model=`."""
        return None

    def text_tokenizer(self):
        """For objectives that read `text`: str -> token ids, run in the data workers."""
        return None

    def multicrop_options(self) -> dict | None:
        """For objectives that read the `crops` view: the multi-crop settings (`MultiCropViews` keywords)."""
        return None

    def frozen_parameters(self) -> dict[str, int]:
        """Parameter-name prefixes -> how many first steps they are held at learning rate 0 (a zero-lr optimizer
        group: unlike dropping gradients, this also works under DeepSpeed)."""
        return {}

    def begin_step(self, step: int, total_steps: int) -> None:
        """Called before optimizer step `step` (0-based) of `total_steps`: for schedules the forward reads."""

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        """Hook for per-step updates outside the gradient (EMA teachers, temperature schedules)."""
