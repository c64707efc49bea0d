"""DINO's multi-crop views (Caron et al. 2021, section 3.1 and its released augmentation): a few global crops that
cover much of the image and many small local ones, each with its own photometric augmentation. The student sees all
crops, the teacher only the global ones (global crops come first).

Per crop, in DINO's order: random resized crop (bicubic), horizontal flip (p 0.5), colour jitter (brightness 0.4,
contrast 0.4, saturation 0.2, hue 0.1; p 0.8), greyscale (p 0.2), Gaussian blur with sigma in [0.1, 2] (p 1.0 on
the first global crop, 0.1 on the others, 0.5 on local crops), solarize at half range (p 0.2, global crops after
the first); then scaled to [0, 1] and normalised.

Where the photometric part runs (`photometric_on`): "workers" applies all of it per crop with torchvision in the
loader's workers and ships normalised float crops; "device" cuts only the crops there (uint8, a quarter of the bytes
through shared memory), draws each crop's photometric parameters under the sample's seed, and leaves the rest to
the training device, batched (ssl_vit.data.photometric), with the same probabilities and ranges; "collate" draws
as "device" does and applies the same batched operations in the workers' collate, on the whole batch at once (one
call per crop position instead of one torchvision pipeline per crop: 2.5x less worker time per image at 32 px on
a CPU, 0.81x at 224 px: measured).

DINOv3's Gram teacher (`gram_size`) sees each global crop's box again at another resolution and without photometric
distortion, as its `DataAugmentationDINO` makes them: the box is cut once at the larger of the two sizes and flipped
(shared), then resized to the global size (and distorted) for the student and to `gram_size` for the Gram teacher.
These crops come last, after the local ones (`n_gram` of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from ssl_vit.data.config import PHOTOMETRIC_ON

FLIP_P, JITTER_P, GREY_P = 0.5, 0.8, 0.2
JITTER = dict(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)  # torchvision ColorJitter's ranges
SIGMA = (0.1, 2.0)
SOLARIZE_THRESHOLD = 128  # of 255: DINO's half range
# One crop's drawn photometric parameters, in this order (flags are 0 / 1; order_* is colour jitter's random order
# of its four adjustments, 0 brightness, 1 contrast, 2 saturation, 3 hue, as torchvision's ColorJitter numbers them).
PARAMETERS = ("flip", "jitter", "order_0", "order_1", "order_2", "order_3", "brightness", "contrast", "saturation",
              "hue", "grey", "blur", "sigma", "solarize")


def local_crop_size(img_size: int, patch_size: int) -> int:
    """DINO's 96 px local crops for 224 px images, scaled to `img_size` and rounded to whole patches."""
    return max(patch_size, round(img_size * 96 / 224 / patch_size) * patch_size)


