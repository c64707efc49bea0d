"""What every dataset kind shares: the data config schema (`DataConfig`, `AugRegConfig`), the augmentation kinds, and
`DatasetKind`, the record under which each kind is registered once (ssl_vit.data.registry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from ssl_vit.data.decode import DEFAULT_MAX_PIXELS
from ssl_vit.data.naflex import RESOLUTIONS, NaFlexConfig
from ssl_vit.schema import checked

AUGMENTS = ("none", "crop_flip", "crop", "augreg")
# where multi-crop's photometric augmentation runs (ssl_vit.data.multicrop)
PHOTOMETRIC_ON = ("workers", "collate", "device")
AUGREG_INTERPOLATIONS = ("bicubic", "bilinear", "nearest")  # timm's create_transform names
# Zero-shot prompts for a dataset that names none of its own (CLIP's generic ones).
DEFAULT_TEMPLATES = ("a photo of a {}.", "a drawing of a {}.", "a picture of the {}.", "a {}.")


@dataclass
class AugRegConfig:
    """`data.augreg.*`, used with `data.augment=augreg` (ssl_vit.data.augreg: timm's data tools). Defaults are DeiT's
    ImageNet recipe; the crop scale is data.crop_scale (DeiT: 0.08 at 224 px; the default 0.35 suits small images)."""

    rand_augment: str = "rand-m9-mstd0.5-inc1"  # timm's RandAugment policy string; "" turns it off
    random_erasing: float = checked(0.25, ge=0, le=1)  # probability per image (timm's RandomErasing, 'pixel' mode)
    mixup: float = checked(0.8, ge=0)  # Mixup's Beta(alpha, alpha); 0 turns it off
    cutmix: float = checked(1.0, ge=0)  # CutMix's Beta(alpha, alpha); 0 turns it off
    mix_prob: float = checked(1.0, ge=0, le=1)  # probability that a batch is mixed at all
    switch_prob: float = checked(0.5, ge=0, le=1)  # with both on: CutMix instead of Mixup for a mixed batch
    label_smoothing: float = checked(0.1, ge=0, lt=1)  # in Mixup's soft targets (Mixup off: objective.label_smoothing)
    repeats: int = checked(3, ge=1)  # repeated augmentation (map-style data): each image this often per epoch
    interpolation: str = checked("bicubic", choices=AUGREG_INTERPOLATIONS)


@dataclass
class DataConfig:
    name: str = MISSING
    img_size: int | None = checked(None, ge=1)  # None: the model preset's (or, evaluating, the encoder's) size
    batch_size: int = checked(64, ge=1)  # per process and micro-step; global = this x processes x grad_accum_steps
    # Loader worker processes per training process. None: on a GPU every core of this process's share but one (at
    # most 16: multi-crop and decoding need them), on CPU the dataset kind's choice (the training threads use the
    # cores: 0 for in-memory data, 2 for files to decode).
    num_workers: int | None = checked(None, ge=0)
    # none | crop_flip (random resized crop + horizontal flip) | crop (the crop alone: I-JEPA's) | augreg (DeiT /
    # AugReg: timm's RandAugment, random erasing, Mixup / CutMix, repeated augmentation; data.augreg.*)
    augment: str = checked("none", choices=AUGMENTS)
    augreg: AugRegConfig = field(default_factory=AugRegConfig)
    # Where multi-crop objectives' (DINO's) per-crop photometric augmentation runs: workers (torchvision, per crop,
    # in the loader's workers) | collate (batched, in the workers' collate, from parameters drawn per crop) | device
    # (batched on the training device, from those parameters; the crops travel as uint8) | auto (device on a GPU,
    # collate on a CPU: measured fastest there, benchmarks/peer_ssl.py)
    multicrop_photometric: str = checked("auto", choices=("auto", *PHOTOMETRIC_ON))
    crop_scale: list[float] = checked(factory=lambda: [0.35, 1.0], gt=0, le=1, length=2)
    # Normalisation per colour channel. None: the encoder's own when evaluating one that records it, else the
    # dataset's statistics (ImageNet's for natural images).
    mean: list[float] | None = checked(None, length=3)
    std: list[float] | None = checked(None, gt=0, length=3)
    max_train_samples: int | None = checked(None, ge=1)  # a stratified subset of the training set
    max_test_samples: int | None = checked(None, ge=1)  # a stratified subset of the test set (evaluation)
    # fixed: every image resized to data.img_size squared | naflex: each at its own aspect ratio, sized to a sequence
    # length per batch under a token budget (data.naflex.*; ssl_vit.data.naflex), for objectives that take it
    resolution: str = checked("fixed", choices=RESOLUTIONS)
    # fixed resolution without augmentation: shortest (the shorter side to img_size, a centred square crop: timm's
    # eval transform) | squash (both sides to img_size, nothing cut: transformers' ViT / SigLIP processors); None:
    # what the encoder recorded, else shortest
    resize_mode: str | None = checked(None, choices=("shortest", "squash"))
    naflex: NaFlexConfig = field(default_factory=NaFlexConfig)
    # Files larger than this (width x height from the header) are skipped as bad samples before they are decoded
    # (a decompression bomb: a small file that unpacks to gigabytes). PIL's default bound; None: no bound.
    max_pixels: int | None = checked(DEFAULT_MAX_PIXELS, ge=1)


@dataclass(frozen=True)
class DatasetKind:
    """Everything the project knows about one kind of dataset (`data=<name>`), in one place.

    `build(cfg, img_size)` gives the training set; `eval_splits(cfg, img_size)` the (train, test) sets that
    evaluation uses, or None when the kind cannot be evaluated (`eval_refusal` says why and what to do instead).
    `mean` / `std`: its pixel statistics (None: natural images, ImageNet's). `captioned`: its samples may carry
    captions (image-text objectives can train on it). `stream`: an endless stream without a length (shards), so no
    stratified subsets. `templates`: its zero-shot prompts. `cpu_workers`: the loader workers that
    data.num_workers=null gives a CPU run (files to decode: 2; in-memory data: 0)."""

    name: str
    config: type  # the schema (a DataConfig dataclass): configs/data/<name>.yaml extends schema/data/<name>
    build: Callable[[Any, int], Any]
    eval_splits: Callable[[Any, int], tuple] | None = None
    eval_refusal: str = ""
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    captioned: bool = False
    stream: bool = False
    templates: tuple[str, ...] = DEFAULT_TEMPLATES
    cpu_workers: int = 0
