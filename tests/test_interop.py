"""Export to and import from transformers, timm, open_clip and ONNX; `model.init_from` and `checkpoint=` imports;
`VisionEncoder` layers against transformers' hidden_states and timm's forward_intermediates; the LLaVA drop-in."""

import json
import os
import re
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, check_ok, export_script, read_metrics
from helpers.inprocess import run_script
from helpers.ranks import pretrain_ranks

from ssl_vit.artifacts import save_encoder
from ssl_vit.backbone import build_vit
from ssl_vit.files import plain_mode
from ssl_vit.interop.hf import export_hf, from_hf
from ssl_vit.interop.onnx import export_onnx
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.interop.timm import export_timm
from ssl_vit.preprocess import Preprocess

TRANSFORMERS4 = ROOT / ".venv" / "compat" / "transformers4"


def perturbed(name="vit_test", seed=0, **options):
    """A preset with every weight moved off its init (so biases, norms and layer scales all matter)."""
    torch.manual_seed(seed)
    encoder = build_vit(name, **options).eval()
    with torch.no_grad():
        for param in encoder.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return encoder


def images(n=2, size=16, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


# (hf arch, our options): every option each target maps, incl. folds (layer scale, no biases, register positions)
HF_CASES = [
    ("vit", {}),
    ("vit", {"layer_scale": 0.1, "qkv_bias": False, "norm_bias": False, "act_layer": "quick_gelu", "norm_eps": 1e-12}),
    ("vit", {"no_embed_class": True}),
    ("dinov2", {"layer_scale": 1e-5}),
    ("dinov2", {"layer_scale": 0.1, "num_registers": 2, "act_layer": "gelu_tanh"}),
    ("dinov2", {"num_registers": 3, "no_embed_class": True}),
    ("clip", {"pre_norm": True, "layer_scale": 0.1, "norm_eps": 1e-5}),
    ("siglip", {"class_token": False, "global_pool": "avg", "act_layer": "gelu_tanh"}),
]


@pytest.mark.parametrize("arch,options", HF_CASES, ids=[f"{a}-{'-'.join(o) or 'plain'}" for a, o in HF_CASES])
def test_hf_export_loads_exactly_and_imports_back(tmp_path, arch, options):
    """AutoModel.from_pretrained: no missing / unexpected key; pooler_output = our embedding (SigLIP: every token
    through fc_norm), every hidden state = ours; from_hf gives our encoder back."""
    import transformers

    encoder = perturbed(**options)
    export_hf(encoder, tmp_path, arch, preprocess=Preprocess(16))
    model, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    x = images()
    with torch.no_grad():
        out = model.eval()(pixel_values=x, output_hidden_states=True)
        tokens = encoder.forward_features(x)
        if arch == "siglip":
            close(out.last_hidden_state, encoder.fc_norm(tokens))
        else:
            close(out.pooler_output, encoder(x))
        if not options.get("num_registers"):  # DINOv2 puts registers after the class token, as we do
            states = [encoder.norm_pre(encoder.embed(x))]
            for block in encoder.blocks:
                states.append(block(states[-1]))
            for theirs, ours in zip(out.hidden_states, states, strict=True):
                close(theirs, ours)
        back = from_hf(tmp_path)
        close(back.forward_features(x), tokens)
        close(back(x), encoder(x))


def test_hf_vit_model_at_224_with_vit_s16(tmp_path):
    import transformers

    encoder = perturbed("vit_s16", img_size=224)
    export_hf(encoder, tmp_path, "vit")
    model = transformers.ViTModel.from_pretrained(tmp_path).eval()
    x = images(1, 224)
    with torch.no_grad():
        close(model(pixel_values=x).pooler_output, encoder(x))


@pytest.mark.parametrize("arch,options,message", [
    ("vit", {"qk_norm": True}, r"qk_norm=True .*timm, onnx and safetensors"),
    ("clip", {"parallel_block": True, "qk_norm": True, "qkv_bias": False, "class_token": False, "global_pool": "avg"},
     r"parallel_block=True .*qk_norm=True .*class_token=False, global_pool='avg' .*--hf-arch siglip.*pre_norm=False"),
    ("vit", {"num_registers": 2}, r"num_registers=2 \(of these, only --hf-arch dinov2"),
    ("vit", {"pre_norm": True}, r"pre_norm=True .*--hf-arch clip"),
    ("siglip", {}, r"class_token=True \(SigLIP has no class token"),
    ("dinov2", {"mlp_dim": 80}, r"mlp_dim=80 .*integer mlp_ratio"),
    ("vit", {"img_size": [16, 24]}, r"img_size=\[16, 24\] \(transformers' vision configs take square sizes\)"),
])
def test_hf_export_refuses_what_the_target_cannot_hold_naming_the_option_and_alternatives(tmp_path, arch, options,
                                                                                          message):
    with pytest.raises(ValueError, match=message):
        export_hf(build_vit("vit_test", **options), tmp_path, arch)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("arch,options", [("vit", {}), ("dinov2", {"layer_scale": 0.1}), ("clip", {"pre_norm": True}),
                                          ("dinov2", {"layer_scale": 0.1, "num_registers": 2})])
def test_hf_import_resamples_position_embeddings_as_transformers_does(tmp_path, arch, options):
    """Our imported encoder at 24 px = the transformers model at 24 px with interpolate_pos_encoding=True (bicubic;
    Dinov2WithRegisters antialiases, the others do not)."""
    import transformers

    export_hf(perturbed(**options), tmp_path, arch)
    model = transformers.AutoModel.from_pretrained(tmp_path).eval()
    ours = from_hf(tmp_path)
    ours.set_img_size(24)
    x = images(2, 24)
    with torch.no_grad():
        close(model(pixel_values=x, interpolate_pos_encoding=True).pooler_output, ours(x))


@pytest.mark.skipif(not (TRANSFORMERS4 / "transformers").is_dir(),
                    reason="transformers 4.x not installed: bash scripts/get_transformers4.sh")
@pytest.mark.slow
def test_hf_exports_load_exactly_in_transformers_4(tmp_path):
    """The directories written here (with transformers 5.x installed) load in transformers 4.57 (LLaVA-family pins)
    with no missing or unexpected key, and give our outputs, in a subprocess with 4.57 first on PYTHONPATH."""
    x = images()
    torch.save(x, tmp_path / "images.pt")
    manifest = []
    cases = [("vit", {"layer_scale": 0.1}), ("dinov2", {"layer_scale": 0.1}),
             ("dinov2", {"layer_scale": 0.1, "num_registers": 2}), ("clip", {"pre_norm": True}),
             ("siglip", {"class_token": False, "global_pool": "avg"})]
    for i, (arch, options) in enumerate(cases):
        encoder = perturbed(**options)
        projection = torch.randn(8, 32) if arch == "clip" else None
        export_hf(encoder, tmp_path / str(i), arch, projection)
        with torch.no_grad():
            tokens = encoder.forward_features(x)
            expected = {"last_hidden_state": encoder.fc_norm(tokens)} if arch == "siglip" else \
                {"pooler_output": encoder(x)}
            if arch == "clip":  # CLIPVisionModelWithProjection: image_embeds and hidden states, no pooler_output
                expected = {"image_embeds": encoder(x) @ projection.T,
                            "hidden_states:-2": encoder.blocks[:-1](encoder.norm_pre(encoder.embed(x)))}
        torch.save(expected, tmp_path / f"{i}.pt")
        manifest.append({"dir": str(tmp_path / str(i)), "inputs": str(tmp_path / "images.pt"),
                         "expected": str(tmp_path / f"{i}.pt")})
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    env = {**os.environ, "PYTHONPATH": str(TRANSFORMERS4), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/load_in_transformers.py"),
                           str(tmp_path / "manifest.json")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["version"].startswith("4."), report["version"]
    classes = [m["class"] for m in report["models"]]
    assert classes == ["ViTModel", "Dinov2Model", "Dinov2WithRegistersModel", "CLIPVisionModelWithProjection",
                       "SiglipVisionModel"], classes
    for model in report["models"]:
        assert not model["missing"] and not model["unexpected"] and not model["mismatched"], model
        assert max(model["errors"].values()) <= 1e-5, model


# ----- timm -----
TIMM_CASES = [{}, {"layer_scale": 0.1, "qk_norm": True, "num_registers": 2, "act_layer": "quick_gelu"},
              {"pre_norm": True}, {"class_token": False, "global_pool": "avg", "no_embed_class": True},
              {"pre_norm": True, "class_token": False, "global_pool": "avg"}]


@pytest.mark.parametrize("options", TIMM_CASES,
                         ids=["plain", "ls-qknorm-reg-quickgelu", "prenorm", "avg", "prenorm-avg"])
def test_timm_export_loads_through_timms_own_loader_and_imports_back(tmp_path, options):
    import timm

    encoder = perturbed(**options)
    squash = bool(options.get("pre_norm"))  # and the squash resize through timm's crop_mode
    export_timm(encoder, tmp_path, Preprocess(16, interpolation="bicubic", crop_pct=0.875,
                                              resize_mode="squash" if squash else "shortest"))
    hub = json.loads((tmp_path / "config.json").read_text())
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == plain_mode()  # not 0600: shareable
    by_dir = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    by_file = timm.create_model(hub["architecture"], pretrained=True, **hub["model_args"],
                                pretrained_cfg_overlay=dict(file=str(tmp_path / "model.safetensors"))).eval()
    x = images()
    with torch.no_grad():
        close(by_dir(x), encoder(x))
        close(by_file(x), encoder(x))
        back = load_pretrained(f"timm:{tmp_path}")
        close(back.encoder(x), encoder(x))
    assert back.preprocess.interpolation == "bicubic" and back.preprocess.crop_pct == 0.875
    assert back.preprocess.resize_mode == ("squash" if squash else "shortest")
    assert by_dir.pretrained_cfg["crop_pct"] == 0.875


def test_timm_names_for_presets_and_refusals():
    from ssl_vit.interop.timm import timm_architecture, timm_model_args

    with pytest.raises(ValueError, match=r"mlp_dim=480 \(timm rebuilds int\(width x mlp_ratio\) = 479\)"):
        timm_model_args(build_vit("vit_test", embed_dim=104, num_heads=2, mlp_dim=480).config)
    with pytest.raises(ValueError, match=r"parallel_block=True .*norm_bias=False .*norm_eps=1e-05"):
        timm_model_args(build_vit("vit_test_22b", norm_eps=1e-5).config)

    assert timm_architecture(build_vit("vit_b16", img_size=32).config) == "vit_base_patch16_224"
    assert timm_architecture(build_vit("vit_s16", img_size=32).config) == "vit_small_patch16_224"
    assert timm_architecture(build_vit("vit_test").config) == "vit_base_patch16_224"  # sizes from model_args


def test_timm_import_resamples_position_embeddings_as_timm_does(tmp_path):
    import timm

    encoder = perturbed()
    export_timm(encoder, tmp_path)
    timm_24 = timm.create_model(f"local-dir:{tmp_path}", pretrained=True, img_size=24).eval()  # timm resamples
    ours = load_pretrained(f"timm:{tmp_path}").encoder
    ours.set_img_size(24)
    with torch.no_grad():
        close(ours(images(2, 24)), timm_24(images(2, 24)))


def _write_vit_npz(model, path):
    """A timm ViT in the original ViT release's .npz layout (Transformer/encoderblock_i/..., HWIO kernels)."""
    def t(tensor):
        return tensor.detach().numpy()

    width, heads = model.embed_dim, model.blocks[0].attn.num_heads
    w = {"embedding/kernel": t(model.patch_embed.proj.weight.permute(2, 3, 1, 0)),
         "embedding/bias": t(model.patch_embed.proj.bias), "cls": t(model.cls_token),
         "Transformer/posembed_input/pos_embedding": t(model.pos_embed),
         "Transformer/encoder_norm/scale": t(model.norm.weight), "Transformer/encoder_norm/bias": t(model.norm.bias)}
    for i, block in enumerate(model.blocks):
        p = f"Transformer/encoderblock_{i}/"
        qkv_w, qkv_b = block.attn.qkv.weight.chunk(3), block.attn.qkv.bias.chunk(3)
        for name, weight, bias in zip(("query", "key", "value"), qkv_w, qkv_b, strict=True):
            w[f"{p}MultiHeadDotProductAttention_1/{name}/kernel"] = t(weight.T.reshape(width, heads, -1))
            w[f"{p}MultiHeadDotProductAttention_1/{name}/bias"] = t(bias.reshape(heads, -1))
        w[f"{p}MultiHeadDotProductAttention_1/out/kernel"] = t(block.attn.proj.weight.T.reshape(heads, -1, width))
        w[f"{p}MultiHeadDotProductAttention_1/out/bias"] = t(block.attn.proj.bias)
        for norm, name in ((block.norm1, "LayerNorm_0"), (block.norm2, "LayerNorm_2")):
            w[f"{p}{name}/scale"], w[f"{p}{name}/bias"] = t(norm.weight), t(norm.bias)
        for r, fc in enumerate((block.mlp.fc1, block.mlp.fc2)):
            w[f"{p}MlpBlock_3/Dense_{r}/kernel"], w[f"{p}MlpBlock_3/Dense_{r}/bias"] = t(fc.weight.T), t(fc.bias)
    np.savez(path, **w)


def test_timm_checkpoint_files_import_through_timms_own_loader(tmp_path):
    """timm:<name>:<file> for a state dict (.pth, .safetensors) and the original ViT release's .npz layout (read by
    timm's big_vision loader): vit_tiny_patch16_224 at full size, random weights (no hub here)."""
    import timm
    from safetensors.torch import save_file

    source = timm.create_model("vit_tiny_patch16_224", num_classes=0).eval()
    with torch.no_grad():
        for param in source.parameters():
            param.add_(0.02 * torch.randn_like(param))
    x = images(1, 224)
    with torch.no_grad():
        expected = source(x)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "w.safetensors"))
    _write_vit_npz(source, tmp_path / "w.npz")
    for name in ("w.pth", "w.safetensors", "w.npz"):
        imported = load_pretrained(f"timm:vit_tiny_patch16_224:{tmp_path / name}")
        with torch.no_grad():
            close(imported.encoder(x), expected)
        assert imported.identity["timm"] == "vit_tiny_patch16_224"


