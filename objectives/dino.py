"""Self-distillation with no labels: DINO (Caron et al. 2021) and DINOv2 (Oquab et al. 2024).

A student (the shared backbone + a projection head) is trained to match, on every crop, the output of a teacher
(a copy of backbone + head that gets no gradient) on the other global crops of the same image. The teacher is an
exponential moving average of the student (momentum 0.996 -> 1 on a cosine, one update per optimizer step, in fp32,
shard by shard under ZeRO-3 / FSDP2: `ssl_vit.ema`). Collapse is avoided by sharpening the teacher (low
temperature) and centring it: DINO subtracts an EMA of its batch mean (all-reduced); DINOv2 uses Sinkhorn-Knopp
over the global batch instead, adds the KoLeo regulariser on the student's class tokens and iBOT's masked-patch
loss (a separate patch head; the teacher sees the unmasked image).

Batches carry `crops` (global crops first, then local ones, from the data layer); the student runs every crop,
one forward per distinct resolution; the teacher only the global crops. `encoder` is the teacher's backbone (the
better network at every point of a DINO run); `heads.safetensors` beside it holds both heads of both networks.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from ssl_vit.backbone import VisionTransformer
from ssl_vit.collectives import all_reduce
from ssl_vit.data.multicrop import local_crop_size
from ssl_vit.data.token_masks import ibot_masks
from ssl_vit.ema import EMA, teacher_backbone
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.objectives.dino_head import DINOHead
from ssl_vit.objectives.losses.dino import (
    centred_probs,
    cross_view_loss,
    sinkhorn_knopp,
    teacher_temperature_schedule,
    updated_centre,
)
from ssl_vit.objectives.losses.ibot import masked_tokens, masked_tokens_loss
from ssl_vit.objectives.losses.koleo import koleo_loss
from ssl_vit.objectives.patches import refuse_hybrid
from ssl_vit.optim import schedule
from ssl_vit.schema import checked

log = logging.getLogger("ssl_vit")
CENTERINGS = ("centre", "sinkhorn_knopp")


@dataclass
class DINOConfig(ObjectiveConfig):
    name: str = "dino"
    # Projection head: MLP (head_layers, GELU, hidden_dim) -> bottleneck_dim -> L2 norm -> out_dim prototypes.
    out_dim: int = checked(65536, ge=2)
    hidden_dim: int = checked(2048, ge=1)
    bottleneck_dim: int = checked(256, ge=1)
    head_layers: int = checked(3, ge=1)
    weight_norm: bool = True  # last layer weight-normalised (DINO); false: a plain linear layer
    norm_last_layer: bool = True  # weight norm with g fixed at 1 (more stable; DINO's default for ViT-S)
    # Multi-crop (data layer): global crops at the model's size, local ones at 96/224 of it unless set.
    global_crops: int = checked(2, ge=1)
    local_crops: int = checked(6, ge=0)
    global_crop_scale: list[float] = checked(factory=lambda: [0.4, 1.0], gt=0, le=1, length=2)
    local_crop_scale: list[float] = checked(factory=lambda: [0.05, 0.4], gt=0, le=1, length=2)
    local_crop_size: int | None = checked(None, ge=1)
    # Temperatures: the teacher's rises linearly from warmup_teacher_temp to teacher_temp over the first
    # warmup_teacher_temp_fraction of the run.
    student_temp: float = checked(0.1, gt=0)
    teacher_temp: float = checked(0.04, gt=0)
    warmup_teacher_temp: float = checked(0.04, gt=0)
    warmup_teacher_temp_fraction: float = checked(0.3, ge=0, le=1)
    centering: str = checked("centre", choices=CENTERINGS)  # centre: an EMA of the batch mean; DINOv2: sinkhorn
    centre_momentum: float = checked(0.9, ge=0, lt=1)
    sinkhorn_iterations: int = checked(3, ge=1)
    teacher_momentum: float = checked(0.996, ge=0, le=1)  # cosine to teacher_momentum_end over the run
    teacher_momentum_end: float = checked(1.0, ge=0, le=1)
    freeze_last_layer_steps: int = checked(0, ge=0)  # the head's last layer gets lr 0 for these first steps
    horizontal_flips: bool = True  # in the multi-crop augmentation (p 0.5); DINOv3 trains without
    # DINOv2's additions (0 = off).
    koleo_weight: float = checked(0.0, ge=0)
    ibot_weight: float = checked(0.0, ge=0)
    ibot_out_dim: int = checked(65536, ge=2)  # patch-head prototypes (a separate head, as DINOv2)
    ibot_mask_ratio: list[float] = checked(factory=lambda: [0.1, 0.5], ge=0, lt=1, length=2)
    ibot_mask_probability: float = checked(0.5, ge=0, le=1)  # the share of global-crop images that get a mask
    # Collapse monitors: warn when, for this many steps in a row, the teacher is near uniform (entropy or loss at
    # ln K) or near one-hot (entropy near 0).
    collapse_window: int = checked(100, ge=1)


@dataclass
class DINOv2Config(DINOConfig):
    name: str = "dinov2"
    centering: str = checked("sinkhorn_knopp", choices=CENTERINGS)
    teacher_temp: float = checked(0.07, gt=0)
    koleo_weight: float = checked(0.1, ge=0)
    ibot_weight: float = checked(1.0, ge=0)


def _heads(dim: int, cfg: DINOConfig) -> tuple[DINOHead, DINOHead | None]:
    """The class-token head and (iBOT) the separate patch head."""
    head = DINOHead(dim, cfg.out_dim, cfg.hidden_dim, cfg.bottleneck_dim, cfg.head_layers, cfg.norm_last_layer,
                    cfg.weight_norm)
    patch_head = (DINOHead(dim, cfg.ibot_out_dim, cfg.hidden_dim, cfg.bottleneck_dim, cfg.head_layers,
                           cfg.norm_last_layer, cfg.weight_norm) if cfg.ibot_weight > 0 else None)
    return head, patch_head


class Teacher(nn.Module):
    """The teacher's backbone and heads, named as the student's are in the objective (the EMA pairs them by name)."""

    def __init__(self, backbone: VisionTransformer, cfg: DINOConfig):
        super().__init__()
        self.backbone = backbone
        self.head, self.patch_head = _heads(backbone.embed_dim, cfg)


class DINO(Objective):
    config_class = DINOConfig
    needs = Requirements(views=("crops",), ema_teacher=True)
    # everything but the encoder (the teacher's backbone), to continue training from: the student's backbone, both
    # networks' heads, the mask token, the centres
    saved_heads = ("backbone.", "head.", "patch_head.", "teacher.head.", "teacher.patch_head.", "mask_token", "centre",
                   "patch_centre")
    fp32_buffers = ("centre", "patch_centre")  # EMAs of batch means: bf16 would round every update away

    def __init__(self, backbone, cfg: DINOConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        if cfg.global_crops + cfg.local_crops < 2:
            raise ValueError(f"global_crops={cfg.global_crops} + local_crops={cfg.local_crops}: DINO compares views, "
                             "it needs at least 2 crops")
        if cfg.ibot_weight > 0 and not backbone.num_prefix_tokens:
            raise ValueError("ibot_weight > 0 needs a backbone with a class token (patch tokens follow it)")
        if cfg.ibot_weight > 0:
            refuse_hybrid(backbone, f"{cfg.name} with iBOT (objective.ibot_weight={cfg.ibot_weight})")
        self.head, self.patch_head = _heads(backbone.embed_dim, cfg)
        # The teacher: the student's backbone and heads built again, given the student's values, frozen.
        self.teacher = Teacher(teacher_backbone(backbone), cfg).eval()
        student = {"backbone": self.backbone, "head": self.head, "patch_head": self.patch_head}
        self.ema = EMA.following(student, self.teacher)  # holds references only (fp32 copies when the teacher is bf16)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, backbone.embed_dim)) if cfg.ibot_weight > 0 else None
        self.register_buffer("centre", torch.zeros(1, cfg.out_dim))
        self.register_buffer("patch_centre", torch.zeros(1, cfg.ibot_out_dim) if cfg.ibot_weight > 0 else None)
        self._step, self._total_steps = 0, 1
        self._momentum: torch.Tensor | None = None
        self._recent: deque = deque(maxlen=cfg.collapse_window)
        self._last_monitor: torch.Tensor | None = None
        self._unread: list[torch.Tensor] = []  # monitors on the device, read once per window
        self._warned = False

    # ----- the data and schedule hooks -----
    def multicrop_options(self) -> dict:
        cfg = self.cfg
        patch = self.backbone.patch_embed.stride[0]  # pixels per token
        options = dict(local_size=cfg.local_crop_size or local_crop_size(self.data.img_size, patch),
                       n_global=cfg.global_crops, n_local=cfg.local_crops, global_scale=list(cfg.global_crop_scale),
                       local_scale=list(cfg.local_crop_scale), flip=cfg.horizontal_flips)
        if self.mask_token is not None:  # iBOT's masks, drawn in the loader's collate
            size = self.data.img_size
            options["global_masks"] = dict(grid=tuple(self.backbone.patch_embed.grid_for(size, size)),
                                           ratio=tuple(cfg.ibot_mask_ratio), probability=cfg.ibot_mask_probability)
        return options

    def train(self, mode: bool = True):
        """The teacher stays in eval mode (as DINO's, DINOv2's and DINOv3's): with RoPE, the coordinate
        augmentations move only the student's positions."""
        super().train(mode)
        self.teacher.eval()
        return self

    def frozen_parameters(self) -> dict[str, int]:
        """Parameter-name prefixes -> the number of first steps they are held at lr 0 (a zero-lr group)."""
        steps = self.cfg.freeze_last_layer_steps
        return {"head.last_layer.": steps, "patch_head.last_layer.": steps} if steps else {}

    def no_weight_decay(self) -> set[str]:
        return {"mask_token"}

    def begin_step(self, step: int, total_steps: int) -> None:
        self._step, self._total_steps = step, total_steps

    def teacher_temp(self) -> float:
        cfg = self.cfg
        warmup = round(cfg.warmup_teacher_temp_fraction * self._total_steps)
        temps = teacher_temperature_schedule(cfg.warmup_teacher_temp, cfg.teacher_temp, warmup, self._total_steps)
        return float(temps[min(self._step, self._total_steps - 1)])

    def teacher_momentum(self, step: int, total_steps: int) -> float:
        """The momentum of the update after optimizer step `step` (1-based): DINO's per-step cosine array."""
        if self._momentum is None or len(self._momentum) != total_steps:
            self._momentum = schedule(self.cfg.teacher_momentum, self.cfg.teacher_momentum_end, total_steps)
        return float(self._momentum[step - 1])

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        self.ema.update(self.teacher_momentum(step, total_steps))
        self._watch_collapse()

    @property
    def encoder(self) -> VisionTransformer:
        return self.teacher.backbone

    def fp32_shards(self) -> dict[str, torch.Tensor]:
        """The teacher's fp32 EMA averages when its tensors are 16-bit (DeepSpeed's bf16 mode)."""
        return {f"teacher.{name}": shard for name, shard in self.ema.fp32_shards().items()}

    # ----- forward -----
    def local_loss_weight(self) -> float:
        """The weight of the local crops' pairs in the DINO loss (1; DINOv3 lowers it)."""
        return 1.0

    def anchor_losses(self, batch: dict, global_images: torch.Tensor, student_patches: torch.Tensor
                      ) -> dict[str, tuple[torch.Tensor, float]]:
        """Further losses on the student's (masked) global-crop patch tokens, name -> (loss, weight): none here
        (DINOv3: Gram anchoring)."""
        return {}

    def _tokens(self, network, images: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return network.backbone.forward_features(images, mask=mask, mask_token=self.mask_token)

    def _targets(self, logits: torch.Tensor, centre_name: str, temp: float) -> torch.Tensor:
        """Teacher probabilities from its logits: centred (and the centre updated) or Sinkhorn-Knopp."""
        if self.cfg.centering == "sinkhorn_knopp":
            return sinkhorn_knopp(logits, temp, self.cfg.sinkhorn_iterations)
        centre = getattr(self, centre_name)
        probs = centred_probs(logits, centre, temp)
        centre.copy_(updated_centre(centre.float(), logits, self.cfg.centre_momentum, all_reduce))
        return probs

    def _masks(self, images: torch.Tensor) -> torch.Tensor | None:
        if self.mask_token is None:
            return None
        grid = self.backbone.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        return ibot_masks(images.shape[0], grid, tuple(self.cfg.ibot_mask_ratio), self.cfg.ibot_mask_probability,
                          generator).to(images.device)

    def forward(self, batch):
        """The teacher's targets, the student's views, then the losses (`_teacher_step`, `_student_step`,
        `_losses`)."""
        cfg, crops = self.cfg, batch["crops"]
        n_global = cfg.global_crops
        if len(crops) != n_global + cfg.local_crops:
            raise ValueError(f"the batch has {len(crops)} crops, the objective expects {n_global} global + "
                             f"{cfg.local_crops} local ones")
        global_images = torch.cat(crops[:n_global])
        if "global_masks" in batch:  # drawn in the collate (ssl_vit.data.token_masks)
            masks, indices = batch["global_masks"], batch["global_mask_indices"]
        else:
            masks, indices = self._masks(global_images), None
        temp = self.teacher_temp()
        teacher_tokens, teacher_probs = self._teacher_step(global_images, temp)
        student_global_tokens, pooled = self._student_step(crops, global_images, masks)
        return self._losses(batch, global_images, masks, indices, temp, teacher_tokens, teacher_probs,
                            student_global_tokens, pooled)

    @torch.no_grad()
    def _teacher_step(self, global_images: torch.Tensor, temp: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's tokens of the global crops and its (centred or Sinkhorn-Knopp) image targets."""
        teacher_tokens = self._tokens(self.teacher, global_images)
        teacher_logits = self.teacher.head(self.teacher.backbone.pool(teacher_tokens))
        return teacher_tokens, self._targets(teacher_logits, "centre", temp)

    def _student_step(self, crops: list[torch.Tensor], global_images: torch.Tensor, masks: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's tokens of the (masked) global crops in one forward, then one forward per local
        resolution; returns (global tokens, every crop's pooled embedding, crop-major)."""
        student_global_tokens = self._tokens(self, global_images, masks)
        pooled, start = [self.backbone.pool(student_global_tokens)], self.cfg.global_crops
        while start < len(crops):
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            pooled.append(self.backbone.pool(self._tokens(self, torch.cat(crops[start:end]))))
            start = end
        return student_global_tokens, torch.cat(pooled)

    def _losses(self, batch: dict, global_images: torch.Tensor, masks, indices, temp: float,
                teacher_tokens: torch.Tensor, teacher_probs: torch.Tensor, student_global_tokens: torch.Tensor,
                pooled: torch.Tensor) -> dict:
        """DINO's cross-view loss, KoLeo, iBOT's masked-patch loss and an objective's anchors (DINOv3's Gram), each
        weighted into `loss`, with the collapse monitors."""
        cfg, n_global, prefix = self.cfg, self.cfg.global_crops, self.backbone.num_prefix_tokens
        student_logits = self.head(pooled)
        local_weight = self.local_loss_weight()
        dino = cross_view_loss(student_logits, teacher_probs, cfg.student_temp, n_global, local_weight)
        with torch.no_grad():  # the monitors read the plain cross-entropy (every pair weighed alike)
            plain = dino.detach() if local_weight == 1.0 else cross_view_loss(
                student_logits.detach(), teacher_probs, cfg.student_temp, n_global)
        outputs = {"dino_loss": dino}
        loss = dino
        if cfg.koleo_weight > 0:
            koleo = sum(koleo_loss(chunk) for chunk in pooled[: global_images.shape[0]].chunk(n_global))
            outputs["koleo_loss"] = koleo
            loss = loss + cfg.koleo_weight * koleo
        if cfg.ibot_weight > 0:
            with torch.no_grad():
                teacher_patch = self.teacher.patch_head(masked_tokens(teacher_tokens[:, prefix:], masks, indices))
                patch_probs = self._targets(teacher_patch, "patch_centre", temp)
            student_patch = self.patch_head(masked_tokens(student_global_tokens[:, prefix:], masks, indices))
            ibot = masked_tokens_loss(student_patch, patch_probs, masks, cfg.student_temp, indices)
            outputs["ibot_loss"] = ibot
            loss = loss + cfg.ibot_weight * ibot
        for name, (value, weight) in self.anchor_losses(batch, global_images,
                                                        student_global_tokens[:, prefix:]).items():
            outputs[name] = value
            loss = loss + weight * value
        # Collapse monitors: mean entropy of the teacher's targets; KL(teacher || student) = cross-entropy - entropy
        # (every teacher crop enters the averaged cross-entropy equally often).
        entropy = -(teacher_probs * teacher_probs.clamp_min(1e-12).log()).sum(dim=-1).mean()
        outputs.update(loss=loss, teacher_entropy=entropy, kl_teacher_student=plain - entropy,
                       teacher_temp=torch.tensor(temp, device=loss.device))
        self._last_monitor = torch.stack([plain, entropy])
        return outputs

    def _watch_collapse(self) -> None:
        """Warn (main process) when the teacher has sat at a collapsed state for `collapse_window` steps. The
        per-step monitors stay on the device and are read together once per window (one host-device sync per
        window, not per step); each step's state is then judged in order, as if read at once."""
        if self._last_monitor is None:
            return
        self._unread.append(self._last_monitor)
        if len(self._unread) < self._recent.maxlen:
            return
        monitors, self._unread = torch.stack(self._unread).tolist(), []
        for loss, entropy in monitors:
            self._judge(loss, entropy)

    def _judge(self, loss: float, entropy: float) -> None:
        log_k = math.log(self.cfg.out_dim)
        state = ("uniform" if entropy > 0.98 * log_k or abs(loss - log_k) < 0.01 * log_k else
                 "one-hot" if entropy < 0.05 else None)
        self._recent.append(state)
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if (state is not None and len(self._recent) == self._recent.maxlen and len(set(self._recent)) == 1
                and not self._warned and rank0):
            self._warned = True
            log.warning("DINO teacher looks collapsed (%s) for the last %d steps: teacher entropy %.3f, loss %.3f "
                        "(ln K = %.3f). Usual fixes: a lower teacher_temp, a higher teacher_momentum, a lower lr, "
                        "or more warm-up", state, len(self._recent), entropy, loss, log_k)


class DINOv2(DINO):
    config_class = DINOv2Config
