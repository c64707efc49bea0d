"""Multi-teacher feature distillation, as AM-RADIO (Ranzinger et al. 2024) and C-RADIO train their students: one
student ViT learns from N frozen teachers at once, each through its own adaptor heads.

Each teacher (feature_teacher.py: any encoder the project imports) sees the student's crop at its own size
and normalisation (the `teacher_images` view: the data layer cuts every view from the same box). Per teacher the
student has two adaptors, 2-layer MLPs (Linear, GELU, Linear) as RADIO's: one on its summary (the pooled embedding)
predicting the teacher's summary (a CLIP teacher's image embedding, another's pooled embedding), one on every patch
token predicting the teacher's patch features, which are resized to the student's grid (bilinear; a 14 px teacher's
grid against a 16 px student's). Losses, per teacher weighted by `summary_weight` / `patch_weight`:

    summary   1 - cos(adaptor(student summary), teacher summary)
    patches   patch_cosine_weight x (1 - cos) + patch_smooth_l1_weight x smooth-L1, averaged over the tokens
              (AM-RADIO's 0.9 / 0.1)

on standardised teacher features: each channel of each teacher's summary and patch features is centred and scaled
by running statistics over the global batch (the first 1 / (1 - stats_momentum) steps their cumulative mean, an
EMA after; `standardize=none` turns it off). Standardising keeps a teacher with large activations from dominating
the sum of losses. C-RADIO's PHI-S goes one step further (a Hadamard rotation after PCA, so that every direction,
not every channel, has the same variance); it needs each teacher's full covariance estimated over the data before
training starts, whereas per-channel statistics are estimated online, in the same pass, with nothing to
precompute: that is why they are used here. The adaptors' outputs are de-standardised (x std + mean) wherever
they stand in for a teacher: zero-shot through a CLIP teacher's adaptor, k-NN on a DINO teacher's.

One teacher, many students (DINOv3's multi-distillation, facebookresearch/dinov3 multidist_meta_arch.py):
`objective.students=[{name: small, model: vit_s16}, ...]` trains further students beside the `model=` one, each a
whole distill student of its own preset (backbone, adaptors, statistics) in `students.<name>`. Every teacher runs
once per batch; its standardised features are shared by all students, whose losses add up (no parameter is shared,
so each student's gradient is its own loss's). Each has optimizer groups of its own (`lr_scale`) and is saved as a
run directory of its own, `<run>/students/<name>/` (encoder.safetensors, heads.safetensors): evaluate, export and
`model.init_from` take it as any distill run. The run's own heads.safetensors and checkpoint hold them all, so the run
rebuilds whole and a resume is exact.

Teachers are loaded whole outside zero.Init and outside the module tree (no optimizer, checkpoint or export sees
them), run in eval mode without gradients, in bf16 where the device has it (`teacher_precision`), and a teacher too
large to replicate is sharded across the ranks for inference (`shard: true`: FSDP2, each block gathered for its
forward only). Their dimensions are recorded in the config, so the student and its adaptors rebuild without them
(`load_teachers=false`); an image-text teacher's text tower is loaded from its source only when text is embedded
(eval=zeroshot / retrieval of the student run).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import MISSING, OmegaConf
from torch import nn

from ssl_vit.backbone import PRESETS, build_vit
from ssl_vit.backbone.init import whole_modules
from ssl_vit.collectives import all_reduce
from ssl_vit.naflex import NaFlexLayout, is_naflex, patch_valid
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.objectives.feature_teacher import (
    TEACHER_FORMS,
    FeatureTeacher,
    cast_keeping_fp32,
    is_image_text_source,
    load_feature_teacher,
    load_text_side,
    shard_for_inference,
)
from ssl_vit.objectives.patches import resize_patch_features
from ssl_vit.schema import checked

log = logging.getLogger("ssl_vit")
TEACHER_PRECISIONS = ("auto", "bf16", "fp32")
STANDARDIZE = ("running", "none")


@dataclass
class TeacherConfig:
    source: str = checked(MISSING, example="objective.teachers=[{source: outputs/<clip run>, name: clip}] (forms: "
                                           + ", ".join(TEACHER_FORMS) + ")")
    name: str | None = None  # its adaptors' name (eval.features=<name>); default teacher<i>
    summary_weight: float = checked(1.0, ge=0)
    patch_weight: float = checked(1.0, ge=0)
    img_size: int | None = checked(None, ge=1)  # its input size; default its own preprocessing's
    shard: bool = False  # split across the ranks for inference (FSDP2) instead of a whole copy per rank
    # recorded when the run is built, so that the student rebuilds without the teacher
    summary_dim: int | None = None
    patch_dim: int | None = None
    image_text: bool | None = None


@dataclass
class StudentConfig:
    """A further student of one teacher forward (DINOv3's multi-distillation)."""

    name: str = checked(MISSING, example="objective.students=[{name: small, model: vit_s16}]")
    model: str = checked(MISSING, example="objective.students=[{name: small, model: vit_s16}]")  # a model= preset
    options: dict[str, Any] = field(default_factory=dict)  # model.* options of that preset ({drop_path: 0.1})
    lr_scale: float = checked(1.0, ge=0)  # its learning rate = the run's x lr_scale (its own optimizer groups)


@dataclass
class DistillConfig(ObjectiveConfig):
    name: str = "distill"
    teachers: list[TeacherConfig] = field(default_factory=list)
    adaptor_hidden_dim: int = checked(1024, ge=1)
    patch_cosine_weight: float = checked(0.9, ge=0)
    patch_smooth_l1_weight: float = checked(0.1, ge=0)
    standardize: str = checked("running", choices=STANDARDIZE)
    stats_momentum: float = checked(0.99, ge=0, lt=1)
    teacher_precision: str = checked("auto", choices=TEACHER_PRECISIONS)  # auto: bf16 on a GPU that has it
    text_teacher: str | None = None  # the image-text teacher zero-shot goes through; default the first one
    load_teachers: bool = True  # false: the student and its adaptors only (evaluation, reloading)
    students: list[StudentConfig] = field(default_factory=list)  # further students of the same teacher forwards


class Adaptor(nn.Module):
    """RADIO's adaptor head: Linear, GELU, Linear."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class RunningStandardizer(nn.Module):
    """Per-channel mean and variance of a teacher's features over the global batch: the cumulative mean of the
    batch statistics for the first 1 / (1 - momentum) updates, an EMA with `momentum` after. Updated at every
    training micro-step (a batch whose features are not all finite is left out). Kept centred (the mean and the
    variance about it, merged as a mixture), so channels with a large offset keep their small spread: E[x^2] - E[x]^2
    in fp32 loses it."""

    _keep_in_fp32_modules_strict = ["mean", "var", "count"]  # running averages: bf16 would round updates away
    eps = 1e-6

    def __init__(self, dim: int, momentum: float, enabled: bool = True):
        super().__init__()
        self.momentum, self.enabled = momentum, enabled
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros(1))

    @torch.no_grad()
    def update(self, features: torch.Tensor) -> None:
        """Fold in (N, D) rows of this rank; every rank's rows count (all-reduced, two passes: the batch mean, then
        the squared deviations from it)."""
        if not self.enabled:
            return
        features = features.float()
        totals = all_reduce(torch.cat([features.sum(0), features.new_tensor([len(features)])]))
        rows = totals[-1]
        batch_mean = totals[:-1] / rows
        batch_var = all_reduce((features - batch_mean).square().sum(0)) / rows
        if not (batch_mean.isfinite().all() and batch_var.isfinite().all()):
            return  # the same on every rank (the sums are global)
        weight = (1 / (self.count + 1)).clamp(min=1 - self.momentum)
        shift = batch_mean - self.mean
        self.var.mul_(1 - weight).add_(weight * batch_var + weight * (1 - weight) * shift.square())
        self.mean.add_(weight * shift)
        self.count += 1

    def std(self) -> torch.Tensor:
        return self.var.clamp(min=self.eps).sqrt()

    def standardize(self, features: torch.Tensor) -> torch.Tensor:
        """(..., D) features centred and scaled per channel."""
        return (features - self.mean) / self.std() if self.enabled else features

    def restore(self, features: torch.Tensor) -> torch.Tensor:
        """The inverse of `standardize`: an adaptor's output in its teacher's own feature space."""
        return features * self.std() + self.mean if self.enabled else features


def cosine_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1 - cosine similarity along the last dimension, averaged over the rest."""
    return (1 - F.cosine_similarity(prediction, target, dim=-1)).mean()


