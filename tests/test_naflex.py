"""NaFlex batches in the backbone (ssl_vit.naflex, VisionTransformer on patch dicts): one image equals the dense
forward at its grid for every position-embedding kind, padding and batch company change no valid token, and parity
with timm's NaFlexVit and transformers' Siglip2VisionModel in both directions."""

import pytest
import timm
import torch
import transformers

from ssl_vit.backbone import build_vit
from ssl_vit.interop.hf import export_hf, from_hf
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.interop.timm import converts, from_timm
from ssl_vit.interop.timm_naflex import export_timm_naflex
from ssl_vit.naflex import NaFlexLayout, batch_grids, pack, patchify, unpack, unpatchify

IMAGES = ((24, 40), (32, 32), (16, 48), (8, 12))  # pixels; 4 x 4 patches: grids 6x10, 8x8, 4x12, 2x3

POSITIONS = {
    "learned": {}, "sincos": dict(pos_embed="sincos"), "rope_dinov3": dict(pos_embed="rope"),
    "rope_axial": dict(pos_embed="rope", rope_kind="axial"), "rope_mixed": dict(pos_embed="rope", rope_kind="mixed"),
    "registers_avg": dict(num_registers=2, class_token=False, global_pool="avg"),
    "bilinear_no_antialias": dict(pos_embed_interp="bilinear", pos_embed_antialias=False),
    "parallel_22b": dict(parallel_block=True, qk_norm=True, class_token=False, global_pool="avg"),
}


