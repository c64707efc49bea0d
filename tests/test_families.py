"""The 2024-26 encoder families (SwiGLU, RMSNorm, MAP heads) against timm and transformers themselves: each family
preset is timm's architecture, and tiny random models (weights moved off init) move both ways with equal outputs
in fp32; what a library cannot hold is refused in one line."""

import pytest
import timm
import torch
import transformers
from helpers.builders import randomise
from helpers.inprocess import pretrain, run_script

from ssl_vit.backbone import PRESETS, build_vit, count_parameters
from ssl_vit.backbone.mlp import dinov2_swiglu_hidden
from ssl_vit.interop.hf import export_hf, from_hf
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.interop.timm import _timm_rope_state, export_timm, from_timm
from ssl_vit.naflex import batch_grids, pack

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
# family preset -> the timm model that defines it (presets.py says which)
TIMM_OF_PRESET = {"vit_g14_dinov2": "vit_giant_patch14_dinov2", "vit_hplus16_dinov3": "vit_huge_plus_patch16_dinov3",
                  "vit_7b16_dinov3": "vit_7b_patch16_dinov3", "vit_so400m14_siglip": "vit_so400m_patch14_siglip_224",
                  "vit_so400m16_siglip2": "vit_so400m_patch16_siglip_256", "vit_l14_aimv2": "aimv2_large_patch14_224",
                  "vit_h14_aimv2": "aimv2_huge_patch14_224", "vit_b16_pe": "vit_pe_core_base_patch16_224",
                  "vit_l14_pe": "vit_pe_core_large_patch14_336", "vit_g14_pe": "vit_pe_core_gigantic_patch14_448"}
# timm entry point, its size overrides at test scale
TIMM_FAMILIES = {"dinov2_g": ("vit_giant_patch14_dinov2", dict(mlp_ratio=8.0, init_values=1e-5)),
                 "siglip_so400m": ("vit_so400m_patch14_siglip_224", dict(mlp_ratio=3.0)),
                 "siglip2_so400m": ("vit_so400m_patch16_siglip_256", dict(mlp_ratio=3.0)),
                 "aimv2": ("aimv2_large_patch14_224", dict(mlp_ratio=2.75)),
                 "dinov3_hplus": ("vit_huge_plus_patch16_dinov3", dict(mlp_ratio=3.0, global_pool="token")),
                 "dinov3_7b": ("vit_7b_patch16_dinov3", dict(mlp_ratio=2.0, global_pool="token")),
                 # Perception Encoder: a learned table with RoPE placed on a 2x2 reference grid (the 4x4 grid here
                 # rescaled onto it), offset 1 (core B / L) or 0 and no class token (core G, its own MLP ratio)
                 "pe_core_b": ("vit_pe_core_base_patch16_224", dict(ref_feat_shape=(2, 2))),
                 "pe_core_g": ("vit_pe_core_gigantic_patch14_448", dict(ref_feat_shape=(2, 2), mlp_ratio=2.5))}


def _images(n=2, size=16):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", sorted(TIMM_OF_PRESET))
def test_each_family_preset_is_timms_architecture(preset):
    """Same parameter names (timm's, through the RoPE renaming for DINOv3) and shapes, built on the meta device."""
    with torch.device("meta"):
        ours = build_vit(preset)
        theirs = timm.create_model(TIMM_OF_PRESET[preset], pretrained=False, num_classes=0)
    state = {k: v.shape for k, v in ours.state_dict().items()}
    if ours.config.has_rope:
        state = {k: v.shape for k, v in _timm_rope_state(ours.state_dict(), ours.config.rope_kind).items()}
    expected = {k: v.shape for k, v in theirs.state_dict().items() if not k.endswith("k_bias")}
    assert state == expected
    assert count_parameters(ours) == sum(v.numel() for v in expected.values())


@pytest.mark.parametrize("family", sorted(TIMM_FAMILIES))
def test_timm_families_import_and_export_with_equal_outputs(tmp_path, family):
    """timm -> ours (from_timm) -> a timm model directory (--to timm) -> timm.create_model('local-dir:...'), forward
    equal within 1e-5, random weights."""
    name, sizes = TIMM_FAMILIES[family]
    torch.manual_seed(0)
    theirs = timm.create_model(name, pretrained=False, num_classes=0, **TINY, **sizes).eval()
    randomise(theirs)
    ours = from_timm(theirs).eval()
    export_timm(ours, tmp_path)
    back = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.forward_features(images), theirs.forward_features(images), atol=1e-5, rtol=0)
        torch.testing.assert_close(back(images), ours(images), atol=1e-5, rtol=0)


