"""A deterministic, built-in dataset of coloured shapes, so that every command runs offline.

Each image is one shape (the class label) of random size, colour and position on a noisy, shaded background,
with a caption such as "a small red disc in the top left", and its exact per-pixel mask (`mask`: 0 background,
1 + the shape's index on the shape: `SEGMENTATION_CLASSES`). Sample i is a pure function of (seed, i).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from ssl_vit.data.config import DataConfig, DatasetKind
from ssl_vit.schema import checked

SHAPES = ("disc", "ring", "square", "frame", "triangle", "diamond", "cross", "star")
SEGMENTATION_CLASSES = ("background", *SHAPES)
COLOURS = {
    "red": (215, 40, 40), "green": (40, 175, 70), "blue": (45, 85, 225), "yellow": (235, 210, 40),
    "cyan": (40, 200, 215), "magenta": (205, 50, 195), "orange": (240, 140, 30), "white": (240, 240, 240),
}
SIZES = {"small": (0.3, 0.4), "medium": (0.4, 0.55), "large": (0.55, 0.75)}  # shape width / image width
ROWS, COLUMNS = ("top", "middle", "bottom"), ("left", "centre", "right")


def _where(row: int, col: int) -> str:
    if (row, col) == (1, 1):
        return "in the centre"
    if row == 1:
        return f"on the {COLUMNS[col]}"
    if col == 1:
        return f"at the {ROWS[row]}"
    return f"in the {ROWS[row]} {COLUMNS[col]}"


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Inside-test for a shape of half-width 1 centred at the origin (dx, dy in units of half-width)."""
    ax, ay = np.abs(dx), np.abs(dy)
    radius = np.hypot(dx, dy)
    if shape == "disc":
        return radius <= 1
    if shape == "ring":
        return (radius <= 1) & (radius >= 0.55)
    if shape == "square":
        return (ax <= 0.85) & (ay <= 0.85)
    if shape == "frame":
        return (ax <= 0.9) & (ay <= 0.9) & ((ax >= 0.5) | (ay >= 0.5))
    if shape == "triangle":  # pointing up, apex at dy=-1, base at dy=+0.8
        return (dy <= 0.8) & (dy >= -1) & (ax <= (dy + 1) / 1.8)
    if shape == "diamond":
        return ax + ay <= 1
    if shape == "cross":
        return ((ax <= 0.3) & (ay <= 1)) | ((ay <= 0.3) & (ax <= 1))
    if shape == "star":  # five points: the boundary radius alternates between 1 and 0.45 around the circle
        angle = np.mod(np.arctan2(dx, -dy), 2 * np.pi / 5) / (2 * np.pi / 5)
        boundary = 0.45 + 0.55 * np.abs(1 - 2 * angle)
        return radius <= boundary
    raise ValueError(f"unknown shape {shape!r}; valid choices: {list(SHAPES)}")


def render_shape_image(rng: np.random.Generator, img_size: int | tuple[int, int], shape: str
                       ) -> tuple[np.ndarray, str, np.ndarray]:
    """One (H, W, 3) uint8 image with `shape` on it, its caption, and the (H, W) bool mask of the shape's pixels;
    `img_size` a side or (H, W) (the shape sized by the shorter side, placed anywhere)."""
    height, width = (img_size, img_size) if isinstance(img_size, int) else img_size
    size_name = list(SIZES)[rng.integers(len(SIZES))]
    colour_name = list(COLOURS)[rng.integers(len(COLOURS))]
    half = rng.uniform(*SIZES[size_name]) * min(height, width) / 2
    if height == width:
        cx, cy = rng.uniform(half, width - half, size=2)
    else:
        cx, cy = rng.uniform(half, width - half), rng.uniform(half, height - half)
    xs, ys = np.arange(width) + 0.5, np.arange(height) + 0.5

    # Shaded background: a linear gradient between two muted colours in a random direction, plus noise.
    angle = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(angle) * xs[None, :] + np.sin(angle) * ys[:, None]) / max(height, width)
    ramp = (ramp - ramp.min()) / max(np.ptp(ramp), 1e-6)
    low, high = rng.uniform(20, 140, size=(2, 3))
    image = low + ramp[..., None] * (high - low)
    image += rng.normal(0, 8, size=image.shape)

    mask = _shape_mask(shape, (xs[None, :] - cx) / half, (ys[:, None] - cy) / half)
    colour = np.clip(np.array(COLOURS[colour_name]) + rng.normal(0, 12, size=3), 0, 255)
    image[mask] = colour + rng.normal(0, 4, size=(int(mask.sum()), 3))

    row, col = min(int(3 * cy / height), 2), min(int(3 * cx / width), 2)
    caption = f"a {size_name} {colour_name} {shape} {_where(row, col)}"
    return np.clip(image, 0, 255).astype(np.uint8), caption, mask


