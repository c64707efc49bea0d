"""The Hydra configs compose, are typed, and stay in sync with the code."""

import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from objectives import OBJECTIVES
from ssl_vit.config import MODEL_OVERRIDE_FIELDS, launch_time, register_configs
from ssl_vit.vit import PRESETS, VisionTransformer

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


def test_model_overrides_are_vision_transformer_arguments():
    params = inspect.signature(VisionTransformer).parameters
    assert set(MODEL_OVERRIDE_FIELDS) <= set(params)


def _listed_options(err, group):
    text = str(err.value)
    return text.split(f"Available options in '{group}':")[1].split("Config search path")[0].split()


def test_unknown_group_option_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("objective=simclr")
    assert "Could not find 'objective/simclr'" in str(err.value)
    assert _listed_options(err, "objective") == sorted(OBJECTIVES)  # schemas live apart and are not listed
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