# ----- ONNX -----
@pytest.mark.parametrize("options", [{}, {"qk_norm": True, "parallel_block": True, "qkv_bias": False,
                                          "layer_scale": 0.1, "class_token": False, "global_pool": "avg",
                                          "num_registers": 2},
                                     {"name": "vit_test_pe"},  # PE: a learned table, axial RoPE, the pool over all
                                     {"pos_embed": "rope", "rope_kind": "mixed"}])
def test_onnx_export_matches_in_onnxruntime_with_a_dynamic_batch(tmp_path, options):
    import onnxruntime

    encoder = perturbed(**options)
    path, error = export_onnx(encoder, tmp_path, Preprocess(16))
    assert error <= 1e-5
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = images(5)
    embedding, tokens = session.run(None, {"pixel_values": x.numpy()})
    with torch.no_grad():
        close(torch.from_numpy(embedding), encoder(x))
        close(torch.from_numpy(tokens), encoder.forward_features(x))
    assert json.loads((tmp_path / "preprocess.json").read_text())["img_size"] == 16


# ----- the export script -----
def test_export_script_converts_between_every_format(tmp_path, capsys):
    """ours -> timm (the script as `python scripts/export.py` runs it) -> (import) -> hf -> (import) -> ours -> onnx
    through scripts/export.py; bad input exits 2 naming the problem. The weights and the preprocessing survive the
    whole chain."""
    encoder = perturbed(layer_scale=0.1)
    save_encoder(encoder, tmp_path / "run" / "encoder.safetensors", Preprocess(16, mean=[0.5] * 3, std=[0.25] * 3))
    proc = run_script(ROOT / "scripts/export.py", tmp_path / "run", "--to", "timm", "--out", tmp_path / "timm")
    assert proc.returncode == 0 and "timm.create_model('local-dir:" in proc.stdout, proc.stderr[-2000:]
    script = export_script()
    for args in ([f"timm:{tmp_path / 'timm'}", "--to", "hf", "--out", str(tmp_path / "hf")],
                 [f"hf:{tmp_path / 'hf'}", "--to", "safetensors", "--out", str(tmp_path / "back")],
                 [str(tmp_path / "back"), "--to", "onnx", "--out", str(tmp_path / "onnx")]):
        assert script.main(args) == 0
    assert "onnxruntime vs torch" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "dinov2"  # layer scale
    back = load_pretrained(str(tmp_path / "back"))
    x = images()
    with torch.no_grad():
        close(back.encoder(x), encoder(x))
    assert back.preprocess.mean == [0.5] * 3 and back.preprocess.std == [0.25] * 3  # carried through timm and HF
    bad = [str(tmp_path / "run"), "--to", "hf", "--hf-arch", "siglip", "--out", str(tmp_path / "bad")]
    assert script.main(bad) == 2
    assert "class_token=True (SigLIP has no class token" in capsys.readouterr().err


