"""The Hydra configs compose, are typed, and stay in sync with the code."""

from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from ssl_vit.backbone import PRESETS, VisionTransformer, ViTConfig, preset_config
from ssl_vit.cli import register_configs
from ssl_vit.config import MODEL_OVERRIDE_FIELDS, launch_time, model_kwargs
from ssl_vit.objectives import OBJECTIVES
from ssl_vit.schema import ConfigError, validate_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=list(overrides))


def test_default_config_composes_offline_defaults():
    cfg = _compose()
    assert (cfg.model.name, cfg.objective.name, cfg.data.name) == ("vit_tiny", "supervised", "synthetic")
    assert cfg.trainer.precision == "fp32"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_model_option(name):
    assert _compose(f"model={name}").model.name == name


def test_model_overrides_are_the_backbone_config_and_reach_the_backbone():
    """model.* is ViTConfig's fields (less the data's and the objective's), with its checks; a value set on the
    command line is the built backbone's."""
    assert set(MODEL_OVERRIDE_FIELDS) == {f.name for f in fields(ViTConfig)} - {"img_size", "in_chans", "num_classes"}
    cfg = _compose("model=vit_test", "model.mlp_ratio=2.0", "model.global_attn_indexes=[1]", "model.window_size=2")
    backbone = VisionTransformer(preset_config("vit_test", **model_kwargs(cfg.model)))
    assert backbone.config.mlp_hidden == 64 and backbone.config.global_attn_indexes == (1,)
    assert backbone.blocks[0].attn.window == 2 and backbone.blocks[1].attn.window == 0
    with pytest.raises(ConfigError, match="model.drop_path=1.5 is invalid: must be >= 0 and < 1"):
        validate_config(_compose("model.drop_path=1.5", "output_dir=x"))


def _listed_options(err, group):
    text = str(err.value)
    return text.split(f"Available options in '{group}':")[1].split("Config search path")[0].split()


def test_unknown_group_option_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("objective=simclr")
    assert "Could not find 'objective/simclr'" in str(err.value)
    # schemas live apart and are not listed; the _tiny options are this machine's scale of these
    tiny = ("dino", "dinov2", "dinov3", "mocov3", "ijepa", "clip", "siglip", "distill")
    assert _listed_options(err, "objective") == sorted([*OBJECTIVES, *(f"{n}_tiny" for n in tiny)])
    with pytest.raises(ConfigCompositionException) as err:
        _compose("model=vit_b17")
    assert "vit_b17" in str(err.value) and set(_listed_options(err, "model")) == set(PRESETS)


def test_wrong_type_fails_at_composition():
    with pytest.raises((ValidationError, ConfigCompositionException)):
        _compose("trainer.max_steps=many")
    with pytest.raises((ValidationError, ConfigCompositionException)):
        _compose("trainer.precision=fp16")


def test_every_config_file_starts_with_a_comment():
    for path in CONFIGS.rglob("*.yaml"):
        assert path.read_text().startswith("# "), path


def test_launch_time_is_shared_by_the_children_of_one_launcher(monkeypatch):
    import time

    monkeypatch.setattr(time, "time", lambda: 0.0)  # "now" is the epoch from here on
    epoch = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(0.0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert launch_time() == epoch  # a single process uses the current time
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch_time() != epoch  # under a launcher: the parent process's start time, whatever "now" is


@pytest.mark.parametrize("overrides, expected", [
    (["data.batch_size=0"], "data.batch_size=0 is invalid: must be >= 1"),
    (["data.batch_size=-4"], "data.batch_size=-4 is invalid: must be >= 1"),
    (["trainer.checkpoint_every=0"], "trainer.checkpoint_every=0 is invalid: must be >= 1"),
    (["trainer.log_every=0"], "trainer.log_every=0 is invalid: must be >= 1"),
    (["optim.lr=-1"], "optim.lr=-1.0 is invalid: must be > 0"),
    (["optim.warmup_steps=-10"], "optim.warmup_steps=-10 is invalid: must be >= 0"),
    (["data.num_workers=-1"], "data.num_workers=-1 is invalid: must be >= 0"),
    (["trainer.cpu_threads=-1"], "trainer.cpu_threads=-1 is invalid: must be >= 1"),
    (["trainer.stop_at_step=0"], "trainer.stop_at_step=0 is invalid: must be >= 1"),
    (["trainer.eval_every=-5"], "trainer.eval_every=-5 is invalid: must be >= 0"),
    (["objective=masked_patch", "objective.bits=0"], "objective.bits=0 is invalid: must be >= 1 and <= 8"),
    (["objective=mae", "objective.mask_ratio=1.0"], "objective.mask_ratio=1.0 is invalid: must be >= 0 and < 1"),
    (["data.mean=[0.5]"], "data.mean=[0.5] is invalid: must have 3 values, got 1"),
    (["data.std=[0.2,0,0.2]"], "data.std=[0.2, 0.0, 0.2] is invalid: every value must be > 0"),
    (["data.crop_scale=[0,1]"], "data.crop_scale=[0.0, 1.0] is invalid: every value must be > 0 and <= 1"),
    (["data=folder"], "data.root is not set (data=folder); give it on the command line, e.g. data.root="),
    (["data=wds"], "data.urls is not set (data=wds); give it on the command line, e.g. data.urls="),
])
def test_out_of_range_and_missing_values_are_one_clear_error(overrides, expected):
    cfg = _compose(*overrides, "output_dir=unused")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert str(err.value).startswith(expected), str(err.value)


@pytest.mark.slow
def test_every_shipped_config_passes_validation():
    validate_config(_compose("output_dir=unused"))
    needs = {"deit": ["objective.teacher=timm:resnet10t:/teacher.pth"]}  # the one value a user must give
    for objective in OBJECTIVES:
        validate_config(_compose(f"objective={objective}", "output_dir=unused", *needs.get(objective, [])))
    validate_config(_compose("optim=augreg", "data.augment=augreg", "output_dir=unused"))
    for data in ("synthetic", "digits", "fashion_mnist"):
        validate_config(_compose(f"data={data}", "output_dir=unused"))
