"""The data-efficient supervised recipe of DeiT (Touvron et al. 2021) and AugReg (Steiner et al. 2022), from timm's
data tools rather than re-written: `timm.data.create_transform` (random resized crop, flip, RandAugment, random
erasing) per sample, `timm.data.Mixup` (Mixup / CutMix with label smoothing) per batch, and repeated augmentation in
the sampler (`ssl_vit.data.step_sampler.StepBatchSampler(repeats=...)`). Stochastic depth is the model's `drop_path`.

Determinism: timm's transforms draw from Python's `random` and NumPy; both are seeded here from the sample's (or the
batch's) own seed and restored afterwards, so a batch stays a pure function of (seed, step, rank) and resumes exactly.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch
from PIL import Image
from timm.data import Mixup, create_transform
from timm.data.auto_augment import RandAugment, posterize
from torchvision.transforms.v2.functional import to_pil_image

from ssl_vit.data.config import AugRegConfig


@contextmanager
def seeded_python_and_numpy(seed: int):
    """Python's and NumPy's global generators seeded with `seed` inside, restored on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


class AugRegTransform:
    """uint8 (3, H, W) image -> normalised float tensor through timm's training transform (`create_transform`),
    under a seed drawn from torch's generator (which the loader seeds per sample)."""

    def __init__(self, img_size: int, mean, std, crop_scale, cfg: AugRegConfig):
        if cfg.rand_augment and not cfg.rand_augment.startswith("rand-m"):
            raise ValueError(f"data.augreg.rand_augment={cfg.rand_augment!r} is not a timm RandAugment policy: "
                             "'rand-m<magnitude>[-n<ops>][-mstd<std>][-inc1]' (DeiT: rand-m9-mstd0.5-inc1), or '' "
                             "for none")
        self.transform = create_transform(
            img_size, is_training=True, scale=tuple(crop_scale), hflip=0.5, vflip=0.0,
            auto_augment=cfg.rand_augment or None, color_jitter=None,  # (timm's 0.4 jitter only without RandAugment)
            interpolation=cfg.interpolation, mean=tuple(mean), std=tuple(std),
            re_prob=cfg.random_erasing, re_mode="pixel", re_count=1)

        _allow_zero_bit_posterize(self.transform)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        with seeded_python_and_numpy(int(torch.randint(2**62, ()))):
            return self.transform(to_pil_image(image))


def _posterize(img, bits_to_keep, **kwargs):
    """timm's posterize, with 0 bits kept giving the black image that TF's RandAugment and Pillow < 13 give.

    timm's 'inc1' RandAugment keeps 4 - int(4 m / 10) bits, so 0 at magnitude 10, which DeiT's m9 with std 0.5
    reaches ~2% of the time; Pillow 13's ImageOps.posterize refuses 0 bits ("bits must be between or equal to 1 and
    8"), which would stop a run."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)


def _allow_zero_bit_posterize(transform) -> None:
    for step in getattr(transform, "transforms", []):
        if isinstance(step, RandAugment):
            for op in step.ops:
                if op.aug_fn is posterize:
                    op.aug_fn = _posterize


class BatchMixer:
    """timm's Mixup / CutMix on a collated batch: `image` mixed, `label` turned into (B, K) soft targets, under the
    batch's own seed."""

    def __init__(self, cfg: AugRegConfig, num_classes: int):
        self.mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mix_prob,
                           switch_prob=cfg.switch_prob, mode="batch", label_smoothing=cfg.label_smoothing,
                           num_classes=num_classes)

    def __call__(self, batch: dict, seed: int) -> dict:
        if len(batch["image"]) % 2:
            raise ValueError(f"Mixup / CutMix pair each image with another: the batch size must be even, got "
                             f"{len(batch['image'])} (data.batch_size)")
        with seeded_python_and_numpy(seed):
            images, targets = self.mixup(batch["image"].clone(), batch["label"])
        return {**batch, "image": images, "label": targets}


def mixes(cfg: AugRegConfig) -> bool:
    return cfg.mix_prob > 0 and (cfg.mixup > 0 or cfg.cutmix > 0)
