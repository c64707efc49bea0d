"""The real entry point, `accelerate launch scripts/pretrain.py`, end to end on tiny models: through the launcher where
the launcher is what is checked (the README's command, a failing run's report, workers that cannot meet), the
script's own entry in this process elsewhere (helpers.inprocess)."""

import json

import pytest
import torch
from conftest import ROOT, TINY, launch, pretrain_in_process, read_metrics
from conftest import check_ok as _ok
from safetensors.torch import load_file

from ssl_vit.artifacts import load_encoder
from ssl_vit.backbone import sincos_pos_embed_2d
from ssl_vit.data import StepBatchSampler


@pytest.mark.slow
def test_tiny_supervised_run_lowers_the_loss_and_writes_its_outputs(reference_run):
    metrics = read_metrics(reference_run)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    losses = [m["loss"] for m in metrics]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert {"acc", "lr", "grad_norm", "images_per_s", "nonfinite_steps"} <= set(metrics[-1])

    summary = json.loads((reference_run / "summary.json").read_text())
    assert summary["finished"] and summary["step"] == 30 and summary["world_size"] == 1
    checkpoints = sorted(p.name for p in (reference_run / "checkpoints").iterdir())
    assert checkpoints == ["step_00000020", "step_00000030"]  # keep_checkpoints=2, no temp dirs left
    events = list((reference_run / "tb").rglob("events.out.tfevents.*"))
    assert events and {p.parent for p in events} == {reference_run / "tb"}  # one TensorBoard run, hparams in it

    encoder = load_encoder(reference_run / "encoder.safetensors")
    state = load_file(str(reference_run / "checkpoints" / "step_00000030" / "model.safetensors"))
    torch.testing.assert_close(encoder.pos_embed, state["backbone.pos_embed"], atol=0, rtol=0)
    assert encoder(torch.randn(1, 3, 16, 16)).shape == (1, 32)


@pytest.mark.slow
def test_a_stopped_and_resumed_run_reproduces_the_uninterrupted_losses(reference_run, tmp_path):
    keys = "trainer.record_sample_keys=true"
    run = [*TINY, "trainer.max_steps=30", keys, f"hydra.run.dir={tmp_path}"]
    _ok(pretrain_in_process(*run, "trainer.stop_at_step=10"))
    assert json.loads((tmp_path / "summary.json").read_text())["finished"] is False
    _ok(pretrain_in_process(*run, "trainer.resume=auto"))
    resumed = {m["step"]: m["loss"] for m in read_metrics(tmp_path)}
    reference = {m["step"]: m["loss"] for m in read_metrics(reference_run)}
    assert sorted(resumed) == list(range(1, 31))
    for step in range(1, 31):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step
    # map-style data: each step's recorded indices are the step-indexed sampler's (seed 0, 32 samples, batch 16)
    rows = [json.loads(line) for line in (tmp_path / "sample_keys" / "rank_0.jsonl").open()]
    sampler = iter(StepBatchSampler(32, 16, seed=0))
    assert rows == [{"step": step, "keys": [index for index, _ in next(sampler)]} for step in range(1, 31)]


@pytest.mark.distributed
def test_two_workers_that_do_not_join_one_group_are_stopped(tmp_path):
    proc = launch(*TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}", config="ddp_cpu2",
                  env={"ACCELERATE_USE_CPU": "0"})  # the one way left to keep CPU workers apart
    assert proc.returncode != 0
    assert "did not join one process group" in proc.stderr and "ACCELERATE_USE_CPU=1" in proc.stderr
    assert "(here: '0')" in proc.stderr


BAD_CONFIGS = [
    ("objective=simclr", ["Could not find 'objective/simclr'", "Available options in 'objective'", "supervised"]),
    ("model=vit_b17", ["Could not find 'model/vit_b17'", "vit_b16", "vit_s16"]),
    ("data=imagenet", ["Could not find 'data/imagenet'", "Available options in 'data'", "folder", "synthetic"]),
    ("data.img_size=30", ["30x30 is not divisible by the patch size 4x4", "[28, 32]"]),
    ("trainer.max_steps=many", ["trainer.max_steps", "'many'", "Integer"]),
    ("trainer.precision=fp16", ["fp16", "fp32", "bf16"]),
]


@pytest.mark.parametrize("override, expected", [
    ("objective=simclr", ["ssl-vit: error: objective=simclr is not an option of objective (valid: clip, ",
                          "supervised"]),
    BAD_CONFIGS[3]])
