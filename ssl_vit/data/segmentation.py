"""Datasets with per-pixel masks, for dense evaluation (eval=segmentation). Each sample has `mask`: a uint8 (H, W)
map of class indices (`segmentation_classes`, background 0; `IGNORE_INDEX` marks pixels left out of the scores).

- `data=synthetic` (ssl_vit.data.synthetic): the shapes' exact masks, a class per shape kind.
- `data=tuxpaint_seg`: Tux Paint's stamps (Debian tuxpaint-stamps-default, scripts/get_data.sh) pasted onto
  textured backgrounds at a random size and place; the stamp's alpha channel at `ALPHA_THRESHOLD` or above is its
  mask, its class the stamp's category (its top-level directory: animals, food, ...). Stamps are split into train
  and test by a stable hash of their path, so the test set pastes stamps never seen in training.
- `data=segfolder data.root=DIR`: any folder of image + mask pairs, DIR/images/<name>.<png|jpg|...> with
  DIR/masks/<name>.png (single channel, or palette: the class index per pixel, 255 ignored); class names from
  DIR/classes.txt (one per line, index 0 first) or data.classes. The test split is data.test_root (the same
  layout) or, without it, a stable hash of the name (data.test_fraction).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import MISSING
from PIL import Image
from torch.utils.data import Dataset

from ssl_vit.data.captions import RASTER_SUFFIXES, in_test_split
from ssl_vit.data.config import DataConfig, DatasetKind
from ssl_vit.data.decode import DEFAULT_MAX_PIXELS, check_size, decode_rgb, open_image
from ssl_vit.data.errors import BadSampleError
from ssl_vit.schema import checked

IGNORE_INDEX = 255
ALPHA_THRESHOLD = 128  # of 255: a stamp pixel at least half opaque is the stamp's
TUXPAINT_DIR = "/usr/share/tuxpaint/stamps"
STAMP_SCALE = (0.45, 0.9)  # the stamp's longer side / the image side


@functools.lru_cache(maxsize=1024)
def _stamp(path: str, max_side: int) -> Image.Image:
    """A stamp as RGBA, shrunk (if larger) to at most `max_side` px on its longer side: each worker decodes each
    stamp once."""
    with open(path, "rb") as file:
        image = open_image(file.read()).convert("RGBA")
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.BILINEAR)
    return image


def textured_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size, size, 3) float: a two-colour gradient in a random direction, stripes of a random period and angle,
    and pixel noise."""
    coords = np.arange(size) + 0.5
    angle, stripe_angle = rng.uniform(0, 2 * np.pi, size=2)
    ramp = (np.cos(angle) * coords[None, :] + np.sin(angle) * coords[:, None]) / size
    ramp = (ramp - ramp.min()) / max(np.ptp(ramp), 1e-6)
    low, high = rng.uniform(30, 220, size=(2, 3))
    period = rng.uniform(0.1, 0.4) * size
    stripes = np.sin(2 * np.pi * (np.cos(stripe_angle) * coords[None, :] + np.sin(stripe_angle) * coords[:, None])
                     / period)
    image = low + ramp[..., None] * (high - low) + rng.uniform(10, 40) * stripes[..., None]
    return image + rng.normal(0, 8, size=image.shape)