@dataclass(frozen=True)
class CropPhotometry:
    """The photometric augmentation of one crop position: its size (the blur kernel is about a tenth of it) and
    its probabilities (flip, jitter and greyscale are DINO's for every crop unless set: 0 for a clean crop)."""

    size: int
    blur_p: float
    solarize_p: float
    flip_p: float = FLIP_P
    jitter_p: float = JITTER_P
    grey_p: float = GREY_P

    @property
    def blur_kernel(self) -> int:
        return max(3, int(0.1 * self.size) // 2 * 2 + 1)  # odd, about a tenth of the crop (23 px at 224)

    def transforms(self) -> list[v2.Transform]:
        """The torchvision transforms that apply it per crop (in the workers)."""
        return [
            v2.RandomHorizontalFlip(p=self.flip_p),
            v2.RandomApply([v2.ColorJitter(**JITTER)], p=self.jitter_p),
            v2.RandomGrayscale(p=self.grey_p),
            v2.RandomApply([v2.GaussianBlur(self.blur_kernel, sigma=SIGMA)], p=self.blur_p),
            v2.RandomSolarize(threshold=SOLARIZE_THRESHOLD, p=self.solarize_p),
        ]

    def draw(self) -> torch.Tensor:
        """The parameters (PARAMETERS) of one crop's augmentation, from torch's generator (in the loader: the
        sample's seed), with the probabilities and ranges of `transforms`."""
        coins = torch.rand(5)
        b, c, s, h = (JITTER[k] for k in ("brightness", "contrast", "saturation", "hue"))
        low = torch.tensor([max(0.0, 1 - b), max(0.0, 1 - c), max(0.0, 1 - s), -h, SIGMA[0]])
        high = torch.tensor([1 + b, 1 + c, 1 + s, h, SIGMA[1]])
        values = low + (high - low) * torch.rand(5)
        flags = coins < torch.tensor([self.flip_p, self.jitter_p, self.grey_p, self.blur_p, self.solarize_p])
        return torch.cat([flags[:2].float(), torch.randperm(4).float(), values[:4], flags[2:4].float(),
                          values[4:], flags[4:].float()])


class MultiCropViews:
    """uint8 (3, H, W) image -> list of `n_global + n_local (+ n_gram)` normalised float crops (global ones first,
    the Gram teacher's last); with photometric_on "device" or "collate", (uint8 crops, their photometric parameters) for
    ssl_vit.data.photometric. `flip`: horizontal flips (p 0.5; DINOv3 turns them off)."""

    def __init__(self, global_size: int, local_size: int, mean, std, n_global: int = 2, n_local: int = 6,
                 global_scale=(0.4, 1.0), local_scale=(0.05, 0.4), interpolation: str = "bicubic",
                 photometric_on: str = "workers", flip: bool = True, gram_size: int | None = None):
        if n_global < 1 or n_local < 0:
            raise ValueError(f"n_global={n_global} and n_local={n_local} are invalid: need >= 1 global crop and "
                             ">= 0 local crops")
        if photometric_on not in PHOTOMETRIC_ON:
            raise ValueError(f"photometric_on={photometric_on!r} is not one of {list(PHOTOMETRIC_ON)}")
        if gram_size is not None and gram_size < 1:
            raise ValueError(f"gram_size={gram_size} is invalid: a crop size in pixels (>= 1), or None")
        self.n_global, self.n_gram = n_global, n_global if gram_size else 0
        self.placement = photometric_on
        self.sizes = [global_size] * n_global + [local_size] * n_local + [gram_size] * self.n_gram
        flip_p = FLIP_P if flip else 0.0
        # with Gram crops the flip is part of the shared box (both see it), not of the student's photometry
        global_flip_p = 0.0 if self.n_gram else flip_p
        self.photometry = ([CropPhotometry(global_size, 1.0, 0.0, global_flip_p)]
                           + [CropPhotometry(global_size, 0.1, 0.2, global_flip_p) for _ in range(n_global - 1)]
                           + [CropPhotometry(local_size, 0.5, 0.0, flip_p) for _ in range(n_local)]
                           + [CropPhotometry(gram_size, 0.0, 0.0, 0.0, 0.0, 0.0) for _ in range(self.n_gram)])
        mode = v2.InterpolationMode(interpolation)

        def distort(photometry: CropPhotometry) -> list[v2.Transform]:  # on the device: later, batched
            return [] if self.batched else photometry.transforms()

        if self.n_gram:
            box = max(global_size, gram_size)
            self.box = v2.Compose([v2.RandomResizedCrop(box, scale=tuple(global_scale), interpolation=mode,
                                                        antialias=True), v2.RandomHorizontalFlip(p=flip_p)])
            self.gram_resize = v2.Resize(gram_size, interpolation=mode, antialias=True)
            global_transforms = [v2.Compose([v2.Resize(global_size, interpolation=mode, antialias=True),
                                             *distort(photometry)])
                                 for photometry in self.photometry[:n_global]]
        else:
            global_transforms = [v2.Compose([v2.RandomResizedCrop(global_size, scale=tuple(global_scale),
                                                                  interpolation=mode, antialias=True),
                                             *distort(photometry)])
                                 for photometry in self.photometry[:n_global]]
        local_transforms = [v2.Compose([v2.RandomResizedCrop(local_size, scale=tuple(local_scale),
                                                             interpolation=mode, antialias=True),
                                        *distort(photometry)])
                            for photometry in self.photometry[n_global:n_global + n_local]]
        self.transforms = global_transforms + local_transforms
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    @property
    def on_device(self) -> bool:
        return self.placement == "device"

    @property
    def batched(self) -> bool:
        """Parameters drawn per crop, applied per batch (in the collate or on the device)."""
        return self.placement in ("device", "collate")

    def _uint8_crops(self, image: torch.Tensor) -> list[torch.Tensor]:
        """The crops before normalisation (distorted, unless the photometric part runs on the device)."""
        if not self.n_gram:
            return [t(image) for t in self.transforms]
        boxes = [self.box(image) for _ in range(self.n_global)]
        global_crops = [t(box) for t, box in zip(self.transforms[:self.n_global], boxes, strict=True)]
        local_crops = [t(image) for t in self.transforms[self.n_global:]]
        return global_crops + local_crops + [self.gram_resize(box) for box in boxes]

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        if image.dtype != torch.uint8:
            raise TypeError(f"multi-crop expects a uint8 (3, H, W) image, got {image.dtype}")
        if self.batched:
            return self._uint8_crops(image), [photometry.draw() for photometry in self.photometry]
        return [(crop.float().div_(255) - self.mean) / self.std for crop in self._uint8_crops(image)]