def test_bad_configuration_fails_at_start_up_with_the_valid_choices(tmp_path, override, expected):
    """`python scripts/pretrain.py`'s entry (in this process; through `accelerate launch` the line comes first too:
    test_a_bad_value_is_one_line_first_then_accelerates_own_report): one of Hydra's composition errors and one of
    ours; the others through the build below."""
    proc = pretrain_in_process("model=vit_test", override, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stderr, proc.stderr[-3000:]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing left of the refused run


@pytest.mark.parametrize("override, expected", BAD_CONFIGS)
def test_bad_configuration_messages_name_the_valid_choices(override, expected):
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.train.build import build_components

    register_configs()
    with pytest.raises(Exception) as err:  # noqa: B017 (Hydra's, OmegaConf's or our ConfigError, as the CLI prints)
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            build_components(compose("pretrain", overrides=["model=vit_test", override, "output_dir=x"]))
    error, messages = err.value, []
    while error is not None:  # Hydra wraps OmegaConf's message (the CLI prints the chain)
        messages.append(str(error))
        error = error.__cause__
    for text in expected:
        assert text in "\n".join(messages), messages


@pytest.mark.slow
def test_masked_patch_pretraining_through_the_cli_lowers_the_loss(tmp_path):
    _ok(launch("objective=masked_patch", *TINY, "trainer.max_steps=20", f"hydra.run.dir={tmp_path}",
               launcher="accelerate"))  # the `accelerate launch` command as the README gives it
    metrics = read_metrics(tmp_path)
    losses = [m["loss"] for m in metrics]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert all(m["corrupted_fraction"] == 0.5 for m in metrics) and "acc" in metrics[-1]


@pytest.mark.slow
def test_mae_pretraining_through_the_cli_lowers_the_loss(tmp_path):
    _ok(pretrain_in_process("objective=mae", "objective.decoder_dim=32", "objective.decoder_depth=1",
                            "objective.decoder_heads=2", *TINY, "trainer.max_steps=20", f"hydra.run.dir={tmp_path}"))
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    encoder = load_encoder(tmp_path / "encoder.safetensors")
    torch.testing.assert_close(encoder.pos_embed, sincos_pos_embed_2d((4, 4), 32, 1))  # fixed during training


@pytest.mark.slow
def test_a_bad_value_is_one_line_first_then_accelerates_own_report(tmp_path):
    proc = launch("model=vit_test", "data.batch_size=0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1  # accelerate launch turns our exit status 2 into 1 (documented in the README)
    ours = proc.stderr.index("ssl-vit: error: data.batch_size=0 is invalid: must be >= 1\n")
    assert "Traceback" not in proc.stderr[:ours]  # only accelerate's own preamble and traceback surround it
    assert "returned non-zero exit status 2" in proc.stderr[ours:]
    direct = pretrain_in_process("data=folder", f"hydra.run.dir={tmp_path}")  # the script's own entry
    assert direct.returncode == 2 and direct.stderr.strip().splitlines() == [
        "ssl-vit: error: data.root is not set (data=folder); give it on the command line, e.g. "
        "data.root=/path/to/images (any layout; class subfolders for labels)"]


def test_a_run_validates_its_config_and_reads_its_objectives_needs_once(tmp_path, monkeypatch):
    """scripts/pretrain.py checks the config (every group's ranges, the preset) and asks the objective what it
    needs exactly once (ssl_vit.train.build.check_config); the strategy, the builders, the periodic evaluation and
    the start-up line all read that one result."""
    import sys

    from ssl_vit import schema
    from ssl_vit.objectives.masked_patch import MaskedPatch

    calls = {"validate": 0, "requirements": 0}
    validate, requirements = schema.validate_config, MaskedPatch.requirements.__func__

    def counted_validate(cfg, prefix=""):
        calls["validate"] += prefix == ""  # the whole config (an objective's own schema check is prefixed)
        return validate(cfg, prefix)

    def counted_requirements(cls, cfg):
        calls["requirements"] += 1
        return requirements(cls, cfg)

    for module in [m for name, m in sys.modules.items() if name.startswith("ssl_vit")]:  # every importer's name
        if getattr(module, "validate_config", None) is validate:
            monkeypatch.setattr(module, "validate_config", counted_validate)
    monkeypatch.setattr(MaskedPatch, "requirements", classmethod(counted_requirements))
    _ok(pretrain_in_process("model=vit_test", "objective=masked_patch", "data.num_samples=16", "data.batch_size=8",
                            "trainer.max_steps=1", "trainer.eval_every=1", "trainer.eval_evaluators=[knn]",
                            f"hydra.run.dir={tmp_path}"))
    assert calls == {"validate": 1, "requirements": 1}
