"""ViTDet / SAM windowed attention and decomposed relative positions (ssl_vit.backbone.windows, the backbone's
window_size / global_attn_indexes / rel_pos): identities, a block against timm's SAM block, timm's SAM ViT imported,
a pre-trained run windowed for evaluation and fine-tuning, bad settings."""

import json

import pytest
import timm
import torch
from conftest import ROOT, TINY, export_script
from helpers.inprocess import pretrain
from hydra import compose, initialize_config_dir
from timm.models import vision_transformer_sam as timm_sam

from ssl_vit.artifacts import load_encoder, save_encoder
from ssl_vit.backbone import Block, build_vit, with_windows
from ssl_vit.backbone.windows import decomposed_rel_pos_bias, rel_pos_table, window_partition, window_unpartition
from ssl_vit.cli import register_configs
from ssl_vit.eval.run import evaluate
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.interop.timm import converts, from_timm
from ssl_vit.schema import ConfigError


def test_partition_and_unpartition_round_trip_with_padding_exactly():
    x = torch.randn(2, 64, 64, 8)
    windows, padded = window_partition(x, 14)  # 64 = 4 x 14 + 8: padded to 70
    assert padded == (70, 70) and windows.shape == (2 * 25, 14, 14, 8)
    assert torch.equal(window_unpartition(windows, 14, (64, 64), padded), x)
    assert torch.equal(windows[4][:, 8:], torch.zeros(14, 6, 8))  # the first row's last window: zero columns right
    assert torch.equal(windows[20][8:], torch.zeros(6, 14, 8))  # the last row's first window: zero rows below
    assert torch.equal(windows[0], x[0, :14, :14])


def _pair(**windowed):
    """A global vit_test at 32 px (8 x 8 grid, a class token, 2 registers) and the same weights windowed."""
    torch.manual_seed(0)
    plain = build_vit("vit_test", img_size=32, num_registers=2)
    other = build_vit("vit_test", img_size=32, num_registers=2, **windowed)
    missing = other.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert all("rel_pos" in name for name in missing)
    return plain.eval(), other.eval()


def test_a_window_covering_the_grid_and_zero_relative_positions_are_global_attention():
    images = torch.randn(2, 3, 32, 32)
    for windowed in ({"window_size": 8}, {"rel_pos": True}, {"window_size": 8, "rel_pos": True},
                     {"window_size": 8, "global_attn_indexes": [1]}):
        plain, other = _pair(**windowed)
        with torch.no_grad():
            torch.testing.assert_close(other.forward_features(images), plain.forward_features(images), atol=1e-5,
                                       rtol=0)
    plain, other = _pair(window_size=3, global_attn_indexes=[1])  # real windows (8 = 2 x 3 + 2: padded) differ
    with torch.no_grad():
        assert (other.forward_features(images) - plain.forward_features(images)).abs().max() > 1e-2


def test_the_decomposed_bias_is_q_dot_the_offset_rows_and_matches_timms():
    torch.manual_seed(0)
    q = torch.randn(3, 4 * 5, 6)
    table_h, table_w = torch.randn(2 * 4 - 1, 6), torch.randn(2 * 5 - 1, 6)
    bias = decomposed_rel_pos_bias(q, table_h, table_w, (4, 5), (4, 5))
    expected = torch.zeros(3, 20, 20)
    for i in range(20):
        for j in range(20):
            (y, x), (yk, xk) = divmod(i, 5), divmod(j, 5)
            expected[:, i, j] = q[:, i] @ (table_h[y - yk + 3] + table_w[x - xk + 4])
    torch.testing.assert_close(bias, expected, atol=1e-5, rtol=0)
    # a table made for another size (7 -> 2 x 9 - 1 offsets), and queries / keys of different sizes: as timm does
    for sizes in (((9, 9), (9, 9)), ((4, 5), (8, 10))):
        q = torch.randn(2, sizes[0][0] * sizes[0][1], 6)
        torch.testing.assert_close(decomposed_rel_pos_bias(q, table_h, table_w, *sizes),
                                   timm_sam.get_decomposed_rel_pos_bias(q, table_h, table_w, *sizes), atol=1e-5,
                                   rtol=0)
    assert rel_pos_table(4, 4, table_h).shape == (4, 4, 6)