def _moved(model, scale=0.05, seed=0):
    """Weights moved off their init (a zero-init part would hide a mapping error)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model.eval()


def _images(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=generator) for h, w in IMAGES]


def test_patchify_is_timm_and_transformers_layout_and_inverts():
    image = torch.randn(3, 8, 12)
    patches, grid = patchify(image, 4)
    theirs, their_grid = timm.models.naflexvit.batch_patchify(image[None], (4, 4))
    assert grid == tuple(their_grid) == (2, 3) and torch.equal(patches, theirs[0])
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches
    assert torch.equal(patches, convert_image_to_patches(image, 4))
    assert torch.equal(unpatchify(patches, grid, 4), image)


@pytest.mark.parametrize("kind", list(POSITIONS))
def test_one_image_equals_the_dense_forward_at_its_grid(kind):
    vit = _moved(build_vit("vit_tiny", **POSITIONS[kind]))
    images = _images()
    batch = pack(images, 4, seq_len=64)
    with torch.no_grad():
        tokens, pooled = vit.forward_features(batch), vit(batch)
        for row, image in enumerate(images):
            dense = vit.forward_features(image[None])[0]
            assert torch.allclose(tokens[row, :len(dense)], dense, atol=1e-5), kind
            assert torch.allclose(pooled[row], vit(image[None])[0], atol=1e-5), kind


def test_padding_and_batch_company_change_no_valid_token():
    # in float64, so that the bound measures the masking and not fp32 rounding (fp32 differs by ~1e-6 relative)
    vit = _moved(build_vit("vit_tiny", pos_embed="rope", num_registers=1, global_pool="avg")).double()
    images = [image.double() for image in _images()]
    with torch.no_grad():
        alone = [vit.forward_features(pack([image], 4)) for image in images]  # no padding at all
        padded = vit.forward_features(pack(images, 4, seq_len=96))
        pooled_alone = [vit(pack([image], 4)) for image in images]
        pooled = vit(pack(images, 4, seq_len=96))
    prefix = vit.num_prefix_tokens
    for row, single in enumerate(alone):
        assert (padded[row, :single.shape[1]] - single[0]).abs().max() < 1e-6
        assert (pooled[row] - pooled_alone[row][0]).abs().max() < 1e-6
    valid = unpack(padded[:, prefix:], pack(images, 4, seq_len=96))
    assert [len(t) for t in valid] == [60, 64, 48, 6]


def test_layout_reads_grids_and_places_shuffled_patches_by_their_coordinates():
    images = _images()
    batch = pack(images, 4, seq_len=64)
    assert batch_grids(batch) == [(6, 10), (8, 8), (4, 12), (2, 3)]
    layout = NaFlexLayout.of(batch)
    assert layout.index[0, :12].tolist() == list(range(12)) and layout.index[3, 6:].eq(0).all()
    # the same patches in another order (a token drop or shuffle keeps coordinates): same outputs, permuted
    vit = _moved(build_vit("vit_tiny", pos_embed="rope"))
    order = torch.randperm(60, generator=torch.Generator().manual_seed(1))
    one = pack(images[:1], 4)
    shuffled = {key: value[:, order] for key, value in one.items()}
    with torch.no_grad():
        reference, permuted = vit.forward_features(one)[0, 1:], vit.forward_features(shuffled)[0, 1:]
    assert torch.allclose(permuted, reference[order], atol=1e-5)


def test_gradients_of_padding_are_zero_for_the_patch_embedding():
    vit = build_vit("vit_tiny", global_pool="avg")
    batch = pack(_images(), 4, seq_len=64)
    batch["patches"].requires_grad_(True)
    pooled = vit(batch)
    (pooled * torch.randn(pooled.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    grad = batch["patches"].grad
    assert grad[~batch["patch_valid"]].abs().max() == 0 and grad[batch["patch_valid"]].abs().max() > 0


@pytest.mark.parametrize("kind", ["learned", "rope_mixed", "registers_avg"])
def test_a_naflex_step_gives_bitwise_the_same_gradients_every_time(kind):
    """Many images of one grid read the same position rows: their gradients are summed in a fixed order (two
    fresh NaFlex runs once differed by 1 ulp from step 3 on: advanced indexing's backward accumulates in a
    thread-dependent order on the CPU). Two threads, as a training process has; 128 images on 3 grids."""
    vit = _moved(build_vit("vit_tiny", **POSITIONS[kind])).train()
    generator = torch.Generator().manual_seed(0)
    shapes = [(32, 16)] * 52 + [(16, 32)] * 41 + [(20, 20)] * 35  # the first batch of the 32 px recipe's grids
    images = [torch.randn(3, h, w, generator=generator) for h, w in shapes]
    batch = pack(images, 4, seq_len=32)  # 8 x 4, 4 x 8 and 5 x 5 patches
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(4):
            vit.zero_grad()
            vit.forward_features(batch).pow(2).mean().backward()
            runs.append({name: p.grad.clone() for name, p in vit.named_parameters() if p.grad is not None})
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert [name for name in runs[0] if not torch.equal(runs[0][name], other[name])] == []


def test_bad_naflex_inputs_are_one_line_each():
    batch = pack(_images()[:1], 4)
    with pytest.raises(ValueError, match="does not fit a sequence of 8"):
        pack(_images()[:1], 4, seq_len=8)
    with pytest.raises(ValueError, match="does not divide into 4x4 patches"):
        patchify(torch.zeros(3, 10, 12), 4)
    with pytest.raises(ValueError, match="this patch embedding takes 8x8x3 = 192"):
        build_vit("vit_tiny", patch_size=8)(batch)
    with pytest.raises(ValueError, match="need the patch stem"):
        build_vit("vit_tiny_r")(batch)
    with pytest.raises(ValueError, match="windowed attention or relative positions"):
        build_vit("vit_tiny", window_size=4)(batch)


# ----- timm's NaFlexVit both ways -----
@pytest.mark.parametrize("pool", ["token", "avg"])
def test_timm_naflexvit_imports_exactly(pool):
    torch.manual_seed(0)
    theirs = _moved(timm.create_model("naflexvit_base_patch16_gap", num_classes=0, img_size=32, patch_size=4,
                                      embed_dim=64, depth=2, num_heads=4, reg_tokens=1, class_token=True,
                                      global_pool=pool, init_values=0.1))
    assert converts(theirs)
    ours = from_timm(theirs).eval()
    batch = pack(_images(), 4, seq_len=64)
    with torch.no_grad():
        assert torch.allclose(ours(batch), theirs(batch), atol=1e-6)
        image = torch.randn(1, 3, 24, 40)
        assert torch.allclose(ours(image), theirs(image), atol=1e-6)


@pytest.mark.parametrize("kind", ["learned", "sincos_avg", "registers"])
def test_our_encoder_exports_to_timm_naflexvit_exactly(tmp_path, kind):
    options = {"learned": {}, "sincos_avg": dict(pos_embed="sincos", class_token=False, global_pool="avg"),
               "registers": dict(num_registers=2, act_layer="gelu_tanh")}[kind]
    ours = _moved(build_vit("vit_tiny", **options))
    export_timm_naflex(ours, tmp_path)
    theirs = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert type(theirs).__name__ == "NaFlexVit"
    batch = pack(_images(), 4, seq_len=64)
    back = load_pretrained(f"timm:{tmp_path}")  # the directory as an import spec: NaFlexVit comes back as ours
    assert back.preprocess.img_size == 32
    with torch.no_grad():
        assert torch.allclose(theirs(batch), ours(batch), atol=1e-6)
        assert torch.allclose(back.encoder(batch), ours(batch), atol=1e-6)


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_siglip", "naflexvit_base_patch16_map"])
def test_timm_naflexvit_with_a_map_head_moves_both_ways_exactly(tmp_path, name):
    """SigLIP 2's NaFlex family: the MAP head attends over each image's own patches (padding masked), both ways."""
    torch.manual_seed(0)
    theirs = timm.create_model(name, num_classes=0, img_size=32, patch_size=4, embed_dim=64, depth=2,
                               num_heads=4).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # off init, the latent and the pool's MLP too
    ours = from_timm(theirs).eval()
    assert ours.config.global_pool == "map" and ours.attn_pool is not None
    batch = pack(_images(), 4, seq_len=64)
    export_timm_naflex(ours, tmp_path)
    back = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(batch), theirs(batch), atol=1e-5, rtol=0)
        torch.testing.assert_close(back(batch), ours(batch), atol=1e-5, rtol=0)
        padded = pack(_images(), 4, seq_len=96)  # more padding changes nothing: it is never attended
        torch.testing.assert_close(ours(padded), ours(batch), atol=1e-5, rtol=0)


# ----- transformers' SigLIP 2 NaFlex vision model both ways -----
def _siglip2_inputs(batch):
    return dict(pixel_values=batch["patches"], pixel_attention_mask=batch["patch_valid"].long(),
                spatial_shapes=torch.tensor(batch_grids(batch)))


def test_siglip2_export_and_import_match_transformers(tmp_path):
    ours = _moved(build_vit("vit_tiny", class_token=False, global_pool="avg", pos_embed_interp="bilinear",
                            act_layer="gelu_tanh"))
    export_hf(ours, tmp_path, "siglip2")
    theirs = transformers.Siglip2VisionModel.from_pretrained(tmp_path).eval()
    batch = pack(_images(), 4, seq_len=64)
    valid = batch["patch_valid"]
    with torch.no_grad():
        hidden = theirs(**_siglip2_inputs(batch)).last_hidden_state
        tokens = ours.fc_norm(ours.forward_features(batch))  # SigLIP normalises every token (post_layernorm)
        assert (hidden[valid] - tokens[valid]).abs().max() < 1e-5
        back = from_hf(tmp_path)
        assert back.config.pos_embed_interp == "bilinear"
        assert torch.allclose(back.forward_features(batch)[valid], ours.forward_features(batch)[valid], atol=1e-6)


def test_siglip2_model_from_transformers_imports(tmp_path):
    config = transformers.Siglip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, patch_size=4, num_patches=64,
                                              vision_use_head=False)
    torch.manual_seed(0)
    theirs = _moved(transformers.Siglip2VisionModel(config))
    theirs.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    batch = pack(_images(), 4, seq_len=64)
    valid = batch["patch_valid"]
    with torch.no_grad():
        hidden = theirs(**_siglip2_inputs(batch)).last_hidden_state
        assert (hidden[valid] - ours.fc_norm(ours.forward_features(batch))[valid]).abs().max() < 1e-5


def test_siglip2_export_refuses_bicubic_position_resampling_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="train with model.pos_embed_interp=bilinear"):
        export_hf(build_vit("vit_tiny", class_token=False, global_pool="avg"), tmp_path, "siglip2")


# ----- evaluation and VLMs -----
def _compose(config, *overrides):
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.paths import CONFIG_DIR

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose(config, overrides=list(overrides))


def test_evaluate_with_naflex_sees_each_image_whole_at_its_aspect(tmp_path):
    """eval.resolution=naflex on mixed-aspect shapes: the k-NN features are the encoder's pooled output of each whole
    image resized within eval.seq_len patches (checked against packing the images by hand), cached apart from the
    fixed-size ones; evaluators that read fixed-size images are refused in one line."""
    from ssl_vit.artifacts import save_encoder
    from ssl_vit.data import SyntheticShapes
    from ssl_vit.data.naflex import NaFlexEvalViews
    from ssl_vit.eval.features import features_from_tokens
    from ssl_vit.eval.run import evaluate
    from ssl_vit.schema import ConfigError

    vit = _moved(build_vit("vit_tiny", global_pool="avg", class_token=False))
    path = save_encoder(vit, tmp_path / "run" / "encoder.safetensors", step=0)
    common = [f"checkpoint={path}", "data=synthetic", "data.num_samples=64", "data.aspect_ratios=[0.5,1,2]",
              "eval=knn", "eval.features=pooled", f"output_dir={tmp_path / 'eval'}", "cache_dir=null"]
    report = evaluate(_compose("evaluate", *common, "eval.resolution=naflex", "eval.seq_len=48"), progress=False)
    fixed = evaluate(_compose("evaluate", *common), progress=False)
    assert 0 <= report["results"]["knn"]["accuracy"] <= 1 and "knn" in fixed["results"]
    views = NaFlexEvalViews(("image", "label"), 4, 48, report["preprocess"]["mean"], report["preprocess"]["std"])
    test = SyntheticShapes(16, 32, seed=1, aspect_ratios=(0.5, 1.0, 2.0))
    images = [views(test[i])["image"] for i in range(4)]
    shapes = {tuple(image.shape[1:]) for image in images}
    assert (24, 24) in shapes and (36, 20) in shapes  # a square image on 6 x 6 patches, a tall one on 9 x 5
    with torch.no_grad():
        packed = features_from_tokens(vit.eval(), views.stack_images(images), "pooled")
        alone = torch.cat([vit(image[None]) for image in images])
    assert torch.allclose(packed, alone, atol=1e-5)
    with pytest.raises(ConfigError, match=r"eval.resolution=naflex with eval.window_size"):
        evaluate(_compose("evaluate", *common, "eval.resolution=naflex", "eval.window_size=4"), progress=False)
    with pytest.raises(ConfigError, match=r"eval.resolution=naflex runs eval=.*not \['segmentation'\]"):
        evaluate(_compose("evaluate", *common[:-3], "eval=segmentation", "eval.resolution=naflex",
                          f"output_dir={tmp_path / 'seg'}"), progress=False)


def test_vision_encoder_gives_token_sets_with_coordinates():
    from ssl_vit import VisionEncoder
    from ssl_vit.preprocess import Preprocess

    vit = _moved(build_vit("vit_tiny", num_registers=1))
    encoder = VisionEncoder(vit, Preprocess(32), layer=-2, drop_prefix=True).eval()
    uint8 = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in ((30, 60), (40, 40))]
    batch = encoder.preprocess_naflex(uint8, seq_len=64)
    sets = encoder.token_sets(batch)
    assert [grid for _, _, grid in sets] == [(5, 10), (8, 8)]  # SigLIP 2's rule: 2:1 kept exactly
    with torch.no_grad():
        for (tokens, coords, grid), image_index in zip(sets, range(2), strict=True):
            assert tokens.shape == (grid[0] * grid[1], vit.embed_dim) and coords[-1].tolist() == [grid[0] - 1,
                                                                                                  grid[1] - 1]
            pixels = unpatchify(batch["patches"][image_index], grid, 4)[None]
            dense = VisionEncoder(vit, layer=-2, drop_prefix=True)(pixels)[0]  # the same image as pixels
            assert torch.allclose(tokens, dense, atol=1e-5)


def test_our_encoder_is_a_drop_in_vision_tower_for_lfm2_vl(tmp_path):
    """LFM2-VL (transformers' SigLIP 2 NaFlex VLM): our encoder exported as its Siglip2VisionModel loads unchanged,
    and our VisionEncoder in the vision tower's seat gives the same image features and logits."""
    from transformers import Lfm2Config, Lfm2VlConfig, Lfm2VlForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from ssl_vit import VisionEncoder
    from ssl_vit.naflex import from_siglip2, to_siglip2

    ours = _moved(build_vit("vit_tiny", class_token=False, global_pool="avg", pos_embed_interp="bilinear",
                            act_layer="gelu_tanh"))
    export_hf(ours, tmp_path, "siglip2")
    tower = transformers.Siglip2VisionModel.from_pretrained(tmp_path).eval()
    image_token = 99
    config = Lfm2VlConfig(vision_config=tower.config.to_dict(), text_config=Lfm2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=100).to_dict(), projector_hidden_size=64, downsample_factor=2, image_token_id=image_token)
    torch.manual_seed(0)
    vlm = Lfm2VlForConditionalGeneration(config).eval()
    vlm.model.vision_tower.load_state_dict(tower.state_dict(), strict=True)
    encoder = VisionEncoder.from_pretrained(f"hf:{tmp_path}", layer=None, drop_prefix=True)

    class OurTower(torch.nn.Module):  # SigLIP's post_layernorm normalises every token: our fc_norm, per token
        def forward(self, pixel_values, spatial_shapes, pixel_attention_mask, **kwargs):
            batch = from_siglip2(pixel_values, spatial_shapes, pixel_attention_mask)
            return BaseModelOutputWithPooling(last_hidden_state=encoder.vit.fc_norm(encoder(batch)))

    batch = pack(_images()[:3], 4, seq_len=64)
    inputs = to_siglip2(batch)
    count = (inputs["spatial_shapes"][0] // 2).prod().item()
    prompt = torch.tensor([[1, 5] + [image_token] * count + [7, 8]])
    first = {key: value[:1] for key, value in inputs.items()}
    with torch.no_grad():
        theirs = vlm.model.get_image_features(**inputs).pooler_output
        their_logits = vlm(input_ids=prompt, **first).logits
        vlm.model.vision_tower = OurTower()
        mine = vlm.model.get_image_features(**inputs).pooler_output
        my_logits = vlm(input_ids=prompt, **first).logits
    assert [len(t) for t in mine] == [15, 16, 12]  # 6x10, 8x8, 4x12 patches merged 2 x 2
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(mine, theirs, strict=True))
    assert (my_logits - their_logits).abs().max() < 1e-4 and torch.isfinite(my_logits).all()


