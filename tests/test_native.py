"""Encoders that are not ViTs, evaluated as their own library runs them (ssl_vit.interop.native): a timm ResNet, a
timm Swin and a transformers ConvNeXt (random weights, small images). Their features are the library's own forward;
the linear probe on them scores as scikit-learn's logistic regression does; linear, k-NN and few-shot run on them
through the real evaluation entry; pre-training from one, or asking it for what it cannot do, is one line."""

import pytest
import timm
import torch
from conftest import ROOT
from hydra import compose, initialize_config_dir
from sklearn.linear_model import LogisticRegression

from ssl_vit.cli import register_configs
from ssl_vit.data import Digits
from ssl_vit.eval.features import extract_features
from ssl_vit.eval.linear import linear_probe, standardise
from ssl_vit.eval.run import encoder_size, evaluate, load_any_encoder
from ssl_vit.interop.native import NativeEncoder, from_hf_native, from_timm_native
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.preprocess import Preprocess
from ssl_vit.schema import ConfigError

transformers = pytest.importorskip("transformers")
SWIN = dict(img_size=32, window_size=2, embed_dim=24, depths=(1, 1), num_heads=(2, 2))  # a small random Swin


def _timm(name: str, **kwargs) -> NativeEncoder:
    torch.manual_seed(0)
    return from_timm_native(timm.create_model(name, pretrained=False, num_classes=0, **kwargs))


@pytest.fixture(scope="module")
def hf_convnext(tmp_path_factory):
    """A tiny transformers ConvNeXt directory (random weights) with its image processor."""
    path = tmp_path_factory.mktemp("convnext")
    torch.manual_seed(0)
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                         image_size=32, patch_size=2)
    transformers.ConvNextModel(config).save_pretrained(path)
    transformers.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=1.0).save_pretrained(path)
    return path


def test_native_features_are_the_librarys_own_forward(hf_convnext):
    images = torch.randn(3, 3, 32, 32)
    resnet = _timm("resnet18")
    swin = _timm("swin_tiny_patch4_window7_224", **SWIN)
    with torch.no_grad():
        for encoder in (resnet, swin):
            model = encoder.model
            expected = model.forward_head(model.forward_features(images), pre_logits=True)
            torch.testing.assert_close(encoder.features(images, "pooled"), expected, atol=1e-6, rtol=0)
        # the last feature map as tokens: ResNet's NCHW (512 x 1 x 1 at 32 px), Swin's NHWC
        assert resnet.tokens(images).shape == (3, 1, 512)
        assert swin.tokens(images).shape[0] == 3 and swin.tokens(images).shape[-1] == swin.model.num_features
        torch.testing.assert_close(swin.features(images, "avg"),
                                   swin.model.forward_features(images).flatten(1, 2).mean(1), atol=1e-6, rtol=0)
        source = load_pretrained(f"hf:{hf_convnext}", native="fallback")
        reference = transformers.ConvNextModel.from_pretrained(hf_convnext).eval()
        assert isinstance(source.encoder, NativeEncoder) and source.encoder.library == "transformers"
        torch.testing.assert_close(source.encoder.features(images, "pooled"),
                                   reference(pixel_values=images).pooler_output, atol=1e-6, rtol=0)
    assert source.preprocess.img_size == 32  # its preprocessor_config.json


@pytest.mark.parametrize("name, kwargs, least", [
    ("convnext_atto", {}, 0.9),  # a random ConvNeXt's features separate the digits (measured 96.1%)
    ("swin_tiny_patch4_window7_224", SWIN, 0.6),  # a two-stage random Swin at 32 px (measured 73.3%)
    ("resnet18", {}, 0.0),  # degenerate features (below): the same answer as scikit-learn's all the same
])
def test_the_linear_probe_on_native_features_scores_as_sklearns_logistic_regression(name, kwargs, least):
    """Features of random timm non-ViTs on digits: our probe (its L2 chosen on a held-out split) against
    scikit-learn's LogisticRegression at that L2 on the same standardised features, within 1 point. (A random
    ResNet's features are degenerate, batch norm at its initial statistics: 11.7%, below chance.)"""
    encoder = _timm(name, **kwargs)
    views = Preprocess(32, [0.5] * 3, [0.5] * 3).view_builder()
    train_x, train_y = extract_features(encoder, Digits(split="train"), views, "pooled", progress=False)
    test_x, test_y = extract_features(encoder, Digits(split="test"), views, "pooled", progress=False)
    ours = linear_probe(train_x, train_y, test_x, test_y)
    train_std, test_std = standardise(train_x, test_x)
    reference = LogisticRegression(C=1 / (ours["l2"] * len(train_y)), max_iter=5000, tol=1e-8)
    reference.fit(train_std.double().numpy(), train_y.numpy())
    theirs = float((reference.predict(test_std.double().numpy()) == test_y.numpy()).mean())
    assert ours["accuracy"] == pytest.approx(theirs, abs=0.01)
    assert ours["accuracy"] > least


