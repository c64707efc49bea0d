"""The backbone against the paper's numbers and against timm with the same weights."""

from functools import partial

import pytest
import timm
import torch
from helpers.builders import randomise
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import ParallelScalingBlock
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from ssl_vit.backbone import PRESETS, PatchEmbed, build_vit, count_parameters, resample_pos_embed
from ssl_vit.backbone.attention import Attention


def test_patch_embedding_equals_patchify_then_matmul():
    embed = PatchEmbed(img_size=(32, 48), patch_size=8, in_chans=3, embed_dim=20)
    images = torch.randn(2, 3, 32, 48)
    P = 8
    # Raster order over the grid; each patch flattened as (channel, row, col) to match the conv weight layout.
    patches = images.unfold(2, P, P).unfold(3, P, P)  # (B, C, 4, 6, P, P)
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(2, 4 * 6, 3 * P * P)
    weight = embed.proj.weight.reshape(20, -1)
    expected = patches @ weight.T + embed.proj.bias
    assert embed.grid_size == (4, 6)
    # Any summation order of a K-term fp32 dot product is within K * eps * sum |x_i w_i| (+ |b|) of the exact value
    # (the standard forward error bound, with a factor 2 to spare): a BLAS-independent tolerance per output.
    bound = weight.shape[1] * torch.finfo(torch.float32).eps * (patches.abs() @ weight.abs().T + embed.proj.bias.abs())
    assert bool(((embed(images) - expected).abs() <= bound).all())


@pytest.mark.parametrize("name, expected", [
    ("vit_ti16", 5_524_416), ("vit_s16", 21_665_664), ("vit_b16", 85_798_656), ("vit_l16", 303_301_632),
    ("vit_h14", 630_764_800), ("vit_g14", 1_011_202_432),
])
def test_parameter_counts_match_the_paper_table(name, expected):
    with torch.device("meta"):
        model = build_vit(name, img_size=224)
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == expected


def test_vit_22b_parameter_count_on_meta_device():
    with torch.device("meta"):
        model = build_vit("vit_22b", img_size=224)
    assert PRESETS["vit_22b"]["parallel_block"] and PRESETS["vit_22b"]["qk_norm"]
    assert abs(count_parameters(model) / 21_743e6 - 1) < 0.005


@pytest.mark.slow
def test_state_dict_loads_into_timm_vit_small_and_features_match():
    ours = build_vit("vit_s16", img_size=224).eval()
    randomise(ours)
    theirs = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.forward_features(images), theirs.forward_features(images), atol=1e-5,
                                   rtol=0)


def test_22b_style_block_matches_timm_parallel_scaling_block():
    ours = build_vit("vit_test_22b").eval()
    randomise(ours)
    theirs = TimmViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                     qkv_bias=False, qk_norm=True, class_token=False, global_pool="avg",
                     block_fn=ParallelScalingBlock, norm_layer=partial(nn.LayerNorm, eps=1e-6, bias=False)).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not any(k.endswith("norm.bias") or "in_proj.bias" in k for k in ours.state_dict())
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)


@pytest.mark.parametrize("options, timm_options", [
    (dict(num_registers=2, global_pool="avg", class_token=False, no_embed_class=True),
     dict(reg_tokens=2, global_pool="avg", class_token=False, no_embed_class=True)),
    (dict(num_registers=3), dict(reg_tokens=3)),
    (dict(layer_scale=0.1, qk_norm=True), dict(init_values=0.1, qk_norm=True)),
    (dict(pre_norm=True, qkv_bias=False), dict(pre_norm=True, qkv_bias=False)),
])
def test_options_match_timm(options, timm_options):
    ours = build_vit("vit_test", **options).eval()
    randomise(ours)
    theirs = TimmViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                     **timm_options).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)


