"""A folder of images: in class subfolders (root/<class>/<image>, listed with torchvision's ImageFolder) where the
objective reads labels, in any layout (every image under root, recursively) where it does not. Decoded by
`ssl_vit.data.decode.decode_rgb` (8-bit RGB from any format ImageFolder lists, 16-bit scaled by its range)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from ssl_vit.data.config import AUGMENTS, DataConfig, DatasetKind
from ssl_vit.data.decode import decode_rgb
from ssl_vit.schema import ConfigError, checked


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

    def __init__(self, root: str | Path, labels: bool = True):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {str(root)!r} does not exist (data.root)")
        self.root, self.labels = root, labels
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

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        path, label = self.samples[index]
        image = decode_rgb(path)
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


def _folder_splits(cfg, img_size: int) -> tuple[FolderDataset, FolderDataset]:
    if not cfg.test_root:
        raise ConfigError("data=folder evaluation needs data.test_root (held-out images, same layout)")
    return FolderDataset(cfg.root), FolderDataset(cfg.test_root)


FOLDER = DatasetKind(name="folder", config=FolderDataConfig,
                     build=lambda cfg, img_size: FolderDataset(cfg.root, labels=cfg.labels is not False),
                     eval_splits=_folder_splits, cpu_workers=2)
