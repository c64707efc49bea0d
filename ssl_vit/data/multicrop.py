"""DINO's multi-crop views (Caron et al. 2021, section 3.1 and its released augmentation): a few global crops that
cover much of the image and many small local ones, each with its own photometric augmentation. The student sees all
crops, the teacher only the global ones (global crops come first).

Per crop, in DINO's order: random resized crop (bicubic), horizontal flip (p 0.5), colour jitter (brightness 0.4,
contrast 0.4, saturation 0.2, hue 0.1; p 0.8), greyscale (p 0.2), Gaussian blur with sigma in [0.1, 2] (p 1.0 on
the first global crop, 0.1 on the others, 0.5 on local crops), solarize at half range (p 0.2, global crops after
the first); then scaled to [0, 1] and normalised.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2


def local_crop_size(img_size: int, patch_size: int) -> int:
    """DINO's 96 px local crops for 224 px images, scaled to `img_size` and rounded to whole patches."""
    return max(patch_size, round(img_size * 96 / 224 / patch_size) * patch_size)


def _blur(size: int, p: float) -> v2.Transform:
    kernel = max(3, int(0.1 * size) // 2 * 2 + 1)  # odd, about a tenth of the crop (23 px at 224)
    return v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=p)


class MultiCropViews:
    """uint8 (3, H, W) image -> list of `n_global + n_local` normalised float crops (global ones first)."""

    def __init__(self, global_size: int, local_size: int, mean, std, n_global: int = 2, n_local: int = 6,
                 global_scale=(0.4, 1.0), local_scale=(0.05, 0.4), interpolation: str = "bicubic"):
        self.sizes = [global_size] * n_global + [local_size] * n_local
        if n_global < 1 or n_local < 0:
            raise ValueError(f"n_global={n_global} and n_local={n_local} are invalid: need >= 1 global crop and "
                             ">= 0 local crops")
        mode = v2.InterpolationMode(interpolation)

        def crop(size, scale, blur_p, solarize_p):
            return v2.Compose([
                v2.RandomResizedCrop(size, scale=tuple(scale), interpolation=mode, antialias=True),
                v2.RandomHorizontalFlip(p=0.5),
                v2.RandomApply([v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)], p=0.8),
                v2.RandomGrayscale(p=0.2),
                _blur(size, blur_p),
                v2.RandomSolarize(threshold=128, p=solarize_p),
            ])

        self.transforms = ([crop(global_size, global_scale, 1.0, 0.0)]
                           + [crop(global_size, global_scale, 0.1, 0.2) for _ in range(n_global - 1)]
                           + [crop(local_size, local_scale, 0.5, 0.0) for _ in range(n_local)])
        self.n_global = n_global
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        if image.dtype != torch.uint8:
            raise TypeError(f"multi-crop expects a uint8 (3, H, W) image, got {image.dtype}")
        return [(t(image).float().div_(255) - self.mean) / self.std for t in self.transforms]