def test_position_embedding_resampling_matches_timm_on_a_non_square_grid():
    pos = torch.randn(1, 1 + 4 * 6, 16)
    ours = resample_pos_embed(pos, new_grid=(7, 5), old_grid=(4, 6), num_prefix_tokens=1)
    theirs = resample_abs_pos_embed(pos, new_size=[7, 5], old_size=[4, 6], num_prefix_tokens=1)
    assert ours.shape == (1, 1 + 35, 16)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, :1], pos[:, :1], atol=0, rtol=0)  # the class slot is kept as is


def test_higher_resolution_keeps_the_class_slot_and_grows_the_grid():
    model = build_vit("vit_test").eval()
    cls_pos = model.pos_embed[:, :1].clone()
    images = torch.randn(1, 3, 24, 32)
    with torch.no_grad():
        on_the_fly = model(images)  # position embeddings resampled per call for a new grid
        model.set_img_size((24, 32))
        assert model.grid_size == (6, 8) and model.pos_embed.shape[1] == 1 + 48
        torch.testing.assert_close(model.pos_embed[:, :1], cls_pos, atol=0, rtol=0)
        torch.testing.assert_close(model(images), on_the_fly, atol=1e-6, rtol=0)


def test_sdpa_equals_explicit_attention():
    attn = Attention(32, 4, qk_norm=True).eval()
    randomise(attn)
    x = torch.randn(2, 10, 32)
    out_explicit, weights = attn(x, return_attention=True)
    torch.testing.assert_close(attn(x), out_explicit, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 10))


def test_attention_maps_come_from_every_block():
    model = build_vit("vit_test").eval()
    maps = model.attention_maps(torch.randn(2, 3, 16, 16))
    assert len(maps) == 2 and maps[0].shape == (2, 2, 17, 17)


@pytest.mark.parametrize("name", ["vit_test", "vit_test_22b"])
@pytest.mark.parametrize("policy", [True, "selective"])
def test_gradient_checkpointing_gives_the_same_gradients(name, policy):
    model = build_vit(name, drop_path=0.0)
    images = torch.randn(2, 3, 16, 16)
    model(images).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(policy)
    model(images).sum().backward()
    for grad, ref in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-6, rtol=0)


def test_an_unknown_checkpointing_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"'sometimes' is not one of \[False, True, 'full', 'selective'\]"):
        build_vit("vit_test").set_grad_checkpointing("sometimes")


def test_drop_path_is_linear_in_depth_and_off_in_eval():
    model = build_vit("vit_test", depth=3, drop_path=0.2)
    rates = [getattr(block.drop_path1, "drop_prob", 0.0) for block in model.blocks]  # block 0: Identity
    assert rates == pytest.approx([0.0, 0.1, 0.2])
    model.eval()
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(model(images), model(images))


def test_fine_tuning_head_starts_at_zero():
    model = build_vit("vit_test", num_classes=5)
    assert torch.count_nonzero(model.head.weight) == 0
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_masking_objectives_can_drop_tokens_between_steps():
    """Embed, keep a subset of patches, prepend the class token, run the blocks: no backbone change needed."""
    model = build_vit("vit_test").eval()
    images = torch.randn(2, 3, 16, 16)
    tokens = model.add_pos(model.patch_embed(images))
    kept = tokens[:, :5]
    out = model.run_blocks(model.prepend_tokens(kept))
    assert out.shape == (2, 6, 32)
    full = model.run_blocks(model.prepend_tokens(tokens))
    torch.testing.assert_close(full, model.forward_features(images))


@pytest.mark.parametrize("size", [30, (32, 18)])
def test_image_size_not_divisible_by_patch_size_is_a_clear_error(size):
    with pytest.raises(ValueError, match="not divisible by the patch size 4x4"):
        build_vit("vit_test", img_size=size)
    model = build_vit("vit_test")
    with pytest.raises(ValueError, match="30x30 is not divisible"):
        model(torch.randn(1, 3, 30, 30))


def test_unknown_preset_lists_the_valid_choices():
    with pytest.raises(ValueError, match=r"unknown model 'vit_x'.*vit_b16"):
        build_vit("vit_x")


def test_token_pooling_without_class_token_is_rejected():
    with pytest.raises(ValueError, match="needs class_token=True"):
        build_vit("vit_test", class_token=False)
