"""Weight-init schemes (ssl_vit.backbone.init) against their definitions, on the meta device as in a normal build, and
the presets' default."""

import math

import pytest
import torch
from helpers.builders import pretrain_config

from ssl_vit.backbone import build_vit
from ssl_vit.backbone.init import materialize
from ssl_vit.train.build import build_components, build_run

D, HIDDEN = 384, 1536  # vit_s16


def _std(t):
    return float(t.detach().float().std())


@pytest.fixture(scope="module", params=["timm", "jax", "torch"])
def model(request):
    torch.manual_seed(0)
    return request.param, build_vit("vit_s16", weight_init=request.param, num_classes=10)


def test_each_scheme_matches_its_definition(model):
    scheme, vit = model
    block = vit.blocks[3]
    qkv, fc1 = block.attn.qkv, block.mlp.fc1
    if scheme == "timm":
        expected_qkv, expected_fc1 = 0.02, 0.02
    elif scheme == "jax":  # xavier-uniform, q / k / v each as a D x D matrix
        expected_qkv, expected_fc1 = math.sqrt(2 / (D + D)), math.sqrt(2 / (D + HIDDEN))
    else:  # PyTorch's kaiming-uniform(a=sqrt(5)): U(+-1/sqrt(fan_in)), std 1/sqrt(3 fan_in)
        expected_qkv, expected_fc1 = 1 / math.sqrt(3 * D), 1 / math.sqrt(3 * D)
    for rows in qkv.weight.split(D):  # every one of q, k, v, not just the fused matrix
        assert _std(rows) == pytest.approx(expected_qkv, rel=0.03)
    assert _std(fc1.weight) == pytest.approx(expected_fc1, rel=0.03)
    assert not vit.head.weight.any() and not vit.head.bias.any()  # zero head in every scheme
    if scheme in ("timm", "jax"):
        assert not qkv.bias.any() and not block.attn.proj.bias.any()
        assert _std(vit.pos_embed) == pytest.approx(0.02, rel=0.05)
    if scheme == "jax":
        assert 0 < fc1.bias.abs().max() < 1e-5  # big_vision: MLP biases normal(1e-6)
        assert not vit.cls_token.any()
        fan_in = 3 * 16 * 16
        assert _std(vit.patch_embed.proj.weight) == pytest.approx(1 / math.sqrt(fan_in), rel=0.05)  # lecun normal
    if scheme == "torch":
        assert qkv.bias.abs().max() <= 1 / math.sqrt(D) and qkv.bias.any()


def test_a_model_built_on_the_meta_device_is_materialised_with_the_same_init():
    torch.manual_seed(0)
    with torch.device("meta"):
        vit = build_vit("vit_s16", num_classes=10)
    assert vit.blocks[0].attn.qkv.weight.is_meta
    materialize(vit)
    assert not any(p.is_meta for p in vit.parameters())
    assert _std(vit.blocks[0].attn.qkv.weight[:D]) == pytest.approx(math.sqrt(1 / D), rel=0.03)  # jax default
    assert not vit.head.weight.any() and not vit.cls_token.any()
    assert 0 < vit.blocks[0].mlp.fc1.bias.abs().max() < 1e-5


def test_presets_default_to_the_paper_init_and_a_bad_scheme_names_the_choices():
    tiny = build_vit("vit_tiny")
    assert _std(tiny.blocks[0].attn.qkv.weight[:64]) == pytest.approx(math.sqrt(1 / 64), rel=0.1)
    timm = build_vit("vit_tiny", weight_init="timm")
    assert _std(timm.blocks[0].attn.qkv.weight) == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match=r"weight_init 'lecun' is not one of \['timm', 'jax', 'torch', 'mocov3', "
                       r"'ijepa', 'dinov3', 'mae'\]"):
        build_vit("vit_tiny", weight_init="lecun")


def _is_classifier_start(layer, scheme, fan_in):
    if scheme == "timm":  # trunc-normal(0.02) (cut at +-2 absolute, as timm's), zero bias
        return _std(layer.weight) == pytest.approx(0.02, rel=0.05) and not layer.bias.any()
    if scheme == "jax":  # big_vision's head_zeroinit
        return not layer.weight.any() and not layer.bias.any()
    return _std(layer.weight) == pytest.approx(1 / math.sqrt(3 * fan_in), rel=0.05) and layer.bias.any() \
        and layer.bias.abs().max() <= 1 / math.sqrt(fan_in)  # PyTorch's nn.Linear default


@pytest.mark.parametrize("head_init", ["auto", "timm", "jax", "torch"])
def test_the_supervised_head_starts_as_its_scheme_starts_a_classifier(head_init):
    """auto follows model.weight_init; the tanh hidden layer of head=mlp starts as the scheme's dense layers. DeiT's
    two heads take the same option (tests/test_deit.py)."""
    from ssl_vit.objectives import DataInfo, build_objective
    from ssl_vit.objectives.supervised import SupervisedConfig

    for backbone_init in ("timm", "jax", "torch"):
        scheme = backbone_init if head_init == "auto" else head_init
        torch.manual_seed(0)
        backbone = build_vit("vit_s16", weight_init=backbone_init, img_size=32)
        mlp = build_objective(SupervisedConfig(head_init=head_init), backbone, DataInfo(1000, 32)).head
        linear = build_objective(SupervisedConfig(head="linear", head_init=head_init), backbone, DataInfo(1000, 32))
        assert _is_classifier_start(mlp[2], scheme, D) and _is_classifier_start(linear.head, scheme, D)
        expected_hidden = {"timm": 0.02, "jax": math.sqrt(2 / (D + D)), "torch": 1 / math.sqrt(3 * D)}[scheme]
        assert _std(mlp[0].weight) == pytest.approx(expected_hidden, rel=0.05)


