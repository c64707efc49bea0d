"""DINO's per-crop photometric augmentation applied to a whole batch of crops at once on the training device, from
parameters the loader's workers drew per crop (`CropPhotometry.draw`, ssl_vit.data.multicrop), with kornia's
batched operations: every sample has its own flip, jitter factors and order, greyscale, blur sigma and solarize.

Nothing here draws random numbers or reads a value back to the host, so the stream stays a pure function of
(seed, step, rank) and the step does not wait on the device. The result follows torchvision's definitions on float
images (what the workers apply to uint8 crops, rounding after each step): brightness and saturation blend with black
and the greyscale image, contrast with the mean grey, hue turns in HSV, all clamped to [0, 1].
"""

from __future__ import annotations

import math

import torch
from kornia.color import rgb_to_grayscale
from kornia.enhance import (
    adjust_brightness_accumulative,
    adjust_contrast_with_mean_subtraction,
    adjust_hue,
    adjust_saturation_with_gray_subtraction,
)
from kornia.filters import gaussian_blur2d

from ssl_vit.data.multicrop import PARAMETERS, SOLARIZE_THRESHOLD, CropPhotometry, MultiCropViews

GREY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale (ITU-R 601-2 luma, as PIL)
BLENDS = (adjust_brightness_accumulative, adjust_contrast_with_mean_subtraction,
          adjust_saturation_with_gray_subtraction)  # colour jitter's adjustments 0, 1, 2 (3 is hue)


def apply_parameters(crops: torch.Tensor, parameters: torch.Tensor, photometry: CropPhotometry) -> torch.Tensor:
    """uint8 (B, 3, h, w) crops of one crop position and their (B, len(PARAMETERS)) parameters -> float crops in
    [0, 1]: flip, colour jitter (in each sample's order), greyscale, blur, solarize."""
    x = crops.float().div_(255)
    p = parameters.to(x.device, x.dtype)
    column = {name: p[:, i] for i, name in enumerate(PARAMETERS)}

    def where(flag, changed, unchanged):
        return torch.where(flag.bool().view(-1, 1, 1, 1), changed, unchanged)

    x = where(column["flip"], x.flip(-1), x)
    jitter = column["jitter"].bool()
    factors = (column["brightness"], column["contrast"], column["saturation"])
    for position in range(4):
        adjustment = column[f"order_{position}"]
        for index, blend in enumerate(BLENDS):  # a factor of 1 leaves an image exactly as it is
            x = blend(x, torch.where(jitter & (adjustment == index), factors[index], 1.0))
        x = where(jitter & (adjustment == 3), adjust_hue(x, column["hue"] * 2 * math.pi), x)
    grey = rgb_to_grayscale(x, rgb_weights=torch.tensor(GREY_WEIGHTS, device=x.device, dtype=x.dtype))
    x = where(column["grey"], grey.expand_as(x), x)
    if photometry.blur_p > 0:
        kernel = photometry.blur_kernel
        x = where(column["blur"], gaussian_blur2d(x, (kernel, kernel), column["sigma"][:, None].expand(-1, 2)), x)
    if photometry.solarize_p > 0:
        x = where(column["solarize"], torch.where(x >= SOLARIZE_THRESHOLD / 255, 1 - x, x), x)
    return x


def finish_crops(multicrop: MultiCropViews, crops: list[torch.Tensor], parameters: list[torch.Tensor]
                 ) -> list[torch.Tensor]:
    """On the training device: a batch's uint8 crops and their drawn parameters -> normalised float crops."""
    mean, std = multicrop.mean.to(crops[0].device), multicrop.std.to(crops[0].device)
    return [(apply_parameters(crop, params, photometry) - mean) / std
            for crop, params, photometry in zip(crops, parameters, multicrop.photometry, strict=True)]
