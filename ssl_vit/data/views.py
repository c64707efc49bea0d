"""Turn dataset samples into the batch entries ("views") an objective declares.

Datasets yield {"image": uint8 (3, H, W), "label": int, "text": str (optional)}. The spatial transform (resize and
centre crop, or random resized crop + flip when augmenting) is applied once; `image` is the normalised float
tensor the backbone reads, `pixels` the same crop in [0, 1] before normalisation (for colour targets). `crops` is
DINO's multi-crop list (global crops first, then local ones; `ssl_vit.data.multicrop`), drawn independently of
`image`; batched, it is a list with one (B, 3, h, w) tensor per crop (`gram_crops`: the global crops' boxes again
for DINOv3's Gram teacher, when the objective asks for them). With the multi-crop photometric augmentation
on the device, the workers ship uint8 crops and `crop_parameters` (one (B, P) tensor per crop), and `on_device`
turns them into the normalised crops on the training device. `text` is the caption, tokenised here (in
the data workers) by the objective's tokenizer when one is given: a (context_length,) int64 tensor. A sample without
a caption raises `MissingTextError`, which the loaders skip and count.
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate
from torchvision.transforms import v2

from ssl_vit.data.augreg import AugRegTransform, BatchMixer, mixes
from ssl_vit.data.config import AUGMENTS, AugRegConfig
from ssl_vit.data.errors import MissingTextError
from ssl_vit.data.multicrop import MultiCropViews
from ssl_vit.data.photometric import finish_crops
from ssl_vit.data.token_masks import GlobalCropMasks

VIEW_KINDS = ("image", "pixels", "crops", "label", "text")


class ViewBuilder:
    """Without augmentation: resize the shorter side to img_size / crop_pct, centre-crop img_size (timm's eval
    transform; `ssl_vit.preprocess`), or with resize_mode "squash" both sides to img_size. `augment`: "none",
    "crop_flip" (random resized crop + flip; True means this) or "augreg" (DeiT's recipe from timm's tools,
    `ssl_vit.data.augreg`, with its settings `augreg` and, for Mixup / CutMix, `num_classes`). `multicrop`: the keyword
    arguments of `MultiCropViews` other than the normalisation (needed for the `crops` view; the global size is img_size
    unless it says `global_size`), and `global_masks`: the `GlobalCropMasks` settings when the objective masks tokens of
    the global crops. `tokenizer`: str -> (context_length,) tensor for `text`. `collate` batches samples (and mixes them
    under augreg, draws the token masks)."""

    def __init__(self, views, img_size: int, mean, std, augment: bool | str = False, crop_scale=(0.35, 1.0),
                 interpolation: str = "bilinear", crop_pct: float = 1.0, multicrop: dict | None = None,
                 tokenizer=None, resize_mode: str = "shortest", augreg=None, num_classes: int | None = None):
        unknown = [v for v in views if v not in VIEW_KINDS]
        if unknown:
            raise ValueError(f"unknown view(s) {unknown}; valid choices: {list(VIEW_KINDS)}")
        self.views = tuple(views)
        self.tokenizer = tokenizer
        self.multicrop = self.global_masks = None
        self.augreg = self.mixer = None
        augment = {True: "crop_flip", False: "none"}.get(augment, augment)
        if augment not in AUGMENTS:
            raise ValueError(f"augment={augment!r} is not one of {list(AUGMENTS)}")
        if augment == "augreg":
            self._build_augreg(img_size, mean, std, crop_scale, augreg, num_classes)
        if "crops" in self.views:
            if not multicrop or "local_size" not in multicrop:
                raise ValueError(f"the crops view needs multi-crop settings with at least local_size (the objective's "
                                 f"multicrop_options()), got {multicrop}")
            multicrop = dict(multicrop)
            masks = multicrop.pop("global_masks", None)
            self.multicrop = MultiCropViews(multicrop.pop("global_size", img_size), mean=mean, std=std, **multicrop)
            if masks is not None:
                self.global_masks = GlobalCropMasks(n_global=self.multicrop.n_global, **masks)
        mode = v2.InterpolationMode(interpolation)
        if augment == "crop_flip":
            self.spatial = v2.Compose([
                v2.RandomResizedCrop(img_size, scale=tuple(crop_scale), interpolation=mode, antialias=True),
                v2.RandomHorizontalFlip(),
            ])
        elif resize_mode == "squash":  # both sides to img_size, no crop
            self.spatial = v2.Resize((img_size, img_size), interpolation=mode, antialias=True)
        else:
            resize = int(img_size / crop_pct) if crop_pct < 1 else img_size
            self.spatial = v2.Compose([v2.Resize(resize, interpolation=mode, antialias=True),
                                       v2.CenterCrop(img_size)])
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def _build_augreg(self, img_size, mean, std, crop_scale, cfg, num_classes) -> None:
        cfg = cfg if cfg is not None else AugRegConfig()
        if "pixels" in self.views:
            raise ValueError("data.augment=augreg gives the normalised `image` view only (timm's transform erases and "
                             "recolours it), but the objective reads raw `pixels` (colour targets); use "
                             "data.augment=crop_flip")
        self.augreg = AugRegTransform(img_size, mean, std, crop_scale, cfg)
        if mixes(cfg):
            if "label" not in self.views:
                raise ValueError("data.augment=augreg mixes labels (Mixup / CutMix), but the objective reads none; "
                                 "set data.augreg.mixup=0 data.augreg.cutmix=0 (or data.augment=crop_flip)")
            self.mixer = BatchMixer(cfg, num_classes)

    def __call__(self, sample: dict) -> dict:
        out = {}
        if self.augreg is not None and "image" in self.views:
            out["image"] = self.augreg(sample["image"])
        elif "image" in self.views or "pixels" in self.views:
            pixels = self.spatial(sample["image"]).float().div_(255)
            if "pixels" in self.views:
                out["pixels"] = pixels
            if "image" in self.views:
                out["image"] = (pixels - self.mean) / self.std
        if self.multicrop is not None and self.multicrop.on_device:
            out["crops"], out["crop_parameters"] = self.multicrop(sample["image"])
        elif self.multicrop is not None:
            out.update(self._split_gram(self.multicrop(sample["image"])))
        if "label" in self.views:
            if "label" not in sample:
                raise KeyError(f"the objective needs 'label' but the dataset's samples have {sorted(sample)}")
            out["label"] = sample["label"]
        if "text" in self.views:
            text = sample.get("text")
            if not text:
                where = sample.get("meta", {}).get("path") or sample.get("key") or "a sample"
                raise MissingTextError(f"{where} has no caption")
            out["text"] = self.tokenizer(text) if self.tokenizer is not None else text
        return out

    def on_device(self, batch: dict) -> dict:
        """The batch's last stage, on the device it was moved to: the multi-crop photometric augmentation when the
        workers left it to the device (`crop_parameters`); any other batch passes as it is."""
        if "crop_parameters" in batch:
            batch = dict(batch)
            batch.update(self._split_gram(finish_crops(self.multicrop, batch["crops"], batch.pop("crop_parameters"))))
        return batch

    def _split_gram(self, crops: list) -> dict:
        """{"crops": the student's crops, "gram_crops": the Gram teacher's (the last `n_gram`), if any}."""
        n = self.multicrop.n_gram
        return {"crops": crops[:len(crops) - n], **({"gram_crops": crops[len(crops) - n:]} if n else {})}

    def collate(self, samples: list[dict]) -> dict:
        """default_collate, then what is drawn per batch: Mixup / CutMix under augreg, the global crops' token
        masks (`global_masks`: ssl_vit.data.token_masks); seeded by the batch's first sample seed (`seed`, which the
        step-indexed loader adds; drawn from torch's generator otherwise)."""
        seeds = [sample.pop("seed", None) for sample in samples]
        batch = default_collate(samples)
        if self.mixer is None and self.global_masks is None:
            return batch
        seed = seeds[0] if seeds and seeds[0] is not None else int(torch.randint(2**62, ()))
        if self.global_masks is not None:
            generator = torch.Generator().manual_seed(seed ^ 0x1B0_7A5C)  # not the mixer's stream
            batch.update(self.global_masks.draw(len(samples), generator))
        return self.mixer(batch, seed) if self.mixer is not None else batch
