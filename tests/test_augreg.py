"""The data-efficient recipe (data.augment=augreg, optim=augreg): timm's transforms and Mixup as configured, Mixup /
CutMix applied with the stated probabilities, batches still a pure function of (seed, step, rank), repeated
augmentation, the optimisation settings scaled to the run, refusals, and a run through the CLI."""

import random

import numpy as np
import pytest
import torch
from conftest import ROOT, check_ok, pretrain_in_process, read_metrics
from hydra import compose, initialize_config_dir
from timm.data import Mixup
from timm.data.auto_augment import RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from timm.layers import DropPath

from ssl_vit.cli import register_configs
from ssl_vit.config import peak_lr, warmup_steps
from ssl_vit.data import StepBatchSampler, build_loader
from ssl_vit.data.augreg import BatchMixer
from ssl_vit.data.config import AugRegConfig
from ssl_vit.schema import ConfigError
from ssl_vit.train.build import build_components


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        return compose("pretrain", ["model=vit_test", "data.num_samples=32", "output_dir=unused", *overrides])


def test_the_recipe_is_timms_transforms_and_mixup_with_deits_defaults():
    cfg = _compose("optim=augreg", "data.augment=augreg", "data.batch_size=8")
    objective, dataset, views, _ = build_components(cfg)
    steps = {type(t): t for t in views.augreg.transform.transforms}
    crop = steps[RandomResizedCropAndInterpolation]
    assert crop.scale == (0.35, 1.0) and crop.interpolation.value == "bicubic"  # data.crop_scale, bicubic as DeiT
    rand_augment = steps[RandAugment]
    assert rand_augment.num_layers == 2 and rand_augment.ops[0].magnitude == 9  # rand-m9-mstd0.5-inc1
    assert rand_augment.ops[0].magnitude_std == 0.5
    erasing = steps[RandomErasing]
    assert erasing.probability == 0.25 and erasing.mode == "pixel"
    mixup = views.mixer.mixup
    assert isinstance(mixup, Mixup) and (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.mix_prob) == (0.8, 1.0, 1.0)
    assert (mixup.switch_prob, mixup.label_smoothing, mixup.num_classes) == (0.5, 0.1, len(dataset.classes))
    # stochastic depth from optim=augreg: rates growing linearly over the blocks to 0.1
    rates = [b.drop_path1.drop_prob if isinstance(b.drop_path1, DropPath) else 0.0 for b in objective.backbone.blocks]
    assert rates == pytest.approx([0.0, 0.1])
    # DeiT's lr per 512 images, scaled by the global batch; warmup 5 of 300 epochs of the run
    assert peak_lr(cfg.optim, 1024) == pytest.approx(1e-3) and warmup_steps(cfg.optim, 3000) == 50
    assert cfg.optim.grad_clip is None and cfg.optim.weight_decay == 0.05


def _classify(original: torch.Tensor, mixed: torch.Tensor) -> str:
    """'none', 'mixup' (every pixel blended) or 'cutmix' (a box replaced, the rest as it was)."""
    changed = ~torch.isclose(mixed, original)
    if not changed.any():
        return "none"
    return "mixup" if changed.all() else "cutmix"


def test_mixup_and_cutmix_are_applied_with_the_stated_probabilities():
    cfg = AugRegConfig(mix_prob=0.6, switch_prob=0.3, mixup=0.8, cutmix=1.0, label_smoothing=0.1)
    mixer = BatchMixer(cfg, num_classes=4)
    # image i is the constant i + 1: blending changes every pixel, a CutMix box only some
    images = torch.arange(1, 5, dtype=torch.float32).view(4, 1, 1, 1).expand(4, 3, 32, 32).contiguous()
    labels = torch.tensor([0, 1, 2, 3])
    kinds = []
    for seed in range(600):
        out = mixer({"image": images, "label": labels}, seed)
        kinds.append(_classify(images, out["image"]))
        targets = out["label"]
        assert targets.shape == (4, 4) and torch.allclose(targets.sum(-1), torch.ones(4))
        assert targets.min() >= 0.1 / 4 - 1e-6  # label smoothing spreads 0.1 over the 4 classes
    mixed = [k for k in kinds if k != "none"]
    assert len(mixed) / len(kinds) == pytest.approx(0.6, abs=0.06)
    assert mixed.count("cutmix") / len(mixed) == pytest.approx(0.3, abs=0.07)
    assert torch.equal(images, torch.arange(1, 5, dtype=torch.float32).view(4, 1, 1, 1).expand(4, 3, 32, 32))


def test_augreg_batches_are_a_pure_function_of_seed_and_step_and_leave_global_rngs_alone():
    cfg = _compose("data.augment=augreg", "data.batch_size=8")
    _, dataset, views, _ = build_components(cfg)
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state())

    def batch(step, workers):
        return next(iter(build_loader(dataset, views, 8, seed=0, start=step, num_workers=workers, repeats=3)))

    first, again = batch(2, 0), batch(2, 2)
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["label"], again["label"])
    resumed_view = build_loader(dataset, views, 8, seed=0, start=0, repeats=3)  # step 2 of a run from 0 = a resume
    from_start = [b for _, b in zip(range(3), iter(resumed_view), strict=False)][2]
    assert torch.equal(from_start["image"], first["image"]) and torch.equal(from_start["label"], first["label"])
    assert first["label"].shape == (8, len(dataset.classes)) and "seed" not in first  # soft targets, seed removed
    assert not torch.equal(first["image"], batch(3, 0)["image"])
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
    assert torch.equal(torch.random.get_rng_state(), state[2])


