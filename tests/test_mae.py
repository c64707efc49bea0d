import numpy as np
import pytest
import torch
from helpers.builders import mae_objective
from transformers.models.vit_mae import modeling_vit_mae

from ssl_vit.backbone import VisionTransformer, sincos_pos_embed_2d
from ssl_vit.data import SyntheticShapes, ViewBuilder, build_loader
from ssl_vit.objectives.mae import mae_loss
from ssl_vit.objectives.patches import patchify, per_sample_shuffle, unpatchify


def _mae_reference_sincos(embed_dim, grid_size):
    """MAE's util/pos_embed.py (square grids), in float64."""
    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    grid_h = np.arange(grid_size, dtype=np.float64)
    grid_w = np.arange(grid_size, dtype=np.float64)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = one_d(embed_dim // 2, grid[0])  # named h, but grid[0] holds the column (w) coordinate
    emb_w = one_d(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def test_sincos_matches_the_mae_reference_and_hf_layout():
    ours = sincos_pos_embed_2d((7, 7), 64, num_prefix_tokens=1)[0]
    assert torch.equal(ours[0], torch.zeros(64))  # the class slot is zero
    reference = torch.from_numpy(_mae_reference_sincos(64, 7)).float()
    torch.testing.assert_close(ours[1:], reference, atol=1e-6, rtol=0)
    if hasattr(modeling_vit_mae, "build_2d_sinusoidal_position_embedding"):  # newer transformers: [h | w]
        hf = modeling_vit_mae.build_2d_sinusoidal_position_embedding(height=7, width=7, embed_dim=64, cls_token=True)
        hf = torch.cat([hf[:, 32:], hf[:, :32]], dim=1)  # HF's fix for the h/w naming in MAE's weights
    else:  # older transformers: its copy of MAE's util/pos_embed.py, MAE's own layout
        hf = torch.from_numpy(modeling_vit_mae.get_2d_sincos_pos_embed(64, 7, add_cls_token=True))
    torch.testing.assert_close(ours, hf.float(), atol=1e-6, rtol=0)


def test_sincos_on_a_non_square_grid_encodes_columns_then_rows():
    embed = sincos_pos_embed_2d((2, 3), 8)[0]  # 6 positions, raster order; omega = [1, 1/100]
    for index in range(6):
        row, col = divmod(index, 3)
        expected = [np.sin(col), np.sin(col / 100), np.cos(col), np.cos(col / 100),
                    np.sin(row), np.sin(row / 100), np.cos(row), np.cos(row / 100)]
        np.testing.assert_allclose(embed[index].numpy(), expected, atol=1e-6)


@pytest.mark.parametrize(("ratio", "size", "visible"), [(0.75, 16, 4), (0.6, 32, 25), (0.9, 40, 9), (0.0, 16, 16)])
def test_the_encoder_gets_maes_count_of_visible_tokens(ratio, size, visible):
    """MAE's `random_masking` keeps `int(L * (1 - mask_ratio))` patches: 25 of 64 at 0.6 and 9 of 100 at 0.9
    (1 - 0.9 is 0.09999... in floating point), where rounding would keep 26 and 10."""
    objective = mae_objective(mask_ratio=ratio, img_size=size)
    seen = []
    objective.backbone.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    objective({"image": torch.randn(2, 3, size, size)})
    assert seen == [1 + visible]  # class token + visible patches


def test_encoder_sees_the_visible_patches_and_the_decoder_gets_them_back_in_order():
    objective = mae_objective(decoder_dim=32, decoder_depth=0).eval()
    vit = objective.backbone
    images = torch.randn(2, 3, 16, 16)
    captured = {}
    vit.blocks[0].register_forward_pre_hook(lambda m, args: captured.setdefault("encoder_in", args[0]))
    objective.decoder_norm.register_forward_pre_hook(lambda m, args: captured.setdefault("decoder_in", args[0]))
    torch.manual_seed(3)
    encoded, mask, restore, grid = objective.encode_visible(images)
    objective.decode(encoded, restore, grid)
    torch.manual_seed(3)
    shuffle, _ = per_sample_shuffle(2, 16)
    tokens = vit.add_pos(vit.patch_embed(images))
    decoder_in = captured["decoder_in"] - sincos_pos_embed_2d(grid, 32, 1)
    embedded = objective.decoder_embed(encoded)
    for b in range(2):
        for j in range(4):  # j-th visible token came from patch shuffle[b, j] and goes back there
            position = shuffle[b, j].item()
            torch.testing.assert_close(captured["encoder_in"][b, 1 + j], tokens[b, position])
            assert mask[b, position] == 0
            torch.testing.assert_close(decoder_in[b, 1 + position], embedded[b, 1 + j], atol=1e-6, rtol=0)
        hidden = mask[b].bool()
        assert hidden.sum() == 12
        torch.testing.assert_close(decoder_in[b, 1:][hidden], objective.mask_token[0].expand(12, 32), atol=1e-6,
                                   rtol=0)


def test_unshuffle_is_the_inverse_permutation():
    shuffle, restore = per_sample_shuffle(4, 10)
    values = torch.arange(10).expand(4, 10)
    assert torch.equal(torch.gather(torch.gather(values, 1, shuffle), 1, restore), values)


def test_loss_ignores_visible_patches():
    pred, target = torch.randn(2, 16, 48, requires_grad=True), torch.randn(2, 16, 48)
    mask = (torch.rand(2, 16) < 0.75).float()
    for norm_pix in (True, False):
        loss = mae_loss(pred, target, mask, norm_pix)
        (grad,) = torch.autograd.grad(loss, pred)
        assert torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))
        assert (grad[mask == 1].abs().sum(-1) > 0).all()
        changed = pred.detach().clone()
        changed[mask == 0] += 10.0
        assert torch.equal(mae_loss(changed, target, mask, norm_pix), loss.detach())