def test_compiled_blocks_compile_once_per_bucket_at_most_not_per_batch():
    """Per-block torch.compile (as trainer.compile) on NaFlex batches from the schedule (4 buckets, a batch size
    each, every batch its own mix of grids): the graphs compiled over the first pass through the buckets are all
    there are; 3 more passes of new images compile nothing (a batch's grids change tables, not shapes)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ssl_vit.data.naflex import NaFlexSchedule, NaFlexSettings, grid_for_seq
    from ssl_vit.train.strategy import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    vit = build_vit("vit_test", pos_embed="rope", num_registers=1, global_pool="avg", class_token=False)
    compile_blocks(vit, backend="aot_eager")
    schedule = NaFlexSchedule(NaFlexSettings(4, (8, 16, 24, 32), 128, 8), seed=0)
    generator = torch.Generator().manual_seed(0)
    by_bucket, compiled = {}, []
    for step in range(64):
        seq_len, batch = schedule.at(step)
        by_bucket.setdefault(seq_len, []).append(step)
        images = []
        for _ in range(batch):
            aspect = float(torch.empty(()).uniform_(0.25, 4, generator=generator))
            rows, cols = grid_for_seq(100, round(100 * aspect), 4, seq_len)
            images.append(torch.randn(3, rows * 4, cols * 4, generator=generator))
        vit(pack(images, 4, seq_len)).square().mean().backward()
        compiled.append(counters["stats"]["unique_graphs"])
    first_pass = max(min(steps) for steps in by_bucket.values())  # every bucket seen once by then
    assert len(by_bucket) == 4 and compiled[-1] == compiled[first_pass]
    # measured: 2 (the first shape static, then one graph with dynamic sizes for every later shape)
    assert compiled[-1] <= len(by_bucket), compiled


def test_a_token_drop_keeps_positions_and_validity_consistent():
    """Kept slots (each image's valid patches first, then its padding) give the outputs of the whole batch with the
    dropped patches masked out (each image's grid, and so its positions, unchanged); the kept padding stays masked."""
    from ssl_vit.naflex import drop_patches

    vit = _moved(build_vit("vit_tiny", pos_embed="rope", num_registers=1, global_pool="avg", class_token=False))
    batch = pack(_images(), 4, seq_len=64)
    keep = drop_patches(batch, 0.5, torch.Generator().manual_seed(0))
    kept_valid = batch["patch_valid"].gather(1, keep)
    assert keep.shape == (4, 32) and kept_valid.sum(1).tolist() == [32, 32, 32, 6]  # the 2x3 image: all 6, padding
    prefix = vit.num_prefix_tokens
    with torch.no_grad():
        tokens = vit.forward_features(batch, keep=keep)
        layout = vit.naflex_layout(batch)
        only_kept = torch.zeros_like(batch["patch_valid"]).scatter(1, keep, True) & batch["patch_valid"]
        masked = vit.run_blocks(vit.embed_naflex(batch, layout), NaFlexLayout(layout.grids, layout.index, only_kept))
    for row in range(4):
        expected = masked[row, prefix:][keep[row][kept_valid[row]]]
        assert torch.allclose(tokens[row, prefix:][kept_valid[row]], expected, atol=1e-5)
    assert torch.allclose(vit.pool(tokens, kept_valid)[3], vit(pack(_images()[3:], 4))[0], atol=1e-5)


def test_under_bf16_autocast_a_naflex_batch_runs_as_the_dense_one():
    """The position embeddings are added as the dense path adds them (fp32 tables promote the bf16 patches), so
    one image gives the same tokens in the same dtype either way."""
    vit = _moved(build_vit("vit_tiny", class_token=False, global_pool="avg"))
    image = _images()[0]
    batch = pack([image], 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        dense, naflex = vit.forward_features(image[None]), vit.forward_features(batch)
    assert naflex.dtype == dense.dtype == torch.float32
    assert (vit.pool(naflex, batch["patch_valid"]) - vit.pool(dense)).abs().max() < 1e-4