class SyntheticShapes(Dataset):
    """`num_samples` images of `img_size` px; sample i = {"image": uint8 (3, H, W), "label": int, "text": str,
    "mask": uint8 (H, W) of SEGMENTATION_CLASSES indices}. `aspect_ratios` (width / height): each image takes one at
    random, at the area of img_size squared (the default, square only, draws nothing more: the same images)."""

    classes = SHAPES
    segmentation_classes = SEGMENTATION_CLASSES

    def __init__(self, num_samples: int = 4096, img_size: int = 32, seed: int = 0, aspect_ratios=(1.0,)):
        if num_samples < 1 or img_size < 8:
            raise ValueError(f"need num_samples >= 1 and img_size >= 8, got {num_samples} and {img_size}")
        bad = [r for r in aspect_ratios if not 1 / 16 <= r <= 16]
        if bad or not aspect_ratios:
            raise ValueError(f"data.aspect_ratios={list(aspect_ratios)}: each must be a width / height in [1/16, 16]")
        self.num_samples, self.img_size, self.seed = num_samples, img_size, seed
        self.aspect_ratios = tuple(float(r) for r in aspect_ratios)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def targets(self) -> list[int]:
        """Every sample's label without rendering it (the label is the first draw of the sample's generator)."""
        return [int(np.random.default_rng([self.seed, i]).integers(len(SHAPES))) for i in range(self.num_samples)]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(len(SHAPES)))
        size = self.img_size
        if self.aspect_ratios != (1.0,):
            ratio = self.aspect_ratios[int(rng.integers(len(self.aspect_ratios)))]
            size = (max(8, round(self.img_size / ratio ** 0.5)), max(8, round(self.img_size * ratio ** 0.5)))
        image, caption, mask = render_shape_image(rng, size, SHAPES[label])
        return {"image": torch.from_numpy(image).permute(2, 0, 1).contiguous(), "label": label, "text": caption,
                "mask": torch.from_numpy(mask.astype(np.uint8) * (label + 1))}


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_samples: int = checked(4096, ge=1)
    seed: int = 0
    # width / height of each image, one drawn per image at img_size squared pixels (e.g. [0.5, 1, 2]: tall, square
    # and wide images, for data.resolution=naflex); [1.0]: square
    aspect_ratios: list[float] = checked(factory=lambda: [1.0], gt=0)


def _synthetic_splits(cfg, img_size: int) -> tuple[SyntheticShapes, SyntheticShapes]:
    """The training set, and a quarter as many held-out shapes rendered with the next seed."""
    ratios = tuple(cfg.get("aspect_ratios", (1.0,)))
    return (SyntheticShapes(cfg.num_samples, img_size, cfg.seed, ratios),
            SyntheticShapes(max(cfg.num_samples // 4, 1), img_size, cfg.seed + 1, ratios))


SYNTHETIC = DatasetKind(
    name="synthetic", config=SyntheticDataConfig,
    build=lambda cfg, img_size: SyntheticShapes(cfg.num_samples, img_size, cfg.seed,
                                                tuple(cfg.get("aspect_ratios", (1.0,)))),
    eval_splits=_synthetic_splits, captioned=True,
    templates=("a {}", "a small {}", "a medium {}", "a large {}", "a {} in the centre"))  # the captions' phrasing