def test_repeated_augmentation_repeats_each_image_with_its_own_augmentation():
    sampler = StepBatchSampler(24, 6, seed=1, repeats=3)
    batches = [b for _, b in zip(range(4), iter(sampler), strict=False)]  # one epoch of 24 samples
    indices = [i for b in batches for i, _ in b]
    assert len(indices) == 24 and len(set(indices)) == 8 and all(indices.count(i) == 3 for i in set(indices))
    assert len({s for b in batches for _, s in b}) == 24  # every copy has its own seed
    plain = [i for b in zip(range(4), iter(StepBatchSampler(24, 6, seed=1)), strict=False) for i, _ in b[1]]
    assert sorted(plain) == list(range(24))
    # as DeiT's RASampler, a global batch is dealt to the ranks in turn: an image's 3 copies go to 3 ranks
    ranks = [next(iter(StepBatchSampler(24, 2, rank=r, world_size=3, seed=1, repeats=3))) for r in range(3)]
    assert [i for i, _ in ranks[0]][0] == [i for i, _ in ranks[1]][0] == [i for i, _ in ranks[2]][0]
    # and the copies in one batch are augmented differently
    cfg = _compose("data.augment=augreg", "data.augreg.mixup=0", "data.augreg.cutmix=0", "data.batch_size=6")
    _, dataset, views, _ = build_components(cfg)
    batch = next(iter(build_loader(dataset, views, 6, seed=1, repeats=3)))
    first_index = batches[0][0][0]
    assert [i for i, _ in batches[0][:3]] == [first_index] * 3
    assert not torch.equal(batch["image"][0], batch["image"][1]) and not torch.equal(batch["image"][1],
                                                                                        batch["image"][2])


@pytest.mark.parametrize("overrides, message", [
    (["objective=mae", "data.augment=augreg"], r"mixes labels .* set data.augreg.mixup=0 data.augreg.cutmix=0"),
    (["objective=masked_patch", "data.augment=augreg"], "reads raw `pixels`"),
    (["data.augment=augreg", "data.batch_size=7"], "data.batch_size=7: Mixup / CutMix .* must be even"),
    (["data.augment=fancy"], r"^data.augment=fancy is not one of none, crop_flip, crop, augreg$"),
    (["data.augment=augreg", "data.augreg.interpolation=cubic"],
     r"^data.augreg.interpolation=cubic is not one of bicubic, bilinear, nearest; did you mean "
     r"data.augreg.interpolation=bicubic\?$"),
    (["data.augment=augreg", "data.augreg.rand_augment=rand-zz"], "'rand-zz' is not a timm RandAugment policy"),
])
def test_the_recipe_refuses_what_it_cannot_do_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_components(_compose(*overrides))


@pytest.mark.slow
def test_the_recipe_trains_through_the_cli(tmp_path):
    check_ok(pretrain_in_process("model=vit_test", "objective=supervised", "optim=augreg", "data.augment=augreg",
                                 "data.num_samples=64", "data.batch_size=8", "trainer.max_steps=4",
                                 "trainer.log_every=1", f"hydra.run.dir={tmp_path}"))
    rows = [m for m in read_metrics(tmp_path) if "loss" in m]
    assert len(rows) == 4 and all(np.isfinite(m["loss"]) for m in rows)
    # 5e-4 x 8 / 512 is below optim.min_lr: the schedule stays at that peak rather than rising to min_lr
    assert [m["lr"] for m in rows] == pytest.approx([5e-4 * 8 / 512] * 4)


def test_randaugment_at_magnitude_10_keeps_zero_bits_as_a_black_image_instead_of_stopping_the_run():
    """timm's 'inc1' posterize keeps 0 bits at magnitude 10 (DeiT's m9 +- 0.5 reaches it), which Pillow 13 refuses."""
    from PIL import Image

    from ssl_vit.data.augreg import AugRegTransform, _posterize

    transform = AugRegTransform(16, [0.5] * 3, [0.5] * 3, (1.0, 1.0), AugRegConfig(
        rand_augment="rand-m10-n1-mstd0-inc1", random_erasing=0.0))
    image = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)
    for seed in range(300):  # every op at magnitude 10, posterize among them
        torch.manual_seed(seed)
        assert transform(image).shape == (3, 16, 16)
    assert _posterize(Image.new("RGB", (2, 2), (200, 100, 50)), 0).getpixel((0, 0)) == (0, 0, 0)
    assert _posterize(Image.new("RGB", (2, 2), (200, 100, 50)), 1).getpixel((0, 0)) == (128, 0, 0)
