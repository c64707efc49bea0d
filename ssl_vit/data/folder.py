"""A folder of images: in class subfolders (root/<class>/<image>, listed with torchvision's ImageFolder) where the
objective reads labels, in any layout (every image under root, recursively) where it does not. Decoded by
`ssl_vit.data.decode.decode_rgb` (8-bit RGB from any format ImageFolder lists, 16-bit scaled by its range).

Symbolic links are followed, as ImageFolder does (a folder of links into a shared store is a common layout); images
that resolve outside data.root are named once at start-up, and `data.follow_symlinks=false` leaves them out."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from ssl_vit.data.config import AUGMENTS, DataConfig, DatasetKind
from ssl_vit.data.decode import DEFAULT_MAX_PIXELS, decode_rgb
from ssl_vit.schema import ConfigError, checked

log = logging.getLogger("ssl_vit")


def outside_root(root: Path, paths: list[str]) -> set[str]:
    """The paths (found under `root` by a walk that follows links) whose file resolves outside it: one realpath per
    folder, and one per file that is itself a link."""
    real_root = os.path.realpath(root)
    folders: dict[str, bool] = {}
    found = set()
    for path in paths:
        folder = os.path.dirname(path)
        if folder not in folders:
            folders[folder] = os.path.commonpath([real_root, os.path.realpath(folder)]) != real_root
        if folders[folder] or (os.path.islink(path) and
                               os.path.commonpath([real_root, os.path.realpath(path)]) != real_root):
            found.add(path)
    return found


def list_images(root: Path) -> list[str]:
    """Every image file under root, in any nesting (hidden files and folders skipped), sorted."""
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        found += [os.path.join(folder, f) for f in files if f.lower().endswith(IMG_EXTENSIONS) and f[0] != "."]
    return sorted(found)


class FolderDataset(Dataset):
    """labels=True: root/<class>/<image> -> {"image": uint8 (3, H, W), "label": int}, classes sorted by folder
    name; labels=False: every image under root, in any layout -> {"image": ...}, no classes.

    An unreadable file (corrupt, empty, vanished) raises BadSampleError naming it; the loaders skip and count it
    (`SeededViews` for training, `extract_features` for evaluation)."""

    def __init__(self, root: str | Path, labels: bool = True, max_pixels: int | None = DEFAULT_MAX_PIXELS,
                 follow_symlinks: bool = True):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {str(root)!r} does not exist (data.root)")
        self.root, self.labels, self.max_pixels = root, labels, max_pixels
        if labels:
            try:
                folder = ImageFolder(str(root), loader=str)  # defer decoding to __getitem__
            except FileNotFoundError as err:
                raise FileNotFoundError(f"no images in class subfolders of {str(root)!r} ({err}); labelled "
                                        "objectives need root/<class>/<image>") from err
            self.samples, self.classes, self.targets = folder.samples, folder.classes, list(folder.targets)
        else:
            paths = list_images(root)
            if not paths:
                raise FileNotFoundError(f"no images under {str(root)!r} (searched recursively for "
                                        f"{', '.join(IMG_EXTENSIONS)})")
            self.samples, self.classes, self.targets = [(path, None) for path in paths], [], None
        self._links_outside(follow_symlinks)

    def _links_outside(self, follow: bool) -> None:
        outside = outside_root(self.root, [path for path, _ in self.samples])
        if not outside:
            return
        example = sorted(outside)[0]
        if follow:
            log.warning("data.root=%s: %d image(s) are symbolic links to files outside it (e.g. %s -> %s); they are "
                        "read (data.follow_symlinks=false leaves them out)", self.root, len(outside), example,
                        os.path.realpath(example))
            return
        kept = [i for i, (path, _) in enumerate(self.samples) if path not in outside]
        if not kept:
            raise FileNotFoundError(f"every image under {str(self.root)!r} links outside it (e.g. {example}) and "
                                    "data.follow_symlinks=false leaves them out")
        self.samples = [self.samples[i] for i in kept]
        self.targets = None if self.targets is None else [self.targets[i] for i in kept]
        log.info("data.follow_symlinks=false: left out %d image(s) that link outside %s (e.g. %s)", len(outside),
                 self.root, example)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        path, label = self.samples[index]
        image = decode_rgb(path, max_pixels=self.max_pixels)
        return {"image": image} if label is None else {"image": image, "label": label}

    def describe(self) -> str:
        layout = f"{len(self.classes)} class subfolders" if self.labels else "unlabelled, any layout"
        return f"image folder {str(self.root)!r} ({len(self)} images, {layout})"


@dataclass
class FolderDataConfig(DataConfig):
    name: str = "folder"
    root: str = checked(MISSING, example="data.root=/path/to/images (any layout; class subfolders for labels)")
    # None: class subfolders as labels where the objective reads labels, else every image under root, any layout
    test_root: str | None = None  # held-out images in the same layout, for evaluation
    augment: str = checked("crop_flip", choices=AUGMENTS)
    labels: bool | None = None
    # images that are symbolic links resolving outside data.root: read (named once at start-up), or left out
    follow_symlinks: bool = True


def _folder_splits(cfg, img_size: int) -> tuple[FolderDataset, FolderDataset]:
    if not cfg.test_root:
        raise ConfigError("data=folder evaluation needs data.test_root (held-out images, same layout)")
    return (FolderDataset(cfg.root, max_pixels=cfg.max_pixels, follow_symlinks=cfg.follow_symlinks),
            FolderDataset(cfg.test_root, max_pixels=cfg.max_pixels, follow_symlinks=cfg.follow_symlinks))


FOLDER = DatasetKind(name="folder", config=FolderDataConfig,
                     build=lambda cfg, img_size: FolderDataset(cfg.root, labels=cfg.labels is not False,
                                                               max_pixels=cfg.max_pixels,
                                                               follow_symlinks=cfg.follow_symlinks),
                     eval_splits=_folder_splits, cpu_workers=2)
