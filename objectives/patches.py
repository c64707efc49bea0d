"""Small pieces shared by the masking and distillation objectives: patchify / unpatchify, per-sample random shuffles,
patch features resized between grids."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssl_vit.naflex import patchify as naflex_patchify


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, P, P, C) patches in raster order (MAE's 'nchpwq->nhwpqc' layout): the NaFlex
    packer's patchify (one layout for both), unflattened."""
    flat, _ = naflex_patchify(images, patch_size)
    return flat.unflatten(-1, (patch_size, patch_size, images.shape[1]))


def unpatchify(patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, N, P, P, C) or (B, N, P*P*C) -> (B, C, H, W); the inverse of `patchify` for a (rows, cols) grid."""
    B, N = patches.shape[:2]
    rows, cols = grid
    if patches.ndim == 3:
        P = int(round((patches.shape[-1] / 3) ** 0.5))
        patches = patches.reshape(B, N, P, P, 3)
    P, C = patches.shape[2], patches.shape[-1]
    images = patches.reshape(B, rows, cols, P, P, C).permute(0, 5, 1, 3, 2, 4)
    return images.reshape(B, C, rows * P, cols * P)


def per_sample_shuffle(batch: int, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random permutation of range(length) per sample (argsort of uniform noise, as MAE) and its inverse."""
    shuffle = torch.rand(batch, length, device=device).argsort(dim=1)
    return shuffle, shuffle.argsort(dim=1)


def refuse_hybrid(backbone, objective: str) -> None:
    """Pixel targets per patch need patch-aligned tokens: a hybrid's tokens are computed by a ResNet that has seen
    every pixel, so masking them after the stem leaks the masked patches' content through its receptive field."""
    if backbone.config.stem != "patch":
        raise ValueError(f"objective={objective} is not defined for model.stem=resnet: it masks tokens after the "
                         f"ResNet stem has seen every pixel, so each masked patch's content leaks into the visible "
                         f"tokens through the ResNet's receptive field; use model.stem=patch, or an objective that "
                         f"takes whole images (supervised, deit, clip, dino / dinov2 without iBOT: "
                         f"objective.ibot_weight=0)")


def resize_patch_features(tokens: torch.Tensor, grid: tuple[int, int], to: tuple[int, int], mode: str
                          ) -> torch.Tensor:
    """(B, h * w, D) patch tokens on `grid` -> (B, H * W, D) on `to`, resampled as an image (align_corners=False,
    no antialiasing: dinov3's global_teacher_resize settings, RADIO's bilinear teacher resizing)."""
    if tuple(grid) == tuple(to):
        return tokens
    maps = tokens.transpose(1, 2).unflatten(-1, tuple(grid))
    return F.interpolate(maps.float(), size=tuple(to), mode=mode, align_corners=None if mode == "nearest" else False,
                         antialias=False).flatten(2).transpose(1, 2).to(tokens.dtype)
