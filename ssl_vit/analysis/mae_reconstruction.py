"""MAE reconstructions as an image grid: one column per image; rows original / masked input / reconstruction.

The reconstruction row shows the decoder's prediction for the hidden patches with the visible patches pasted back,
as in the MAE paper's figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ssl_vit.objectives.mae import MAE
from ssl_vit.objectives.patches import patchify, unpatchify

MASK_GREY = 0.5


def _to_unit(images: torch.Tensor, mean, std) -> torch.Tensor:
    mean = torch.tensor(mean, dtype=images.dtype).view(1, -1, 1, 1)
    std = torch.tensor(std, dtype=images.dtype).view(1, -1, 1, 1)
    return (images * std + mean).clamp(0, 1)


def reconstruction_rows(objective: MAE, images: torch.Tensor, mean, std) -> dict[str, torch.Tensor]:
    """(B, 3, H, W) normalised images -> {"original", "masked", "reconstruction"} in [0, 1]."""
    objective.eval()
    reconstruction, mask = objective.reconstruct(images)
    grid = objective.backbone.patch_embed.grid_for(images.shape[-2], images.shape[-1])
    hidden = mask.bool()[..., None, None, None]  # (B, N, 1, 1, 1) over (P, P, C)
    original = _to_unit(images, mean, std)
    patches = patchify(original, objective.patch_size)
    masked = unpatchify(torch.where(hidden, torch.full_like(patches, MASK_GREY), patches), grid)
    predicted = patchify(_to_unit(reconstruction, mean, std), objective.patch_size)
    pasted = unpatchify(torch.where(hidden, predicted, patches), grid)
    return {"original": original, "masked": masked, "reconstruction": pasted}


def grid_image(rows: dict[str, torch.Tensor], pad: int = 2, scale: int = 1) -> np.ndarray:
    """Lay the rows out as one (H, W, 3) uint8 image with `pad` white pixels between cells."""
    stacked = torch.stack(list(rows.values()))  # (R, B, C, H, W)
    R, B, C, H, W = stacked.shape
    canvas = torch.ones(C, R * (H + pad) + pad, B * (W + pad) + pad)
    for r in range(R):
        for b in range(B):
            top, left = pad + r * (H + pad), pad + b * (W + pad)
            canvas[:, top:top + H, left:left + W] = stacked[r, b]
    image = (canvas.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    return np.kron(image, np.ones((scale, scale, 1), dtype=np.uint8)) if scale > 1 else image


def save_reconstruction_png(objective: MAE, images: torch.Tensor, mean, std, path: str | Path,
                            scale: int = 1) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid_image(reconstruction_rows(objective, images, mean, std), scale=scale)).save(path)
    return path
