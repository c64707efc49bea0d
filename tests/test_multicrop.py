"""DINO's multi-crop views: counts, sizes, order, the crop scales and the stated per-crop probabilities."""

import pytest
import torch
from torchvision.transforms import v2

from ssl_vit.data.multicrop import MultiCropViews, local_crop_size


def _image(seed=0, size=64):
    torch.manual_seed(seed)
    return torch.randint(0, 256, (3, size, size), dtype=torch.uint8)


def test_local_crop_size_scales_dinos_96_of_224_to_whole_patches():
    assert local_crop_size(224, 16) == 96 and local_crop_size(224, 14) == 98 and local_crop_size(32, 4) == 12


def test_crops_come_global_first_at_their_sizes_and_scales():
    views = MultiCropViews(32, 12, [0.5] * 3, [0.5] * 3, n_global=2, n_local=6)
    crops = views(_image())
    assert [c.shape for c in crops] == [(3, 32, 32)] * 2 + [(3, 12, 12)] * 6
    assert all(c.dtype == torch.float32 and torch.isfinite(c).all() and c.abs().max() <= 1 for c in crops)
    scales = [next(t for t in tr.transforms if isinstance(t, v2.RandomResizedCrop)).scale for tr in views.transforms]
    assert scales == [(0.4, 1.0)] * 2 + [(0.05, 0.4)] * 6
    assert len(MultiCropViews(32, 12, [0.5] * 3, [0.5] * 3, n_local=0)(_image())) == 2
    with pytest.raises(ValueError, match="n_global=0"):
        MultiCropViews(32, 12, [0.5] * 3, [0.5] * 3, n_global=0)
    with pytest.raises(TypeError, match="uint8"):
        views(_image().float())


def _probability(views, index, kind):
    transform = views.transforms[index]
    for t in transform.transforms:
        if kind == "blur" and isinstance(t, v2.RandomApply) and isinstance(t.transforms[0], v2.GaussianBlur):
            return t.p
        if kind == "solarize" and isinstance(t, v2.RandomSolarize):
            return t.p
        if kind == "jitter" and isinstance(t, v2.RandomApply) and isinstance(t.transforms[0], v2.ColorJitter):
            return t.p
    raise AssertionError(kind)


def test_per_crop_probabilities_are_dinos():
    views = MultiCropViews(32, 12, [0.5] * 3, [0.5] * 3, n_global=2, n_local=2)
    assert [_probability(views, i, "blur") for i in range(4)] == [1.0, 0.1, 0.5, 0.5]
    assert [_probability(views, i, "solarize") for i in range(4)] == [0.0, 0.2, 0.0, 0.0]
    assert [_probability(views, i, "jitter") for i in range(4)] == [0.8] * 4


def test_greyscale_happens_about_a_fifth_of_the_time():
    """Measured on the output: a grey crop has three equal channels (same mean and std per channel here)."""
    views = MultiCropViews(16, 8, [0.5] * 3, [0.5] * 3, n_global=1, n_local=3)
    torch.manual_seed(0)
    grey = [bool((c[0] == c[1]).all() and (c[1] == c[2]).all()) for i in range(150) for c in views(_image(i, 32))]
    assert 0.13 < sum(grey) / len(grey) < 0.27  # 600 crops, p = 0.2
