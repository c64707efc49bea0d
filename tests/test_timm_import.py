"""Importing timm models (layer-scale init value, position-embedding resampling convention) and the resampling option
against its references: timm's `resample_abs_pos_embed` (antialiased) and HF transformers' DINOv2 (not)."""

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers.builders import randomise
from omegaconf import OmegaConf
from timm.layers import LayerScale, resample_abs_pos_embed
from timm.models.vision_transformer import ParallelScalingBlock
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from ssl_vit.artifacts import load_encoder, save_encoder
from ssl_vit.backbone import VisionTransformer, build_vit, resample_pos_embed
from ssl_vit.backbone.init import LayerScale as OurLayerScale
from ssl_vit.config import ModelConfig, model_kwargs
from ssl_vit.interop.timm import from_timm, layer_scale_init


def _gammas(model: nn.Module) -> torch.Tensor:
    return torch.cat([m.gamma.detach().flatten() for m in model.modules()
                      if isinstance(m, LayerScale | OurLayerScale)])


def _check_import(theirs: nn.Module, size: int, init_value: float) -> VisionTransformer:
    randomise(theirs)  # trained-looking weights: the gammas no longer hold the init value
    theirs.eval()
    ours = from_timm(theirs).eval()
    assert ours.config.layer_scale == init_value
    fresh = VisionTransformer(ours.config)
    gammas = _gammas(fresh)
    assert gammas.numel() > 0 and torch.equal(gammas, torch.full_like(gammas, init_value))
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)
    return ours


def test_dinov2_import_records_its_layer_scale_init_and_resampling():
    theirs = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=56, num_classes=0, depth=2)
    assert theirs.blocks[0].ls1.init_values == 1e-5
    ours = _check_import(theirs, 56, 1e-5)
    assert (ours.pos_embed_interp, ours.pos_embed_antialias) == ("bicubic", False)
    assert (ours.config.pos_embed_interp, ours.config.pos_embed_antialias) == ("bicubic", False)
    overridden = from_timm(theirs, pos_embed_antialias=True, pos_embed_interp="bilinear")
    assert (overridden.pos_embed_interp, overridden.pos_embed_antialias) == ("bilinear", True)


@pytest.mark.parametrize("block_fn", [None, ParallelScalingBlock])
def test_plain_timm_import_records_layer_scale_and_timm_resampling(block_fn):
    extra = dict(block_fn=block_fn, qkv_bias=False, qk_norm=True) if block_fn else {}
    theirs = TimmViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0,
                     init_values=0.1, **extra)
    ours = _check_import(theirs, 16, 0.1)
    assert (ours.pos_embed_interp, ours.pos_embed_antialias) == ("bicubic", True)  # resample_abs_pos_embed's
    without = from_timm(TimmViT(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0))
    assert without.config.layer_scale is None


def test_layer_scale_init_without_a_record_comes_from_equal_gammas_or_is_an_error():
    theirs = TimmViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0, init_values=0.25)
    for module in theirs.modules():
        if isinstance(module, LayerScale):
            del module.init_values  # as if an older timm had not kept it
    assert layer_scale_init(theirs) == 0.25  # untrained: every gamma still holds the init value
    randomise(theirs)
    with pytest.raises(ValueError, match="layer_scale="):
        from_timm(theirs)
    assert from_timm(theirs, layer_scale=0.25).config.layer_scale == 0.25


def test_resampling_without_antialias_is_plain_bicubic_interpolation():
    pos = torch.randn(1, 1 + 6 * 5, 8)
    ours = resample_pos_embed(pos, (4, 3), (6, 5), num_prefix_tokens=1, antialias=False)
    grid = pos[:, 1:].reshape(1, 6, 5, 8).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(4, 3), mode="bicubic", align_corners=False)
    torch.testing.assert_close(ours[:, 1:], expected.permute(0, 2, 3, 1).reshape(1, 12, 8), atol=0, rtol=0)
    torch.testing.assert_close(ours[:, :1], pos[:, :1], atol=0, rtol=0)


@pytest.mark.parametrize("new_grid", [(3, 3), (2, 5), (9, 7)])
def test_resampling_without_antialias_matches_hf_dinov2(new_grid):
    from transformers import Dinov2Config, Dinov2Model

    patch, old = 4, 6
    config = Dinov2Config(image_size=old * patch, patch_size=patch, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=64)
    hf = Dinov2Model(config).eval()
    pos = torch.randn(1, 1 + old * old, 32)
    with torch.no_grad():
        hf.embeddings.position_embeddings.copy_(pos)
        tokens = torch.zeros(1, 1 + new_grid[0] * new_grid[1], 32)
        theirs = hf.embeddings.interpolate_pos_encoding(tokens, new_grid[0] * patch, new_grid[1] * patch)
    ours = resample_pos_embed(pos, new_grid, (old, old), num_prefix_tokens=1, antialias=False)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)  # measured: identical (0.0)
    # The antialiased default is a different function, growing too (PyTorch's antialiased bicubic is PIL's a=-0.5).
    assert (resample_pos_embed(pos, new_grid, (old, old), 1) - theirs).abs().max() > 1e-2


