"""2-D rotary position embeddings (ssl_vit.backbone.rope, model.pos_embed=rope) against DINOv3's formulas and timm's
port, and timm's DINOv3 ViTs imported with their outputs (1e-5, fp32)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from timm.layers import RotaryEmbeddingDinoV3

from ssl_vit.backbone import VisionTransformer
from ssl_vit.backbone.rope import AxialRope, MixedRope, Rope2D, apply_rope, build_rope
from ssl_vit.interop.hf_dinov3 import dinov3_refusals
from ssl_vit.interop.timm import export_timm, from_timm
from ssl_vit.optim import build_optimizer


def _dinov3_rope(head_dim, grid, base=100.0, min_period=None, max_period=None, normalize="separate", shift=None,
                 jitter=None, rescale=None, training=False):
    """facebookresearch/dinov3 `RopePositionEmbedding.forward`, written here from its code (float64 numpy for the
    coordinates and angles, torch's generator for the training-time draws, in its order)."""
    H, W = grid
    denominators = {"max": (max(H, W),) * 2, "min": (min(H, W),) * 2, "separate": (H, W)}[normalize]
    coords_h = np.arange(0.5, H) / denominators[0]
    coords_w = np.arange(0.5, W) / denominators[1]
    coords = np.stack(np.meshgrid(coords_h, coords_w, indexing="ij"), axis=-1).reshape(-1, 2) * 2.0 - 1.0
    if training and shift is not None:
        coords = coords + torch.empty(2).uniform_(-shift, shift).double().numpy()[None]
    if training and jitter is not None:
        coords = coords * torch.empty(2).uniform_(-np.log(jitter), np.log(jitter)).exp().double().numpy()[None]
    if training and rescale is not None:
        coords = coords * torch.empty(1).uniform_(-np.log(rescale), np.log(rescale)).exp().double().numpy()
    if base is not None:
        periods = base ** (2 * np.arange(head_dim // 4) / (head_dim // 2))
    else:
        ratio = max_period / min_period
        periods = ratio ** np.linspace(0, 1, head_dim // 4) / ratio * max_period
    angles = 2 * math.pi * coords[:, :, None] / periods[None, None, :]
    angles = np.tile(angles.reshape(len(coords), -1), 2)
    return np.sin(angles), np.cos(angles)


@pytest.mark.parametrize(("grid", "options"), [
    ((4, 4), {}), ((3, 5), {"normalize": "min"}), ((5, 3), {"normalize": "max"}),
    ((4, 6), {"theta": None, "min_period": 0.5, "max_period": 20.0})])
def test_the_tables_are_dinov3s_and_timms(grid, options):
    ours = Rope2D(32, **{"theta": 100.0, **options}).eval()
    reference = {"base" if k == "theta" else k: v for k, v in {"theta": 100.0, **options}.items()}
    for mine, theirs in zip(ours(grid), _dinov3_rope(32, grid, **reference), strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs, atol=2e-6, rtol=0)
    timm_rope = RotaryEmbeddingDinoV3(32, temperature=options.get("theta") or 100.0,  # unused with periods
                                      min_period=options.get("min_period"), max_period=options.get("max_period"),
                                      normalize_coords=options.get("normalize", "separate")).eval()
    sin, cos = timm_rope.get_embed(list(grid)).chunk(2, dim=-1)
    torch.testing.assert_close(ours(grid), (sin, cos), atol=1e-6, rtol=0)


def test_the_training_time_shift_jitter_and_rescale_are_dinov3s_draws():
    """The same draws in DINOv3's order (shift 2, jitter 2, rescale 1) give DINOv3's tables; in eval mode none."""
    rope = Rope2D(16, shift=0.5, jitter=1.5, rescale=2.0)
    torch.manual_seed(3)
    moved = rope((4, 5))
    torch.manual_seed(3)
    expected = _dinov3_rope(16, (4, 5), shift=0.5, jitter=1.5, rescale=2.0, training=True)
    for mine, theirs in zip(moved, expected, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs, atol=1e-5, rtol=0)
    assert not torch.allclose(moved[0], rope.eval()((4, 5))[0])
    torch.testing.assert_close(rope((4, 5)), Rope2D(16)((4, 5)))


def test_rotation_keeps_the_prefix_and_relative_positions():
    """A rotation: norms are kept, prefix tokens untouched, and a query-key score depends only on the offset of
    their positions along an axis (with the grid's normalisation fixed)."""
    rope = Rope2D(8, theta=10.0).eval()
    sin, cos = rope((1, 6))
    q = torch.randn(1, 1, 7, 8)
    rotated, _ = apply_rope(q, q, (sin, cos))
    torch.testing.assert_close(rotated[..., 0, :], q[..., 0, :])
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    same = torch.randn(8).expand(1, 1, 6, 8)
    r, _ = apply_rope(same, same, (sin, cos))
    scores = (r[0, 0] @ r[0, 0].T)
    torch.testing.assert_close(scores.diagonal(1), scores[0, 1].expand(5), atol=1e-5, rtol=0)
    keep = torch.tensor([[2, 5]])
    gathered = rope((1, 6), keep)
    torch.testing.assert_close(gathered[0][0], sin[[2, 5]])


def test_the_axial_and_mixed_tables_rotate_as_timms_rope_vit_embeddings():
    """RoPE-ViT's variants as timm builds them for its vit_*_rope[_mixed]_224 models (RotaryEmbeddingCat with
    in_pixels=False and RotaryEmbeddingMixed, 'xy' grids, temperatures 100 and 10), applied to q with timm's
    apply_rot_embed_cat behind 2 prefix tokens: ours rotates alike, on a non-square grid, per block for mixed."""
    from timm.layers import RotaryEmbeddingCat, RotaryEmbeddingMixed, apply_rot_embed_cat

    torch.manual_seed(0)
    heads, head_dim, depth, grid = 2, 16, 3, (3, 5)
    q = torch.randn(2, heads, 2 + 15, head_dim)
    theirs = RotaryEmbeddingCat(dim=head_dim, temperature=100.0, in_pixels=False, grid_indexing="xy")
    ours = build_rope("axial", head_dim, depth, heads, 100.0)
    assert isinstance(ours, AxialRope)
    expected = torch.cat([q[:, :, :2], apply_rot_embed_cat(q[:, :, 2:], theirs.get_embed(list(grid)))], dim=2)
    torch.testing.assert_close(apply_rope(q, q, ours(grid))[0], expected, atol=1e-6, rtol=1e-6)
    theirs = RotaryEmbeddingMixed(dim=heads * head_dim, depth=depth, num_heads=heads, temperature=10.0)
    ours = build_rope("mixed", head_dim, depth, heads)
    assert isinstance(ours, MixedRope) and ours.freqs.shape == theirs.freqs.shape
    # the init: per block and head, pairs (x, y) of timm's magnitudes along one random direction
    quarter = head_dim // 4
    torch.testing.assert_close(ours.freqs.norm(dim=0)[..., :quarter], theirs.freqs.norm(dim=0)[..., :quarter])
    with torch.no_grad():
        ours.freqs.copy_(theirs.freqs + 0.1 * torch.randn_like(theirs.freqs))
        theirs.freqs.copy_(ours.freqs)
    embeds = theirs.get_embed(list(grid))  # (depth, heads, N, 2 * head_dim)
    for block, tables in enumerate(ours(grid)):
        expected = torch.cat([q[:, :, :2], apply_rot_embed_cat(q[:, :, 2:], embeds[block])], dim=2)
        torch.testing.assert_close(apply_rope(q, q, tables)[0], expected, atol=1e-6, rtol=1e-6)
    keep = torch.tensor([[0, 4, 7], [14, 1, 2]])
    kept = ours(grid, keep)[1]
    for image in range(2):
        torch.testing.assert_close(kept[0][image], ours(grid)[1][0][0][:, keep[image]])
    with pytest.raises(ValueError, match=r"rope_kind 'spiral' is not one of \['dinov3', 'axial', 'mixed'\]"):
        build_rope("spiral", head_dim, depth, heads)
    with pytest.raises(ValueError, match=r"rope_kind='axial' takes rope_theta .*rope_normalize are the dinov3"):
        build_rope("axial", head_dim, depth, heads, normalize="max")


def test_perception_encoders_tables_are_timms_with_an_offset_and_a_reference_grid():
    """PE's axial RoPE (timm's RotaryEmbeddingCat at temperature 10000, grid_offset 1, ref_feat_shape: the indices
    of any grid rescaled onto the pre-training one) on non-square grids, applied behind a class token; and a NaFlex
    batch's patches, each placed by its own image's grid, get the rows of their image's table."""
    from timm.layers import RotaryEmbeddingCat, apply_rot_embed_cat

    torch.manual_seed(0)
    heads, head_dim, ref = 2, 16, (4, 6)
    ours = build_rope("axial", head_dim, 2, heads, 10000.0, offset=1.0, ref_grid=ref)
    for grid in ((3, 5), (4, 6), (8, 2)):
        theirs = RotaryEmbeddingCat(dim=head_dim, temperature=10000.0, in_pixels=False, grid_indexing="xy",
                                    grid_offset=1.0, ref_feat_shape=list(ref))
        q = torch.randn(2, heads, 1 + grid[0] * grid[1], head_dim)
        expected = torch.cat([q[:, :, :1], apply_rot_embed_cat(q[:, :, 1:], theirs.get_embed(list(grid)))], dim=2)
        torch.testing.assert_close(apply_rope(q, q, ours(grid))[0], expected, atol=1e-5, rtol=1e-6)
    # NaFlex: the patches of a 3x5 and an 8x2 image given one by one (rows, cols, heights, widths)
    places = [(r, c, h, w) for h, w in ((3, 5), (8, 2)) for r in range(h) for c in range(w)]
    points = [torch.tensor([p[i] for p in places]) for i in range(4)]
    sin, cos, _ = ours(None, points=points)
    torch.testing.assert_close(sin, torch.cat([ours((3, 5))[0], ours((8, 2))[0]]))
    torch.testing.assert_close(cos, torch.cat([ours((3, 5))[1], ours((8, 2))[1]]))
    with pytest.raises(ValueError, match=r"rope_offset / rope_ref_grid place rope_kind='axial' patch indices, not "
                                         r"rope_kind='dinov3'"):
        build_rope("dinov3", head_dim, 2, heads, offset=1.0)


def _perturbed_timm(name: str):
    """timm's `name` at 2 blocks, width 64, 64 px, every weight moved off its init (gammas and biases too)."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=64, embed_dim=64, num_heads=2, depth=2).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.mark.parametrize("name", ["vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224"])
def test_timms_rope_vit_models_import_with_their_outputs_and_export_back(name, tmp_path):
    """timm's RoPE-ViT ports (Eva, axial and mixed RoPE, layer scale, a qkv bias with a key part: RoPE-ViT keeps it),
    random weights moved off their init, 2 blocks at 64 px: every output token equals timm's; the mixed frequencies
    come along as rope.freqs. Trained further here (every weight moved again), --to timm writes a model directory
    timm builds as that architecture, with our outputs; transformers' DINOv3 export refuses the variant by name."""
    model = _perturbed_timm(name)
    ours = from_timm(model).eval()
    assert ours.config.rope_kind == ("mixed" if "mixed" in name else "axial")
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(images), model.forward_features(images), atol=1e-5,
                                   rtol=1e-5)
        for param in ours.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    export_timm(ours, tmp_path / "timm")
    assert json.loads((tmp_path / "timm" / "config.json").read_text())["architecture"] == name
    loaded = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    assert type(loaded.rope) is type(model.rope)
    with torch.no_grad():
        exported = loaded.forward_features(images)
        torch.testing.assert_close(exported, ours.forward_features(images), atol=1e-5, rtol=1e-5)
        assert (exported - model.forward_features(images)).abs().max() > 1e-2  # the moved weights, not timm's
    assert any("rope_kind=" in problem for problem in dinov3_refusals(ours.config))
    # neither RoPE-ViT's 1e-6 nor PE's 1e-5 (the eps of timm's axial entry points)
    odd = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=2, pos_embed="rope",
                            rope_kind=ours.config.rope_kind, rope_theta=100.0, norm_eps=1e-4)
    with pytest.raises(ValueError, match=rf"rope_kind='{ours.config.rope_kind}' .*cannot express: norm_eps=0.0001"):
        export_timm(odd, tmp_path / "refused")


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3", "vit_small_patch16_dinov3_qkvb"])
def test_timms_dinov3_vits_import_with_their_outputs(name):
    """Random weights (gammas and biases moved off their init) at 2 blocks, 64 px: every output token equals timm's
    at the native grid and another one (RoPE needs no resampling); the class token is the pooled embedding."""
    model = _perturbed_timm(name)
    ours = from_timm(model).eval()
    assert ours.config.pos_embed == "rope" and ours.num_prefix_tokens == 5 and ours.pos_embed is None
    for size in (64, 48):
        images = torch.randn(2, 3, size, size)
        with torch.no_grad():
            expected = model.forward_features(images)
            got = ours.forward_features(images)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(images), expected[:, 0], atol=1e-5, rtol=1e-5)
    rebuilt = VisionTransformer(ours.config)
    rebuilt.load_state_dict(ours.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval().forward_features(images), got)


def test_a_rope_backbone_trains_with_kept_subsets_and_bad_settings_are_named():
    vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, pos_embed="rope",
                            num_registers=1)
    images = torch.randn(2, 3, 16, 16)
    keep = torch.tensor([[0, 5, 9], [3, 4, 15]])
    subset = vit.eval().forward_features(images, keep=keep)
    whole_rows = torch.stack([vit.patch_embed(images)[i, keep[i]] for i in range(2)])
    by_hand = vit.run_blocks(vit.prepend_tokens(whole_rows), (4, 4), keep)
    torch.testing.assert_close(subset, by_hand)
    vit.train()(images).sum().backward()
    assert vit.pos_embed is None and "pos_embed" not in vit.state_dict()
    with pytest.raises(ValueError, match=r"pos_embed 'alibi' is not one of \['learned', 'sincos', 'rope', "
                                         r"'learned_rope', 'none'\]"):
        VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, pos_embed="alibi")
    with pytest.raises(ValueError, match=r"head dimension divisible by 4 .* got 6"):
        VisionTransformer(img_size=16, patch_size=4, embed_dim=12, depth=1, num_heads=2, pos_embed="rope")
    with pytest.raises(ValueError, match=r"the blocks need the patch grid"):
        vit.run_blocks(vit.embed(images))


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_dinov3vitmodel_both_ways_exact(tmp_path, qkv_bias):
    """transformers' DINOv3ViTModel (random weights from its config, 2 blocks, 4 registers, 64 px) imports with its
    outputs; our RoPE encoder exports as one that transformers loads with ours (last_hidden_state and pooler_output)
    at the native grid and another; a learned-position encoder is refused naming the option."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    from ssl_vit.interop.hf import export_hf, from_hf

    torch.manual_seed(0)
    hf_cfg = DINOv3ViTConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128,
                             image_size=64, num_register_tokens=4, query_bias=qkv_bias, value_bias=qkv_bias,
                             layerscale_value=0.1)
    model = DINOv3ViTModel(hf_cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path / "theirs")
    ours = from_hf(tmp_path / "theirs")
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(pixel_values=images)
        torch.testing.assert_close(ours.forward_features(images), expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    ours.blocks[0].ls1.gamma.data.uniform_(0.5, 1.5)  # and back: what transformers loads is ours
    export_hf(ours, tmp_path / "back")
    loaded = DINOv3ViTModel.from_pretrained(tmp_path / "back").eval()
    for size in (64, 80):
        images = torch.randn(2, 3, size, size)
        with torch.no_grad():
            out, tokens = loaded(pixel_values=images), ours.forward_features(images)
        torch.testing.assert_close(out.last_hidden_state, tokens, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.pooler_output, ours(images), atol=1e-5, rtol=1e-5)
    learned = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=2)
    with pytest.raises(ValueError, match=r"transformers dinov3 cannot represent this encoder: pos_embed='learned'"):
        export_hf(learned, tmp_path / "refused", arch="dinov3")
    if qkv_bias:  # under RoPE a key bias turns with the key's position: ours has none, so a nonzero one is refused
        keyed = DINOv3ViTModel(DINOv3ViTConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1,
                                               intermediate_size=128, image_size=64, key_bias=True))
        with torch.no_grad():
            keyed.model.layer[0].attention.k_proj.bias.fill_(0.1)
        keyed.save_pretrained(tmp_path / "keyed")
        with pytest.raises(ValueError, match=r"model.layer.0.attention.k_proj.bias is nonzero"):
            from_hf(tmp_path / "keyed")


@pytest.mark.parametrize("kind", ["dinov3", "axial", "mixed"])
@pytest.mark.parametrize("objective", [["objective=dinov2_tiny", "objective.out_dim=64", "objective.ibot_out_dim=64",
                                        "objective.local_crops=2"], ["objective=mae"], ["objective=masked_patch"]])
def test_model_pos_embed_rope_trains_the_objectives_that_place_tokens_themselves(objective, kind):
    """Through the config, each variant: multi-crop at two grids with iBOT's masked tokens, MAE's kept subsets and
    masked-patch prediction's replaced patches, each a finite loss with gradients reaching every block (and the mixed
    variant's frequencies, which get no weight decay)."""
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.data import make_loader
    from ssl_vit.train import build_components

    register_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=[*objective, "model=vit_test", "model.pos_embed=rope",
                                             f"model.rope_kind={kind}", "model.rope_rescale=2", "data.num_samples=8",
                                             "output_dir=x"])
    model, dataset, views, _ = build_components(cfg)
    assert model.backbone.pos_embed is None and model.backbone.rope.rescale == 2
    loss = model(next(iter(make_loader(dataset, views, batch_size=4))))["loss"]
    loss.backward()
    assert torch.isfinite(loss) and all(block.attn.qkv.weight.grad.abs().sum() > 0 for block in model.backbone.blocks)
    if kind == "mixed":
        assert model.backbone.rope.freqs.grad.abs().sum() > 0
        groups = build_optimizer(model, cfg.optim).param_groups
        assert [g["weight_decay"] for g in groups if any(p is model.backbone.rope.freqs for p in g["params"])] == [0]


