"""Frozen classifiers to distil from (DeiT's teacher): a timm model from a local weights file, or an encoder + head
trained here (a run of objective=supervised, which saves its head, or of objective=deit).

The teacher sees the student's input (the same augmented, normalised images at the same size), runs in eval mode
without gradients, and is loaded outside the trained model: it is in no optimizer, checkpoint or exported encoder.
"""

from __future__ import annotations

import json
from pathlib import Path

import timm
import torch
from timm.models import load_checkpoint
from torch import nn

from ssl_vit.artifacts import load_encoder, load_heads, read_preprocess, run_files
from ssl_vit.objectives.supervised import build_head
from ssl_vit.untrusted import file_kind, refusing_pickles

TEACHER_FORMS = ["timm:<timm model name>:<weights file (.pth / .safetensors)>",
                 "<run directory (or its encoder.safetensors) of objective=supervised or deit>"]


class RunClassifier(nn.Module):
    """An encoder and the head(s) a run trained on it: the head on the pooled embedding, or DeiT's two heads on the
    class and distillation tokens, averaged."""

    def __init__(self, encoder: nn.Module, head: nn.Module, head_dist: nn.Module | None = None):
        super().__init__()
        self.encoder, self.head, self.head_dist = encoder, head, head_dist

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder.forward_features(images)
        if self.head_dist is None:
            return self.head(self.encoder.pool(tokens))
        return (self.head(tokens[:, 0]) + self.head_dist(tokens[:, 1])) / 2


def _timm_teacher(name: str, path: Path, num_classes: int) -> nn.Module:
    if not timm.is_model(name):
        raise ValueError(f"objective.teacher: {name!r} is not a timm model name (timm.list_models() lists them)")
    model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    try:  # strict: a head of another size is an error here, never silently re-initialised
        with refusing_pickles(f"objective.teacher={path}"):  # timm reads as weights only
            load_checkpoint(model, str(path), strict=True)
    except RuntimeError as err:
        classes = [line for line in str(err).splitlines() if "size mismatch" in line]
        raise ValueError(f"objective.teacher: {path} does not fit timm's {name} with {num_classes} classes (the "
                         f"data's): {classes[0].strip() if classes else str(err).splitlines()[0]}") from err
    return model


def _run_teacher(path: Path, num_classes: int, mean=None, std=None) -> nn.Module:
    encoder_file, heads_file = run_files(path)
    run = encoder_file.parent
    if path.is_file() and path.name != encoder_file.name and file_kind(path) != "safetensors":
        raise ValueError(f"objective.teacher: {path} is {file_kind(path)}, not a run's {encoder_file.name}; valid "
                         f"forms: {TEACHER_FORMS} (a timm checkpoint: timm:<model name>:{path})")
    if not encoder_file.is_file() or not heads_file.is_file():
        raise ValueError(f"objective.teacher: {run} has no encoder.safetensors + heads.safetensors (a run of "
                         f"objective=supervised or deit writes both)")
    heads, meta = load_heads(heads_file)
    objective = meta.get("objective")
    if objective not in ("supervised", "deit"):
        raise ValueError(f"objective.teacher: {run} was trained with objective={objective!r}, which has no "
                         f"classification head; a teacher is a run of objective=supervised or deit")
    config = json.loads(meta.get("objective_config", "{}"))
    recorded = read_preprocess(encoder_file)
    if recorded is not None and mean is not None and not (_close(recorded.mean, mean) and _close(recorded.std, std)):
        raise ValueError(f"objective.teacher: {run} was trained on images normalised with mean={recorded.mean}, "
                         f"std={recorded.std}, this run's are mean={list(mean)}, std={list(std)}; the teacher sees "
                         f"the student's images: set data.mean={recorded.mean} data.std={recorded.std}")
    encoder = load_encoder(encoder_file)
    kind = config.get("head", "linear") if objective == "supervised" else "linear"

    def head(prefix: str) -> nn.Module:
        module = build_head(kind, encoder.embed_dim, num_classes, config.get("hidden_dim"))
        state = {k[len(prefix):]: v for k, v in heads.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"objective.teacher: the head saved in {heads_file} does not fit {num_classes} classes "
                             f"(the data's): {str(err).splitlines()[-1].strip()}") from err
        return module

    return RunClassifier(encoder, head("head."), head("head_dist.") if objective == "deit" else None)


def _close(a, b) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))


def load_teacher(spec: str, num_classes: int, img_size: int | None = None, mean=None, std=None) -> nn.Module:
    """A frozen classifier (eval mode, no gradients) from `spec` (see TEACHER_FORMS), checked to give
    `num_classes` logits for `img_size` images; a run teacher also to have been trained on the `mean` / `std`
    normalisation (the student's, which it sees)."""
    if spec.startswith("timm:"):
        name, _, file = spec[len("timm:"):].partition(":")
        if not name or not file:
            raise ValueError(f"objective.teacher={spec!r}: give timm:<name>:<weights file>; valid forms: "
                             f"{TEACHER_FORMS}")
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"objective.teacher: weights file {file!r} does not exist (no model hub here)")
        teacher = _timm_teacher(name, path, num_classes)
    else:
        path = Path(spec)
        if not path.exists():
            raise ValueError(f"objective.teacher={spec!r} does not exist; valid forms: {TEACHER_FORMS}")
        teacher = _run_teacher(path, num_classes, mean, std)
    teacher.eval().requires_grad_(False)
    if img_size is not None:  # fail here, not at the first step (e.g. a timm ViT built for another size)
        try:
            with torch.no_grad():
                shape = tuple(teacher(torch.zeros(1, 3, img_size, img_size)).shape)
        except (RuntimeError, AssertionError, ValueError) as err:
            raise ValueError(f"objective.teacher={spec!r} cannot classify {img_size} px images (the student's): "
                             f"{str(err).splitlines()[0]}") from err
        if shape != (1, num_classes):
            raise ValueError(f"objective.teacher={spec!r} gives outputs of shape {shape} for a {img_size} px image, "
                             f"not (1, {num_classes}) logits")
    return teacher
