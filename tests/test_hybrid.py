"""The hybrid stem (ResNet-v2 features as tokens) against timm's hybrid ViTs with the same weights, both ways; the
objectives that cannot use it refuse by name; it trains through the CLI."""

from functools import partial

import pytest
import timm
import torch
from conftest import ROOT, check_ok, pretrain_in_process, read_metrics
from helpers.builders import randomise
from timm.layers import HybridEmbed, StdConv2dSame
from timm.models.resnetv2 import ResNetV2
from timm.models.vision_transformer import VisionTransformer as TimmViT

from ssl_vit.artifacts import load_encoder
from ssl_vit.backbone import PRESETS, VisionTransformer, build_vit, count_parameters
from ssl_vit.interop.timm import export_timm, from_timm

SMALL_VIT = dict(embed_dim=32, depth=2, num_heads=2)


def _assert_same(ours, theirs, images, atol=1e-5):
    ours.eval(), theirs.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(images), theirs.forward_features(images), atol=atol, rtol=0)
        torch.testing.assert_close(ours(images), theirs(images), atol=atol, rtol=0)


@pytest.mark.parametrize("timm_name, ours_kwargs, size", [
    ("vit_base_r50_s16_224", dict(stem_layers=[3, 4, 9], patch_size=1), 32),   # the paper's R50 hybrid, stride 16
    ("vit_tiny_r_s16_p8_224", dict(stem_layers=[], patch_size=8), 64),         # timm's stem-only hybrid
    ("vit_small_r26_s32_224", dict(stem_layers=[2, 2, 2, 2], patch_size=1), 64),
])
@pytest.mark.slow
def test_timm_hybrids_match_ours_with_the_same_weights_both_ways(timm_name, ours_kwargs, size):
    theirs = timm.create_model(timm_name, pretrained=False, img_size=size, num_classes=0, **SMALL_VIT)
    ours = VisionTransformer(img_size=size, stem="resnet", **ours_kwargs, **SMALL_VIT)
    randomise(theirs)  # norm scales and biases too
    ours.load_state_dict(theirs.state_dict(), strict=True)  # timm's names, nothing renamed
    images = torch.randn(2, 3, size, size)
    _assert_same(ours, theirs, images)
    randomise(ours)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    _assert_same(ours, theirs, images)
    # and through the import / export paths: from_timm reads the stem off the model; export_timm names the hybrid
    _assert_same(from_timm(theirs), theirs, images)


def test_the_test_preset_is_timms_resnetv2_and_hybrid_embed(tmp_path):
    """vit_tiny_r (a one-stage ResNet-v2 of width 32, 2x2 patches of its stride-4 map) equals timm's
    VisionTransformer over timm's HybridEmbed and ResNetV2 built with the same arguments, and rescales as timm does."""
    ours = build_vit("vit_tiny_r")
    backbone = ResNetV2(layers=[1], channels=(128,), stem_chs=32, num_classes=0, global_pool="", preact=False,
                        stem_type="same", conv_layer=partial(StdConv2dSame, eps=1e-8))
    theirs = TimmViT(img_size=32, patch_size=2, num_classes=0, **SMALL_VIT,
                     embed_layer=partial(HybridEmbed, backbone=backbone))
    assert ours.grid_size == theirs.patch_embed.grid_size == (4, 4) and ours.patch_embed.stride == (8, 8)
    randomise(ours)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    _assert_same(ours, theirs, torch.randn(3, 3, 32, 32))
    ours.set_img_size(48)  # position embeddings resampled as timm resamples them (bicubic, antialiased)
    theirs.set_input_size(img_size=48)
    assert ours.grid_size == theirs.patch_embed.grid_size == (6, 6)
    _assert_same(ours, theirs, torch.randn(2, 3, 48, 48))
    with pytest.raises(ValueError, match="not divisible by the patch size 8x8"):
        ours(torch.randn(1, 3, 44, 44))  # the token stride is the ResNet's 4 x the 2x2 patches