def test_hf_preprocessor_configs_in_the_older_number_form_read_as_transformers_reads_them(tmp_path):
    """openai/clip-vit-large-patch14-336 style: "size": 336, "crop_size": 336 (plain numbers)."""
    from ssl_vit.interop.hf import hf_preprocess

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": 256, "crop_size": 224, "do_center_crop": True, "image_mean": [0.48, 0.46, 0.41],
        "image_std": [0.27, 0.26, 0.28], "resample": 3}))
    read = hf_preprocess(tmp_path, 518)
    assert read.img_size == 224 and int(224 / read.crop_pct) == 256 and read.interpolation == "bicubic"


@pytest.mark.parametrize("spec,message", [("hf:/nonexistent", "no config.json"),
                                          ("timm:not_a_model", "is not a timm model name"),
                                          ("timm:vit_tiny_patch16_224:/nonexistent.pth", "no checkpoint file"),
                                          ("open_clip:/nonexistent", "open_clip_config.json"),
                                          ("/nonexistent", "valid forms")])
def test_bad_import_specs_name_the_problem(spec, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_pretrained(spec)


# ----- VisionEncoder and the LLaVA drop-in -----
def test_vision_encoder_layers_match_transformers_hidden_states_and_timm_intermediates(tmp_path):
    import timm
    import transformers

    from ssl_vit import VisionEncoder

    vit = perturbed(depth=3, num_registers=2, layer_scale=0.1)
    export_timm(vit, tmp_path / "timm")
    timm_model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    x = images()
    with torch.no_grad():
        for layer, block_index in ((-2, 1), (-1, 2), (1, 0)):
            tokens, prefix = timm_model.forward_intermediates(x, indices=[block_index], norm=False, output_fmt="NLC",
                                                              return_prefix_tokens=True, intermediates_only=True)[0]
            keep = VisionEncoder(vit, layer=layer, drop_prefix=False)(x)
            close(keep, torch.cat([prefix, tokens], dim=1))
            close(VisionEncoder(vit, layer=layer, drop_prefix=True)(x), tokens)  # class token + 2 registers dropped
        close(VisionEncoder(vit, layer=None, drop_prefix=False)(x), vit.forward_features(x))
        close(VisionEncoder(vit, layer=0, drop_prefix=False)(x), vit.embed(x))
    clip_vit = perturbed(depth=3, pre_norm=True)
    export_hf(clip_vit, tmp_path / "hf", "clip")
    hf = transformers.CLIPVisionModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        states = hf(pixel_values=x, output_hidden_states=True).hidden_states
        for layer in range(-4, 4):
            close(VisionEncoder(clip_vit, layer=layer, drop_prefix=False)(x), states[layer])
        for ours, theirs in zip(VisionEncoder(clip_vit).hidden_states(x), states, strict=True):
            close(ours, theirs)
    with pytest.raises(ValueError, match=r"layer=4 is out of range for 3 blocks: valid are -4..3"):
        VisionEncoder(clip_vit, layer=4)


def test_llava_takes_the_exported_clip_tower_unchanged_and_our_encoder_gives_its_image_features(tmp_path):
    """A tiny LlavaForConditionalGeneration (Llama text model, vision_feature_layer=-2, strategy "default") gets our
    exported CLIPVisionModel weights; its image features = projector(VisionEncoder(layer=-2, drop_prefix=True)),
    and a forward with an image and a prompt runs."""
    from transformers import CLIPVisionModel, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from ssl_vit import VisionEncoder, mlp_projector

    vit = perturbed(depth=3, pre_norm=True, img_size=32)
    preprocess = Preprocess(32, mean=[0.48, 0.46, 0.41], std=[0.27, 0.26, 0.28], interpolation="bicubic")
    export_hf(vit, tmp_path, "clip", preprocess=preprocess)
    tower = CLIPVisionModel.from_pretrained(tmp_path)  # what LLaVA's own code loads
    image_token = 99
    config = LlavaConfig(vision_config=tower.config, text_config=LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=100), vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_token_index=image_token, projector_hidden_act="gelu")
    llava = LlavaForConditionalGeneration(config).eval()
    llava.model.vision_tower.load_state_dict(tower.state_dict(), strict=True)
    projector = mlp_projector(vit.embed_dim, 64)
    projector[0].load_state_dict(llava.model.multi_modal_projector.linear_1.state_dict())
    projector[2].load_state_dict(llava.model.multi_modal_projector.linear_2.state_dict())
    encoder = VisionEncoder.from_pretrained(f"hf:{tmp_path}", layer=-2, drop_prefix=True)
    x = images(2, 32)
    with torch.no_grad():
        features = llava.model.get_image_features(pixel_values=x, vision_feature_layer=-2,
                                                  vision_feature_select_strategy="default").pooler_output
        close(torch.stack(list(features)), projector(encoder(x)))
        prompt = torch.tensor([[1, 5] + [image_token] * encoder.num_patches + [7, 8]])
        logits = llava(input_ids=prompt, pixel_values=x[:1]).logits
    assert logits.shape == (1, prompt.shape[1], 100) and torch.isfinite(logits).all()