@pytest.mark.parametrize("new_grid", [(3, 4), (2, 9), (8, 8)])
def test_default_resampling_still_equals_timm_resample_abs_pos_embed(new_grid):
    pos = torch.randn(1, 2 + 5 * 6, 8)
    ours = resample_pos_embed(pos, new_grid, (5, 6), num_prefix_tokens=2)
    theirs = resample_abs_pos_embed(pos, new_size=list(new_grid), old_size=[5, 6], num_prefix_tokens=2)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("interp, antialias", [("bicubic", False), ("bilinear", True), ("bilinear", False)])
def test_set_img_size_and_the_on_the_fly_path_honour_the_option(interp, antialias):
    model = build_vit("vit_test", img_size=24, pos_embed_interp=interp, pos_embed_antialias=antialias).eval()
    pos = model.pos_embed.detach().clone()
    expected = resample_pos_embed(pos, (2, 3), (6, 6), 1, mode=interp, antialias=antialias)
    other = resample_pos_embed(pos, (2, 3), (6, 6), 1)  # the default (bicubic, antialiased)
    assert (expected - other).abs().max() > 1e-3
    images = torch.randn(2, 3, 8, 12)
    with torch.no_grad():
        torch.testing.assert_close(model.patch_pos_embed((2, 3)), expected[:, 1:], atol=0, rtol=0)
        on_the_fly = model(images)
        model.set_img_size((8, 12))
        torch.testing.assert_close(model.pos_embed, expected, atol=0, rtol=0)
        torch.testing.assert_close(model(images), on_the_fly, atol=1e-6, rtol=0)


def test_dinov2_import_resized_like_hf():
    """End to end: a timm DINOv2 imported at 56 px and set to 42 px has HF Dinov2Model's interpolated embedding."""
    from transformers import Dinov2Config, Dinov2Model

    theirs = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=56, num_classes=0, depth=2)
    ours = from_timm(theirs)
    config = Dinov2Config(image_size=56, patch_size=14, hidden_size=384, num_hidden_layers=1, num_attention_heads=6)
    hf = Dinov2Model(config)
    with torch.no_grad():
        hf.embeddings.position_embeddings.copy_(ours.pos_embed)
        expected = hf.embeddings.interpolate_pos_encoding(torch.zeros(1, 1 + 9, 384), 42, 42)
        ours.set_img_size(42)
    torch.testing.assert_close(ours.pos_embed.detach(), expected, atol=1e-5, rtol=0)


def test_the_option_round_trips_through_the_encoder_file(tmp_path):
    model = build_vit("vit_test", pos_embed_interp="bilinear", pos_embed_antialias=False).eval()
    model.set_img_size(24)  # the file must also rebuild at the new size
    loaded = load_encoder(save_encoder(model, tmp_path / "encoder.safetensors")).eval()
    assert (loaded.pos_embed_interp, loaded.pos_embed_antialias) == ("bilinear", False)
    assert loaded.config == model.config and loaded.grid_size == (6, 6)
    images = torch.randn(1, 3, 8, 8)  # on the fly to a smaller grid, where antialiasing would matter
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), model(images), atol=0, rtol=0)


def test_fine_tuning_at_another_size_uses_the_encoders_resampling(monkeypatch):
    import ssl_vit.backbone.vit as vit
    from ssl_vit.eval.finetune import finetune

    class Grey(torch.utils.data.Dataset):
        classes = ("dark", "light")

        def __len__(self):
            return 4

        def __getitem__(self, index):
            return {"image": torch.full((3, 16, 16), 60 + 120 * (index % 2), dtype=torch.uint8), "label": index % 2}

    calls = []
    original = vit.resample_pos_embed
    monkeypatch.setattr(vit, "resample_pos_embed", lambda *a, **k: calls.append(k) or original(*a, **k))
    encoder = build_vit("vit_test", pos_embed_interp="bilinear", pos_embed_antialias=False)
    result = finetune(encoder, Grey(), Grey(), mean=[0.5] * 3, std=[0.25] * 3, img_size=8, steps=1, batch_size=4,
                      warmup_steps=0, progress=False)
    assert result["img_size"] == 8
    assert calls and all(k == {"mode": "bilinear", "antialias": False} for k in calls)


def test_unknown_interpolation_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"pos_embed_interp 'cubic' is not one of \['bicubic', 'bilinear'\]"):
        build_vit("vit_test", pos_embed_interp="cubic")
    with pytest.raises(ValueError, match="'nearest' is not one of"):
        resample_pos_embed(torch.zeros(1, 5, 4), (3, 3), (2, 2), mode="nearest")


def test_model_config_overrides_reach_the_backbone():
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig(name="vit_test")),
                          OmegaConf.from_dotlist(["pos_embed_antialias=false", "pos_embed_interp=bilinear"]))
    kwargs = model_kwargs(cfg)
    assert kwargs == {"pos_embed_antialias": False, "pos_embed_interp": "bilinear"}
    model = build_vit(cfg.name, **kwargs)
    assert (model.pos_embed_interp, model.pos_embed_antialias) == ("bilinear", False)
    assert model_kwargs(OmegaConf.structured(ModelConfig(name="vit_test"))) == {}