def _hf_model(kind: str):
    """A transformers model of each family built by transformers itself at test size (its own init)."""
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
    if kind == "dinov2_swiglu":
        return transformers.Dinov2Model(transformers.Dinov2Config(**common, mlp_ratio=4, use_swiglu_ffn=True,
                                                                  layerscale_value=0.5))
    if kind == "dinov3_gated":
        return transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(
            **common, intermediate_size=48, use_gated_mlp=True, hidden_act="silu", num_register_tokens=2,
            query_bias=False, value_bias=False, layer_norm_eps=1e-5))
    if kind == "siglip_map":
        return transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
            **common, intermediate_size=64, vision_use_head=True))
    if kind == "aimv2":
        return transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(
            **common, intermediate_size=88, use_head=False))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["dinov2_swiglu", "dinov3_gated", "siglip_map", "aimv2"])
def test_transformers_families_import_and_export_with_equal_outputs(tmp_path, kind):
    """A transformers directory (its own save_pretrained) -> ours (hf:) -> --to hf -> transformers again: tokens
    and pooled outputs equal within 1e-5."""
    torch.manual_seed(0)
    theirs = _hf_model(kind).eval()
    randomise(theirs)
    theirs.save_pretrained(tmp_path / "theirs")
    ours = load_pretrained(f"hf:{tmp_path / 'theirs'}").encoder.eval()
    arch = {"dinov2_swiglu": "dinov2", "dinov3_gated": "dinov3", "siglip_map": "siglip", "aimv2": "aimv2"}[kind]
    export_hf(ours, tmp_path / "back", arch=arch)
    back = type(theirs).from_pretrained(tmp_path / "back").eval()
    images = _images()
    with torch.no_grad():
        out, again = theirs(pixel_values=images), back(pixel_values=images)
        torch.testing.assert_close(ours.forward_features(images), out.last_hidden_state, atol=1e-5, rtol=0)
        torch.testing.assert_close(again.last_hidden_state, out.last_hidden_state, atol=1e-5, rtol=0)
        if out.pooler_output is not None:  # SigLIP's MAP head; DINOv2 / v3's class token
            torch.testing.assert_close(ours(images), out.pooler_output, atol=1e-5, rtol=0)
            torch.testing.assert_close(again.pooler_output, out.pooler_output, atol=1e-5, rtol=0)
        else:  # AIMv2 pools nothing itself: ours is the mean of its last hidden state
            torch.testing.assert_close(ours(images), out.last_hidden_state.mean(1), atol=1e-5, rtol=0)


def test_siglip2_with_its_map_head_moves_to_transformers_and_back_on_naflex_batches(tmp_path):
    ours = build_vit("vit_test_siglip", pos_embed_interp="bilinear").eval()
    randomise(ours)
    export_hf(ours, tmp_path, arch="siglip2")
    theirs = transformers.Siglip2VisionModel.from_pretrained(tmp_path).eval()
    images = [torch.randn(3, 16, 24), torch.randn(3, 24, 12), torch.randn(3, 8, 8)]
    batch = pack(images, 4, seq_len=32)
    with torch.no_grad():
        out = theirs(pixel_values=batch["patches"], pixel_attention_mask=batch["patch_valid"].long(),
                     spatial_shapes=torch.tensor(batch_grids(batch)))
        torch.testing.assert_close(ours(batch), out.pooler_output, atol=1e-5, rtol=0)
        valid = batch["patch_valid"]
        torch.testing.assert_close(ours.forward_features(batch)[valid], out.last_hidden_state[valid], atol=1e-5,
                                   rtol=0)
        back = from_hf(tmp_path)
        torch.testing.assert_close(back(batch), ours(batch), atol=1e-5, rtol=0)


def test_dinov2_swiglu_width_is_dinov2s_rule():
    """DINOv2's SwiGLUFFNFused: (int(width x ratio x 2/3) + 7) // 8 x 8 (ViT-g/14: 4096), as the preset has it."""
    assert dinov2_swiglu_hidden(1536, 4) == 4096 == PRESETS["vit_g14_dinov2"]["mlp_dim"]
    assert dinov2_swiglu_hidden(32, 4) == 88 == PRESETS["vit_test_dinov2"]["mlp_dim"]


