"""How images become encoder inputs, recorded in every encoder file so that evaluation and export use what
pre-training used: resize the shorter side to img_size / crop_pct, centre-crop img_size, scale to [0, 1],
normalise per channel with mean and std (the rule of timm's eval transform; crop_pct 1 = no border cropped).
`resize_mode="squash"` resizes both sides to img_size instead, without a crop (transformers' ViT and SigLIP
processors, open_clip's "squash")."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ssl_vit.data.registry import dataset_kind
from ssl_vit.data.views import ViewBuilder

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
RESIZE_MODES = ("shortest", "squash")


@dataclass
class Preprocess:
    img_size: int
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    interpolation: str = "bilinear"
    crop_pct: float = 1.0
    resize_mode: str = "shortest"

    def __post_init__(self):
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"unknown resize_mode {self.resize_mode!r}; valid choices: {list(RESIZE_MODES)}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"unknown interpolation {self.interpolation!r}; valid choices: {list(INTERPOLATIONS)}")
        if not 0 < self.crop_pct <= 1:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        self.mean, self.std = [float(v) for v in self.mean], [float(v) for v in self.std]

    def view_builder(self, views=("image", "label"), augment: bool | str = False, crop_scale=(0.35, 1.0),
                     multicrop: dict | None = None, tokenizer=None, augreg=None, num_classes: int | None = None,
                     teacher_inputs=None):
        return ViewBuilder(views, self.img_size, self.mean, self.std, augment, crop_scale, self.interpolation,
                           self.crop_pct, multicrop, tokenizer, self.resize_mode, augreg, num_classes,
                           teacher_inputs)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Preprocess:
        return cls(**json.loads(text))


def dataset_stats(data_name: str) -> tuple[list[float], list[float]]:
    """The dataset kind's pixel statistics (ssl_vit.data.registry); ImageNet's for natural images."""
    kind = dataset_kind(data_name)
    return list(kind.mean or IMAGENET_MEAN), list(kind.std or IMAGENET_STD)


def resolve_preprocess(data_cfg, img_size: int, recorded: Preprocess | None = None) -> Preprocess:
    """The preprocessing for `data_cfg` at `img_size`: values set in the data config win, then what the encoder
    recorded (`recorded`), then the dataset's statistics."""
    default_mean, default_std = (recorded.mean, recorded.std) if recorded else dataset_stats(data_cfg.name)
    return Preprocess(
        img_size=img_size,
        mean=list(data_cfg.mean) if data_cfg.get("mean") is not None else default_mean,
        std=list(data_cfg.std) if data_cfg.get("std") is not None else default_std,
        interpolation=recorded.interpolation if recorded else "bilinear",
        crop_pct=recorded.crop_pct if recorded else 1.0,
        resize_mode=data_cfg.get("resize_mode") or (recorded.resize_mode if recorded else "shortest"),
    )
