"""Checkpoints: the encoder file, finding the checkpoint to resume, the data position; exact resume from the sharded
checkpoints of 2-process runs (the session's pool, helpers.pool) and their consolidation into one process's files."""

import os
import re
import shutil
import stat
from fractions import Fraction

import pytest
import torch
from accelerate import Accelerator
from conftest import ROOT, check_ok, pretrain_in_process, read_metrics
from helpers.builders import pretrain_config
from helpers.pool import EVAL, OBJECTIVES, STEPS, strategy_run
from safetensors.torch import load_file, save_file

from ssl_vit.artifacts import load_encoder, read_metadata, save_encoder
from ssl_vit.backbone import build_vit
from ssl_vit.files import plain_mode
from ssl_vit.objectives import load_trained, rebuild_untrained
from ssl_vit.schema import ConfigError
from ssl_vit.train.build import build_components
from ssl_vit.train.checkpoint import (
    TRAIN_STATE_FILE,
    data_position_file,
    list_checkpoints,
    read_data_position,
    resolve_resume,
    save_checkpoint,
)
from ssl_vit.train.consolidate import find_checkpoint, full_state, write_consolidated
from ssl_vit.train.trainer import TrainState

UMASK = os.umask(0o022)
os.umask(UMASK)


def test_encoder_file_round_trips_with_its_config(tmp_path):
    model = build_vit("vit_test", num_registers=1, global_pool="avg").eval()
    path = save_encoder(model, tmp_path / "enc" / "encoder.safetensors", step=7)
    assert read_metadata(path)["step"] == "7"
    loaded = load_encoder(path).eval()
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded(images), model(images), atol=0, rtol=0)
    assert not list(path.parent.glob(".*tmp*"))
    assert stat.S_IMODE(path.stat().st_mode) == plain_mode()  # readable as any file (safetensors writes 0600)


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


def test_a_single_process_checkpoint_consolidates_into_the_runs_files(tmp_path):
    """ssl_vit.train.consolidate on the DDP / one-process layout (model.safetensors, optimizer.bin, the loop's state)
    as save_checkpoint writes it after one optimizer step: the full state and Adam's moments come back as they were,
    and the files written from them are the run's encoder and head (the sharded layouts: the distributed tests)."""
    objective, dataset, views, preprocess = build_components(pretrain_config(tmp_path / "run", "objective=supervised"))
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(objective, torch.optim.AdamW(objective.parameters(), lr=1e-2))
    batch = torch.utils.data.default_collate([views(dataset[i]) for i in range(4)])
    accelerator.backward(model(batch)["loss"])
    optimizer.step()
    accelerator.register_for_checkpointing(TrainState(step=7))
    for step in (3, 7):
        save_checkpoint(accelerator, tmp_path / "run", step, keep=2)

    checkpoint = find_checkpoint(str(tmp_path / "run"))  # the run: its newest checkpoint
    assert checkpoint.name == "step_00000007"
    assert stat.S_IMODE((checkpoint / "model.safetensors").stat().st_mode) == plain_mode() == 0o666 & ~UMASK
    state, adam = full_state(checkpoint)
    assert state.keys() == objective.state_dict().keys()
    for name, tensor in objective.state_dict().items():
        assert torch.equal(state[name], tensor), name
    moments = [entry["exp_avg"] for entry in adam["state"].values()]
    assert len(moments) == len(list(objective.parameters())) and any(m.abs().sum() > 0 for m in moments)

    written = write_consolidated(objective, state, adam, checkpoint, tmp_path / "whole", preprocess)
    whole = torch.load(written["training_state"], weights_only=False)
    assert (whole["format"], whole["world_size"], whole["train_state"]["step"]) == ("whole", 1, 7)
    rebuilt = load_trained(tmp_path / "whole")
    for name, tensor in objective.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="is not a checkpoint of this project .* a checkpoint is a directory like"):
        full_state(tmp_path / "run")
    # a file holding other pickled objects (here the loop's state) is refused in one line unless trusted
    torch.save({"step": 7, "odd": Fraction(1, 3)}, checkpoint / TRAIN_STATE_FILE)
    with pytest.raises(ValueError, match=r"custom_checkpoint_0.pkl holds Python objects beyond tensors .* "
                                         r"consolidate with --trust-pickle"):
        write_consolidated(objective, state, adam, checkpoint, tmp_path / "refused", preprocess)
    assert not (tmp_path / "refused" / "training_state.pt").exists()
    written = write_consolidated(objective, state, adam, checkpoint, tmp_path / "trusted", preprocess,
                                 trust_pickle=True)
    assert torch.load(written["training_state"], weights_only=False)["train_state"]["odd"] == Fraction(1, 3)


