"""Supervised pre-training as in the ViT paper: cross-entropy on the pooled embedding.

The paper pre-trains with a head of one tanh hidden layer (`head=mlp`) and fine-tunes with a single linear layer
(`head=linear`). Logs `loss` and top-1 `acc`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch.nn.functional as F
from torch import nn

from objectives.base import DataInfo, Objective, ObjectiveConfig
from ssl_vit.config import checked
from ssl_vit.init import Linear


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


class Supervised(Objective):
    config_class = SupervisedConfig
    views = ("image", "label")

    def __init__(self, backbone, cfg: SupervisedConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        if data.num_classes < 2:
            raise ValueError(f"supervised training needs at least 2 classes, the data has {data.num_classes}")
        self.head = build_head(cfg.head, backbone.embed_dim, data.num_classes, cfg.hidden_dim)

    def forward(self, batch):
        embedding = self.backbone.pool(self.backbone.forward_features(batch["image"]))
        logits = self.head(embedding).float()  # the loss in fp32 when the weights are bf16
        labels = batch["label"]
        loss = F.cross_entropy(logits, labels, label_smoothing=self.cfg.label_smoothing)
        return {"loss": loss, "acc": (logits.argmax(dim=-1) == labels).float().mean()}
