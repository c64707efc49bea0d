"""NaFlex data (`data.resolution=naflex`): every image at its own aspect ratio, resized to fit the batch's sequence
length, patchified and padded into one NaFlex batch (ssl_vit.naflex), as timm's NaFlex loader and SigLIP 2 do.

Each micro-step draws one sequence length from `data.naflex.seq_lens` (the buckets) and takes as many images as the
token budget holds: batch size = max_tokens // seq_len. The draw is a pure function of (seed, step), so every rank
gets the same batch shape at every step while the samples are sharded (rank r takes its slice of the step's global
batch, dealt from a seeded permutation per epoch), and a resumed run continues at the exact position
(`NaFlexSchedule.samples_before`). An image is resized to the largest size of its aspect ratio whose patch grid
fits the sequence (`grid_for_seq`); with augmentation, a random resized crop box (scale data.crop_scale, aspect
ratio 3/4..4/3 of the image's own, so that a wide image stays wide) and a flip are drawn per sample under its seed
first. Distillation teachers get the same box at their own fixed sizes. The resizing to the batch's length runs in
the loader's collate (the sample does not know its batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from ssl_vit.data.seeds import sample_seed
from ssl_vit.data.targets import label_and_text
from ssl_vit.naflex import pack
from ssl_vit.schema import checked

RESOLUTIONS = ("fixed", "naflex")
NAFLEX_VIEWS = ("image", "label", "text", "teacher_images")
NAFLEX_AUGMENTS = ("none", "crop_flip", "crop")
# Loss x (actual batch / data.batch_size)^p for p = 0, 1, 1/2 (timm's --naflex-loss-scale; open_clip: none)
LOSS_SCALES = ("none", "linear", "sqrt")
# Sequence lengths are multiples of this: fused attention kernels and tensor-core matmuls tile by 8
SEQ_MULTIPLE = 8
# The default buckets, as multiples of the model's patch count at data.img_size (timm's 128..1024 at 224 px / 16)
DEFAULT_SEQ_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0)
_SCHEDULE_CHUNK = 1024  # steps whose sequence lengths are drawn at once (one generator per chunk)


@dataclass
class NaFlexConfig:
    """`data.naflex.*` (data.resolution=naflex)."""

    # sequence lengths (patches per image, padded) a batch may take; None: 1/2, 3/4, 1, 3/2, 2 x the patches of
    # data.img_size, rounded up to multiples of 8
    seq_lens: list[int] | None = None
    # patches per batch and process; None: data.batch_size x the patches of data.img_size
    max_tokens: int | None = checked(None, ge=1)
    loss_scale: str = checked("none", choices=LOSS_SCALES)


@dataclass
class NaFlexSettings:
    """`NaFlexConfig` resolved for one model: its patch size, the buckets, the budget."""

    patch_size: int
    seq_lens: tuple[int, ...]
    max_tokens: int
    reference_batch: int  # data.batch_size (loss scaling's reference)
    loss_scale: str = "none"
    batch_sizes: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        if not self.seq_lens:
            raise ValueError("data.naflex.seq_lens=[] names no sequence length: give one or more multiples of "
                             f"{SEQ_MULTIPLE}, or leave it unset (null) for {list(DEFAULT_SEQ_FACTORS)} x the patches "
                             "of data.img_size")
        bad = [n for n in self.seq_lens if n < SEQ_MULTIPLE or n % SEQ_MULTIPLE]
        if bad:
            raise ValueError(f"data.naflex.seq_lens={list(self.seq_lens)}: each must be a positive multiple of "
                             f"{SEQ_MULTIPLE} (fused attention and tensor-core kernels tile by {SEQ_MULTIPLE}); "
                             f"e.g. {[max(SEQ_MULTIPLE, -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE) for n in self.seq_lens]}")
        if self.max_tokens < max(self.seq_lens):
            raise ValueError(f"data.naflex.max_tokens={self.max_tokens} is smaller than the sequence length "
                             f"{max(self.seq_lens)} of one image (data.naflex.seq_lens={list(self.seq_lens)}); "
                             f"give at least {max(self.seq_lens)}")
        if self.loss_scale not in LOSS_SCALES:
            raise ValueError(f"data.naflex.loss_scale={self.loss_scale!r} is not one of {list(LOSS_SCALES)}")
        self.seq_lens = tuple(sorted(int(n) for n in self.seq_lens))
        self.batch_sizes = tuple(self.max_tokens // n for n in self.seq_lens)

    @classmethod
    def resolve(cls, cfg, patch_size: int, img_size: int, batch_size: int) -> NaFlexSettings:
        native = (img_size // patch_size) ** 2
        seq_lens = cfg.seq_lens if cfg.seq_lens is not None else sorted(
            {-(-int(native * f) // SEQ_MULTIPLE) * SEQ_MULTIPLE for f in DEFAULT_SEQ_FACTORS})
        return cls(patch_size, tuple(seq_lens), int(cfg.max_tokens or batch_size * native), batch_size,
                   cfg.loss_scale)

    def loss_factor(self, batch: int) -> float:
        ratio = batch / self.reference_batch
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.loss_scale]


def grid_for_seq(height: int, width: int, patch_size: int, seq_len: int) -> tuple[int, int]:
    """The patch grid (rows, cols) of the largest scale at which the image, each side rounded up to whole patches,
    fits `seq_len` patches: SigLIP 2's rule (transformers' `get_image_size_for_max_num_patches`, solved exactly
    instead of by bisection). A side never goes below one patch; a sliver too long for the sequence is clipped to it.
    `patch_size` only sets the units: the grid depends on the aspect ratio and seq_len."""
    del patch_size  # the grid of a scale s is (ceil(h s / P), ceil(w s / P)): the largest fit depends on h / w only

    def best(short: int, long: int) -> tuple[int, int]:
        """The largest n (patches along `short`) with n x ceil(n long / short) <= seq_len, and that product's
        other side (area is non-decreasing in n: bisect)."""
        low, high = 0, seq_len
        while low < high:
            mid = (low + high + 1) // 2
            if mid * -(-mid * long // short) <= seq_len:
                low = mid
            else:
                high = mid - 1
        return (low, -(-low * long // short)) if low else (1, seq_len)

    by_rows = best(height, width)  # rows chosen, cols following
    cols, rows = best(width, height)  # cols chosen, rows following
    return max([by_rows, (rows, cols)], key=lambda grid: (grid[0] * grid[1], -abs(math.log(grid[1] / grid[0] * height
                                                                                            / width))))


class NaFlexSchedule:
    """Micro-step -> (sequence length, batch size per process): the length drawn uniformly from the buckets,
    seeded by (seed, step) only, identical on every rank."""

    def __init__(self, settings: NaFlexSettings, seed: int = 0, world_size: int = 1):
        self.settings, self.seed, self.world_size = settings, int(seed), int(world_size)
        self._chunks: dict[int, np.ndarray] = {}
        self._totals: list[int] = []  # global samples of each whole chunk, from chunk 0

    def _chunk(self, chunk: int) -> np.ndarray:
        if chunk not in self._chunks:
            if len(self._chunks) > 4:
                self._chunks.clear()
            rng = np.random.default_rng([self.seed, 0x5EC1E5, chunk])
            self._chunks[chunk] = rng.integers(len(self.settings.seq_lens), size=_SCHEDULE_CHUNK)
        return self._chunks[chunk]

    def at(self, step: int) -> tuple[int, int]:
        bucket = int(self._chunk(step // _SCHEDULE_CHUNK)[step % _SCHEDULE_CHUNK])
        return self.settings.seq_lens[bucket], self.settings.batch_sizes[bucket]

    def samples_before(self, step: int) -> int:
        """Samples all ranks took in micro-steps 0 .. step - 1."""
        chunk, offset = divmod(step, _SCHEDULE_CHUNK)
        sizes = np.asarray(self.settings.batch_sizes)
        while len(self._totals) < chunk:
            self._totals.append(int(sizes[self._chunk(len(self._totals))].sum()))
        within = int(sizes[self._chunk(chunk)[:offset]].sum()) if offset else 0
        return (sum(self._totals[:chunk]) + within) * self.world_size


class NaFlexBatchSampler(Sampler):
    """Endless batches of (index, sample seed, sequence length) for one rank from micro-step `start`: step m takes
    the next `world x batch(m)` positions of the sample stream (a seeded permutation per epoch), rank r its r-th
    slice."""

    def __init__(self, num_samples: int, schedule: NaFlexSchedule, rank: int = 0, seed: int = 0, start: int = 0,
                 shuffle: bool = True):
        self.num_samples, self.schedule, self.rank = num_samples, schedule, rank
        self.seed, self.start, self.shuffle = seed, start, shuffle
        self._order: tuple[int, torch.Tensor] | None = None

    def _index(self, position: int) -> tuple[int, int]:
        epoch, offset = divmod(position, self.num_samples)
        if self._order is None or self._order[0] != epoch:
            order = (torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(
                self.seed * 100_003 + epoch)) if self.shuffle else torch.arange(self.num_samples))
            self._order = (epoch, order)
        return epoch, int(self._order[1][offset])

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        step, position = self.start, self.schedule.samples_before(self.start)
        world = self.schedule.world_size
        while True:
            seq_len, batch = self.schedule.at(step)
            first = position + self.rank * batch
            keys = []
            for p in range(first, first + batch):
                epoch, index = self._index(p)
                keys.append((index, sample_seed(self.seed, epoch, index), seq_len))
            yield keys
            position += batch * world
            step += 1


class NaFlexViews:
    """Samples -> NaFlex batches: per sample (under its seed) the crop box and flip, the label, the tokenised
    caption and the teachers' fixed-size views; per batch (`collate`, given the batch's `seq_len`) each crop resized
    to its grid for the sequence, normalised, patchified and padded. The `ViewBuilder` interface the loaders use
    (`views`, `__call__`, `collate`, `on_device`)."""

    def __init__(self, views, settings: NaFlexSettings, mean, std, augment: str = "none", crop_scale=(0.35, 1.0),
                 interpolation: str = "bilinear", tokenizer=None, teacher_inputs=None):
        unsupported = [v for v in views if v not in NAFLEX_VIEWS]
        if unsupported:
            raise ValueError(f"data.resolution=naflex gives the views {list(NAFLEX_VIEWS)}; the objective also reads "
                             f"{unsupported}")
        augment = {True: "crop_flip", False: "none"}.get(augment, augment)
        if augment not in NAFLEX_AUGMENTS:
            raise ValueError(f"data.augment={augment!r} with data.resolution=naflex: valid choices "
                             f"{list(NAFLEX_AUGMENTS)} (augreg's transforms are timm's fixed-size ones)")
        self.views, self.settings, self.tokenizer = tuple(views), settings, tokenizer
        self.augment, self.crop_scale = augment, tuple(crop_scale)
        self.mode = InterpolationMode(interpolation)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.teachers = []
        if "teacher_images" in self.views:
            if not teacher_inputs:
                raise ValueError("the teacher_images view needs the teachers' input recipes, got none")
            self.teachers = [(int(t.img_size), InterpolationMode(t.interpolation),
                              torch.tensor(t.mean, dtype=torch.float32).view(-1, 1, 1),
                              torch.tensor(t.std, dtype=torch.float32).view(-1, 1, 1)) for t in teacher_inputs]

    def __call__(self, sample: dict) -> dict:
        image = sample["image"]
        top, left, height, width = 0, 0, image.shape[-2], image.shape[-1]
        flip = False
        if self.augment != "none":  # the box's aspect ratio within 3/4..4/3 of the image's own (NaFlex keeps it)
            aspect = width / height
            top, left, height, width = RandomResizedCrop.get_params(image, self.crop_scale,
                                                                    (3 / 4 * aspect, 4 / 3 * aspect))
            flip = self.augment == "crop_flip" and bool(torch.rand(()) < 0.5)
        crop = image[..., top:top + height, left:left + width]
        crop = TF.horizontal_flip(crop) if flip else crop
        out = {"crop": crop}
        if self.teachers:
            out["teacher_images"] = [
                (TF.resize(crop, [size, size], interpolation=mode, antialias=True).float().div_(255) - mean) / std
                for size, mode, mean, std in self.teachers]
        out.update(label_and_text(self.views, sample, self.tokenizer))
        return out

    # ----- the view builder's interface to the loaders and the Trainer (ViewBuilder's) -----
    def batch_sampler(self, size: int, batch_size: int, rank: int, world_size: int, seed: int, start: int,
                      repeats: int = 1) -> NaFlexBatchSampler:
        """This rank's batches from micro-step `start`, each step's sequence length and batch size from the
        schedule (batch_size and repeats are the settings')."""
        return NaFlexBatchSampler(size, self.schedule(seed, world_size), rank, seed, start)

    def schedule(self, seed: int, world_size: int) -> NaFlexSchedule:
        return NaFlexSchedule(self.settings, seed, world_size)

    def batch_counts(self, batch: dict) -> tuple[int, int]:
        """(images, valid patches) of this rank's batch (on the host still)."""
        return len(batch["image"]["patches"]), int(batch["image"]["patch_valid"].sum())

    def loss_factor(self, batches: list[dict]) -> float:
        """data.naflex.loss_scale: one factor for the optimizer step, from the images of all its micro-batches
        (CLIP's accumulation scores each micro-step against all of them)."""
        if self.settings.loss_scale == "none":
            return 1.0
        images = sum(len(batch["image"]["patches"]) for batch in batches)
        return self.settings.loss_factor(images / len(batches))

    def image_for_seq(self, crop: torch.Tensor, seq_len: int) -> torch.Tensor:
        return resize_for_seq(crop, self.settings.patch_size, seq_len, self.mode, self.mean, self.std)

    def collate(self, samples: list[dict]) -> dict:
        """One NaFlex batch at the samples' `seq_len` (the sampler's or the stream's), other entries batched."""
        seq_lens = {sample.pop("seq_len", None) for sample in samples}
        if len(seq_lens) != 1 or None in seq_lens:
            carried = sorted(map(str, seq_lens))
            raise ValueError(f"a NaFlex batch needs one sequence length; its samples carry {carried}")
        seq_len = seq_lens.pop()
        for sample in samples:
            sample.pop("seed", None)
        crops = [sample.pop("crop") for sample in samples]
        batch = default_collate(samples)
        batch["image"] = pack([self.image_for_seq(crop, seq_len) for crop in crops], self.settings.patch_size,
                              seq_len)
        return batch

    def on_device(self, batch: dict) -> dict:
        return batch


def resize_for_seq(image: torch.Tensor, patch_size: int, seq_len: int, mode: InterpolationMode, mean: torch.Tensor,
                   std: torch.Tensor) -> torch.Tensor:
    """A uint8 image resized to its largest grid within `seq_len` patches (`grid_for_seq`), in [0, 1], normalised."""
    rows, cols = grid_for_seq(image.shape[-2], image.shape[-1], patch_size, seq_len)
    resized = TF.resize(image, [rows * patch_size, cols * patch_size], interpolation=mode, antialias=True)
    return (resized.float().div_(255) - mean) / std


class NaFlexEvalViews:
    """Evaluation's NaFlex transform (eval.resolution=naflex): each whole image (no crop) resized to its largest
    grid within `seq_len` patches, normalised; `stack_images` packs a batch of them into one NaFlex batch."""

    def __init__(self, views, patch_size: int, seq_len: int, mean, std, interpolation: str = "bilinear"):
        self.views, self.patch_size, self.seq_len = tuple(views), int(patch_size), int(seq_len)
        self.mode = InterpolationMode(interpolation)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def cache_fields(self) -> dict:
        """What of this transform a feature cache's key must hold (ViewBuilder's interface): the patch budget."""
        return {"naflex_seq_len": self.seq_len}

    @classmethod
    def for_encoder(cls, preprocess, patch_size: int, seq_len: int | None = None, views=("image", "label")):
        """An encoder's NaFlex eval transform: its statistics and interpolation, `seq_len` patches (None: those of
        preprocess.img_size)."""
        seq_len = seq_len or (preprocess.img_size // int(patch_size)) ** 2
        return cls(views, patch_size, seq_len, preprocess.mean, preprocess.std, preprocess.interpolation)

    def __call__(self, sample: dict) -> dict:
        image = resize_for_seq(sample["image"], self.patch_size, self.seq_len, self.mode, self.mean, self.std)
        out = {"image": image}
        if "label" in self.views and "label" in sample:
            out["label"] = sample["label"]
        return out

    def stack_images(self, images: list[torch.Tensor]) -> dict:
        return pack(images, self.patch_size, self.seq_len)


def stack_images(views, images: list[torch.Tensor]):
    """A batch of prepared images: one tensor, or a NaFlex batch for views that pack (NaFlexEvalViews)."""
    return views.stack_images(images) if hasattr(views, "stack_images") else torch.stack(images)


def to_device(images, device):
    """An image tensor or a NaFlex batch on `device`."""
    if isinstance(images, dict):
        return {key: value.to(device) for key, value in images.items()}
    return images.to(device)