def test_the_resnet_starts_as_timms_hybrids_start_it():
    """timm's hybrid ViTs run ResNetV2.init_weights(): kaiming-normal (fan-out) kernels and the last GroupNorm of
    every bottleneck at zero (each residual branch starts closed); the stem alone keeps PyTorch's default."""
    ours = VisionTransformer(img_size=32, stem="resnet", stem_layers=[3, 4, 9], patch_size=1, **SMALL_VIT)
    theirs = timm.create_model("vit_base_r50_s16_224", pretrained=False, img_size=32, num_classes=0, **SMALL_VIT)
    for model in (ours, theirs):
        norms = [m.norm3.weight for m in model.patch_embed.backbone.modules() if hasattr(m, "norm3")]
        assert len(norms) == 16 and all(bool((w == 0).all()) for w in norms)
    name = "patch_embed.backbone.stages.2.blocks.0.conv2.weight"  # 256 x 256 x 3 x 3: fan-out 2304
    for model in (ours, theirs):
        assert model.state_dict()[name].std().item() == pytest.approx((2 / 2304) ** 0.5, rel=0.02)


def test_paper_hybrid_presets_have_timms_parameter_counts_and_grid():
    with torch.device("meta"):
        ours = build_vit("vit_b16_r50")
        theirs = timm.create_model("vit_base_r50_s16_224", pretrained=False, num_classes=0)
        large = build_vit("vit_l16_r50")
    assert ours.grid_size == (14, 14) and large.grid_size == (14, 14)  # 224 / 16: 196 tokens, as ViT-B/16
    assert count_parameters(ours) == count_parameters(theirs) == 97_890_112
    # the ResNet part is the same in both presets; the transformer is ViT-L/16's (303,301,632 with 1x1 patches of
    # the 1024-channel map instead of 16x16x3 pixels: the patch projection differs)
    resnet = count_parameters(ours.patch_embed.backbone)
    assert count_parameters(large.patch_embed.backbone) == resnet
    assert count_parameters(large) - resnet - 1024 * 1024 - 1024 == 303_301_632 - 16 * 16 * 3 * 1024 - 1024


def test_timm_export_of_a_hybrid_loads_in_timm_and_unsupported_stems_are_refused(tmp_path):
    ours = VisionTransformer(img_size=32, stem="resnet", stem_layers=[3, 4, 9], patch_size=1, **SMALL_VIT)
    randomise(ours)
    export_timm(ours, tmp_path / "r50")
    theirs = timm.create_model(f"local-dir:{tmp_path / 'r50'}", pretrained=True)
    assert theirs.pretrained_cfg["architecture"] == "vit_base_r50_s16_224"
    _assert_same(ours, theirs, torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match=r"timm has no hybrid with stem_layers=\[1\].*vit_base_r50_s16_224"):
        export_timm(build_vit("vit_tiny_r"), tmp_path / "tiny")
    from ssl_vit.interop.hf import hf_config
    from ssl_vit.interop.open_clip import vision_config

    with pytest.raises(ValueError, match="stem='resnet' .*no hybrid ViT"):
        hf_config(build_vit("vit_tiny_r").config, "vit")
    with pytest.raises(ValueError, match="stem='resnet'"):
        vision_config(build_vit("vit_tiny_r").config)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stem="conv"), r"stem 'conv' is not one of \['patch', 'resnet'\]"),
    (dict(stem="resnet", stem_width=48), "stem_width must be a multiple of 32"),
    (dict(stem="resnet", stem_layers=[1, 1], stem_channels=[128]), "needs one width per stage"),
    (dict(stem="resnet", stem_layers=[1, 1, 1, 1, 1]), "0 to 4 stages"),
])
def test_bad_stem_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VisionTransformer(img_size=32, patch_size=1, **SMALL_VIT, **kwargs)


@pytest.mark.parametrize("objective", ["mae", "masked_patch", "dinov2_tiny"])
def test_pixel_target_objectives_refuse_the_hybrid_by_name(objective):
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.schema import ConfigError
    from ssl_vit.train.build import build_components

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        cfg = compose("pretrain", [f"objective={objective}", "model=vit_tiny_r", "output_dir=unused"])
    name = {"dinov2_tiny": r"dinov2 with iBOT \(objective.ibot_weight=.*\)"}.get(objective, objective)
    with pytest.raises(ConfigError, match=f"objective={name} is not defined for model.stem=resnet: .*leaks"):
        build_components(cfg)