def test_norm_pix_targets_are_normalised_per_patch():
    target = torch.rand(1, 1, 48) * 5 + 3
    loss_pred_zero = mae_loss(torch.zeros(1, 1, 48), target, torch.ones(1, 1), norm_pix_loss=True)
    assert loss_pred_zero.item() == pytest.approx(47 / 48, rel=1e-4)  # unbiased variance, as MAE


def test_patchify_round_trips_on_non_square_images():
    images = torch.randn(2, 3, 8, 12)
    assert torch.equal(unpatchify(patchify(images, 4), (2, 3)), images)
    assert torch.equal(unpatchify(patchify(images, 4).flatten(2), (2, 3)), images)


def test_encoder_after_mae_is_a_plain_vit_with_fixed_sincos_positions():
    objective = mae_objective()
    encoder = objective.encoder
    assert type(encoder) is VisionTransformer and not encoder.pos_embed.requires_grad
    torch.testing.assert_close(encoder.pos_embed, sincos_pos_embed_2d((4, 4), 32, 1))
    names = {n for n, p in objective.named_parameters() if p.requires_grad}
    assert "backbone.pos_embed" not in names and "mask_token" in names


@pytest.mark.slow
def test_reconstruction_improves_over_a_short_run():
    torch.manual_seed(0)
    objective = mae_objective(model="vit_test", img_size=32, decoder_dim=64, decoder_depth=2, decoder_heads=4)
    data = SyntheticShapes(256, 32, seed=0)
    views = ViewBuilder(("image",), 32, [0.5] * 3, [0.25] * 3)
    batches = iter(build_loader(data, views, 32, seed=0))
    held_out = torch.stack([views(SyntheticShapes(16, 32, seed=99)[i])["image"] for i in range(16)])

    def held_out_loss():
        torch.manual_seed(123)  # the same masks before and after
        with torch.no_grad():
            return objective({"image": held_out})["loss"].item()

    before = held_out_loss()
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(60):
        loss = objective(next(batches))["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = held_out_loss()
    assert after < 0.7 * before, (before, after)
    reconstruction, mask = objective.reconstruct(held_out)
    assert reconstruction.shape == held_out.shape and mask.shape == (16, 64)


def test_bad_mask_ratio_is_rejected():
    with pytest.raises(ValueError, match=r"mask_ratio must be in \[0, 1\), got 1.0"):
        mae_objective(mask_ratio=1.0)