PHOTOS = ("astronaut", "chelsea", "coffee")  # 512x512, 300x451, 400x600


def _photos():
    from PIL import Image
    from skimage import data

    return [Image.fromarray(getattr(data, name)()) for name in PHOTOS]


@pytest.mark.parametrize("crop_pct,resize_mode", [(1.0, "shortest"), (0.875, "shortest"), (1.0, "squash")])
def test_auto_image_processor_of_our_export_equals_our_preprocessing_on_real_photos(tmp_path, crop_pct, resize_mode):
    from transformers import AutoImageProcessor

    from ssl_vit import VisionEncoder

    preprocess = Preprocess(32, mean=[0.48, 0.46, 0.41], std=[0.27, 0.26, 0.28], interpolation="bicubic",
                            crop_pct=crop_pct, resize_mode=resize_mode)
    export_hf(perturbed(img_size=32), tmp_path, "vit", preprocess=preprocess)
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    encoder = VisionEncoder.from_pretrained(f"hf:{tmp_path}")
    read_back = encoder.preprocessing  # from preprocessor_config.json
    assert (read_back.mean, read_back.std, read_back.interpolation) == (preprocess.mean, preprocess.std, "bicubic")
    assert read_back.resize_mode == resize_mode and int(32 / read_back.crop_pct) == int(32 / crop_pct)
    for image in _photos():
        close(encoder.preprocess([image]), processor(images=image, return_tensors="pt")["pixel_values"])


