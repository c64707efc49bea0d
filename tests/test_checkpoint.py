import pytest
import torch

from ssl_vit.artifacts import load_encoder, read_metadata, save_encoder
from ssl_vit.schema import ConfigError
from ssl_vit.train.checkpoint import data_position_file, list_checkpoints, read_data_position, resolve_resume
from ssl_vit.vit import build_vit


def test_encoder_file_round_trips_with_its_config(tmp_path):
    model = build_vit("vit_test", num_registers=1, global_pool="avg").eval()
    path = save_encoder(model, tmp_path / "enc" / "encoder.safetensors", step=7)
    assert read_metadata(path)["step"] == "7"
    loaded = load_encoder(path).eval()
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded(images), model(images), atol=0, rtol=0)
    assert not list(path.parent.glob(".*tmp*"))


def test_load_encoder_rejects_a_foreign_file(tmp_path):
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an ssl_vit encoder"):
        load_encoder(tmp_path / "other.safetensors")


def test_resume_finds_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_00000010", "step_00000200", ".tmp_step_00000300", "step_00000030"):
        (root / name).mkdir(parents=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000030", "step_00000200"]
    assert resolve_resume("auto", tmp_path).name == "step_00000200"
    assert resolve_resume("auto", tmp_path / "fresh") is None
    assert resolve_resume(None, tmp_path) is None
    with pytest.raises(ConfigError, match="does not exist or is not a directory; valid values: auto"):
        resolve_resume(str(tmp_path / "missing"), tmp_path)


def test_a_data_position_from_another_layout_or_none_is_refused_unless_inexact_is_allowed(tmp_path, caplog):
    torch.save({"world_size": 2, "num_workers": 2, "loader": {"x": 1}}, tmp_path / data_position_file(1))
    assert read_data_position(tmp_path, 1, 2, 2, allow_inexact=False) == {"x": 1}
    with pytest.raises(ConfigError, match=r"2 process\(es\) x 2 loader worker\(s\) and this run has 2 x 1 "
                                          r"\(data.num_workers=2 .*trainer.allow_inexact_resume=true"):
        read_data_position(tmp_path, 1, 2, 1, allow_inexact=False)
    with pytest.raises(ConfigError, match="holds no data stream position for rank 0"):
        read_data_position(tmp_path, 0, 2, 2, allow_inexact=False)
    assert read_data_position(tmp_path, 0, 2, 2, allow_inexact=True) is None
    assert "RESUME IS NOT EXACT" in caplog.text and "fresh draws" in caplog.text
    (tmp_path / data_position_file(0)).write_bytes(b"cut")
    with pytest.raises(ConfigError, match="data_position_0.pt is unreadable"):
        read_data_position(tmp_path, 0, 2, 2, allow_inexact=True)