def _evaluate(tmp_path, *overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("evaluate", overrides=[*overrides, "data=digits", "data.img_size=32", f"output_dir={tmp_path}",
                                             f"cache_dir={tmp_path / 'cache'}"])
    return evaluate(cfg, progress=False)


def test_a_timm_resnet_swin_and_an_hf_convnext_evaluate_through_linear_knn_and_fewshot(tmp_path, hf_convnext,
                                                                                      caplog):
    """Through the evaluate entry (a Swin built for 224 px run at 32 by timm's set_input_size)."""
    for spec in ("timm:resnet18", "timm:swin_tiny_patch4_window7_224", f"hf:{hf_convnext}"):
        report = _evaluate(tmp_path, f"checkpoint={spec}", "eval=all", "eval.fewshot_shots=[1,5]",
                           "eval.fewshot_draws=2")
        assert set(report["results"]) == {"linear", "knn", "fewshot"} and report["features"] == "pooled"
        assert all(0 <= report["results"][name]["accuracy"] <= 1 for name in ("linear", "knn"))
    assert "left out: ['finetune']" in caplog.text  # eval=all's fine-tuning needs a ViT of ours


def test_what_a_native_encoder_cannot_do_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval: ResNet \(timm, evaluated through it: not a ViT\) takes "
                                          r"\['linear', 'knn', 'fewshot', 'segmentation'\], not \['finetune'\]$"):
        _evaluate(tmp_path, "checkpoint=timm:resnet18", "eval=finetune")
    with pytest.raises(ConfigError, match=r"^eval.features=patch is not one of \['pooled', 'avg', 'last_k'\] for "
                                          r"ResNet"):
        _evaluate(tmp_path, "checkpoint=timm:resnet18", "eval=knn", "eval.features=patch")
    with pytest.raises(ValueError, match=r"^timm:resnet18: a ResNet is not a ViT; only ViTs pre-train, export or "
                                         r"teach here \(ssl-vit evaluate checkpoint=timm:resnet18 evaluates it"):
        load_pretrained("timm:resnet18")  # what model.init_from and export load
    vit, _, _ = load_any_encoder("timm:vit_tiny_patch16_224")  # a ViT still converts into ours
    assert not isinstance(vit, NativeEncoder)
    native, _, _ = load_any_encoder("timm:vit_tiny_patch16_224", native=True)
    assert isinstance(native, NativeEncoder) and native.library == "timm"


def test_hf_native_summary_is_the_pooled_output_else_the_token_mean():
    torch.manual_seed(0)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
    encoder = from_hf_native(transformers.ResNetModel(config).eval())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = encoder.model(pixel_values=images)
        torch.testing.assert_close(encoder.summary(images), out.pooler_output.flatten(1))
        torch.testing.assert_close(encoder.features(images, "avg"), out.last_hidden_state.mean(dim=(2, 3)))
        # last_k: the spatial means of the last k hidden states, concatenated (the embeddings' output included)
        hidden = encoder.model(pixel_values=images, output_hidden_states=True).hidden_states
        torch.testing.assert_close(encoder.features(images, "last_k", 2),
                                   torch.cat([h.mean(dim=(2, 3)) for h in hidden[-2:]], dim=1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="eval.last_k=5: ResNetModel .* has 3 stages to give"):
        encoder.features(images, "last_k", 5)


def test_the_feature_map_for_dense_protocols_is_the_librarys_last_map_and_a_swin_runs_at_another_size(tmp_path):
    """ResNet's NCHW map as it is, Swin's NHWC map permuted (1e-6); a Swin built for 224 px runs at 64 px through
    timm's own set_input_size; a ResNet's map takes the linear segmentation protocol through evaluate."""
    images = torch.randn(2, 3, 64, 64)
    resnet = _timm("resnet18")
    swin, _, _ = load_any_encoder("timm:swin_tiny_patch4_window7_224")
    assert encoder_size(64, swin, None) == 64 and swin.img_size == 64
    with torch.no_grad():
        torch.testing.assert_close(resnet.feature_map(images), resnet.model.forward_features(images), atol=1e-6,
                                   rtol=0)
        torch.testing.assert_close(swin.feature_map(images), swin.model.forward_features(images).permute(0, 3, 1, 2),
                                   atol=1e-6, rtol=0)
        stages = resnet.model.forward_intermediates(images, indices=2, intermediates_only=True)
        torch.testing.assert_close(resnet.features(images, "last_k", 2),
                                   torch.cat([s.mean(dim=(2, 3)) for s in stages], dim=1), atol=1e-6, rtol=0)
    assert swin.feature_map(images).shape == (2, 768, 2, 2) and resnet.features(images, "last_k", 2).shape == (2, 768)
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("evaluate", overrides=["checkpoint=timm:resnet18", "data=synthetic", "data.img_size=32",
                                             "data.num_samples=64", "eval=segmentation", f"output_dir={tmp_path}",
                                             "cache_dir=null"])
    result = evaluate(cfg, progress=False)["results"]["segmentation"]
    assert result["grid"] == [1, 1] and 0 <= result["miou"] <= 1  # stride 32 at 32 px: one cell