@pytest.mark.parametrize("processor_class", ["ViTImageProcessor", "SiglipImageProcessor", "BitImageProcessor"])
def test_transformers_own_image_processors_are_read_as_they_resize(tmp_path, processor_class):
    """Directories with transformers' own processors: ViT's and SigLIP's resize both sides (squash), DINOv2's
    BitImageProcessor the shorter side then a centre crop; ours equals theirs on the photos (non-square ones too)."""
    import transformers

    from ssl_vit import VisionEncoder

    export_hf(perturbed(img_size=32), tmp_path, "vit")
    options = dict(image_mean=[0.5, 0.45, 0.4], image_std=[0.25, 0.26, 0.27], resample=3)
    if processor_class == "BitImageProcessor":
        options.update(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}, do_center_crop=True)
    else:
        options.update(size={"height": 32, "width": 32})
    getattr(transformers, processor_class)(**options).save_pretrained(tmp_path)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    encoder = VisionEncoder.from_pretrained(f"hf:{tmp_path}")
    assert encoder.preprocessing.resize_mode == ("shortest" if processor_class == "BitImageProcessor" else "squash")
    for image in _photos():
        close(encoder.preprocess([image]), processor(images=image, return_tensors="pt")["pixel_values"])


# ----- imports into training and evaluation -----
@pytest.mark.slow
def test_init_from_starts_training_from_imported_weights_in_every_format(tmp_path):
    """The same weights as our file, a transformers directory and a timm directory: step 0's loss is the same in all
    three runs (the objective's head and masks seeded alike), and differs from a run from scratch."""
    from accelerate.state import AcceleratorState
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.train.trainer import pretrain

    encoder = perturbed(layer_scale=0.1)
    save_encoder(encoder, tmp_path / "ours" / "encoder.safetensors")
    export_hf(encoder, tmp_path / "hf", "dinov2")
    export_timm(encoder, tmp_path / "timm")
    register_configs()
    losses = {}
    for name, spec in (("ours", tmp_path / "ours"), ("hf", f"hf:{tmp_path / 'hf'}"),
                       ("timm", f"timm:{tmp_path / 'timm'}"), ("scratch", None)):
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("pretrain", overrides=[
                "model=vit_test", "objective=masked_patch", "data.batch_size=8", "trainer.max_steps=1",
                "trainer.progress=false", "trainer.trackers=[]", "trainer.log_every=1",
                f"output_dir={tmp_path / ('run_' + name)}", *([f"model.init_from={spec}"] if spec else [])])
        pretrain(cfg)
        AcceleratorState._reset_state(reset_partial_state=True)
        losses[name] = read_metrics(tmp_path / f"run_{name}")[0]["loss"]
    assert losses["ours"] == pytest.approx(losses["hf"], abs=1e-5) == pytest.approx(losses["timm"], abs=1e-5)
    assert abs(losses["ours"] - losses["scratch"]) > 1e-3


