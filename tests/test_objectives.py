import pytest
import torch
import torch.nn.functional as F
from helpers.builders import pretrain_config
from omegaconf import OmegaConf

from ssl_vit.backbone import build_vit
from ssl_vit.objectives import OBJECTIVES, DataInfo, Objective, build_objective
from ssl_vit.objectives.supervised import Supervised, SupervisedConfig
from ssl_vit.train.build import build_components


@pytest.mark.parametrize("head, layers", [("mlp", 3), ("linear", 1)])
def test_supervised_loss_is_cross_entropy_of_its_head(head, layers):
    cfg = OmegaConf.structured(SupervisedConfig(head=head))
    objective = build_objective(cfg, build_vit("vit_test"), DataInfo(num_classes=5, img_size=16))
    assert len(list(objective.head.modules())) - (1 if layers > 1 else 0) == layers
    if head == "mlp":
        assert isinstance(objective.head[1], torch.nn.Tanh)
    batch = {"image": torch.randn(4, 3, 16, 16), "label": torch.tensor([0, 1, 2, 4])}
    out = objective(batch)
    logits = objective.head(objective.encoder(batch["image"]))
    torch.testing.assert_close(out["loss"], F.cross_entropy(logits, batch["label"]))
    assert out["acc"] == (logits.argmax(-1) == batch["label"]).float().mean()
    out["loss"].backward()
    assert objective.backbone.patch_embed.proj.weight.grad is not None


def test_registry_lists_valid_names_for_an_unknown_objective():
    assert issubclass(OBJECTIVES["supervised"], Objective)
    expected = (r"unknown objective 'byol'; valid choices: \['clip', 'deit', 'dino', 'dinov2', 'dinov3', 'distill', "
                r"'ijepa', 'mae', 'masked_patch', 'mocov3', 'siglip', 'supervised'\]")
    with pytest.raises(ValueError, match=expected):
        build_objective(OmegaConf.create({"name": "byol"}), build_vit("vit_test"), DataInfo(2, 16))


def test_supervised_needs_two_classes():
    with pytest.raises(ValueError, match="at least 2 classes"):
        Supervised(build_vit("vit_test"), SupervisedConfig(), DataInfo(1, 16))


def test_encoder_is_the_backbone():
    backbone = build_vit("vit_test")
    assert Supervised(backbone, SupervisedConfig(), DataInfo(3, 16)).encoder is backbone


SELF_CONTAINED = {  # every objective whose build needs no file from outside (DeiT and distill take teachers)
    "supervised": ["objective=supervised"], "masked_patch": ["objective=masked_patch"],
    "mae": ["objective=mae", "objective.decoder_dim=32", "objective.decoder_depth=1", "objective.decoder_heads=2"],
    "dino": ["objective=dino_tiny"], "dinov2": ["objective=dinov2_tiny"], "dinov3": ["objective=dinov3_tiny"],
    "ijepa": ["objective=ijepa_tiny", "data.img_size=32", "objective.predictor_depth=1"],
    "mocov3": ["objective=mocov3_tiny"], "clip": ["objective=clip_tiny"], "siglip": ["objective=siglip_tiny"]}


@pytest.mark.parametrize("name", sorted(SELF_CONTAINED))
def test_the_saved_artifacts_hold_every_weight_that_continued_training_needs(tmp_path, name):
    """encoder.safetensors + heads.safetensors (Objective.artifacts) hold every parameter and persistent buffer:
    a second build of the objective (other random weights) loads them strictly and then holds the first one's
    weights exactly, so continuing from a run (model.init_heads) restarts nothing (MAE's decoder and masked_patch's
    head were once left out)."""
    cfg = pretrain_config(tmp_path, *SELF_CONTAINED[name])
    torch.manual_seed(0)
    first = build_components(cfg)[0]
    torch.manual_seed(1)
    second = build_components(cfg)[0]
    state = first.state_dict()
    artifacts = first.artifacts(state)
    second.load_state_dict(second.state_from_artifacts(artifacts.encoder, artifacts.heads), strict=True)
    assert all(torch.equal(value, second.state_dict()[key]) for key, value in state.items())