def test_a_rope_encoder_exports_as_timms_dinov3_and_loads_there_with_our_outputs(tmp_path):
    """--to timm of a RoPE encoder: a timm model directory of the DINOv3 port (Eva) that timm builds from its
    config.json and loads; its tokens are ours. A setting Eva cannot express is refused by name."""
    torch.manual_seed(1)
    timm_model = timm.create_model("vit_small_patch16_dinov3_qkvb", pretrained=False, img_size=64, embed_dim=64,
                                   num_heads=2, depth=2).eval()
    ours = from_timm(timm_model).eval()
    with torch.no_grad():
        for param in ours.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    export_timm(ours, tmp_path / "timm")  # the key bias moved too: masked (RoPE), as Eva's zero k_bias
    loaded = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_features(images), ours.forward_features(images), atol=1e-5,
                                   rtol=1e-5)
    odd = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=2, pos_embed="rope",
                            norm_eps=1e-6, qk_norm=True)
    with pytest.raises(ValueError, match=r"cannot express: qk_norm=True, norm_eps=1e-06"):
        export_timm(odd, tmp_path / "refused")
    uneven = VisionTransformer(img_size=32, patch_size=16, embed_dim=44, depth=1, num_heads=1, pos_embed="rope",
                               mlp_dim=15, norm_eps=1e-5)  # int(44 * (15 / 44)) == 14
    with pytest.raises(ValueError, match=r"mlp_dim=15 is not int\(width x a ratio\)"):
        export_timm(uneven, tmp_path / "refused")
    from ssl_vit.interop.open_clip import vision_config  # open_clip's tower adds an absolute table

    with pytest.raises(ValueError, match=r"pos_embed='rope' \(open_clip's ViT adds an absolute"):
        vision_config(ours.config)