# ZeRO-1/2 keep whole parameters in the module as DDP does, and init_from loads before `prepare` either way (all
# five ran when init_from landed): whole parameters (DDP) and the two sharded kinds are what differ.
@pytest.mark.distributed
@pytest.mark.parametrize("config", ["ddp_cpu2", "zero3_cpu2", "fsdp2_cpu2"])
def test_init_from_under_whole_and_sharded_parameters_resamples_to_the_run_size_and_refuses_source_changes(
        tmp_path, config):
    """2 processes under DDP, ZeRO-3 and FSDP2 (ZeRO-3 with zero.Init: the transformers source is built outside
    DeepSpeed's partitioning, transformers' own ZeRO-3 hook off, and loaded into the sharded backbone) at
    data.img_size=24 (resampled as transformers does); after one step at learning rate 0 (warm-up) the saved encoder
    is that exactly."""
    from ssl_vit.artifacts import load_encoder

    export_hf(perturbed(layer_scale=0.1), tmp_path / "hf", "dinov2")
    run = tmp_path / "run"
    check_ok(pretrain_ranks(*TINY, "objective=masked_patch", "trainer.max_steps=1", "data.img_size=24",
                            f"model.init_from=hf:{tmp_path / 'hf'}", f"hydra.run.dir={run}", config=config,
                            log_dir=tmp_path / "ranks"))
    assert read_metrics(run)[0]["lr"] == 0.0
    trained = load_encoder(run / "encoder.safetensors")
    assert trained.config.img_size == 24 and trained.config.layer_scale == 0.1
    assert trained.config.pos_embed_antialias is False  # DINOv2 / transformers resampling recorded
    expected = from_hf(tmp_path / "hf")
    expected.set_img_size(24)
    for key, value in expected.state_dict().items():
        close(trained.state_dict()[key], value, atol=0)
    if config != "ddp_cpu2":
        return
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.schema import ConfigError
    from ssl_vit.train.build import build_components

    register_configs()
    for overrides, message in ((["model.depth=4"], "remove model.depth=4 (adjustable:"),
                               (["objective=mae"], "set objective.fixed_pos_embed=false")):
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("pretrain", overrides=["model=vit_test", f"model.init_from=hf:{tmp_path / 'hf'}",
                                                 "output_dir=x", *overrides])
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_components(cfg)
    # restating the source's own value (a shared recipe naming it) shapes nothing and is not refused
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["model=vit_test", f"model.init_from=hf:{tmp_path / 'hf'}", "output_dir=x",
                                             f"model.depth={expected.config.depth}"])
    assert build_components(cfg)[0].backbone.config.depth == expected.config.depth


