"""Supervised pre-training as in the ViT paper: cross-entropy on the pooled embedding.

The paper pre-trains with a head of one tanh hidden layer (`head=mlp`) and fine-tunes with a single linear layer
(`head=linear`). The head starts as a weight-init scheme starts a classifier: `head_init=torch` (PyTorch's default,
measured best: benchmarks/head_init.py; the default), `timm`, `jax` (big_vision's zero head) or `auto` (the backbone's
`model.weight_init`). Logs `loss` and top-1 `acc`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from torch import nn

from ssl_vit.backbone.init import WEIGHT_INITS, Linear
from ssl_vit.naflex import patch_valid
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.schema import checked


class HeadKind(str, Enum):
    mlp = "mlp"
    linear = "linear"


HeadInit = Enum("HeadInit", {name: name for name in ("auto", *WEIGHT_INITS)}, type=str)


@dataclass
class SupervisedConfig(ObjectiveConfig):
    name: str = "supervised"
    head: HeadKind = HeadKind.mlp
    # torch (PyTorch's default) measured best (benchmarks/head_init.py); timm: trunc-normal(0.02), the head of before
    head_init: HeadInit = HeadInit.torch
    hidden_dim: int | None = checked(None, ge=1)  # the tanh layer's width; None: the backbone's width
    label_smoothing: float = checked(0.0, ge=0, lt=1)


def build_head(kind: str, dim: int, num_classes: int, hidden_dim: int | None = None, scheme: str = "timm") -> nn.Module:
    """The output layer starts as `scheme` starts a classifier: trunc-normal(0.02) (timm), zero (big_vision's
    `head_zeroinit`, for jax), PyTorch's nn.Linear default (torch); the tanh hidden layer as the scheme's dense
    layers. Each layer initialises itself in its constructor (zero.Init-safe)."""
    output_role = "zero" if scheme == "jax" else "dense"
    if kind == HeadKind.linear:
        return Linear(dim, num_classes, scheme=scheme, role=output_role)
    if kind == HeadKind.mlp:
        hidden_dim = hidden_dim or dim
        return nn.Sequential(Linear(dim, hidden_dim, scheme=scheme), nn.Tanh(),
                             Linear(hidden_dim, num_classes, scheme=scheme, role=output_role))
    raise ValueError(f"unknown head {kind!r}; valid choices: {[k.value for k in HeadKind]}")


def head_scheme(head_init: str, backbone) -> str:
    """The scheme `head_init` names, the backbone's for auto."""
    return backbone.weight_init if head_init == HeadInit.auto else str(HeadInit(head_init).value)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy against class indices (B,), or against soft targets (B, K) such as Mixup / CutMix make
    (timm's SoftTargetCrossEntropy; those targets carry their own label smoothing)."""
    if labels.ndim == 2:
        return SoftTargetCrossEntropy()(logits, labels)
    return F.cross_entropy(logits, labels, label_smoothing=label_smoothing)


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Top-1 against class indices, or against the largest share of soft targets."""
    labels = labels.argmax(dim=-1) if labels.ndim == 2 else labels
    return (logits.argmax(dim=-1) == labels).float().mean()


class Supervised(Objective):
    config_class = SupervisedConfig
    needs = Requirements(views=("image", "label"), naflex=True)
    saved_heads = ("head.",)  # heads.safetensors: the run is a classifier (e.g. a DeiT teacher: objectives/teacher.py)

    def __init__(self, backbone, cfg: SupervisedConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        if data.num_classes < 2:
            raise ValueError(f"supervised training needs at least 2 classes, the data has {data.num_classes}")
        self.head = build_head(cfg.head, backbone.embed_dim, data.num_classes, cfg.hidden_dim,
                               head_scheme(cfg.head_init, backbone))

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (of images or a NaFlex batch)."""
        return self.head(self.backbone.pool(self.backbone.forward_features(images), patch_valid(images)))

    def forward(self, batch):
        logits = self.predict(batch["image"]).float()  # the loss in fp32 when the weights are bf16
        labels = batch["label"]
        return {"loss": classification_loss(logits, labels, self.cfg.label_smoothing), "acc": accuracy(logits, labels)}
