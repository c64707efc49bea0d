"""ViTDet's simple feature pyramid (ssl_vit.backbone.pyramid): levels, names and strides as detectron2's
SimpleFeaturePyramid gives them (read from detectron2/modeling/backbone/vit.py: detectron2 is not installable here),
each level the functional composition of its layers; the segmentation probe reads a level."""

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from hydra import compose, initialize_config_dir

from ssl_vit.artifacts import save_encoder
from ssl_vit.backbone import build_vit
from ssl_vit.backbone.pyramid import SimpleFeaturePyramid
from ssl_vit.cli import register_configs
from ssl_vit.eval.run import evaluate
from ssl_vit.schema import ConfigError


def _ln(x, norm):
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), norm.weight, norm.bias, 1e-6).permute(0, 3, 1, 2)


def test_levels_strides_and_names_are_vitdets():
    torch.manual_seed(0)
    pyramid = SimpleFeaturePyramid(64, 16, out_channels=32).eval()
    x = torch.randn(2, 64, 8, 6)  # a 128 x 96 image's stride-16 map
    with torch.no_grad():
        out = pyramid(x)
    assert pyramid.names == ["p2", "p3", "p4", "p5", "p6"] and pyramid.strides == [4, 8, 16, 32, 64]
    assert {k: tuple(v.shape) for k, v in out.items()} == {"p2": (2, 32, 32, 24), "p3": (2, 32, 16, 12),
                                                          "p4": (2, 32, 8, 6), "p5": (2, 32, 4, 3),
                                                          "p6": (2, 32, 2, 2)}
    names = set(pyramid.state_dict())
    assert {"simfp_2.0.weight", "simfp_2.1.weight", "simfp_2.3.bias", "simfp_2.4.weight", "simfp_2.4.norm.weight",
            "simfp_2.5.norm.bias", "simfp_3.0.weight", "simfp_3.1.norm.weight", "simfp_4.0.weight",
            "simfp_5.1.weight", "simfp_5.2.norm.weight"} <= names  # detectron2's state-dict names
    assert not any(name.endswith(("4.bias", "5.bias")) and ".norm." not in name for name in names)  # bias-free
    stage = pyramid.simfp_2  # scale 4: deconv, LN, GELU, deconv, 1x1 conv + LN, 3x3 conv + LN
    with torch.no_grad():
        y = F.conv_transpose2d(x, stage[0].weight, stage[0].bias, stride=2)
        y = F.gelu(_ln(y, stage[1]))
        y = F.conv_transpose2d(y, stage[3].weight, stage[3].bias, stride=2)
        y = _ln(F.conv2d(y, stage[4].weight), stage[4].norm)
        y = _ln(F.conv2d(y, stage[5].weight, padding=1), stage[5].norm)
        torch.testing.assert_close(out["p2"], y, atol=1e-5, rtol=0)
        p5 = _ln(F.conv2d(_ln(F.conv2d(F.max_pool2d(x, 2), pyramid.simfp_5[1].weight), pyramid.simfp_5[1].norm),
                          pyramid.simfp_5[2].weight, padding=1), pyramid.simfp_5[2].norm)
        torch.testing.assert_close(out["p5"], p5, atol=1e-5, rtol=0)
        torch.testing.assert_close(out["p6"], p5[:, :, ::2, ::2], atol=0, rtol=0)
    with pytest.raises(ValueError, match="scale factor 4.0 gives stride 3.5 at patch size 14"):
        SimpleFeaturePyramid(64, 14)


def test_the_segmentation_probe_reads_a_pyramid_level(tmp_path):
    torch.manual_seed(0)
    path = save_encoder(build_vit("vit_test", img_size=32), tmp_path / "run" / "encoder.safetensors", step=0)
    register_configs()

    def run(*overrides):
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("evaluate", overrides=[f"checkpoint={path}", "data=synthetic", "data.num_samples=48",
                                                 "eval=segmentation", "cache_dir=null", f"output_dir={tmp_path}",
                                                 *overrides])
        return evaluate(cfg, progress=False)["results"]["segmentation"]

    assert run("eval.pyramid_stride=2")["grid"] == [16, 16]  # patch 4: stride 2 is the scale-2 level
    assert run("eval.pyramid_stride=2", "eval.window_size=4")["grid"] == [16, 16]  # windowed + pyramid
    with pytest.raises(ConfigError, match=r"eval.pyramid_stride=3 is not a level of the pyramid on patch size 4 "
                                          r"\(valid: \[1, 2, 4, 8, 16\]\)"):
        run("eval.pyramid_stride=3")