@pytest.mark.slow
def test_evaluate_takes_imported_checkpoints(tmp_path):
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.eval.run import evaluate

    encoder = perturbed()
    export_hf(encoder, tmp_path / "hf", "vit")
    save_encoder(encoder, tmp_path / "ours" / "encoder.safetensors")
    register_configs()
    results = {}
    for name, spec in (("hf", f"hf:{tmp_path / 'hf'}"), ("ours", str(tmp_path / "ours"))):
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("evaluate", overrides=[f"checkpoint={spec}", "data=synthetic", "data.num_samples=64",
                                                 "eval=knn", "cache_dir=null", f"output_dir={tmp_path / name}"])
        results[name] = evaluate(cfg, progress=False)["results"]["knn"]["accuracy"]
    assert results["hf"] == results["ours"]


def _native_hf_model(name):
    """A transformers model built by transformers itself (its own init and 5.x save_pretrained names)."""
    import transformers as t

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
    if name == "vit":
        return t.ViTModel(t.ViTConfig(**small, intermediate_size=64))
    if name == "dinov2":
        return t.Dinov2Model(t.Dinov2Config(**small, layerscale_value=0.1))
    if name == "dinov2_registers":
        return t.Dinov2WithRegistersModel(t.Dinov2WithRegistersConfig(**small, num_register_tokens=4))
    if name == "clip_vision":
        return t.CLIPVisionModel(t.CLIPVisionConfig(**small, intermediate_size=64))
    if name == "siglip_with_head":
        return t.SiglipVisionModel(t.SiglipVisionConfig(**small, intermediate_size=64))
    return t.CLIPModel(t.CLIPConfig(vision_config=dict(**small, intermediate_size=64), text_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)))


