"""Turn dataset samples into the batch entries ("views") an objective declares.

Datasets yield {"image": uint8 (3, H, W), "label": int, "text": str (optional)}. The spatial transform (resize and
centre crop, or random resized crop + flip when augmenting) is applied once; `image` is the normalised float tensor
the backbone reads, `pixels` the same crop in [0, 1] before normalisation (for colour targets). `teacher_images` is
one tensor per distillation teacher: the crop of `image` again, cut from the same box (and flipped with it) but
resized to that teacher's size with its interpolation and normalised with its statistics (a teacher's own processor
when no augmentation runs). `crops` is DINO's multi-crop list (global crops first, then local ones;
`ssl_vit.data.multicrop`), drawn independently of `image`; batched, it is a list with one (B, 3, h, w) tensor per
crop (`gram_crops`: the global crops' boxes again for DINOv3's Gram teacher, when the objective asks for them). With
the multi-crop photometric augmentation on the device, the workers ship uint8 crops and `crop_parameters` (one (B,
P) tensor per crop), and `on_device` turns them into the normalised crops on the training device. `text` is the
caption, tokenised here (in the data workers) by the objective's tokenizer when one is given: a (context_length,)
int64 tensor. A sample without a caption raises `MissingTextError`, which the loaders skip and count.
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate
from torchvision.transforms import RandomResizedCrop, v2
from torchvision.transforms.v2 import functional as TF

from ssl_vit.data.augreg import AugRegTransform, BatchMixer, mixes
from ssl_vit.data.config import AUGMENTS, AugRegConfig
from ssl_vit.data.multicrop import MultiCropViews
from ssl_vit.data.photometric import finish_crops
from ssl_vit.data.step_sampler import StepBatchSampler
from ssl_vit.data.targets import label_and_text
from ssl_vit.data.token_masks import GlobalCropMasks

VIEW_KINDS = ("image", "pixels", "crops", "teacher_images", "label", "text")


def eval_transform(size: int, interpolation: str = "bilinear", crop_pct: float = 1.0,
                   resize_mode: str = "shortest") -> v2.Transform:
    """timm's eval transform: the shorter side resized to size / crop_pct, a centred size x size crop; or
    (resize_mode "squash") both sides resized to size. Masks given with the image (tv_tensors.Mask) are resized
    nearest-neighbour."""
    mode = v2.InterpolationMode(interpolation)
    if resize_mode == "squash":
        return v2.Resize((size, size), interpolation=mode, antialias=True)
    resize = int(size / crop_pct) if crop_pct < 1 else size
    return v2.Compose([v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(size)])


class ViewBuilder:
    """Without augmentation: resize the shorter side to img_size / crop_pct, centre-crop img_size (timm's eval
    transform; `ssl_vit.preprocess`), or with resize_mode "squash" both sides to img_size. `augment`: "none",
    "crop_flip" (random resized crop + flip; True means this), "crop" (the crop alone) or "augreg" (DeiT's recipe
    from timm's tools, `ssl_vit.data.augreg`, with its settings `augreg` and, for Mixup / CutMix, `num_classes`).
    `multicrop`: the keyword arguments of `MultiCropViews` other than the normalisation (needed for the `crops`
    view; the global size is img_size unless it says `global_size`), and `global_masks`: the `GlobalCropMasks`
    settings when the objective masks tokens of the global crops. `teacher_inputs`: for the `teacher_images` view,
    one input recipe per teacher (objects with img_size, mean, std, interpolation: ssl_vit.preprocess.Preprocess).
    `tokenizer`: str -> (context_length,) tensor for `text`. `collate` batches samples (and mixes them under augreg,
    draws the token masks)."""

    # ----- what the loaders and the Trainer ask of any view builder (NaFlexViews answers them for its batches) -----
    def batch_sampler(self, size: int, batch_size: int, rank: int, world_size: int, seed: int, start: int,
                      repeats: int = 1) -> StepBatchSampler:
        """This rank's batches of a map-style dataset of `size` samples from micro-step `start`: `batch_size`
        images each (`repeats`: repeated augmentation)."""
        return StepBatchSampler(size, batch_size, rank, world_size, seed, start, repeats=repeats)

    def schedule(self, seed: int, world_size: int) -> None:
        """The shape of each step's batch for a shard stream: None, every batch has batch_size images."""
        return None

    def batch_counts(self, batch: dict) -> tuple[int, int] | None:
        """(images, valid tokens) of this rank's batch where they vary from step to step; None: every batch has the
        configured size (the Trainer counts images per step from it)."""
        return None

    def loss_factor(self, batches: list[dict]) -> float:
        """The factor of an optimizer step's losses, from its micro-batches: 1 (batches of one size)."""
        return 1.0

    def cache_fields(self) -> dict:
        """What of this transform, beyond the encoder's preprocessing, a feature cache's key must hold: nothing."""
        return {}

    def __init__(self, views, img_size: int, mean, std, augment: bool | str = False, crop_scale=(0.35, 1.0),
                 interpolation: str = "bilinear", crop_pct: float = 1.0, multicrop: dict | None = None,
                 tokenizer=None, resize_mode: str = "shortest", augreg=None, num_classes: int | None = None,
                 teacher_inputs=None):
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
        self.paired = None
        if "teacher_images" in self.views:
            if not teacher_inputs:
                raise ValueError("the teacher_images view needs the teachers' input recipes (the objective's "
                                 "teacher_inputs()), got none")
            if augment == "augreg":
                raise ValueError("data.augment=augreg transforms the student's image alone (timm's transform), but "
                                 "distillation teachers must see the same crop; use data.augment=crop_flip or none")
            self.paired = PairedCrops([(img_size, interpolation, mean, std)]
                                      + [(t.img_size, t.interpolation, t.mean, t.std) for t in teacher_inputs],
                                      augment in ("crop_flip", "crop"), tuple(crop_scale), crop_pct, resize_mode,
                                      flip=augment == "crop_flip")
        if augment in ("crop_flip", "crop"):
            crop = v2.RandomResizedCrop(img_size, scale=tuple(crop_scale), interpolation=mode, antialias=True)
            self.spatial = v2.Compose([crop, v2.RandomHorizontalFlip()]) if augment == "crop_flip" else crop
        else:
            self.spatial = eval_transform(img_size, interpolation, crop_pct, resize_mode)
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
        elif self.paired is not None:
            student, *teachers = self.paired(sample["image"])
            out.update(self._image_views(student), teacher_images=teachers)
        elif "image" in self.views or "pixels" in self.views:
            out.update(self._image_views(self.spatial(sample["image"]).float().div_(255)))
        if self.multicrop is not None and self.multicrop.batched:
            out["crops"], out["crop_parameters"] = self.multicrop(sample["image"])
        elif self.multicrop is not None:
            out.update(self._split_gram(self.multicrop(sample["image"])))
        out.update(label_and_text(self.views, sample, self.tokenizer))
        return out

    def _image_views(self, pixels: torch.Tensor) -> dict:
        """`pixels` ([0, 1]) and `image` (normalised) of a spatially transformed crop, those the objective reads."""
        out = {"pixels": pixels} if "pixels" in self.views else {}
        if "image" in self.views:
            out["image"] = (pixels - self.mean) / self.std
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
        """default_collate, then multi-crop's photometric part where it runs here ("collate"), then what is drawn
        per batch: Mixup / CutMix under augreg, the global crops' token
        masks (`global_masks`: ssl_vit.data.token_masks); seeded by the batch's first sample seed (`seed`, which the
        step-indexed loader adds; drawn from torch's generator otherwise)."""
        seeds = [sample.pop("seed", None) for sample in samples]
        batch = default_collate(samples)
        if self.multicrop is not None and self.multicrop.placement == "collate":  # the batch's photometric part
            batch.update(self._split_gram(finish_crops(self.multicrop, batch["crops"], batch.pop("crop_parameters"))))
        if self.mixer is None and self.global_masks is None:
            return batch
        seed = seeds[0] if seeds and seeds[0] is not None else int(torch.randint(2**62, ()))
        if self.global_masks is not None:
            generator = torch.Generator().manual_seed(seed ^ 0x1B0_7A5C)  # not the mixer's stream
            batch.update(self.global_masks.draw(len(samples), generator))
        return self.mixer(batch, seed) if self.mixer is not None else batch


class PairedCrops:
    """One crop of an image at several resolutions: the student's and each distillation teacher's, every one with
    its own size, interpolation and normalisation. Augmenting, one random resized crop box (and one flip) is drawn
    and each view resized from the original image's box (no resampling twice); without augmentation each view is
    the eval transform at its own size with the student's crop rule (crop_pct, resize_mode), so that all cover the
    same region: a teacher's own processor where its crop rule is the student's. `recipes`: (size, interpolation,
    mean, std) per view, the student's first. Returns the student's crop in [0, 1] and each teacher's normalised."""

    def __init__(self, recipes, augment: bool, crop_scale=(0.35, 1.0), crop_pct: float = 1.0,
                 resize_mode: str = "shortest", flip: bool = True):
        self.augment, self.crop_scale, self.flip = augment, tuple(crop_scale), flip
        self.sizes = [int(size) for size, *_ in recipes]
        self.modes = [v2.InterpolationMode(interpolation) for _, interpolation, *_ in recipes]
        self.stats = [(torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1),
                       torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)) for *_, mean, std in recipes]
        self.eval_transforms = [eval_transform(size, interpolation, crop_pct, resize_mode)
                                for size, interpolation, *_ in recipes]

    def crops(self, image: torch.Tensor) -> list[torch.Tensor]:
        """The uint8 crops, the student's first."""
        if not self.augment:
            return [transform(image) for transform in self.eval_transforms]
        top, left, height, width = RandomResizedCrop.get_params(image, self.crop_scale, (3 / 4, 4 / 3))
        flip = self.flip and bool(torch.rand(()) < 0.5)
        crops = [TF.resized_crop(image, top, left, height, width, [size, size], interpolation=mode, antialias=True)
                 for size, mode in zip(self.sizes, self.modes, strict=True)]
        return [TF.horizontal_flip(crop) for crop in crops] if flip else crops

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        student, *teachers = (crop.float().div_(255) for crop in self.crops(image))
        return [student] + [(crop - mean) / std for crop, (mean, std) in zip(teachers, self.stats[1:], strict=True)]
