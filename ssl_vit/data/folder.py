"""Images in class subfolders (root/<class>/<image>), listed with torchvision's ImageFolder, decoded by
`ssl_vit.data.decode.decode_rgb` (8-bit RGB from any format ImageFolder lists, 16-bit scaled by its range)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from ssl_vit.data.config import DataConfig, DatasetKind
from ssl_vit.data.decode import decode_rgb
from ssl_vit.schema import ConfigError, checked


class FolderDataset(Dataset):
    """root/<class>/<image> -> {"image": uint8 (3, H, W), "label": int}; classes sorted by folder name.

    An unreadable file (corrupt, empty, vanished) raises BadSampleError naming it; the loaders skip and count it
    (`SeededViews` for training, `extract_features` for evaluation)."""

    def __init__(self, root: str | Path):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {str(root)!r} does not exist (data.root)")
        try:
            self.folder = ImageFolder(str(root), loader=str)  # defer decoding to __getitem__
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no images in class subfolders of {str(root)!r}: {err}") from err
        self.root = root
        self.classes = self.folder.classes
        self.targets = list(self.folder.targets)  # every label without decoding (stratified subsets)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> dict:
        path, label = self.folder.samples[index]
        return {"image": decode_rgb(path), "label": label}

    def describe(self) -> str:
        return f"image folder {str(self.root)!r}"


@dataclass
class FolderDataConfig(DataConfig):
    name: str = "folder"
    root: str = checked(MISSING, example="data.root=/path/to/images (class subfolders of images)")
    test_root: str | None = None  # held-out images in the same layout, for evaluation
    augment: str = "crop_flip"


def _folder_splits(cfg, img_size: int) -> tuple[FolderDataset, FolderDataset]:
    if not cfg.test_root:
        raise ConfigError("data=folder evaluation needs data.test_root (held-out images, same layout)")
    return FolderDataset(cfg.root), FolderDataset(cfg.test_root)


FOLDER = DatasetKind(name="folder", config=FolderDataConfig, build=lambda cfg, img_size: FolderDataset(cfg.root),
                     eval_splits=_folder_splits, cpu_workers=2)
