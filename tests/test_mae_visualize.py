
import numpy as np
import pytest
import torch
from conftest import ROOT
from helpers.builders import CONFIGS, mae_objective
from helpers.inprocess import run_script
from hydra import compose, initialize_config_dir
from PIL import Image

from ssl_vit.analysis.mae_reconstruction import MASK_GREY, reconstruction_rows
from ssl_vit.cli import register_configs
from ssl_vit.objectives.patches import patchify
from ssl_vit.train import pretrain


def test_rows_show_grey_where_hidden_and_the_original_where_visible():
    objective = mae_objective()
    images = torch.randn(2, 3, 16, 16)
    torch.manual_seed(1)
    rows = reconstruction_rows(objective, images, mean=[0.5] * 3, std=[0.25] * 3)
    torch.manual_seed(1)
    _, mask, _, _ = objective.encode_visible(images)
    hidden = mask.bool()
    masked, original, pasted = (patchify(rows[k], 4) for k in ("masked", "original", "reconstruction"))
    assert (masked[hidden] == MASK_GREY).all()
    assert torch.equal(masked[~hidden], original[~hidden]) and torch.equal(pasted[~hidden], original[~hidden])
    assert not torch.equal(pasted[hidden], original[hidden])
    assert all(0 <= r.min() and r.max() <= 1 for r in rows.values())


def _run(tmp_path, objective, *options):
    register_configs()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("pretrain", overrides=[
            f"objective={objective}", "model=vit_test", "trainer.max_steps=3", "data.batch_size=8",
            "trainer.progress=false", "trainer.trackers=[]", f"output_dir={tmp_path}", *options])
    pretrain(cfg)
    return tmp_path


def _visualize(*args):
    """`python scripts/visualize_mae.py args` (in this process)."""
    return run_script(ROOT / "scripts" / "visualize_mae.py", *map(str, args))


@pytest.mark.slow
def test_script_writes_the_grid_png_from_a_run(tmp_path):
    run = _run(tmp_path / "mae", "mae", "objective.decoder_dim=32", "objective.decoder_depth=1",
               "objective.decoder_heads=2")
    proc = _visualize(run, "--num-images", 3, "--scale", 2, "--out", tmp_path / "grid.png")
    assert proc.returncode == 0, proc.stderr
    image = np.asarray(Image.open(tmp_path / "grid.png"))
    assert image.shape == (2 * (3 * 18 + 2), 2 * (3 * 18 + 2), 3)  # 3 rows x 3 images of 16 px, 2 px padding


@pytest.mark.slow
def test_script_refuses_a_run_of_another_objective(tmp_path):
    run = _run(tmp_path / "sup", "supervised")
    proc = _visualize(run)
    assert proc.returncode != 0 and "trained objective=supervised, not mae" in proc.stderr
    proc = _visualize(tmp_path / "nothing")
    assert proc.returncode != 0 and "config.yaml not found" in proc.stderr