def test_the_mocov3_scheme_is_vits_py_and_objective_mocov3_builds_with_it(tmp_path):
    """moco-v3's vits.py: xavier-uniform Linear weights with q, k, v each its own matrix (bound sqrt(6 / (D +
    D))), zero biases, the patch projection uniform within sqrt(6 / (3 P^2 + D)), the class
    token normal(1e-6); objective=mocov3 builds its backbone so, and its recipe decays every parameter as
    main_moco.py does (model.parameters() in one AdamW group)."""
    torch.manual_seed(0)
    model = build_vit("vit_tiny", weight_init="mocov3")
    dim, patch = model.embed_dim, model.patch_embed.proj.weight.shape[-1]
    qkv = model.blocks[0].attn.qkv.weight
    for block in qkv.chunk(3):
        bound = math.sqrt(6 / (dim + dim))
        assert block.abs().max() <= bound and block.abs().max() > 0.95 * bound
    fc1 = model.blocks[0].mlp.fc1.weight
    assert fc1.abs().max() <= math.sqrt(6 / (fc1.shape[0] + fc1.shape[1]))
    assert all(float(b.abs().max()) == 0 for name, b in model.named_parameters() if name.endswith(".bias")
               and "norm" not in name)
    projection = model.patch_embed.proj.weight
    bound = math.sqrt(6 / (3 * patch * patch + dim))
    assert projection.abs().max() <= bound and projection.abs().max() > 0.95 * bound
    assert 0 < float(model.cls_token.abs().max()) < 1e-5

    cfg = pretrain_config(tmp_path, "objective=mocov3_tiny", "data.num_samples=16")
    run = build_run(cfg, *build_components(cfg), world=1)
    assert run.objective.backbone.config.weight_init == "mocov3"
    assert {group["weight_decay"] for group in run.optimizer.param_groups} == {0.1}


def test_the_ijepa_and_dinov3_schemes_are_their_references_and_their_objectives_build_with_them(tmp_path):
    """I-JEPA (src/helper.py init_model over the model's _init_weights): trunc-normal(0.02) Linear weights with no
    depth rescaling, zero biases, the patch projection trunc-normal(0.02) with a zero bias. DINOv3
    (vision_transformer.py init_weights_vit, PatchEmbed.reset_parameters): trunc-normal(0.02) Linear weights, zero
    biases, the projection and its bias uniform(+-1/sqrt(fan_in)), class and storage tokens normal(0.02)."""
    torch.manual_seed(0)
    fan_in = 3 * 16 * 16
    for scheme in ("ijepa", "dinov3"):
        vit = build_vit("vit_s16", weight_init=scheme, num_registers=4)
        for block in (vit.blocks[0], vit.blocks[11]):  # the last block as wide as the first: no 1/sqrt(2 depth)
            for linear in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2):
                assert _std(linear.weight) == pytest.approx(0.02, rel=0.05)
                assert not linear.bias.any()
        projection = vit.patch_embed.proj
        if scheme == "ijepa":
            assert _std(projection.weight) == pytest.approx(0.02, rel=0.05) and not projection.bias.any()
        else:
            bound = 1 / math.sqrt(fan_in)
            assert projection.weight.abs().max() <= bound and _std(projection.weight) == pytest.approx(
                bound / math.sqrt(3), rel=0.05)
            assert 0 < projection.bias.abs().max() <= bound
            assert _std(vit.reg_token) == pytest.approx(0.02, rel=0.3) and vit.cls_token.abs().max() > 1e-3

    from ssl_vit.objectives.ijepa import Predictor

    predictor = Predictor(64, 48, depth=4, heads=4, grid=(4, 4))
    assert _std(predictor.blocks[3].mlp.fc2.weight) == pytest.approx(0.02, rel=0.1)  # no fix_init_weight
    for objective, scheme in (("ijepa_tiny", "ijepa"), ("dinov3_tiny", "dinov3")):
        cfg = pretrain_config(tmp_path, f"objective={objective}", "data.num_samples=16", "data.img_size=32")
        run = build_run(cfg, *build_components(cfg), world=1)
        assert run.objective.backbone.config.weight_init == scheme


def test_the_mae_scheme_is_models_mae_py_and_objective_mae_builds_with_it(tmp_path):
    """MAE's initialize_weights: xavier-uniform over every whole Linear matrix (the fused qkv as one: bound
    sqrt(6 / (D + 3D))), zero biases, the patch projection xavier over (D, 3 P^2), class token normal(0.02)."""
    torch.manual_seed(0)
    vit = build_vit("vit_s16", weight_init="mae")
    qkv = vit.blocks[0].attn.qkv.weight
    bound = math.sqrt(6 / (D + 3 * D))
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.95 * bound
    assert _std(qkv[:D]) == pytest.approx(bound / math.sqrt(3), rel=0.03)  # q alone: the whole matrix's spread
    assert not vit.blocks[0].mlp.fc1.bias.any() and not vit.blocks[0].attn.qkv.bias.any()
    projection = vit.patch_embed.proj.weight
    assert projection.abs().max() <= math.sqrt(6 / (3 * 16 * 16 + D))
    assert _std(vit.cls_token) == pytest.approx(0.02, rel=0.15)
    cfg = pretrain_config(tmp_path, "objective=mae", "data.num_samples=16")
    run = build_run(cfg, *build_components(cfg), world=1)
    assert run.objective.backbone.config.weight_init == "mae"
    assert cfg.optim.min_lr == 0 and cfg.optim.grad_clip is None  # main_pretrain.py's --min_lr, no clip_grad