def _resize_per_image(tokens: torch.Tensor, grid: tuple[int, int], layout: NaFlexLayout) -> torch.Tensor:
    """(B, h * w, D) teacher patch features -> (valid patches, D): each image's resized to its own grid (bilinear,
    as the dense path) and taken at its patches' positions, in the order of the student's valid tokens."""
    out = tokens.new_empty(*layout.valid.shape, tokens.shape[-1])
    for to, rows in layout.groups().items():
        resized = resize_patch_features(tokens[rows], grid, to, "bilinear")  # (b, H * W, D)
        index = layout.index[rows]
        out[rows] = torch.gather(resized, 1, index[..., None].expand(-1, -1, resized.shape[-1]))
    return out[layout.valid]


class Distill(Objective):
    config_class = DistillConfig
    needs = Requirements(views=("image", "teacher_images"), naflex=True)
    saved_heads = ("summary_adaptors.", "patch_adaptors.", "summary_stats.", "patch_stats.")

    def __init__(self, backbone, cfg: DistillConfig, data: DataInfo):
        # The teachers' resolved facts (default names, feature widths, image-text) go into the objective's own copy
        # of its config, which its artifacts record; the caller's config stays as it was given.
        cfg = OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else copy.deepcopy(cfg)
        super().__init__(backbone, cfg, data)
        if not cfg.teachers:
            raise ValueError("objective=distill needs at least one teacher: objective.teachers=[{source: <run dir | "
                             "timm:... | hf:... | open_clip:...>, name: <name>}, ...]")
        for index, teacher_cfg in enumerate(cfg.teachers):
            if teacher_cfg.name is None:
                teacher_cfg.name = f"teacher{index}"
        names = [t.name for t in cfg.teachers]
        bad = [n for n in names if not n.isidentifier()]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"objective.teachers: names must be distinct identifiers (letters, digits, _), got "
                             f"{names}")
        teachers = self._load_teachers(cfg) if cfg.load_teachers else []
        object.__setattr__(self, "teachers", teachers)  # outside the module tree: no optimizer, state or strategy
        missing = [t.name for t in cfg.teachers if t.summary_dim is None or t.patch_dim is None]
        if missing:
            raise ValueError(f"objective.teachers {missing} record no feature dimensions (objective.load_teachers="
                             "false rebuilds a student whose run recorded them)")
        if cfg.text_teacher is not None and cfg.text_teacher not in names:
            raise ValueError(f"objective.text_teacher={cfg.text_teacher!r} is not a teacher; valid choices: {names}")
        hidden, width, stats = cfg.adaptor_hidden_dim, backbone.embed_dim, cfg.standardize == "running"
        self.summary_adaptors = nn.ModuleDict({t.name: Adaptor(width, hidden, t.summary_dim) for t in cfg.teachers})
        self.patch_adaptors = nn.ModuleDict({t.name: Adaptor(width, hidden, t.patch_dim) for t in cfg.teachers})
        self.summary_stats = nn.ModuleDict({t.name: RunningStandardizer(t.summary_dim, cfg.stats_momentum, stats)
                                            for t in cfg.teachers})
        self.patch_stats = nn.ModuleDict({t.name: RunningStandardizer(t.patch_dim, cfg.stats_momentum, stats)
                                          for t in cfg.teachers})
        self._teachers_device: torch.device | None = None
        object.__setattr__(self, "_text_side", None)
        self.students = nn.ModuleDict(self._build_students(cfg, data) if cfg.students else {})
        if cfg.students:
            # the run's heads hold the further students too: the run rebuilds whole (load_trained, consolidation,
            # model.init_heads), and each student is also a run of its own (member_artifacts)
            self.saved_heads = (*type(self).saved_heads, "students.")

    @staticmethod
    def _build_students(cfg: DistillConfig, data: DataInfo) -> dict[str, Distill]:
        """Each further student: a distill student of its preset at the run's image size, with the teachers'
        recorded dimensions (no teacher of its own)."""
        names = [student.name for student in cfg.students]
        if len(set(names)) != len(names) or not all(name.isidentifier() for name in names):
            raise ValueError(f"objective.students: names must be distinct identifiers (letters, digits, _), got "
                             f"{names}")
        own = replace(cfg, students=[], load_teachers=False)
        students = {}
        for student in cfg.students:
            where = f"objective.students[{student.name}]"
            if student.model not in PRESETS:
                raise ValueError(f"{where}: unknown model {student.model!r}; valid choices: {sorted(PRESETS)}")
            try:
                backbone = build_vit(student.model, img_size=data.img_size, **dict(student.options))
            except ValueError as err:  # a patch grid that does not tile the run's images, a bad option
                raise ValueError(f"{where}: model={student.model} at data.img_size={data.img_size}: {err} (every "
                                 "student sees the run's images; the teachers' patch maps are resized to each "
                                 "student's grid)") from err
            students[student.name] = Distill(backbone, copy.deepcopy(own), data)
        return students

    def lr_scales(self) -> dict[str, float]:
        return {f"students.{student.name}.": student.lr_scale for student in self.cfg.students}

    @staticmethod
    def _load_teachers(cfg: DistillConfig) -> list[FeatureTeacher]:
        """Each teacher whole, outside zero.Init and without moving the run's random stream; its dimensions and
        kind recorded in `cfg`."""
        teachers = []
        for teacher_cfg in cfg.teachers:
            try:
                with whole_modules(), torch.random.fork_rng(devices=[]):
                    teacher = load_feature_teacher(teacher_cfg.source, teacher_cfg.img_size)
            except (ValueError, FileNotFoundError, OSError, RuntimeError) as err:
                raise ValueError(f"objective.teachers[{teacher_cfg.name}]: {err} (valid forms: {TEACHER_FORMS})") \
                    from err
            teacher_cfg.summary_dim, teacher_cfg.patch_dim = teacher.summary_dim, teacher.patch_dim
            teacher_cfg.image_text = is_image_text_source(teacher_cfg.source)
            teachers.append(teacher)
        return teachers

    @classmethod
    def requirements(cls, cfg) -> Requirements:
        """An image-text model (zero-shot, retrieval) when a teacher embeds text too."""
        image_text = any(t.image_text if t.image_text is not None else is_image_text_source(t.source)
                         for t in cfg.teachers)
        return replace(cls.needs, image_text=image_text)

    @classmethod
    def rebuild_config(cls, cfg):
        """The student and its adaptors from the recorded dimensions; the teachers stay where they are."""
        return OmegaConf.merge(OmegaConf.structured(cls.config_class), cfg, {"load_teachers": False})

    def teacher_inputs(self) -> list:
        return [teacher.preprocess for teacher in self.teachers]

    # ----- the step -----
    def _teacher_dtype(self, device: torch.device) -> torch.dtype:
        if self.cfg.teacher_precision == "bf16" or (self.cfg.teacher_precision == "auto" and device.type == "cuda"
                                                    and torch.cuda.is_bf16_supported()):
            return torch.bfloat16
        return torch.float32

    def _place_teachers(self, device: torch.device) -> None:
        """On the training device (once): in the teacher precision, sharded across the ranks where asked."""
        if self._teachers_device == device:
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        for teacher, teacher_cfg in zip(self.teachers, self.cfg.teachers, strict=True):
            cast_keeping_fp32(teacher, self._teacher_dtype(device))  # on the CPU still: no whole copy on the device
            if teacher_cfg.shard and distributed and torch.distributed.get_world_size() > 1:
                whole = sum(p.numel() for p in teacher.parameters())
                shard_for_inference(teacher, device)  # block by block: one block whole on the device at a time
                local = sum(p.to_local().numel() for p in teacher.parameters())
                log.info("teacher %s: sharded across %d processes for inference (FSDP2), %d of its %d parameters "
                         "on this one", teacher_cfg.name, torch.distributed.get_world_size(), local, whole)
            teacher.to(device)
        self._teachers_device = device

    def teacher_features(self, teacher_images: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
        """(summary (B, Ds), patch features (B, h x w, Dp), grid (h, w)) of each teacher on its view, fp32, outside
        any autocast (a teacher runs in its own precision)."""
        self._place_teachers(teacher_images[0].device)
        with torch.autocast(teacher_images[0].device.type, enabled=False):
            return [teacher(images) for teacher, images in zip(self.teachers, teacher_images, strict=True)]

    def standardized_targets(self, features: list) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
        """Each teacher's (summary, patch features, grid) standardised by this student's running statistics,
        updated first when training."""
        targets = []
        for teacher_cfg, (summary, patches, grid) in zip(self.cfg.teachers, features, strict=True):
            summary_stats, patch_stats = self.summary_stats[teacher_cfg.name], self.patch_stats[teacher_cfg.name]
            if self.training:
                summary_stats.update(summary)
                patch_stats.update(patches.flatten(0, 1))
            targets.append((summary_stats.standardize(summary), patch_stats.standardize(patches), grid))
        return targets

    def forward(self, batch: dict) -> dict[str, torch.Tensor]:
        images = batch["image"]
        targets = self.standardized_targets(self.teacher_features(batch["teacher_images"]))
        out = self.student_losses(images, targets)
        if not self.cfg.students:
            return out
        total, metrics = out["loss"], {"student_loss": out["loss"].detach()}
        for name, student in self.students.items():
            # the same statistics, so that each student's own artifacts restore its adaptors' outputs
            student.summary_stats.load_state_dict(self.summary_stats.state_dict())
            student.patch_stats.load_state_dict(self.patch_stats.state_dict())
            losses = student.student_losses(images, targets)
            total = total + losses["loss"]
            metrics.update({f"{name}_{key}": value.detach() for key, value in losses.items()})
        return {**out, **metrics, "loss": total}

    def student_losses(self, images, targets: list) -> dict[str, torch.Tensor]:
        """This student's loss on `images` against the teachers' standardised `targets`."""
        tokens = self.backbone.forward_features(images)
        summary = self.backbone.pool(tokens, patch_valid(images))
        patches = tokens[:, self.backbone.num_prefix_tokens:]
        if is_naflex(images):  # each image on its own grid: the teachers' maps resized per image, padding left out
            layout = NaFlexLayout.of(images)
            resize = partial(_resize_per_image, layout=layout)
            patches = patches[layout.valid]
        else:
            grid = self.backbone.patch_embed.grid_for(images.shape[-2], images.shape[-1])
            resize = partial(resize_patch_features, to=grid, mode="bilinear")
        cfg, loss, metrics = self.cfg, 0.0, {}
        for teacher_cfg, (target_summary, target_patches, teacher_grid) in zip(cfg.teachers, targets, strict=True):
            name = teacher_cfg.name
            # standardised first: the same (a per-channel affine map commutes with bilinear weights summing to 1)
            target_patches = resize(target_patches, teacher_grid)
            predicted_summary = self.summary_adaptors[name](summary).float()
            predicted_patches = self.patch_adaptors[name](patches).float()
            summary_loss = cosine_loss(predicted_summary, target_summary)
            patch_cosine = cosine_loss(predicted_patches, target_patches)
            patch_smooth_l1 = F.smooth_l1_loss(predicted_patches, target_patches)
            patch_loss = cfg.patch_cosine_weight * patch_cosine + cfg.patch_smooth_l1_weight * patch_smooth_l1
            loss = loss + teacher_cfg.summary_weight * summary_loss + teacher_cfg.patch_weight * patch_loss
            metrics.update({f"{name}_summary_loss": summary_loss.detach(), f"{name}_patch_loss": patch_loss.detach(),
                            f"{name}_patch_cosine": 1 - patch_cosine.detach()})
        return {"loss": loss, **metrics}

    # ----- the further students: saved as runs of their own -----
    def member_artifacts(self, state: dict[str, torch.Tensor]) -> dict:
        members = {}
        for name, student in self.students.items():
            prefix = f"students.{name}."
            own = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
            members[f"students/{name}"] = (student.backbone.config, student.artifacts(own))
        return members

    # ----- the adaptors as the teachers' stand-ins -----
    @property
    def feature_names(self) -> list[str]:
        """The adaptors that give features (eval.features=<name>): one per teacher."""
        return [t.name for t in self.cfg.teachers]

    def summary_features(self, images: torch.Tensor, name: str) -> torch.Tensor:
        """(B, Ds): the student's prediction of teacher `name`'s summary, in that teacher's own space."""
        if name not in self.summary_adaptors:
            raise ValueError(f"no adaptor {name!r}; valid choices: {self.feature_names}")
        summary = self.backbone.pool(self.backbone.forward_features(images), patch_valid(images))
        return self.summary_stats[name].restore(self.summary_adaptors[name](summary).float())

    def patch_features(self, images: torch.Tensor, name: str) -> torch.Tensor:
        """(B, N, Dp): the student's prediction of teacher `name`'s patch features on the student's grid, in that
        teacher's own space."""
        if name not in self.patch_adaptors:
            raise ValueError(f"no adaptor {name!r}; valid choices: {self.feature_names}")
        patches = self.backbone.forward_features(images)[:, self.backbone.num_prefix_tokens:]
        return self.patch_stats[name].restore(self.patch_adaptors[name](patches).float())

    # ----- image-text: through the adaptor of an image-text teacher, with that teacher's text tower -----
    @property
    def text_teacher(self) -> str:
        if self.cfg.text_teacher is not None:
            return self.cfg.text_teacher
        image_text = [t.name for t in self.cfg.teachers if t.image_text]
        if not image_text:
            raise ValueError(f"no image-text teacher among {self.feature_names}: zero-shot and retrieval need one "
                             "(an open_clip model or a clip / siglip run)")
        return image_text[0]

    def text_side(self) -> nn.Module:
        """The text tower of the image-text teacher, loaded from its source at first use (never trained or saved
        with the student)."""
        if self._text_side is None:
            source = next(t.source for t in self.cfg.teachers if t.name == self.text_teacher)
            with whole_modules(), torch.random.fork_rng(devices=[]):
                object.__setattr__(self, "_text_side", load_text_side(source))
        return self._text_side

    def text_tokenizer(self):
        return self.text_side().text_tokenizer()

    @property
    def zeroshot_templates(self) -> list[str]:
        return list(getattr(self.text_side(), "zeroshot_templates", []))

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.summary_features(images, self.text_teacher)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        text = self.text_side()
        first = next(text.parameters(), None)
        if first is not None and first.device != tokens.device:
            text.to(tokens.device)
        return text.encode_text(tokens, normalize=normalize)


__all__ = ["Adaptor", "Distill", "DistillConfig", "RunningStandardizer", "StudentConfig", "TeacherConfig",
           "cosine_loss"]