@pytest.mark.distributed
@pytest.mark.parametrize("config, objective", [("zero2_cpu2", "dinov3"), ("fsdp2_cpu2", "dinov3"),
                                               ("zero3_cpu2", "mocov3"), ("fsdp2_cpu2", "mocov3"),
                                               ("fsdp2_cpu2", "ijepa")])
def test_resume_from_a_sharded_checkpoint_reproduces_the_uninterrupted_losses(pool, tmp_path, config, objective):
    """Steps 4-5 resumed from the step-3 checkpoint of the uninterrupted run (model and optimizer shards, RNG,
    data position) into a new run directory give that run's losses. DINOv3's checkpoint also holds the sharded EMA
    teacher and Gram teacher (refreshed before step 3, the first resumed one) and its iBOT masks come from the
    restored RNG (ZeRO-3: test_preemption's SIGTERM test); MoCo v3's holds the momentum encoder and a frozen patch
    projection, which the optimizer state lacks."""
    uninterrupted = pool[objective, config]
    checkpoint = uninterrupted / "checkpoints" / "step_00000003"
    sharded_files = {"zero2_cpu2": "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt",  # optimizer shards
                     "zero3_cpu2": "pytorch_model/zero_pp_rank_1_mp_rank_00_model_states.pt",
                     "fsdp2_cpu2": "pytorch_model_fsdp_0/__1_0.distcp"}
    assert (checkpoint / sharded_files[config]).is_file()  # each rank wrote its own shard
    check_ok(strategy_run(config, tmp_path, *OBJECTIVES[objective], f"trainer.resume={checkpoint}"))
    resumed = {m["step"]: m["loss"] for m in read_metrics(tmp_path)}
    assert sorted(resumed) == [4, 5]
    reference = {m["step"]: m["loss"] for m in read_metrics(uninterrupted) if "loss" in m}
    assert [resumed[4], resumed[5]] == pytest.approx([reference[4], reference[5]], abs=1e-6)
    teacher = load_encoder(tmp_path / "encoder.safetensors").state_dict()
    for name, value in load_encoder(uninterrupted / "encoder.safetensors").state_dict().items():
        torch.testing.assert_close(teacher[name], value, atol=1e-6, rtol=0, msg=name)


