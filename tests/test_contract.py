"""The objective contract, used from outside: an objective written here (no file in objectives/, nothing
registered, no engine file touched) trains through the CLI under DDP and ZeRO-3 (2 forked processes each:
helpers.ranks), gives the same losses under both, saves its artifacts, and is rebuilt from them; its config is typed
and checked like a registered one's."""

import json
import sys

import pytest
import torch
from conftest import ROOT, check_ok, read_metrics
from helpers.ranks import pretrain_ranks
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from ssl_vit.cli import register_configs
from ssl_vit.objectives import load_trained, objective_class
from ssl_vit.schema import ConfigError
from ssl_vit.train.build import build_components

PROBE = '''
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from ssl_vit.objectives.base import Objective, ObjectiveConfig, Requirements
from ssl_vit.schema import checked


@dataclass
class LinearHeadConfig(ObjectiveConfig):
    name: str = "linear_head_objective:LinearHead"
    label_smoothing: float = checked(0.0, ge=0, lt=1)


class LinearHead(Objective):
    """A linear head on the pooled embedding, cross-entropy against the labels."""

    config_class = LinearHeadConfig
    needs = Requirements(views=("image", "label"))
    saved_heads = ("head.",)

    def __init__(self, backbone, cfg, data):
        super().__init__(backbone, cfg, data)
        self.head = nn.Linear(backbone.embed_dim, data.num_classes)

    def forward(self, batch):
        logits = self.head(self.backbone.pool(self.backbone.forward_features(batch["image"]))).float()
        loss = F.cross_entropy(logits, batch["label"], label_smoothing=self.cfg.label_smoothing)
        return {"loss": loss, "acc": (logits.argmax(dim=-1) == batch["label"]).float().mean()}
'''
RUN = ["model=vit_test", "data.num_samples=64", "data.batch_size=8", "trainer.max_steps=3", "trainer.log_every=1",
       "optim.warmup_steps=1", "objective=linear_head", "objective.label_smoothing=0.1"]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The objective's module and its config, in a directory of their own (on PYTHONPATH, in Hydra's search path)."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "linear_head_objective.py").write_text(PROBE)
    (root / "configs" / "objective").mkdir(parents=True)
    (root / "configs" / "objective" / "linear_head.yaml").write_text(
        "# A linear head outside the package (tests/test_contract.py); typed by its schema when the run builds it.\n"
        "name: linear_head_objective:LinearHead\nlabel_smoothing: 0.0\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def runs(plugin, tmp_path_factory):
    out = tmp_path_factory.mktemp("plugin_runs")
    for config in ("ddp_cpu2", "zero3_cpu2"):
        check_ok(pretrain_ranks(*RUN, f"hydra.searchpath=[file://{plugin / 'configs'}]",
                                f"hydra.run.dir={out / config}", config=config, log_dir=out / f"{config}.ranks",
                                env={"PYTHONPATH": str(plugin)}))
    return out


@pytest.mark.distributed
def test_an_objective_from_outside_the_package_trains_under_ddp_and_zero3_alike(runs):
    losses = {config: [m["loss"] for m in read_metrics(runs / config)] for config in ("ddp_cpu2", "zero3_cpu2")}
    assert len(losses["ddp_cpu2"]) == 3 and losses["zero3_cpu2"] == pytest.approx(losses["ddp_cpu2"], rel=1e-4)
    for config in ("ddp_cpu2", "zero3_cpu2"):
        summary = json.loads((runs / config / "summary.json").read_text())
        assert summary["finished"] and summary["strategy"] == config.split("_")[0]
    heads = load_file(runs / "zero3_cpu2" / "heads.safetensors")  # gathered from the ZeRO-3 shards
    assert heads["head.weight"].shape == (8, 32)
    torch.testing.assert_close(heads["head.weight"], load_file(runs / "ddp_cpu2" / "heads.safetensors")["head.weight"],
                               atol=1e-5, rtol=1e-4)


@pytest.mark.distributed
def test_its_artifacts_rebuild_it(runs):
    model = load_trained(runs / "ddp_cpu2")
    assert type(model).__name__ == "LinearHead" and model.cfg.label_smoothing == 0.1 and not model.training
    torch.testing.assert_close(model.head.weight, load_file(runs / "ddp_cpu2" / "heads.safetensors")["head.weight"])


def test_its_config_is_typed_and_checked_like_a_registered_one(plugin):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        compose_args = [*RUN, f"hydra.searchpath=[file://{plugin / 'configs'}]", "output_dir=x"]
        cfg = compose("pretrain", overrides=compose_args)
        objective, *_ = build_components(cfg)
        assert objective.cfg.label_smoothing == 0.1
        for bad, message in (("objective.label_smoothing=2", "objective.label_smoothing=2.0 is invalid"),
                             ("+objective.smoothing=1", "smoothing")):
            with pytest.raises(ConfigError, match=message):
                build_components(compose("pretrain", overrides=[*compose_args, bad]))
    with pytest.raises(ValueError, match="no Objective subclass 'Nothing'"):
        objective_class("linear_head_objective:Nothing")
    with pytest.raises(ValueError, match="unknown objective 'linear_heads'; valid choices"):
        objective_class("linear_heads")


@pytest.mark.distributed
def test_image_text_uses_of_its_run_are_refused_by_name(runs, tmp_path):
    """Zero-shot, retrieval and the open_clip export need an image-text model: said before anything is built."""
    from conftest import export_script

    with pytest.raises(ValueError, match="trained with objective=linear_head_objective:LinearHead; this needs an "
                                         "image-text model \\(objective=clip or siglip, or a distill run with "
                                         "an image-text teacher\\)"):
        load_trained(runs / "ddp_cpu2", image_text=True)
    assert export_script().main([str(runs / "ddp_cpu2"), "--to", "open_clip", "--out", str(tmp_path)]) == 2