def test_a_windowed_block_with_relative_positions_equals_timms_sam_block():
    """Window 3 on an 8 x 8 grid (padded), random non-zero relative-position tables, the same weights: timm's
    vision_transformer_sam.Block and ours give the same tokens."""
    torch.manual_seed(0)
    theirs = timm_sam.Block(32, 4, use_rel_pos=True, window_size=3, input_size=(8, 8)).eval()
    with torch.no_grad():
        theirs.attn.rel_pos_h.normal_(std=0.5)
        theirs.attn.rel_pos_w.normal_(std=0.5)
    ours = Block(32, 4, 128, norm_layer=lambda d: torch.nn.LayerNorm(d, eps=1e-5), window=3,
                 rel_pos_size=(3, 3)).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 8, 8, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x.reshape(2, 64, 32), grid=(8, 8)), theirs(x).reshape(2, 64, 32),
                                   atol=1e-5, rtol=0)
    global_theirs = timm_sam.Block(32, 4, use_rel_pos=True, window_size=0, input_size=(6, 6)).eval()
    with torch.no_grad():
        global_theirs.attn.rel_pos_h.normal_(std=0.5)
    global_ours = Block(32, 4, 128, norm_layer=lambda d: torch.nn.LayerNorm(d, eps=1e-5),
                        rel_pos_size=(6, 6)).eval()
    global_ours.load_state_dict(global_theirs.state_dict())
    x = torch.randn(2, 8, 8, 32)  # run at a larger grid than the tables were made for: resampled, as timm
    with torch.no_grad():
        torch.testing.assert_close(global_ours(x.reshape(2, 64, 32), grid=(8, 8)),
                                   global_theirs(x).reshape(2, 64, 32), atol=1e-5, rtol=0)


def test_bad_window_settings_are_one_line_each():
    cases = [
        ({"window_size": 4, "global_attn_indexes": [2]}, r"global_attn_indexes=\[2\]: \[2\] not a block of this "
                                                         r"depth-2 ViT \(valid: 0..1\)"),
        ({"global_attn_indexes": [0]}, "global_attn_indexes=[0] needs window_size > 0"),
        ({"window_size": 9}, "window_size=9 is larger than the 8x8 patch grid"),
        ({"rel_pos": True, "pos_embed": "rope"}, "rel_pos with pos_embed=rope"),
        ({"window_size": -1}, "window_size=-1 must be >= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")
                           if "\\" not in message else message) as err:
            build_vit("vit_test", img_size=32, **kwargs)
        assert "\n" not in str(err.value)
    windowed = build_vit("vit_test", img_size=32, window_size=4)
    with pytest.raises(ValueError, match="need every patch token on its grid"):
        windowed.forward_features(torch.randn(1, 3, 32, 32), keep=torch.arange(10)[None])


@pytest.mark.parametrize("config, objective, options", [("mae", "mae", "model.window_size=2"),
                                                        ("ijepa_tiny", "ijepa", "model.rel_pos=true")])