@pytest.mark.parametrize(("preset", "to", "arch", "message"), [
    ("vit_test_aimv2", "hf", "vit", "mlp_kind='swiglu' (vit has a plain MLP"),
    ("vit_test_aimv2", "hf", "siglip", "norm_layer='rmsnorm' (siglip has LayerNorms"),
    ("vit_test_siglip", "hf", "dinov2", "only --hf-arch siglip / siglip2 have a MAP head"),
    ("vit_test_siglip", "hf", "aimv2", "mlp_kind='mlp' (Aimv2VisionModel has a SwiGLU MLP)"),
    ("vit_test_dinov2", "open_clip", None, "mlp_kind='swiglu_packed'"),
    ("vit_test_pe", "hf", None, "pos_embed='learned_rope' (Perception Encoder: transformers has no vision model"),
    ("vit_test_pe", "hf", "dinov3", "pos_embed='learned_rope' (DINOv3ViTModel has rotary position embeddings only"),
    ("vit_test_pe", "open_clip", None, "pos_embed='learned_rope' (open_clip's ViT adds an absolute"),
])
def test_a_family_exported_where_the_library_lacks_it_is_one_line(preset, to, arch, message):
    encoder = build_vit(preset)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        if to == "hf":
            export_hf(encoder, "/nonexistent/never-written", arch=arch)
        else:
            from ssl_vit.interop.open_clip import vision_config

            vision_config(encoder.config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "message"), [
    ("eva02_tiny_patch14_224", r"this one has RotaryEmbeddingCat \(grid_indexing='ij'"),  # EVA-02's RoPE
    ("vit_pe_spatial_base_patch16_512", r"no final norm \(vit_pe_lang_\*, vit_pe_spatial_\*\)"),
])
def test_an_unknown_family_from_timm_is_one_line(name, message):
    """A timm Eva family whose RoPE grid or layout ssl-vit does not build (EVA-02's 'ij' grid) or whose ViT has no
    final norm (PE lang / spatial) is refused naming what differs."""
    theirs = timm.create_model(name, pretrained=False, num_classes=0, img_size=32, patch_size=4, embed_dim=32,
                               depth=1, num_heads=2)
    with pytest.raises(ValueError, match=message) as err:
        from_timm(theirs)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "objective", "targets"), [
    ("vit_test_aimv2", "mae", ("timm", "hf")), ("vit_test_siglip", "supervised", ("timm", "hf")),
    ("vit_test_pe", "dinov2", ("timm",))])  # transformers has no Perception Encoder
def test_a_family_model_pretrains_evaluates_exports_and_serves_a_vlm(tmp_path, preset, objective, targets):
    """SwiGLU + RMSNorm (AIMv2's block), the MAP head (SigLIP's) and Perception Encoder's learned table with RoPE
    and its pool over the class token through the real commands: pretrain, evaluate (its pooled embedding),
    export to timm and transformers (each read back by the library), and VisionEncoder's tokens for a VLM."""
    from ssl_vit import load_encoder

    run = tmp_path / "run"
    proc = pretrain(f"model={preset}", f"objective={objective}", "data.num_samples=32", "data.batch_size=16",
                    "trainer.max_steps=2", "optim.warmup_steps=1", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_script("scripts/evaluate.py", run, "data=synthetic", "data.num_samples=64", "eval=knn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pooled embedding" in proc.stderr + proc.stdout
    ours = load_pretrained(str(run)).encoder.eval()
    images = _images()
    for to in targets:
        proc = run_script("scripts/export.py", run, "--to", to, "--out", tmp_path / to)
        assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(images), ours(images), atol=1e-5, rtol=0)
        if "hf" in targets:
            hf = transformers.AutoModel.from_pretrained(tmp_path / "hf").eval()
            torch.testing.assert_close(hf(pixel_values=images).last_hidden_state, ours.forward_features(images),
                                       atol=1e-5, rtol=0)
    vlm = load_encoder(run)  # the VLM settings: the second-to-last block, no prefix tokens
    tokens = vlm(images)
    assert tokens.shape == (2, ours.patch_embed.num_patches, ours.embed_dim)
