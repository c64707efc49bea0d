"""Images in class subfolders (root/<class>/<image>), read with torchvision's ImageFolder."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image


class FolderDataset(Dataset):
    """root/<class>/<image> -> {"image": uint8 (3, H, W), "label": int}; classes sorted by folder name."""

    def __init__(self, root: str | Path):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {str(root)!r} does not exist (data.root)")
        try:
            self.folder = ImageFolder(str(root), loader=str)  # defer decoding to __getitem__
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no images in class subfolders of {str(root)!r}: {err}") from err
        self.classes = self.folder.classes

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> dict:
        path, label = self.folder.samples[index]
        return {"image": decode_image(path, mode=ImageReadMode.RGB), "label": label}
