"""DINO's multi-crop views: counts, sizes, order, the crop scales and the stated per-crop probabilities."""

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from ssl_vit.data.multicrop import PARAMETERS, MultiCropViews, local_crop_size
from ssl_vit.data.photometric import apply_parameters, finish_crops


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


@pytest.mark.slow
def test_greyscale_happens_about_a_fifth_of_the_time():
    """Measured on the output: a grey crop has three equal channels (same mean and std per channel here)."""
    views = MultiCropViews(16, 8, [0.5] * 3, [0.5] * 3, n_global=1, n_local=3)
    torch.manual_seed(0)
    grey = [bool((c[0] == c[1]).all() and (c[1] == c[2]).all()) for i in range(150) for c in views(_image(i, 32))]
    assert 0.13 < sum(grey) / len(grey) < 0.27  # 600 crops, p = 0.2


# The photometric augmentation on the training device (data.multicrop_photometric=device): the workers cut uint8
# crops and draw each crop's parameters; ssl_vit.data.photometric applies them batched.


def _device_views(n_global=2, n_local=2):
    return MultiCropViews(32, 12, [0.5] * 3, [0.25] * 3, n_global=n_global, n_local=n_local,
                          photometric_on="device")


def _batch(views, count, seed=0):
    torch.manual_seed(seed)
    samples = [views(_image(i, 48)) for i in range(count)]
    crops = [torch.stack([crops[k] for crops, _ in samples]) for k in range(len(views.sizes))]
    parameters = [torch.stack([params[k] for _, params in samples]) for k in range(len(views.sizes))]
    return crops, parameters


def test_device_mode_ships_uint8_crops_and_their_parameters_and_finishes_them_normalised():
    views = _device_views()
    crops, parameters = views(_image())
    assert [c.shape for c in crops] == [(3, 32, 32)] * 2 + [(3, 12, 12)] * 2
    assert all(c.dtype == torch.uint8 for c in crops)
    assert all(p.shape == (len(PARAMETERS),) and p.dtype == torch.float32 for p in parameters)
    assert not any(isinstance(t, v2.ColorJitter | v2.RandomApply) for tr in views.transforms for t in tr.transforms)
    crops, parameters = _batch(views, 4)
    finished = finish_crops(views, crops, parameters)
    assert [tuple(c.shape) for c in finished] == [(4, 3, 32, 32)] * 2 + [(4, 3, 12, 12)] * 2
    assert all(c.dtype == torch.float32 and c.min() >= -2 and c.max() <= 2 for c in finished)  # (x - 0.5) / 0.25
    with pytest.raises(ValueError, match="photometric_on=.gpu..*workers.*collate.*device"):
        MultiCropViews(32, 12, [0.5] * 3, [0.5] * 3, photometric_on="gpu")


@pytest.mark.slow
def test_device_mode_draws_dinos_probabilities_and_ranges():
    views = _device_views()
    torch.manual_seed(0)
    draws = [torch.stack([photometry.draw() for _ in range(4000)]) for photometry in views.photometry]
    rate = [{name: float(d[:, PARAMETERS.index(name)].mean()) for name in ("flip", "jitter", "grey", "blur",
                                                                            "solarize")} for d in draws]
    assert [r["blur"] for r in rate][:1] == [1.0] and [r["solarize"] for r in rate][::2] == [0.0, 0.0]
    assert rate[1]["blur"] == pytest.approx(0.1, abs=0.02) and rate[2]["blur"] == pytest.approx(0.5, abs=0.03)
    assert rate[1]["solarize"] == pytest.approx(0.2, abs=0.02) and rate[3]["solarize"] == 0.0
    for r in rate:
        assert r["flip"] == pytest.approx(0.5, abs=0.03) and r["jitter"] == pytest.approx(0.8, abs=0.02)
        assert r["grey"] == pytest.approx(0.2, abs=0.02)
    d = torch.cat(draws)
    for name, (low, high) in {"brightness": (0.6, 1.4), "contrast": (0.6, 1.4), "saturation": (0.8, 1.2),
                              "hue": (-0.1, 0.1), "sigma": (0.1, 2.0)}.items():
        column = d[:, PARAMETERS.index(name)]
        assert low <= column.min() < low + 0.01 and high - 0.01 < column.max() <= high, name
    orders = d[:, [PARAMETERS.index(f"order_{i}") for i in range(4)]]
    assert (orders.sort(dim=1).values == torch.arange(4.0)).all()  # a permutation of the four adjustments
    assert len({tuple(o.tolist()) for o in orders}) == 24  # every order occurs


