"""DINOv3 (Siméoni et al. 2025): DINOv2's losses (Sinkhorn-Knopp, KoLeo, iBOT) plus Gram anchoring, on a RoPE
backbone with registers, and a high-resolution adaptation stage (`stage=hires`).

Gram anchoring keeps the patch features' similarity structure from degrading over long runs: a Gram teacher (a
frozen earlier snapshot of the EMA teacher's backbone) sees the global crops again, at `gram_size_factor` times
their resolution and without photometric distortion, its patch features are resized (bicubic) to the student's
grid, and the loss is the mean squared difference of the per-image Gram matrices of the L2-normalised patch
features of the student's (masked) global crops and the Gram teacher's (`ssl_vit.objectives.losses.gram.gram_loss`, as
facebookresearch/dinov3's `GramLoss` with `img_level`, `apply_norm`).

The schedule, per 0-based step k, as dinov3's train loop and `linear_warmup_cosine_decay` arrays give it:
- before step `gram_start` the Gram teacher takes the EMA teacher's values (dinov3's `it_load_ema_teacher`), then
  every `gram_update_every` steps again, at most `gram_max_updates` times (its `rep_update`, `update_frequency`;
  dinov3 counts those from iteration 0, ours from `gram_start`: the same when one is a multiple of the other);
- the loss weight is 0 before `gram_start`, then rises over `gram_warmup_steps` on an inclusive cosine from 0 to
  `gram_weight` and stays there; over the same steps the local crops' DINO weight falls from 1 to
  `local_loss_weight` (dinov3's `reweight_dino_local_loss`; its configs start both at the same iteration).
The schedule is a function of the step alone, so a resumed run refreshes where the uninterrupted one does.

`stage=hires` continues a run (`model.init_from=<its run directory>`) at higher resolution: global crops at
`hires_scale` times the model's size (local crops scaled alike), the Gram teacher at `hires_gram_size_factor`
times that, fixed for the whole stage at the starting weights, with constant weights `hires_gram_weight` and
`hires_local_loss_weight` (dinov3_vit7b16_high_res_adapt.yaml: 512 -> 768 px Gram crops, 1.5, 0.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ssl_vit.backbone.init import whole_modules, writable
from ssl_vit.data.multicrop import local_crop_size
from ssl_vit.ema import copy_parameters, teacher_backbone
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.objectives.base import DataInfo, Requirements
from ssl_vit.objectives.dino import DINO, DINOv2Config
from ssl_vit.objectives.losses.gram import gram_loss
from ssl_vit.objectives.patches import resize_patch_features
from ssl_vit.partition import full_shape
from ssl_vit.schema import checked

STAGES = ("pretrain", "hires")
GRAM_RESIZES = ("bicubic", "bilinear", "nearest")


@dataclass
class DINOv3Config(DINOv2Config):
    name: str = "dinov3"
    horizontal_flips: bool = False  # DINOv3 crops without flips
    # Gram anchoring (see the module docstring for the schedule)
    gram_weight: float = checked(2.0, ge=0)
    # the step anchoring starts; None: gram_start_fraction of trainer.max_steps (dinov3's ViT-7B: 1M of 1.2M)
    gram_start: int | None = checked(None, ge=0)
    gram_start_fraction: float = checked(1 / 1.2, ge=0, lt=1)
    gram_warmup_steps: int = checked(1000, ge=0)  # the weight's cosine ramp (dinov3: 1000 iterations)
    # an encoder (a run, an encoder file, timm:..., hf:...: what model.init_from takes) the Gram teacher holds from
    # the start instead of the EMA teacher's values at gram_start; refreshed from the EMA teacher as without it
    gram_teacher: str | None = None
    gram_untrained: bool = False  # true: allow anchoring to the untrained network (gram_start 0 from scratch)
    gram_update_every: int = checked(10000, ge=0)  # 0: the Gram teacher stays as it was at gram_start
    gram_max_updates: int = checked(3, ge=0)
    gram_size_factor: float = checked(2.0, ge=1)  # the Gram teacher's crops: this times the global crops' size
    # its features to the student's grid (F.interpolate mode, no antialiasing)
    gram_resize: str = checked("bicubic", choices=GRAM_RESIZES)
    gram_remove_negative: bool = False
    local_loss_weight: float = checked(0.5, ge=0)  # the local crops' DINO weight once Gram anchoring is on
    # the high-resolution adaptation stage
    stage: str = checked("pretrain", choices=STAGES)
    hires_scale: float = checked(2.0, ge=1)  # global (and local) crops at this times the model's size
    hires_gram_size_factor: float = checked(1.5, ge=1)
    hires_gram_weight: float = checked(1.5, ge=0)
    hires_local_loss_weight: float = checked(0.5, ge=0)
    # The stage's crop mixture: [global, local, share] per pair, sizes as multiples of the model's size (each step
    # one pair, drawn by the step with these shares, the same on every rank; the Gram crops at
    # hires_gram_size_factor x the global size). None: one pair, hires_scale for both.
    hires_crop_pairs: list | None = None
    hires_teacher_temp: float = checked(0.07, gt=0)  # constant in the stage (no warm-up)
    hires_teacher_momentum: float = checked(0.999, ge=0, le=1)  # constant in the stage (no cosine)


@dataclass(frozen=True)
class GramPlan:
    """The effective Gram-anchoring settings of a run (the stage's)."""

    weight: float
    start: int | None  # None: start_fraction of the run, fixed by `resolved`
    warmup_steps: int
    update_every: int
    max_updates: int
    size_factor: float
    local_weight: float
    start_fraction: float = 0.0

    def resolved(self, total_steps: int) -> GramPlan:
        """The plan with its start step fixed for a run of `total_steps`."""
        return self if self.start is not None else replace(self, start=round(self.start_fraction * total_steps))

    def ramp(self, step: int) -> float:
        """0 before `start`, then dinov3's inclusive cosine from 0 to 1 over `warmup_steps`, then 1."""
        if step < self.start:
            return 0.0
        done = step - self.start
        if done >= self.warmup_steps:
            return 1.0
        fraction = done / (self.warmup_steps - 1) if self.warmup_steps > 1 else 0.0
        return (1 - math.cos(math.pi * fraction)) / 2

    def takes_teacher_at(self, step: int) -> bool:
        """Whether the Gram teacher takes the EMA teacher's values before step `step` (0-based), i.e. after the
        EMA update of the step before: at `start`, then every `update_every` steps, at most `max_updates` times."""
        since = step - self.start
        return since == 0 or (self.update_every > 0 and since > 0 and since % self.update_every == 0
                              and since // self.update_every <= self.max_updates)


@dataclass(frozen=True)
class CropPairs:
    """dinov3's high-resolution crop mixture (`global_local_crop_pairs_ratios`): per step one (global, local, Gram)
    size triple, drawn from the step alone with the pairs' shares, so every rank takes the same and a resumed run
    the same again. The loader cuts every crop at the largest size of its kind; a step's smaller sizes are resized
    from those (bicubic, antialiased), and iBOT's masks are drawn again for the step's grid."""

    sizes: tuple[tuple[int, int, int], ...]  # (global, local, Gram) pixels per pair
    shares: tuple[float, ...]

    @classmethod
    def from_config(cls, pairs, img_size: int, gram_factor: float, patch: int) -> CropPairs:
        rows = [list(row) for row in pairs]
        if not rows or any(len(row) != 3 or min(row) <= 0 for row in rows):
            raise ValueError(f"objective.hires_crop_pairs={pairs}: give [global, local, share] per pair, each > 0 "
                             "(sizes as multiples of the model's size), e.g. [[2, 0.4375, 0.3], [3, 0.4375, 0.7]]")
        sizes = tuple((_whole_patches(g * img_size, patch), _whole_patches(local * img_size, patch),
                       _whole_patches(_whole_patches(g * img_size, patch) * gram_factor, patch))
                      for g, local, _ in rows)
        return cls(sizes, tuple(float(row[2]) for row in rows))

    @property
    def largest(self) -> tuple[int, int, int]:
        return tuple(max(kind) for kind in zip(*self.sizes, strict=True))

    def pick(self, step: int) -> tuple[int, int, int]:
        generator = torch.Generator().manual_seed(0x5EED_C407 + step)
        return self.sizes[int(torch.multinomial(torch.tensor(self.shares), 1, generator=generator))]

    def resized(self, batch: dict, step: int, n_global: int) -> dict:
        """The batch at step `step`'s sizes (the crops resized where the pair is smaller than the largest)."""
        global_size, local_size, gram_size = self.pick(step)

        def fit(crop: torch.Tensor, size: int) -> torch.Tensor:
            if crop.shape[-1] == size:
                return crop
            return F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True, align_corners=False)

        out = dict(batch)
        out["crops"] = [fit(c, global_size if i < n_global else local_size) for i, c in enumerate(batch["crops"])]
        if "gram_crops" in batch:
            out["gram_crops"] = [fit(c, gram_size) for c in batch["gram_crops"]]
        if global_size != self.largest[0]:  # the collate's masks are for the largest grid: the objective redraws
            out.pop("global_masks", None)
            out.pop("global_mask_indices", None)
        return out


def gram_plan(cfg: DINOv3Config) -> GramPlan:
    if cfg.stage == "hires":  # the starting weights anchor the whole stage, at constant weights
        return GramPlan(cfg.hires_gram_weight, 0, 0, 0, 0, cfg.hires_gram_size_factor, cfg.hires_local_loss_weight)
    return GramPlan(cfg.gram_weight, cfg.gram_start, cfg.gram_warmup_steps, cfg.gram_update_every,
                    cfg.gram_max_updates, cfg.gram_size_factor, cfg.local_loss_weight, cfg.gram_start_fraction)


class DINOv3(DINO):
    config_class = DINOv3Config
    # DINOv3's backbone, where the model config leaves it unset: RoPE (base 100, coordinates rescaled by up to 2x
    # while training) and 4 registers (its storage tokens)
    needs = Requirements(views=("crops",), ema_teacher=True,
                         model_defaults={"pos_embed": "rope", "rope_rescale": 2.0, "num_registers": 4,
                                         "weight_init": "dinov3"})
    saved_heads = (*DINO.saved_heads, "gram_teacher.")

    def __init__(self, backbone, cfg: DINOv3Config, data: DataInfo):
        super().__init__(backbone, cfg, data)
        self.plan = gram_plan(cfg)
        patch = self.backbone.patch_embed.stride[0]
        scale = cfg.hires_scale if cfg.stage == "hires" else 1.0
        self.global_size = _whole_patches(data.img_size * scale, patch)
        self.gram_size = _whole_patches(self.global_size * self.plan.size_factor, patch)
        self.pairs = None
        if cfg.stage == "hires" and cfg.hires_crop_pairs:
            self.pairs = CropPairs.from_config(cfg.hires_crop_pairs, data.img_size, self.plan.size_factor, patch)
            self.global_size, _, self.gram_size = self.pairs.largest
        # the Gram teacher: the teacher's backbone again (no heads), frozen, given the EMA teacher's values
        self.gram_teacher = teacher_backbone(backbone).eval()
        copy_parameters(self.gram_teacher, self.teacher.backbone)
        self.gram_teacher.requires_grad_(False)
        if cfg.gram_teacher:
            self.load_gram_teacher(cfg.gram_teacher)

    def train(self, mode: bool = True):
        super().train(mode)
        self.gram_teacher.eval()
        return self

    def multicrop_options(self) -> dict:
        options = super().multicrop_options()
        patch = self.backbone.patch_embed.stride[0]
        local = self.cfg.local_crop_size
        options["local_size"] = (_whole_patches(local * self.global_size / self.data.img_size, patch) if local
                                 else local_crop_size(self.global_size, patch))
        if self.pairs is not None:
            options["local_size"] = self.pairs.largest[1]
        options["global_size"] = self.global_size
        if self.gram_size != self.global_size:
            options["gram_size"] = self.gram_size
        if "global_masks" in options:
            options["global_masks"]["grid"] = tuple(self.backbone.patch_embed.grid_for(self.global_size,
                                                                                        self.global_size))
        return options

    @property
    def gram(self) -> GramPlan:
        """The plan for this run's length (gram_start unset: a fraction of it)."""
        return self.plan.resolved(self._total_steps)

    def local_loss_weight(self) -> float:
        return 1.0 + (self.plan.local_weight - 1.0) * self.gram.ramp(self._step)

    def gram_weight(self) -> float:
        return self.plan.weight * self.gram.ramp(self._step)

    def check_start(self, total_steps: int, from_trained: bool) -> None:
        """Refuse to anchor the patch features to the untrained network: dinov3 anchors late, to a trained teacher
        (ViT-7B: from 1M of 1.2M iterations; the high-resolution stage: the pre-trained weights)."""
        cfg = self.cfg
        if (self.plan.resolved(total_steps).start == 0 and self.plan.weight > 0 and not from_trained
                and not cfg.gram_teacher and not cfg.gram_untrained):
            given = "objective.stage=hires" if cfg.stage == "hires" else f"objective.gram_start={cfg.gram_start}"
            raise ValueError(
                f"{given} anchors the patch features to the untrained network from step 0 (dinov3 anchors late, "
                "to a trained teacher); leave objective.gram_start unset (objective.gram_start_fraction of the run), "
                "start from a trained run (model.init_from=...), give objective.gram_teacher=..., or set "
                "objective.gram_untrained=true")

    def load_gram_teacher(self, spec: str) -> None:
        """The Gram teacher <- the encoder `spec` names (its architecture must be the backbone's)."""
        with whole_modules():  # built whole on every rank, outside zero.Init
            state = load_pretrained(spec).encoder.state_dict()
        params = dict(self.gram_teacher.named_parameters())
        wrong = {name: tuple(state[name].shape) if name in state else None for name, param in params.items()
                 if name not in state or tuple(state[name].shape) != full_shape(param)}
        if wrong:
            name, shape = next(iter(wrong.items()))
            raise ValueError(f"objective.gram_teacher={spec}: its architecture is not the backbone's ({len(wrong)} "
                             f"tensors differ, e.g. {name}: {shape or 'missing'})")
        with torch.no_grad(), writable(*params.values()):
            for name, param in params.items():
                param.copy_(state[name])

    def begin_step(self, step: int, total_steps: int) -> None:
        super().begin_step(step, total_steps)
        gram = self.gram
        # (stage=hires: step 0, after model.init_heads loaded the heads; a given gram_teacher holds from the start)
        if gram.takes_teacher_at(step) and not (self.cfg.gram_teacher and step == gram.start):
            copy_parameters(self.gram_teacher, self.teacher.backbone)

    def teacher_temp(self) -> float:
        return self.cfg.hires_teacher_temp if self.cfg.stage == "hires" else super().teacher_temp()

    def teacher_momentum(self, step: int, total_steps: int) -> float:
        return self.cfg.hires_teacher_momentum if self.cfg.stage == "hires" else super().teacher_momentum(
            step, total_steps)

    def anchor_losses(self, batch, global_images, student_patches):
        if self._step < self.gram.start:
            return {}
        images = torch.cat(batch["gram_crops"]) if "gram_crops" in batch else global_images
        with torch.no_grad():
            teacher = self.gram_teacher.forward_features(images)[:, self.gram_teacher.num_prefix_tokens:]
        embed = self.backbone.patch_embed
        teacher = resize_patch_features(teacher, embed.grid_for(*images.shape[-2:]),
                                        embed.grid_for(*global_images.shape[-2:]), self.cfg.gram_resize)
        weight = self.gram_weight()
        return {"gram_loss": (gram_loss(student_patches, teacher, self.cfg.gram_remove_negative), weight)}

    def forward(self, batch):
        if self.pairs is not None:
            batch = self.pairs.resized(batch, self._step, self.cfg.global_crops)
        outputs = super().forward(batch)
        device = outputs["loss"].device
        outputs.update(gram_weight=torch.tensor(self.gram_weight(), device=device),
                       local_loss_weight=torch.tensor(self.local_loss_weight(), device=device))
        return outputs


def _whole_patches(pixels: float, patch: int) -> int:
    return max(patch, round(pixels / patch) * patch)