@pytest.mark.parametrize("name", ["vit", "dinov2", "dinov2_registers", "clip_vision", "siglip_with_head", "clip_full"])
def test_hf_import_of_directories_transformers_wrote_itself(tmp_path, name):
    """ViT's pooler and SigLIP's attention-pooling head are dropped; every token output is exact (quick_gelu for
    CLIP's default activation, gelu_pytorch_tanh for SigLIP's); a CLIPModel directory gives its vision tower."""
    torch.manual_seed(0)
    model = _native_hf_model(name).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    vision = model.vision_model if hasattr(model, "text_model") else model  # a whole model (hidden states: not
    x = images()                                                           # from an inner module in transformers 5.4)
    with torch.no_grad():
        out = vision(pixel_values=x, output_hidden_states=True)
        tokens = ours.forward_features(x)
        if name.startswith("siglip"):
            close(out.last_hidden_state, ours.fc_norm(tokens))
        elif name.startswith("clip"):  # CLIP's last_hidden_state is before post_layernorm, its pooler after
            close(out.last_hidden_state, ours.blocks(ours.norm_pre(ours.embed(x))))
            close(out.pooler_output, ours(x))
        else:
            close(out.last_hidden_state, tokens)
        close(out.hidden_states[-2], ours.blocks[:-1](ours.norm_pre(ours.embed(x))))
    assert ours.config.act_layer == {"clip": "quick_gelu", "sigl": "gelu_tanh"}.get(name[:4], "gelu")


def test_init_from_gives_a_dino_teacher_and_student_the_source_weights(tmp_path):
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.train.build import build_components

    register_configs()
    encoder = perturbed()
    directory = tmp_path / "source"
    save_encoder(encoder, directory / "encoder.safetensors")
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["model=vit_test", "objective=dino_tiny", f"model.init_from={directory}",
                                             "output_dir=x"])
    objective, *_ = build_components(cfg)
    for module in (objective.encoder, objective.backbone):  # the teacher (evaluated, exported) and the student
        for key, value in encoder.state_dict().items():
            close(module.state_dict()[key], value, atol=0)


def test_vision_encoder_runs_at_the_size_its_preprocessing_gives(tmp_path):
    """A source whose processor gives another size than its native one (DINOv2: 518 native, 224 used) is resampled
    to the size its pixels come in at, so `num_patches` is what `forward` returns."""
    from ssl_vit import VisionEncoder

    export_hf(perturbed(img_size=32), tmp_path, "vit", preprocess=Preprocess(16))
    encoder = VisionEncoder.from_pretrained(f"hf:{tmp_path}")
    pixels = encoder.preprocess([np.full((40, 60, 3), 128, dtype=np.uint8)])
    assert pixels.shape == (1, 3, 16, 16)
    assert encoder(pixels).shape[1] == encoder.num_patches == 16
