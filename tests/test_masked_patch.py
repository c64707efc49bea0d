import pytest
import torch
from omegaconf import OmegaConf

from ssl_vit.backbone import build_vit
from ssl_vit.data import SyntheticShapes, ViewBuilder
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.masked_patch import MaskedPatchConfig, colour_targets, corrupt_patches, quantise_colour
from ssl_vit.objectives.patches import patchify, unpatchify


def _objective(**options):
    cfg = OmegaConf.structured(MaskedPatchConfig(**options))
    return build_objective(cfg, build_vit("vit_test"), DataInfo(8, 16))


def _constant_image(colour, size=8):
    return torch.tensor(colour, dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, size, size).clone()


@pytest.mark.parametrize("colour, expected", [
    ((0.2, 0.5, 0.9), (1 * 8 + 4) * 8 + 7),  # r=floor(1.6)=1, g=floor(4.0)=4, b=floor(7.2)=7 -> 103
    ((0.0, 0.0, 0.0), 0),
    ((1.0, 1.0, 1.0), 511),  # the top level is closed: 1.0 -> 7
    ((0.124, 0.126, 0.999), (0 * 8 + 1) * 8 + 7),
])
def test_mean_colour_class_of_a_constant_patch(colour, expected):
    targets = colour_targets(_constant_image(colour), patch_size=4, bits=3)
    assert targets.shape == (1, 4, 1) and (targets == expected).all()


def test_mean_colour_averages_the_patch_before_quantising():
    image = torch.zeros(1, 3, 4, 4)
    image[:, :, :2] = 1.0  # top half white, bottom half black: mean 0.5 -> level 4 in every channel
    assert colour_targets(image, 4, bits=3).item() == (4 * 8 + 4) * 8 + 4
    assert colour_targets(image, 4, bits=1).item() == 7  # 1 bit: 0.5 -> level 1 in each channel


def test_subpatch_colour_targets_follow_the_cell_grid():
    image = torch.zeros(1, 3, 8, 8)
    image[:, 0, :, 4:] = 1.0  # right half red
    targets = colour_targets(image, patch_size=8, bits=3, grid=2)  # one patch, 2x2 cells, raster order
    red = quantise_colour(torch.tensor([1.0, 0.0, 0.0]), 3).item()
    assert targets.tolist() == [[[0, red, 0, red]]]
    with pytest.raises(ValueError, match="not divisible by subpatch_grid 3"):
        colour_targets(image, 8, 3, grid=3)


def test_targets_spread_over_many_of_the_512_classes_on_synthetic_data():
    data = SyntheticShapes(64, 32, seed=0)
    views = ViewBuilder(("pixels",), 32, [0.5] * 3, [0.5] * 3)
    pixels = torch.stack([views(data[i])["pixels"] for i in range(64)])
    classes = colour_targets(pixels, patch_size=4, bits=3).flatten()
    counts = torch.bincount(classes, minlength=512)
    assert (counts > 0).sum() >= 100
    assert counts.max() / classes.numel() < 0.1


def test_corruption_statistics_are_50_percent_and_80_10_10():
    torch.manual_seed(0)
    tokens = torch.randn(400, 64, 8)
    mask_token = torch.full((1, 1, 8), 7.0)
    out, corrupted, kind = corrupt_patches(tokens, 0.5, (0.8, 0.1, 0.1), mask_token)
    assert (corrupted.sum(dim=1) == 32).all()  # exactly half of each image
    n = corrupted.sum().item()
    fractions = [((kind == k).sum().item() / n) for k in (1, 2, 3)]
    assert fractions == pytest.approx([0.8, 0.1, 0.1], abs=0.01)
    assert (out[kind == 1] == 7.0).all()
    assert torch.equal(out[kind == 3], tokens[kind == 3]) and torch.equal(out[kind == 0], tokens[kind == 0])
    donors = tokens.reshape(-1, 8)
    replaced = out[kind == 2]
    assert all((donors == row).all(dim=1).any() for row in replaced[:50])  # a real patch from the batch
    assert (replaced != tokens[kind == 2]).any(dim=1).float().mean() > 0.99


def test_loss_is_computed_on_corrupted_patches_only():
    objective = _objective().eval()
    images = torch.randn(2, 3, 16, 16)
    pixels = torch.rand(2, 3, 16, 16)
    torch.manual_seed(5)
    loss = objective({"image": images, "pixels": pixels})["loss"]
    torch.manual_seed(5)
    _, corrupted, _ = corrupt_patches(objective.backbone.patch_embed(images), 0.5, objective.probs,
                                      objective.mask_token)
    patch_pixels = patchify(pixels, 4)  # (B, N, P, P, C), a view into a copy
    changed_clean = patch_pixels.clone()
    changed_clean[~corrupted] = 1.0 - changed_clean[~corrupted]
    changed_corrupt = patch_pixels.clone()
    changed_corrupt[corrupted] = 1.0 - changed_corrupt[corrupted]
    torch.testing.assert_close(unpatchify(patch_pixels, (4, 4)), pixels)
    for changed, same in ((changed_clean, True), (changed_corrupt, False)):
        torch.manual_seed(5)
        other = objective({"image": images, "pixels": unpatchify(changed, (4, 4))})["loss"]
        assert torch.equal(other, loss) is same


@pytest.mark.parametrize("target, metrics", [("mean_colour", {"loss", "acc", "corrupted_fraction"}),
                                             ("subpatch_colour", {"loss", "acc", "corrupted_fraction"}),
                                             ("pixels", {"loss", "corrupted_fraction"})])
def test_each_target_variant_trains(target, metrics):
    objective = _objective(target=target, subpatch_grid=2)
    batch = {"image": torch.randn(4, 3, 16, 16), "pixels": torch.rand(4, 3, 16, 16)}
    out = objective(batch)
    assert set(out) == metrics and out["corrupted_fraction"].item() == 0.5
    out["loss"].backward()
    assert objective.mask_token.grad is not None and objective.backbone.blocks[0].attn.qkv.weight.grad is not None


def test_bad_probabilities_are_rejected():
    with pytest.raises(ValueError, match="summing to 1"):
        _objective(mask_token_prob=0.5)