@pytest.mark.slow
def test_hybrid_trains_through_the_cli_and_saves_a_loadable_encoder(tmp_path):
    """A plain preset with model.stem=resnet (1x1 patches of the ResNet map unless patch_size says otherwise)."""
    out = tmp_path / "run"
    check_ok(pretrain_in_process("model=vit_test", "model.stem=resnet", "model.stem_layers=[1]",
                                 "model.stem_channels=[128]", "model.stem_width=32", "data.img_size=32",
                                 "data.num_samples=64", "data.batch_size=16", "trainer.max_steps=12",
                                 "trainer.log_every=1", "optim.lr=3e-3", "optim.warmup_steps=2", "objective=supervised",
                                 f"hydra.run.dir={out}"))
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert len(losses) == 12 and min(losses[-3:]) < losses[0]
    encoder = load_encoder(out / "encoder.safetensors")
    assert encoder.config.stem == "resnet" and encoder.config.patch_size == 1 and encoder.grid_size == (8, 8)
    assert "patch_embed.backbone.stages.0.blocks.0.conv2.weight" in encoder.state_dict()
    assert PRESETS["vit_test"]["patch_size"] == 4  # the preset's 4x4 pixel patches were not used


@pytest.mark.parametrize("objective", [["objective=dino_tiny", "objective.out_dim=64", "objective.local_crops=2"],
                                       ["objective=clip_tiny", "objective.text_layers=1"]])
def test_whole_image_objectives_train_a_hybrid(objective):
    """DINO (its local crops a multiple of the token stride) and CLIP (pre-norm, no projection bias) on vit_tiny_r:
    a forward and backward reach the ResNet."""
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.train.build import build_components

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        cfg = compose("pretrain", [*objective, "model=vit_tiny_r", "data.num_samples=16", "output_dir=unused"])
    model, dataset, views, _ = build_components(cfg)
    batch = torch.utils.data.default_collate([views(dataset[i]) for i in range(4)])
    model(batch)["loss"].backward()
    stem_conv = model.backbone.patch_embed.backbone.stem.conv.weight  # the student (DINO: encoder = teacher)
    assert stem_conv.grad is not None and stem_conv.grad.abs().sum() > 0
    if "crops" in batch:
        assert {crop.shape[-1] % 8 for crop in batch["crops"]} == {0}  # 32 px global, 16 px local crops


@pytest.mark.parametrize("name, size", [("vit_tiny_r", 32), ("vit_b16_r50", 64)])
def test_the_memory_plan_counts_the_resnets_activations_as_autograd_saves_them(name, size):
    """plan_memory's hybrid term against the tensors autograd actually keeps for backward (saved_tensors_hooks):
    the per-image slope (batch 2 - batch 1) and the batch-independent part (weight-standardised kernels)."""
    from ssl_vit.train.memory import ModelShape

    shape = ModelShape.of(name, img_size=size, **({} if name == "vit_tiny_r" else SMALL_VIT))
    model = build_vit(name, img_size=size, **({} if name == "vit_tiny_r" else SMALL_VIT))
    params = {p.data_ptr() for p in model.parameters()}
    saved = []
    for batch in (1, 2):
        kept = {}

        def pack(tensor, kept=kept):
            if tensor.data_ptr() not in params and tensor.dtype.is_floating_point:
                kept[tensor.data_ptr(), tensor.numel()] = tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.patch_embed.backbone(torch.randn(batch, 3, size, size))
        saved.append(sum(kept.values()))
    per_image, fixed = saved[1] - saved[0], 2 * saved[0] - saved[1]
    assert shape.stem_elements == pytest.approx(per_image, rel=0.1)
    assert shape.stem_weights == pytest.approx(fixed, rel=0.05)
    assert shape.stem_checkpointed <= shape.stem_elements
    assert ModelShape.of("vit_test").stem_elements == 0
