"""Image-text pairs from a directory: every raster image with a caption file of the same stem (photo.png +
photo.txt), found recursively and sorted by path, as samples {"image": uint8 (3, H, W), "text": str}.

Splits are stable: a pair belongs to `test` when a hash of its relative path falls in the first `test_fraction`,
so adding files never moves an existing pair between splits. Images with transparency are composited on white
(drawings such as Tux Paint's stamps have transparent backgrounds). Captions whose image is not a raster file
(Tux Paint ships 165 SVG-only stamps) and images without a caption are not samples: they are counted
(`unpaired`) and reported once. A caption file that is empty gives a sample without text, which the loaders skip
and count like any bad sample.

`TuxPaintStamps` reads Debian's `tuxpaint-stamps-default` (scripts/get_data.sh): 785 drawings, each with a .txt whose
first line is the English caption (the following `xx.utf8=` lines are translations).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING
from torch.utils.data import Dataset

from ssl_vit.data.config import DataConfig, DatasetKind
from ssl_vit.data.decode import DEFAULT_MAX_PIXELS, decode_rgb
from ssl_vit.schema import checked

log = logging.getLogger(__name__)
RASTER_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".ppm", ".tif", ".tiff")
SPLITS = ("train", "test", "all")
TUXPAINT_DIR = "/usr/share/tuxpaint/stamps"


def in_test_split(relative_path: str, test_fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def first_line(text: str) -> str:
    """The first non-empty line (Tux Paint: the English caption before the `xx.utf8=` translations)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


class CaptionFolder(Dataset):
    """root/**/name.{png,jpg,...} + root/**/name.txt -> {"image", "text", "meta"}; see the module docstring."""

    classes: tuple = ()  # captions, no class labels

    def __init__(self, root: str | Path, split: str = "all", test_fraction: float = 0.1, background: int = 255,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid choices: {list(SPLITS)}")
        if not 0 <= test_fraction < 1:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise FileNotFoundError(f"caption folder {str(self.root)!r} does not exist (data.root)")
        self.split, self.background, self.max_pixels = split, background, max_pixels
        images = {p.with_suffix(""): p for p in sorted(self.root.rglob("*"))
                  if p.suffix.lower() in RASTER_SUFFIXES and p.is_file()}
        captions = {p.with_suffix("") for p in self.root.rglob("*.txt")}
        paired = sorted(stem for stem in images if stem in captions)
        self.unpaired = {"captions without a raster image": len(captions - set(images)),
                         "images without a caption": len(set(images) - captions)}
        self.pairs = [(images[stem], stem.with_suffix(".txt")) for stem in paired
                      if split == "all" or in_test_split(str(stem.relative_to(self.root)), test_fraction)
                      == (split == "test")]
        if not self.pairs:
            raise FileNotFoundError(f"no image + .txt caption pairs in the {split} split of {str(self.root)!r} "
                                    f"({self.unpaired})")
        left_out = {k: v for k, v in self.unpaired.items() if v}
        if left_out:
            log.info("%s in the %s split; left out: %s", self.describe(), split,
                     ", ".join(f"{v} {k}" for k, v in left_out.items()))

    def __len__(self) -> int:
        return len(self.pairs)

    def read_caption(self, path: Path) -> str:
        return path.read_text(errors="replace").strip()

    def caption(self, index: int) -> str:
        return self.read_caption(self.pairs[index][1])

    def __getitem__(self, index: int) -> dict:
        image_path, caption_path = self.pairs[index]
        sample = {"image": decode_rgb(image_path, background=self.background, max_pixels=self.max_pixels),
                  "meta": {"path": str(image_path.relative_to(self.root))}}
        text = self.read_caption(caption_path)
        if text:
            sample["text"] = text
        return sample

    def describe(self) -> str:
        return f"caption folder {str(self.root)!r} ({len(self.pairs)} image + caption pairs)"


class TuxPaintStamps(CaptionFolder):
    def __init__(self, root: str | Path = TUXPAINT_DIR, split: str = "all", test_fraction: float = 0.1,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS):
        if not Path(root).is_dir():
            raise FileNotFoundError(f"Tux Paint stamps not found at {str(root)!r}: install them with "
                                    "`bash scripts/get_data.sh` (Debian package tuxpaint-stamps-default)")
        super().__init__(root, split, test_fraction, max_pixels=max_pixels)

    def read_caption(self, path: Path) -> str:
        return first_line(path.read_text(errors="replace"))

    def describe(self) -> str:
        return f"Tux Paint stamps {str(self.root)!r} ({len(self.pairs)} image + caption pairs)"


@dataclass
class CaptionDataConfig(DataConfig):
    """Images with same-named .txt captions, split by a stable hash of the path."""

    name: str = "captions"
    root: str = checked(MISSING, example="data.root=/path/to/pairs (images with same-named .txt captions)")
    split: str = checked("train", choices=SPLITS)
    test_fraction: float = checked(0.1, ge=0, lt=1)


@dataclass
class TuxPaintDataConfig(CaptionDataConfig):
    name: str = "tuxpaint"
    root: str = TUXPAINT_DIR


def _caption_kind(name: str, config: type, folder: type) -> DatasetKind:
    return DatasetKind(
        name=name, config=config,
        build=lambda cfg, img_size: folder(cfg.root, cfg.split, cfg.test_fraction, max_pixels=cfg.max_pixels),
        eval_splits=lambda cfg, img_size: (folder(cfg.root, "train", cfg.test_fraction, max_pixels=cfg.max_pixels),
                                           folder(cfg.root, "test", cfg.test_fraction, max_pixels=cfg.max_pixels)),
        captioned=True, cpu_workers=2)


CAPTIONS = _caption_kind("captions", CaptionDataConfig, CaptionFolder)
TUXPAINT = _caption_kind("tuxpaint", TuxPaintDataConfig, TuxPaintStamps)
