"""DeiT (Touvron et al. 2021, "Training data-efficient image transformers & distillation through attention"):
supervised training with a distillation token that learns from a frozen teacher classifier.

The backbone carries a class token and a distillation token (`model.dist_token`, on by default here); each has its
linear head. The class head learns the labels (or Mixup's soft targets); the distillation head learns the teacher:
its argmax (hard distillation, DeiT's default and best) or its softened distribution (soft: KL at temperature tau,
scaled by tau^2). loss = (1 - alpha) * CE(class head, labels) + alpha * distillation. At inference the two heads'
logits are averaged (`predict`); the encoder's pooled embedding is the mean of the two tokens (timm's pre-logits).

The teacher (`teacher.py`): a timm model from a local weights file or a supervised run of this framework;
it sees the student's images, runs in eval mode without gradients and is held outside the module tree, so it is in
no optimizer, checkpoint or exported encoder. Logs `loss`, `acc` (averaged heads), `acc_cls`, `acc_dist`,
`base_loss`, `distill_loss` and `teacher_agreement` (distillation head's argmax = the teacher's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from omegaconf import MISSING

from ssl_vit.backbone.init import whole_modules
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.objectives.supervised import HeadInit, accuracy, build_head, classification_loss, head_scheme
from ssl_vit.objectives.teacher import TEACHER_FORMS, load_teacher
from ssl_vit.schema import checked


class Distillation(str, Enum):
    hard = "hard"
    soft = "soft"


@dataclass
class DeiTConfig(ObjectiveConfig):
    name: str = "deit"
    teacher: str = checked(MISSING, example="objective.teacher=outputs/<run of objective=supervised> (or "
                                            "timm:<model name>:<weights file>)")
    distillation: Distillation = Distillation.hard
    alpha: float = checked(0.5, ge=0, le=1)  # weight of the distillation loss (DeiT: 0.5)
    tau: float = checked(1.0, gt=0)  # soft distillation's temperature (DeiT: 1.0)
    label_smoothing: float = checked(0.0, ge=0, lt=1)  # for class indices; Mixup's soft targets carry their own
    head_init: HeadInit = HeadInit.torch  # both heads (objective=supervised's option and default)


def hard_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the distillation head against the teacher's argmax."""
    return F.cross_entropy(student, teacher.argmax(dim=-1))


def soft_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(teacher || student) at temperature tau, times tau^2, averaged over the logits as DeiT's code does
    (sum / (B x K))."""
    kl = F.kl_div(F.log_softmax(student / tau, dim=-1), F.log_softmax(teacher / tau, dim=-1), reduction="sum",
                  log_target=True)
    return kl * tau * tau / student.numel()


class DeiT(Objective):
    config_class = DeiTConfig
    needs = Requirements(views=("image", "label"), model_defaults={"dist_token": True})
    saved_heads = ("head.", "head_dist.")

    def __init__(self, backbone, cfg: DeiTConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        if backbone.dist_token is None:
            raise ValueError("objective=deit needs a backbone with a distillation token (model.dist_token=true; a "
                             "model.init_from source without one cannot start a DeiT run: the token is part of the "
                             "architecture)")
        if data.num_classes < 2:
            raise ValueError(f"objective=deit needs at least 2 classes, the data has {data.num_classes}")
        Distillation(cfg.distillation)
        scheme = head_scheme(cfg.head_init, backbone)
        self.head = build_head("linear", backbone.embed_dim, data.num_classes, scheme=scheme)
        self.head_dist = build_head("linear", backbone.embed_dim, data.num_classes, scheme=scheme)
        # Loaded whole (outside zero.Init's partitioning) and without moving the run's random stream; assigned
        # past nn.Module's registration so that no optimizer, state dict, checkpoint or strategy ever sees it.
        with whole_modules(), torch.random.fork_rng(devices=[]):
            teacher = load_teacher(cfg.teacher, data.num_classes, data.img_size, data.mean or None, data.std or None)
        object.__setattr__(self, "teacher", teacher)

    def _teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's logits in fp32, computed in the student's precision: the teacher is fp32 and outside the
        trained model, so where the student's weights are 16-bit (DeepSpeed's bf16 mode: no autocast) it runs
        under bf16 autocast, as under DDP's and FSDP2's (accelerate's autocast covers the whole forward)."""
        first = next(self.teacher.parameters(), None)
        if first is not None and first.device != images.device:
            self.teacher.to(images.device)
        self.teacher.eval()
        student_dtype = self.backbone.patch_embed.proj.weight.dtype
        # (an autocast with enabled=False would switch off DDP's / FSDP2's own: enter one only for 16-bit weights)
        precision = torch.autocast(images.device.type, dtype=student_dtype) if student_dtype != torch.float32 \
            else contextlib.nullcontext()
        with torch.no_grad(), precision:
            return self.teacher(images.float()).float()

    def head_logits(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(class head, distillation head) logits."""
        tokens = self.backbone.forward_features(images)
        return self.head(tokens[:, 0]), self.head_dist(tokens[:, 1])

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Inference logits: the mean of the two heads' (DeiT)."""
        cls_logits, dist_logits = self.head_logits(images)
        return (cls_logits + dist_logits) / 2

    def forward(self, batch):
        images, labels = batch["image"], batch["label"]
        cls_logits, dist_logits = (t.float() for t in self.head_logits(images))  # the losses in fp32
        teacher = self._teacher_logits(images)
        base = classification_loss(cls_logits, labels, self.cfg.label_smoothing)
        if self.cfg.distillation == Distillation.hard:
            distill = hard_distillation_loss(dist_logits, teacher)
        else:
            distill = soft_distillation_loss(dist_logits, teacher, self.cfg.tau)
        loss = (1 - self.cfg.alpha) * base + self.cfg.alpha * distill
        return {"loss": loss, "acc": accuracy((cls_logits + dist_logits) / 2, labels),
                "acc_cls": accuracy(cls_logits, labels), "acc_dist": accuracy(dist_logits, labels),
                "base_loss": base.detach(), "distill_loss": distill.detach(),
                "teacher_agreement": (dist_logits.argmax(-1) == teacher.argmax(-1)).float().mean()}


__all__ = ["DeiT", "DeiTConfig", "TEACHER_FORMS"]