def _torchvision_reference(crop: torch.Tensor, parameters: torch.Tensor, kernel: int) -> torch.Tensor:
    """One crop, augmented by torchvision's functional ops (what the workers' transforms call) on a float image."""
    p = dict(zip(PARAMETERS, parameters.tolist(), strict=True))
    x = crop.float() / 255
    if p["flip"]:
        x = F.horizontal_flip(x)
    if p["jitter"]:
        adjust = [lambda x: F.adjust_brightness(x, p["brightness"]), lambda x: F.adjust_contrast(x, p["contrast"]),
                  lambda x: F.adjust_saturation(x, p["saturation"]), lambda x: F.adjust_hue(x, p["hue"])]
        for position in range(4):
            x = adjust[int(p[f"order_{position}"])](x)
    if p["grey"]:
        x = F.rgb_to_grayscale(x, num_output_channels=3)
    if p["blur"]:
        x = F.gaussian_blur(x, [kernel, kernel], [p["sigma"], p["sigma"]])
    if p["solarize"]:
        x = F.solarize(x, 128 / 255)
    return x


def test_device_augmentation_equals_torchvisions_ops_per_sample():
    """Every sample with its own parameters, against torchvision applied one sample at a time (kornia's grey
    weights for contrast and saturation, 0.299 instead of 0.2989 for red, account for the ~5e-5; a pixel within
    that of solarize's threshold 128/255 may fall on the other side of it: there, 1 - x against x)."""
    views = _device_views()
    crops, parameters = _batch(views, 48)
    for crop, params, photometry in zip(crops, parameters, views.photometry, strict=True):
        got = apply_parameters(crop, params, photometry)
        want = torch.stack([_torchvision_reference(c, p, photometry.blur_kernel)
                            for c, p in zip(crop, params, strict=True)])
        off = (got - want).abs() > 2e-4
        at_threshold = (torch.minimum(got, want) - (1 - 128 / 255)).abs() < 1e-3
        assert off.sum() <= 3 and bool(at_threshold[off].all()), (got - want).abs().max()
    assert {int(v) for p in parameters for v in p[:, PARAMETERS.index("jitter")]} == {0, 1}  # both cases were met


def test_device_mode_greyscale_happens_about_a_fifth_of_the_time():
    views = MultiCropViews(16, 8, [0.5] * 3, [0.5] * 3, n_global=1, n_local=3, photometric_on="device")
    crops, parameters = _batch(views, 150)
    grey = [bool((c[0] == c[1]).all() and (c[1] == c[2]).all()) for batch in finish_crops(views, crops, parameters)
            for c in batch]
    assert 0.13 < sum(grey) / len(grey) < 0.27  # 600 crops, p = 0.2


def test_the_collate_placement_is_the_device_stage_run_on_the_batch_in_the_loader():
    """photometric_on="collate": the workers cut and draw per crop as for "device", and the collate applies the
    batched stage there, so a batch equals the device path's finished batch sample for sample (same seeds)."""
    from ssl_vit.preprocess import Preprocess

    preprocess = Preprocess(32, [0.5] * 3, [0.25] * 3)
    options = dict(local_size=12, n_global=2, n_local=3)
    builders = {placement: preprocess.view_builder(("crops",), multicrop={**options, "photometric_on": placement})
                for placement in ("collate", "device")}
    images = [_image() for _ in range(4)]
    batches = {}
    for placement, views in builders.items():
        samples = []
        for index, image in enumerate(images):
            torch.manual_seed(index)
            samples.append(views({"image": image}))
        batches[placement] = views.on_device(views.collate(samples))
    assert "crop_parameters" not in batches["collate"]
    for ours, device in zip(batches["collate"]["crops"], batches["device"]["crops"], strict=True):
        assert ours.dtype == torch.float32 and torch.equal(ours, device)


def test_auto_places_the_photometric_stage_where_it_measured_fastest():
    """A GPU: the device. A CPU: the workers' collate for small global crops (2.5x at 32 px), torchvision per crop
    from 80 px (0.81x of it at 224 px for the batched stage)."""
    from omegaconf import OmegaConf

    from ssl_vit.train.build import photometric_on

    auto = OmegaConf.create({"multicrop_photometric": "auto"})
    assert photometric_on(auto, "cuda", 224) == "device"
    assert [photometric_on(auto, "cpu", size) for size in (16, 32, 64, 80, 224)] == ["collate"] * 3 + ["workers"] * 2
    assert photometric_on(OmegaConf.create({"multicrop_photometric": "workers"}), "cpu", 32) == "workers"