def test_objectives_that_drop_patches_refuse_windows_at_start_up_in_one_line(tmp_path, config, objective, options):
    """MAE's encoder sees 25% of the patches and I-JEPA's context encoder one block: windows and relative positions
    need the whole grid, so the run stops before building anything more (it failed in the first forward)."""
    proc = pretrain(*TINY, f"objective={config}", options, "data.img_size=32", "trainer.max_steps=1",
                    f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert line.startswith(f"ssl-vit: error: objective={objective} with {options}: its encoder sees a subset of "
                           "each image's patches, and windowed attention and relative positions need them all")
    assert "model.init_from=<this run> model.window_size=" in line


def test_with_windows_keeps_the_weights_and_adds_zero_tables():
    torch.manual_seed(0)
    plain = build_vit("vit_test", img_size=32).eval()
    windowed = with_windows(plain, 4, [1], rel_pos=True)
    assert windowed.config.window_size == 4 and windowed.blocks[1].attn.window == 0
    assert windowed.blocks[0].attn.window == 4 and torch.equal(windowed.blocks[0].attn.rel_pos_h,
                                                               torch.zeros(7, 16))
    assert torch.equal(windowed.blocks[0].attn.qkv.weight, plain.blocks[0].attn.qkv.weight)
    assert with_windows(plain) is plain  # nothing to change


def _compose(config, *overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose(config, overrides=list(overrides))


def test_evaluate_runs_an_encoder_of_ours_windowed_at_a_higher_resolution(tmp_path):
    """eval.window_size on a 16 px vit_test run at 48 px (a 12 x 12 grid in 4 x 4 windows, block 1 global): the
    features are those of the encoder rebuilt with those windows; a window covering the grid gives the global ones."""
    torch.manual_seed(0)
    path = save_encoder(build_vit("vit_test"), tmp_path / "run" / "encoder.safetensors", step=0)
    reports = {}
    for name, windows in (("global", []), ("whole", ["eval.window_size=12"]),
                          ("windowed", ["eval.window_size=4", "eval.global_attn_indexes=[1]"])):
        cfg = _compose("evaluate", f"checkpoint={path}", "data=digits", "data.img_size=48", "eval=knn",
                       "data.max_train_samples=200", "data.max_test_samples=50", "cache_dir=null",
                       f"output_dir={tmp_path / name}", *windows)
        reports[name] = evaluate(cfg, progress=False)["results"]["knn"]["accuracy"]
    assert reports["whole"] == reports["global"]
    with pytest.raises(ConfigError, match=r"^eval.global_attn_indexes=\[1\] needs eval.window_size > 0$"):
        evaluate(_compose("evaluate", f"checkpoint={path}", "data=digits", "eval=knn", "eval.global_attn_indexes=[1]",
                          f"output_dir={tmp_path}"), progress=False)
    with pytest.raises(ConfigError, match=r"^eval.window_size=20: window_size=20 is larger than the 4x4 patch grid"):
        evaluate(_compose("evaluate", f"checkpoint={path}", "data=digits", "eval=knn", "eval.window_size=20",
                          f"output_dir={tmp_path}"), progress=False)


@pytest.mark.slow
def test_a_globally_pre_trained_run_fine_tunes_windowed_from_init_from_with_overrides_only(tmp_path):
    """ViTDet's recipe on a tiny scale: a vit_test run (16 px, global) continues as objective=supervised at 48 px
    with 4 x 4 windows in block 0 (block 1 global) and zero-initialised relative positions that then train."""
    source = tmp_path / "source"
    assert pretrain(*TINY, "objective=masked_patch", "trainer.max_steps=2", f"hydra.run.dir={source}").returncode == 0
    out = tmp_path / "windowed"
    proc = pretrain(*TINY, "objective=supervised", f"model.init_from={source}", "data.img_size=48",
                    "model.window_size=4", "model.global_attn_indexes=[1]", "model.rel_pos=true",
                    "trainer.max_steps=3", "optim.warmup_steps=1", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    encoder = load_encoder(out / "encoder.safetensors")
    assert encoder.config.window_size == 4 and encoder.config.global_attn_indexes == (1,)
    assert encoder.grid_size == (12, 12) and encoder.blocks[0].attn.rel_pos_h.abs().sum() > 0  # trained from 0
    source_encoder = load_encoder(source / "encoder.safetensors")
    assert source_encoder.blocks[0].attn.rel_pos_h is None
    # continued again with another window: its trained tables (7 rows for window 4) resampled to window 3's 5
    again = tmp_path / "window3"
    proc = pretrain(*TINY, "objective=supervised", f"model.init_from={out}", "data.img_size=48",
                    "model.window_size=3", "model.global_attn_indexes=[1]", "model.rel_pos=true",
                    "trainer.max_steps=1", f"hydra.run.dir={again}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert load_encoder(again / "encoder.safetensors").blocks[0].attn.rel_pos_h.shape == (5, 16)


def test_timms_sam_vit_imports_with_its_windows_relative_positions_and_neck():
    """timm samvit_base_patch16 at 256 px (a 16 x 16 grid: windows of 14 padded to 28; blocks 2, 5, 8, 11 global),
    every weight moved off its init (the relative-position tables off zero): our encoder's forward_neck equals
    timm's forward_features (the neck's 256-channel map) within 1e-5."""
    torch.manual_seed(0)
    theirs = timm.create_model("samvit_base_patch16", pretrained=False, img_size=256, num_classes=0).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    assert converts(theirs)
    ours = from_timm(theirs).eval()
    assert ours.config.window_size == 14 and ours.config.global_attn_indexes == (2, 5, 8, 11)
    assert ours.config.rel_pos and ours.config.neck_channels == 256 and ours.num_prefix_tokens == 0
    images = torch.randn(2, 3, 256, 256)
    with torch.no_grad():
        expected = theirs.forward_features(images)
        torch.testing.assert_close(ours.forward_neck(images), expected, atol=1e-5, rtol=0)
        global_ = with_windows(ours, 0, []).eval().forward_neck(images)  # the windows matter here
    assert (global_ - expected).abs().max() > 1e-2


def test_exporting_a_windowed_encoder_to_a_library_vit_is_one_line(tmp_path):
    path = save_encoder(build_vit("vit_test", img_size=32, window_size=4, rel_pos=True),
                        tmp_path / "run" / "encoder.safetensors", step=0)
    with pytest.raises(ValueError, match=r"^--to hf: this encoder has ViTDet / SAM parts \({'window_size': 4, "
                                         r"'rel_pos': True}\) that a hf ViT does not hold"):
        export_script().export(str(path), "hf", str(tmp_path / "out"))


def test_a_windowed_encoder_exports_to_timms_sam_vit_with_our_outputs(tmp_path, capsys):
    """Windows of 5 on a 12 x 12 grid (padded), block 1 global, relative positions and a neck, every weight off its
    init: `ssl-vit export --to timm` writes timm's SAM ViT, which timm.create_model loads and which gives our
    forward_neck (1e-5). With a class token the export says in one line that it was dropped."""
    torch.manual_seed(0)
    ours = build_vit("vit_test", img_size=48, class_token=False, global_pool="avg", window_size=5,
                     global_attn_indexes=[1], rel_pos=True, neck_channels=16, norm_eps=1e-5).eval()
    with torch.no_grad():
        for param in ours.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = save_encoder(ours, tmp_path / "run" / "encoder.safetensors", step=0)
    line = export_script().export(str(path), "timm", str(tmp_path / "out"))
    assert "timm's SAM ViT" in line and capsys.readouterr().err == ""
    theirs = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    images = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(theirs.forward_features(images), ours.forward_neck(images), atol=1e-5, rtol=0)
    with_class = save_encoder(build_vit("vit_test", img_size=32, window_size=4),
                              tmp_path / "cls" / "encoder.safetensors", step=0)
    export_script().export(str(with_class), "timm", str(tmp_path / "out_cls"))
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("export:")]
    assert len(said) == 1 and said[0].startswith("export: timm's SAM ViT has no class or register tokens: the 1 "
                                                 "prefix token(s) were dropped")


# detectron2/modeling/backbone/vit.py (commit 0818132), read: ViT.__init__ builds patch_embed (PatchEmbed: proj),
# pos_embed (1, num_positions, D) with num_positions = (pretrain_img_size // patch_size) ** 2 + 1 if
# pretrain_use_cls_token, blocks[i] = Block(norm1, attn (qkv, proj, rel_pos_h, rel_pos_w if use_rel_pos), norm2,
# mlp = timm Mlp (fc1, fc2)); rel_pos tables (2 x input_size - 1, head_dim) with input_size the window for
# windowed blocks and the grid for the others; no class token, no final norm.
def _detectron2_names(depth: int, rel_pos: bool) -> set[str]:
    names = {"patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed"}
    for i in range(depth):
        names |= {f"blocks.{i}.{part}" for part in (
            "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
            "norm2.weight", "norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
            *(("attn.rel_pos_h", "attn.rel_pos_w") if rel_pos else ()))}
    return {"backbone.net." + name for name in names}


def test_the_detectron2_export_has_vitdets_names_and_layouts(tmp_path, capsys):
    torch.manual_seed(0)
    encoder = build_vit("vit_test", img_size=32, window_size=3, global_attn_indexes=[1], rel_pos=True)
    path = save_encoder(encoder, tmp_path / "run" / "encoder.safetensors", step=0)
    line = export_script().export(str(path), "detectron2", str(tmp_path / "out"))
    assert "train.init_checkpoint=" in line
    assert "left out" in capsys.readouterr().err  # the class token and the final norm
    state = torch.load(tmp_path / "out" / "vitdet_backbone.pth", weights_only=True)["model"]
    assert set(state) == _detectron2_names(2, rel_pos=True)
    assert state["backbone.net.pos_embed"].shape == (1, 1 + 8 * 8, 32)  # the class slot first, pre-training grid
    torch.testing.assert_close(state["backbone.net.pos_embed"], encoder.pos_embed.detach())
    assert state["backbone.net.blocks.0.attn.rel_pos_h"].shape == (2 * 3 - 1, 16)  # windowed block: the window
    assert state["backbone.net.blocks.1.attn.rel_pos_h"].shape == (2 * 8 - 1, 16)  # global block: the grid
    args = json.loads((tmp_path / "out" / "vitdet_args.json").read_text())
    assert args["window_block_indexes"] == [0] and args["pretrain_use_cls_token"] and args["pretrain_img_size"] == 32
    assert args["use_rel_pos"] and args["window_size"] == 3 and args["mlp_ratio"] == 4.0


@pytest.mark.slow
def test_a_segment_anything_checkpoint_imports_through_timms_port(tmp_path):
    """segment-anything's own names (image_encoder.*, mlp.lin1 / lin2; the prompt encoder and mask decoder beside
    them) as timm:samvit_base_patch16:<file> reads them (timm's checkpoint filter): our encoder gives the neck
    output of timm's model holding the same weights (at 256 px: positions resampled on the fly from 64 x 64)."""
    torch.manual_seed(0)
    reference = timm.create_model("samvit_base_patch16", pretrained=False, num_classes=0).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    sam = {"image_encoder." + name.replace("mlp.fc", "mlp.lin"): value
           for name, value in reference.state_dict().items() if not name.startswith("head")}
    sam["prompt_encoder.pe_layer.positional_encoding_gaussian_matrix"] = torch.randn(2, 128)
    torch.save(sam, tmp_path / "sam_vit_b.pth")
    encoder = load_pretrained(f"timm:samvit_base_patch16:{tmp_path / 'sam_vit_b.pth'}").encoder.eval()
    images = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        torch.testing.assert_close(encoder.forward_neck(images), reference.forward_features(images), atol=1e-5,
                                   rtol=0)