def test_sincos_is_maes_fixed_table_and_none_adds_no_position():
    """pos_embed=sincos: MAE's 2-D sin-cos table (class slot zero), not trained; none: nothing added, so the patch
    tokens' outputs follow a permutation of the patches."""
    from ssl_vit.backbone import sincos_pos_embed_2d

    fixed = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, pos_embed="sincos")
    assert not fixed.pos_embed.requires_grad
    torch.testing.assert_close(fixed.pos_embed.data, sincos_pos_embed_2d((4, 4), 32, 1))
    plain = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, pos_embed="none").eval()
    assert plain.pos_embed is None and plain.rope is None
    patches = plain.patch_embed(torch.randn(1, 3, 16, 16))
    tokens = plain.run_blocks(plain.prepend_tokens(patches))
    reversed_tokens = plain.run_blocks(plain.prepend_tokens(patches.flip(1)))
    torch.testing.assert_close(reversed_tokens[:, 1:], tokens[:, 1:].flip(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reversed_tokens[:, 0], tokens[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_model_init_from_takes_timms_dinov3_checkpoints_and_dinov3vitmodel_directories(tmp_path):
    """`model.init_from=timm:vit_small_patch16_dinov3:<file>` (a timm checkpoint of the full ViT-S/16, random
    weights) and `hf:<dir>` (a DINOv3ViTModel) start a run with those weights at data.img_size (no resampling)."""
    from hydra import compose, initialize_config_dir
    from safetensors.torch import save_file
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    from ssl_vit.cli import register_configs
    from ssl_vit.train import build_components

    torch.manual_seed(0)
    timm_model = timm.create_model("vit_small_patch16_dinov3", pretrained=False)
    save_file(timm_model.state_dict(), str(tmp_path / "dinov3_s16.safetensors"))
    DINOv3ViTModel(DINOv3ViTConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128,
                                   image_size=32, num_register_tokens=2)).save_pretrained(tmp_path / "hf")
    register_configs()
    images = torch.randn(2, 3, 32, 32)
    for spec, source in ((f"timm:vit_small_patch16_dinov3:{tmp_path / 'dinov3_s16.safetensors'}", timm_model),
                         (f"hf:{tmp_path / 'hf'}", None)):
        with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
            cfg = compose("pretrain", overrides=["objective=masked_patch", f"model.init_from={spec}",
                                                 "data.img_size=32", "data.num_samples=8", "output_dir=x"])
        backbone = build_components(cfg)[0].backbone.eval()
        assert backbone.config.pos_embed == "rope" and backbone.patch_embed.img_size == (32, 32)
        if source is not None:
            with torch.no_grad():
                torch.testing.assert_close(backbone.forward_features(images), source.eval().forward_features(images),
                                           atol=1e-5, rtol=1e-5)
        else:
            assert backbone.num_prefix_tokens == 3 and backbone.embed_dim == 64