class TuxPaintComposites(Dataset):
    """`num_samples` images of `img_size` px, each one stamp of the split pasted on a textured background; sample
    i = {"image": uint8 (3, H, W), "label": the stamp's category, "mask": uint8 (H, W), "meta": {"path", "box":
    (top, left, height, width) of the pasted stamp}}, a pure function of (seed, i)."""

    def __init__(self, root: str | Path = TUXPAINT_DIR, img_size: int = 32, num_samples: int = 2048,
                 split: str = "train", test_fraction: float = 0.2, seed: int = 0):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise FileNotFoundError(f"Tux Paint stamps not found at {str(self.root)!r}: install them with "
                                    "`bash scripts/get_data.sh` (Debian package tuxpaint-stamps-default)")
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; valid choices: ['train', 'test']")
        every = sorted(p for p in self.root.rglob("*.png") if p.is_file())
        self.classes = tuple(sorted({p.relative_to(self.root).parts[0] for p in every}))
        self.segmentation_classes = ("background", *self.classes)
        self.stamps = [p for p in every
                       if in_test_split(str(p.relative_to(self.root)), test_fraction) == (split == "test")]
        if not self.stamps:
            raise FileNotFoundError(f"no PNG stamps in the {split} split of {str(self.root)!r}")
        self.img_size, self.num_samples, self.seed = img_size, num_samples, seed
        self.stamp_labels = [self.classes.index(p.relative_to(self.root).parts[0]) for p in self.stamps]

    def __len__(self) -> int:
        return self.num_samples

    @property
    def targets(self) -> list[int]:
        return [self.stamp_labels[self._stamp_index(np.random.default_rng([self.seed, i]))]
                for i in range(self.num_samples)]

    def _stamp_index(self, rng: np.random.Generator) -> int:
        return int(rng.integers(len(self.stamps)))

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, index])
        which = self._stamp_index(rng)
        stamp = _stamp(str(self.stamps[which]), max(4 * self.img_size, 128))
        side = rng.uniform(*STAMP_SCALE) * self.img_size
        scale = side / max(stamp.size)
        width, height = max(1, round(stamp.size[0] * scale)), max(1, round(stamp.size[1] * scale))
        top, left = int(rng.integers(0, self.img_size - height + 1)), int(rng.integers(0, self.img_size - width + 1))
        pasted = np.asarray(stamp.resize((width, height), Image.BILINEAR), dtype=np.float64)
        image = textured_background(rng, self.img_size)
        alpha = pasted[..., 3:] / 255
        window = image[top:top + height, left:left + width]
        image[top:top + height, left:left + width] = alpha * pasted[..., :3] + (1 - alpha) * window
        mask = np.zeros((self.img_size, self.img_size), dtype=np.uint8)
        mask[top:top + height, left:left + width] = (pasted[..., 3] >= ALPHA_THRESHOLD) * (self.stamp_labels[which] + 1)
        return {"image": torch.from_numpy(np.clip(image, 0, 255).astype(np.uint8)).permute(2, 0, 1).contiguous(),
                "label": self.stamp_labels[which], "mask": torch.from_numpy(mask),
                "meta": {"path": str(self.stamps[which].relative_to(self.root)), "box": (top, left, height, width)}}


