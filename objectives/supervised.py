"""Supervised pre-training as in the ViT paper: cross-entropy on the pooled embedding.

The paper pre-trains with a head of one tanh hidden layer (`head=mlp`) and fine-tunes with a single linear layer
(`head=linear`). Logs `loss` and top-1 `acc`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from torch import nn

from objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.init import Linear
from ssl_vit.schema import checked


class HeadKind(str, Enum):
    mlp = "mlp"
    linear = "linear"


@dataclass
class SupervisedConfig(ObjectiveConfig):
    name: str = "supervised"
    head: HeadKind = HeadKind.mlp
    hidden_dim: int | None = checked(None, ge=1)  # the tanh layer's width; None: the backbone's width
    label_smoothing: float = checked(0.0, ge=0, lt=1)


def build_head(kind: str, dim: int, num_classes: int, hidden_dim: int | None = None) -> nn.Module:
    """Layers initialised trunc-normal(0.02) with zero biases, in their own constructors (zero.Init-safe)."""
    if kind == HeadKind.linear:
        return Linear(dim, num_classes, scheme="timm")
    if kind == HeadKind.mlp:
        hidden_dim = hidden_dim or dim
        return nn.Sequential(Linear(dim, hidden_dim, scheme="timm"), nn.Tanh(),
                             Linear(hidden_dim, num_classes, scheme="timm"))
    raise ValueError(f"unknown head {kind!r}; valid choices: {[k.value for k in HeadKind]}")


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
    needs = Requirements(views=("image", "label"))
    saved_heads = ("head.",)  # heads.safetensors: the run is a classifier (e.g. a DeiT teacher: objectives/teacher.py)

    def __init__(self, backbone, cfg: SupervisedConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        if data.num_classes < 2:
            raise ValueError(f"supervised training needs at least 2 classes, the data has {data.num_classes}")
        self.head = build_head(cfg.head, backbone.embed_dim, data.num_classes, cfg.hidden_dim)

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.head(self.backbone.pool(self.backbone.forward_features(images)))

    def forward(self, batch):
        logits = self.predict(batch["image"]).float()  # the loss in fp32 when the weights are bf16
        labels = batch["label"]
        return {"loss": classification_loss(logits, labels, self.cfg.label_smoothing), "acc": accuracy(logits, labels)}