def _consolidate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("consolidate_script", ROOT / "scripts" / "consolidate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("objective", ["masked_patch", "mae"])
def test_masked_patch_and_mae_save_their_heads_consolidate_and_continue_with_them(pool, tmp_path, objective):
    """The two objectives whose runs once saved no heads (consolidation refused their shards, and MAE continued from
    a run restarted its decoder): ZeRO-3 shards consolidate into the run's own encoder and heads, bitwise; a run
    directory as they were written before (no heads.safetensors, an encoder file recording the objective's name
    only) consolidates too, its config read from Hydra's .hydra/config.yaml; load_trained rebuilds the whole
    objective; a run continued with model.init_heads starts from the run's heads (one step at lr 1e-12)."""
    run = pool[objective, "zero3_cpu2"]
    heads = load_file(run / "heads.safetensors")
    expected = ({"mask_token", "decoder_pred.weight", "decoder_blocks.0.attn.qkv.weight"} if objective == "mae" else
                {"mask_token", "head.weight", "head.bias"})
    assert expected <= set(heads) and (objective == "mae" or expected == set(heads))
    old = tmp_path / "old"
    shutil.copytree(run, old, ignore=shutil.ignore_patterns("heads.safetensors", "tb"))
    encoder = load_file(old / "encoder.safetensors")
    meta = {k: v for k, v in read_metadata(old / "encoder.safetensors").items() if k not in ("objective_config",
                                                                                              "data_info")}
    save_file(encoder, old / "encoder.safetensors", metadata=meta)
    for source in (run, old):
        out = tmp_path / f"whole-{source.name}"
        assert _consolidate_script().main([str(source), "--out", str(out)]) == 0
        for name, theirs in (("encoder.safetensors", encoder), ("heads.safetensors", heads)):
            ours = load_file(out / name)
            assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs), name
    rebuilt = load_trained(run).state_dict()
    assert all(torch.equal(rebuilt[name], value) for name, value in heads.items())
    fixed = ["objective.fixed_pos_embed=false"] if objective == "mae" else []  # taken from the run (the same)
    proc = pretrain_in_process("model=vit_test", *STEPS, *OBJECTIVES[objective], *fixed, f"model.init_from={run}",
                               "model.init_heads=true", "trainer.max_steps=1", "optim.lr=1e-12", "optim.min_lr=0",
                               "optim.warmup_steps=0", f"out={tmp_path / 'continued'}")
    check_ok(proc)
    assert re.search(rf"model.init_heads: \d+ tensors from {re.escape(str(run))} \(objective={objective}\)",
                     proc.stdout + proc.stderr)
    for name, value in load_file(tmp_path / "continued" / "heads.safetensors").items():
        torch.testing.assert_close(value, heads[name], atol=1e-6, rtol=0, msg=name)
    if objective == "mae":  # the loss on one batch and mask draw: the run's, the continued run's, a new decoder's
        size = load_encoder(run / "encoder.safetensors").patch_embed.img_size
        images = torch.rand(4, 3, *size, generator=torch.Generator().manual_seed(0))

        def loss(model):
            torch.manual_seed(0)
            with torch.no_grad():
                return float(model({"image": images})["loss"])

        trained = loss(load_trained(run))
        assert loss(load_trained(tmp_path / "continued")) == pytest.approx(trained, abs=1e-5)
        assert loss(rebuild_untrained(run).eval()) > trained + 0.1  # a new decoder (measured: 1.69 against 1.38)


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["zero2_cpu2", "zero3_cpu2", "fsdp2_cpu2"])
def test_consolidate_turns_a_2_process_checkpoint_into_the_runs_own_files_and_1_process_resume_is_refused(
        pool, tmp_path, config):
    """scripts/consolidate.py on the final DINOv3 checkpoint written by 2 processes (DeepSpeed's zero_to_fp32, DCP's
    dcp_to_torch_save), in this one process: encoder.safetensors and heads.safetensors equal the run's own exactly
    (the teacher, the student's and teacher's heads, the centres), training_state.pt holds the full state and step;
    resuming those shards on 1 process is refused in one line naming consolidate.py."""
    run = pool["dinov3", config]
    checkpoint = run / "checkpoints" / "step_00000005"
    assert _consolidate_script().main([str(run), "--out", str(tmp_path / "whole")]) == 0  # the run: its newest
    for name in ("encoder.safetensors", "heads.safetensors"):
        ours, theirs = load_file(tmp_path / "whole" / name), load_file(run / name)
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs), name
    state = torch.load(tmp_path / "whole" / "training_state.pt", weights_only=False)
    assert state["train_state"]["step"] == 5 and state["world_size"] == 2
    assert (state["optimizer"] is not None) == (config == "fsdp2_cpu2")  # zero_to_fp32: weights, not moments
    teacher = load_file(run / "encoder.safetensors")
    assert torch.equal(state["model"]["teacher.backbone.cls_token"], teacher["cls_token"])
    if config == "zero3_cpu2":  # the real CLI on one process
        proc = pretrain_in_process("model=vit_test", *STEPS, *EVAL, *OBJECTIVES["dinov3"],
                                   f"trainer.resume={checkpoint}", f"out={tmp_path / 'one'}")
        assert proc.returncode != 0
        assert (f"ssl-vit: error: trainer.resume: {checkpoint} was written by 2 processes and this run has 1: its "
                f"DeepSpeed ZeRO shards resume only on 2; python scripts/consolidate.py {checkpoint} --out DIR"
                in proc.stderr), proc.stderr[-2000:]
        # A new ZeRO-3 run from the run's files with its heads (model.init_heads), loaded into partitioned
        # parameters: one step that moves nothing (lr 1e-12, teacher momentum 1) saves what it started from.
        check_ok(strategy_run(config, tmp_path / "continued", *OBJECTIVES["dinov3"], f"model.init_from={run}",
                      "model.init_heads=true", "trainer.max_steps=1", "optim.lr=1e-12", "optim.min_lr=0",
                      "optim.warmup_steps=0", "objective.teacher_momentum=1"))
        for name in ("encoder.safetensors", "heads.safetensors"):
            ours, theirs = load_file(tmp_path / "continued" / name), load_file(run / name)
            assert set(ours) == set(theirs), name
            for key, value in theirs.items():
                torch.testing.assert_close(ours[key], value, atol=1e-6, rtol=0, msg=f"{name}: {key}")
