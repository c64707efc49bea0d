"""Frozen feature teachers for multi-teacher distillation (objective=distill): any encoder the project imports, seen
as a summary vector and a grid of patch features.

    ours (a run directory or encoder.safetensors)   summary: the pooled embedding; a clip / siglip run's: its image
                                                    embedding (pooled, projected), the space its text tower shares
    open_clip:<dir>, open_clip:<name>:<file>        summary: the image embedding (the image tower's `proj`)
    timm:..., hf:<dir>                              summary: the pooled embedding (class token, or the average)

Patch features are the output tokens after the final norm, prefix tokens (class, registers) dropped, laid out on
the teacher's grid. A teacher keeps its own preprocessing (size, interpolation, normalisation: its recorded one, or
its library's), which the data layer uses to cut its view. It runs in eval mode without gradients, optionally in
bf16, and is loaded whole outside any zero.Init (the caller's `whole_modules`) or sharded for inference across the
ranks with FSDP2 (`shard_for_inference`).

An image-text teacher's text side (`load_text_side`) is loaded only where text is embedded (zero-shot, retrieval of
the student through its adaptor for that teacher): never for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ssl_vit.artifacts import load_heads, read_preprocess, run_files
from ssl_vit.backbone import VisionTransformer
from ssl_vit.interop.open_clip import from_open_clip_visual, load_open_clip_model, open_clip_preprocess
from ssl_vit.interop.sources import SOURCES, load_pretrained
from ssl_vit.objectives.base import Objective, load_run
from ssl_vit.objectives.clip import CLIP, SigLIP
from ssl_vit.preprocess import Preprocess
from ssl_vit.untrusted import refusing_pickles

TEACHER_FORMS = [form for form in SOURCES if not form.startswith(("dino:", "dinov2:"))]
IMAGE_TEXT_OBJECTIVES: dict[str, type[Objective]] = {"clip": CLIP, "siglip": SigLIP}


def image_text_class(name: str) -> type[Objective]:
    if name not in IMAGE_TEXT_OBJECTIVES:
        raise ValueError(f"objective={name!r} is not an image-text objective ({sorted(IMAGE_TEXT_OBJECTIVES)})")
    return IMAGE_TEXT_OBJECTIVES[name]


class FeatureTeacher(nn.Module):
    """`encoder` (+ `projection` of the pooled embedding into an image-text space) -> (summary (B, Ds), patch
    features (B, h x w, Dp), the teacher's grid (h, w)), in fp32."""

    def __init__(self, encoder: VisionTransformer, preprocess: Preprocess, projection: nn.Module | None = None):
        super().__init__()
        self.encoder, self.projection, self.preprocess = encoder, projection, preprocess
        self.eval().requires_grad_(False)

    @property
    def patch_dim(self) -> int:
        return self.encoder.embed_dim

    @property
    def summary_dim(self) -> int:
        return self.projection.out_features if self.projection is not None else self.encoder.embed_dim

    def train(self, mode: bool = True):
        return super().train(False)  # always as at inference (no dropout, stochastic depth)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        dtype = next(self.encoder.parameters()).dtype
        tokens = self.encoder.forward_features(images.to(dtype))
        summary = self.encoder.pool(tokens)
        if self.projection is not None:
            summary = self.projection(summary)
        grid = tuple(self.encoder.patch_embed.grid_for(images.shape[-2], images.shape[-1]))
        return summary.float(), tokens[:, self.encoder.num_prefix_tokens:].float(), grid


def is_image_text_source(spec: str) -> bool:
    """Whether the teacher `spec` names embeds text too (an open_clip model, or our clip / siglip run)."""
    if spec.startswith("open_clip:"):
        return True
    if spec.split(":", 1)[0] in ("timm", "hf"):
        return False
    heads = run_files(spec)[1]
    return heads.is_file() and load_heads(heads)[1].get("objective") in IMAGE_TEXT_OBJECTIVES


def load_feature_teacher(spec: str, img_size: int | None = None) -> FeatureTeacher:
    """The frozen teacher `spec` names (TEACHER_FORMS), its input at `img_size` when given (position embeddings
    resampled as its library does), else at its own preprocessing's size; ValueError / FileNotFoundError naming the
    problem."""
    if spec.startswith("open_clip:"):
        with refusing_pickles(spec):
            model, vision_cfg, _, _ = load_open_clip_model(spec[len("open_clip:"):])
        encoder = from_open_clip_visual(model.visual, vision_cfg.get("ls_init_value"))
        proj = getattr(model.visual, "proj", None)  # (width, embed dim): x @ proj
        if proj is None:
            raise ValueError(f"{spec}: the open_clip image tower has no projection (proj) into its text space")
        projection = nn.Linear(*proj.shape, bias=False)
        projection.weight.data.copy_(proj.detach().T)
        teacher = FeatureTeacher(encoder, open_clip_preprocess(model.visual), projection)
    elif is_image_text_source(spec):
        model = load_run(spec, image_text_class, image_text=True)
        teacher = FeatureTeacher(model.backbone, read_preprocess(run_files(spec)[0]) or _native(model.backbone),
                                 model.image_proj)
    else:
        source = load_pretrained(spec)
        teacher = FeatureTeacher(source.encoder, source.preprocess or _native(source.encoder))
    if img_size is not None and img_size != teacher.preprocess.img_size:
        teacher.encoder.set_img_size(img_size)
        teacher.preprocess = Preprocess(**{**vars(teacher.preprocess), "img_size": img_size})
    return teacher


def _native(encoder: VisionTransformer) -> Preprocess:
    """A source that records no preprocessing: its native size, ImageNet's statistics."""
    size = encoder.patch_embed.img_size
    return Preprocess(int(size[0] if isinstance(size, (tuple, list)) else size))


class OpenClipText(nn.Module):
    """An open_clip model's text side: `encode_text`, and its tokenizer as `text_tokenizer()`."""

    def __init__(self, model: nn.Module, tokenizer_name: str):
        super().__init__()
        self.model, self.tokenizer_name = model, tokenizer_name
        self.zeroshot_templates: list[str] = []

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.model.encode_text(tokens)
        return F.normalize(features.float(), dim=-1) if normalize else features

    def text_tokenizer(self):
        import open_clip  # heavy: open_clip models only

        return open_clip.get_tokenizer(self.tokenizer_name)


def load_text_side(spec: str) -> nn.Module:
    """The text side of the image-text teacher `spec`: a module with `encode_text(tokens, normalize)`,
    `text_tokenizer()` and `zeroshot_templates`, in eval mode."""
    if spec.startswith("open_clip:"):
        model, _, _, tokenizer_name = load_open_clip_model(spec[len("open_clip:"):])
        return OpenClipText(model, tokenizer_name).eval().requires_grad_(False)
    if spec.split(":", 1)[0] not in ("timm", "hf") and not run_files(spec)[1].is_file():
        raise ValueError(f"the image-text teacher {spec!r} (recorded in the student's config) is not there: text is "
                         "embedded by that teacher's own text tower")
    if not is_image_text_source(spec):
        raise ValueError(f"teacher {spec!r} embeds no text (an image-text teacher is an open_clip model or a run of "
                         f"objective={'/'.join(IMAGE_TEXT_OBJECTIVES)})")
    return load_run(spec, image_text_class, image_text=True).requires_grad_(False)


def cast_keeping_fp32(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to(dtype)`, except the buffers its modules keep in fp32 (`_keep_in_fp32_modules_strict`: RoPE's
    periods)."""
    module.to(dtype)
    for sub in module.modules():
        for name in getattr(sub, "_keep_in_fp32_modules_strict", ()):
            if isinstance(sub._buffers.get(name), torch.Tensor):
                sub._buffers[name] = sub._buffers[name].float()
    return module


def shard_for_inference(teacher: FeatureTeacher, device: torch.device) -> FeatureTeacher:
    """The teacher's parameters split across the ranks with FSDP2 (`fully_shard`: each block, then the rest), for a
    teacher too large to hold whole on every rank: each block is gathered for its forward and freed after, never
    kept whole. Called on a teacher still on the CPU, FSDP2 moves one block at a time to the device and shards it.
    Every rank must run the teacher on each step (the gathers are collective)."""
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for block in teacher.encoder.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    return teacher
