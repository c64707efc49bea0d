import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from objectives import OBJECTIVES, DataInfo, Objective, build_objective
from objectives.supervised import Supervised, SupervisedConfig
from ssl_vit.vit import build_vit


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