class SegmentationFolder(Dataset):
    """DIR/images/<name>.<ext> + DIR/masks/<name>.png pairs (see the module docstring); `split` "all", or "train" /
    "test" by a stable hash of the name."""

    classes: tuple = ()  # no image-level labels

    def __init__(self, root: str | Path, classes=None, split: str = "all", test_fraction: float = 0.2,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS):
        self.root, self.max_pixels = Path(root).expanduser(), max_pixels
        images_dir, masks_dir = self.root / "images", self.root / "masks"
        if not images_dir.is_dir() or not masks_dir.is_dir():
            raise FileNotFoundError(f"{str(self.root)!r} needs images/ and masks/ subfolders (images/<name>.png|jpg "
                                    "with masks/<name>.png)")
        masks = {p.stem: p for p in masks_dir.iterdir() if p.suffix.lower() == ".png"}
        images = sorted(p for p in images_dir.iterdir() if p.suffix.lower() in RASTER_SUFFIXES)
        self.unpaired = sum(p.stem not in masks for p in images)
        self.pairs = [(p, masks[p.stem]) for p in images if p.stem in masks
                      and (split == "all" or in_test_split(p.stem, test_fraction) == (split == "test"))]
        if not self.pairs:
            raise FileNotFoundError(f"no image + mask pairs in the {split} split of {str(self.root)!r}")
        names = list(classes or [])
        if not names and (self.root / "classes.txt").is_file():
            names = [line.strip() for line in (self.root / "classes.txt").read_text().splitlines() if line.strip()]
        if not names:
            raise ValueError(f"{str(self.root)!r}: name the classes in classes.txt (one per line, index 0 first) or "
                             "data.classes=[background, ...]")
        self.segmentation_classes = tuple(names)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict:
        image_path, mask_path = self.pairs[index]
        image = decode_rgb(image_path, max_pixels=self.max_pixels)
        try:
            encoded = mask_path.read_bytes()
            check_size(encoded, self.max_pixels, f"{mask_path}: ")
            with open_image(encoded) as file:
                if file.mode not in ("L", "P"):
                    raise BadSampleError(f"{mask_path}: a mask must be single-channel (L) or palette (P), not "
                                         f"{file.mode}")
                mask = np.asarray(file, dtype=np.uint8).copy()
        except (OSError, Image.DecompressionBombError) as err:
            raise BadSampleError(f"{mask_path}: unreadable mask ({err})") from err
        if mask.shape != tuple(image.shape[1:]):
            raise BadSampleError(f"{mask_path}: mask {mask.shape} and image {tuple(image.shape[1:])} differ in size")
        bad = np.unique(mask[(mask >= len(self.segmentation_classes)) & (mask != IGNORE_INDEX)])
        if bad.size:
            raise BadSampleError(f"{mask_path}: class indices {bad[:5].tolist()} beyond the "
                                 f"{len(self.segmentation_classes)} classes (255 is ignored)")
        return {"image": image, "mask": torch.from_numpy(mask), "meta": {"path": str(image_path.name)}}


@dataclass
class TuxPaintSegDataConfig(DataConfig):
    name: str = "tuxpaint_seg"
    root: str = TUXPAINT_DIR
    num_samples: int = checked(2048, ge=1)  # composites of the training stamps (the test set: a quarter as many)
    test_fraction: float = checked(0.2, ge=0, lt=1)  # of the stamps
    seed: int = 0


@dataclass
class SegFolderDataConfig(DataConfig):
    name: str = "segfolder"
    root: str = checked(MISSING, example="data.root=/path/to/pairs (images/<name>.png + masks/<name>.png)")
    test_root: str | None = None  # the test split's folder; None: a hash split of root by test_fraction
    test_fraction: float = checked(0.2, ge=0, lt=1)
    classes: list[str] = field(default_factory=list)  # empty: root/classes.txt


def _tuxpaint_splits(cfg, img_size: int):
    return (TuxPaintComposites(cfg.root, img_size, cfg.num_samples, "train", cfg.test_fraction, cfg.seed),
            TuxPaintComposites(cfg.root, img_size, max(cfg.num_samples // 4, 1), "test", cfg.test_fraction,
                               cfg.seed + 1))


def _segfolder_splits(cfg, img_size: int):
    if cfg.test_root:
        return (SegmentationFolder(cfg.root, cfg.classes or None, max_pixels=cfg.max_pixels),
                SegmentationFolder(cfg.test_root, cfg.classes or None, max_pixels=cfg.max_pixels))
    return (SegmentationFolder(cfg.root, cfg.classes or None, "train", cfg.test_fraction, cfg.max_pixels),
            SegmentationFolder(cfg.root, cfg.classes or None, "test", cfg.test_fraction, cfg.max_pixels))


TUXPAINT_SEG = DatasetKind(
    name="tuxpaint_seg", config=TuxPaintSegDataConfig, eval_splits=_tuxpaint_splits, cpu_workers=2,
    build=lambda cfg, img_size: TuxPaintComposites(cfg.root, img_size, cfg.num_samples, "train", cfg.test_fraction,
                                                   cfg.seed))
SEGFOLDER = DatasetKind(
    name="segfolder", config=SegFolderDataConfig, eval_splits=_segfolder_splits, cpu_workers=2,
    build=lambda cfg, img_size: SegmentationFolder(cfg.root, cfg.classes or None,
                                                   "all" if cfg.test_root else "train", cfg.test_fraction,
                                                   cfg.max_pixels))
