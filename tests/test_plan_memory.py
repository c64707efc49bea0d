"""The memory planner: model counts from the meta device, model states equal to DeepSpeed's own estimators, and
the CLI."""

import json

import pytest
import torch
from conftest import ROOT
from helpers.inprocess import run_script
from helpers.kept_for_backward import kept_for_backward

from ssl_vit.backbone import build_vit, count_parameters
from ssl_vit.schema import ConfigError
from ssl_vit.train.memory import (
    DEEPSPEED_BUCKET,
    GIB,
    ZERO3_MAX_LIVE,
    ModelShape,
    activation_terms,
    deepspeed_estimate,
    plan,
    smallest_gpu_count,
)


def test_meta_device_counts_match_the_paper_table_and_the_built_model():
    shape = ModelShape.of("vit_22b")
    assert shape.params == 21_750_546_432 and shape.largest_layer == 264_241_152  # fused QKV + fc1: 7 x 6144^2
    assert ModelShape.of("vit_b16").params == count_parameters(build_vit("vit_b16"))  # 86.6M, the paper's 86M
    assert ModelShape.of("vit_l16", img_size=384).tokens == 24 * 24 + 1


@pytest.mark.parametrize("model", ["vit_h14", "vit_g14", "vit_22b"])
@pytest.mark.parametrize("gpus", [8, 64, 256])
@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_model_states_equal_deepspeeds_estimators(model, gpus, strategy):
    shape = ModelShape.of(model)
    ours = plan(shape, strategy, gpus, gpus_per_node=8, precision="bf16")
    gpu, cpu = deepspeed_estimate(shape, strategy, gpus, gpus_per_node=8)
    assert (ours.model_states, ours.cpu_per_node) == (gpu, cpu)


def test_the_issue_reference_figures_for_vit_22b_under_zero3():
    shape = ModelShape.of("vit_22b")
    assert plan(shape, "zero3", 8).model_states / GIB == pytest.approx(46.6, abs=0.05)
    assert plan(shape, "zero3", 64).model_states / GIB == pytest.approx(6.7, abs=0.05)


def test_activations_follow_the_stated_formula_and_checkpointing_keeps_block_inputs():
    shape = ModelShape.of("vit_b16")  # 197 tokens, width 768, MLP 3072, 12 heads, 12 blocks
    per_block = (8 * 768 + 2 * 3072) * 197 * 2 * 2 + 12 * 197 * 2 * 4  # batch 2, bf16
    final_norm = 768 * 197 * 2 * 2  # its input
    assert plan(shape, "ddp", 1, batch_per_gpu=2).activations == 12 * per_block + final_norm
    checkpointed = plan(shape, "ddp", 1, batch_per_gpu=2, grad_checkpointing=True).activations
    assert checkpointed == 12 * 768 * 197 * 2 * 2 + final_norm + per_block
    selective = plan(shape, "ddp", 1, batch_per_gpu=2, grad_checkpointing="selective").activations
    kept = (7 * 768 + 3072) * 197 * 2 * 2 + 12 * 197 * 2 * 4  # input, matmul and attention outputs
    assert selective == 12 * kept + final_norm + (per_block - kept)


@pytest.mark.parametrize("checkpointing", [False, "full", "selective"])
@pytest.mark.parametrize("name", ["vit_test", "vit_test_22b", "vit_test_aimv2", "vit_test_dinov2", "vit_test_siglip",
                                  "vit_test_pe"])
def test_kept_activations_are_what_the_forward_leaves_alive_for_backward(name, checkpointing):
    """The planner's kept activations against the storages a real fp32 forward leaves alive for its backward
    (autograd's saved tensors, a checkpoint's block inputs, a selective checkpoint's cached matmul and attention
    outputs), for the plain and the parallel block and the families' SwiGLU / RMSNorm / MAP: within 5%, and
    selective between none and full."""
    size = dict(img_size=32, embed_dim=64, depth=3, num_heads=4)  # 65 tokens (64 for the 22B-style: no class token)
    model = build_vit(name, **size)
    model.set_grad_checkpointing(checkpointing)
    images = torch.randn(4, 3, 32, 32)
    kept, loss = kept_for_backward(lambda: model.forward_features(images).sum(), model)
    planned, _ = activation_terms(ModelShape.of(name, **size), 4, "fp32", checkpointing)
    assert kept == pytest.approx(planned, rel=0.05), (kept, planned)
    loss.backward()  # the kept tensors were the ones backward needs
    if checkpointing == "selective":
        none, _ = activation_terms(ModelShape.of(name, **size), 4, "fp32", False)
        full, _ = activation_terms(ModelShape.of(name, **size), 4, "fp32", "full")
        assert full < kept < none


@pytest.mark.parametrize("prefix, windows, tolerance", [
    (False, {"window_size": 5}, 0.03),  # SAM / ViTDet's layout: no class token; a 12 x 12 grid padded to 15 x 15
    (False, {"window_size": 4, "global_attn_indexes": [1], "rel_pos": True}, 0.03),
    (False, {"rel_pos": True}, 0.03),
    (True, {"window_size": 5}, 0.10),
    (True, {"window_size": 5, "global_attn_indexes": [1], "rel_pos": True}, 0.10),
])
def test_windowed_blocks_keep_what_the_planner_says(prefix, windows, tolerance):
    """Windowed attention and relative positions (ssl_vit.backbone.windows) against the storages a real fp32 forward
    keeps for its backward."""
    size = dict(img_size=48, embed_dim=64, depth=3, num_heads=4, **({} if prefix else
                                                                    {"class_token": False, "global_pool": "avg"}))
    model = build_vit("vit_test", **size, **windows)
    images = torch.randn(2, 3, 48, 48)
    kept, loss = kept_for_backward(lambda: model.forward_features(images).sum(), model)
    planned, _ = activation_terms(ModelShape.of("vit_test", **size, **windows), 2, "fp32", False)
    assert kept == pytest.approx(planned, rel=tolerance), (kept, planned)
    loss.backward()
    global_, _ = activation_terms(ModelShape.of("vit_test", **size), 2, "fp32", False)
    assert planned > global_  # at this size windows cost memory: the padding and the partition's copy


def test_smallest_gpu_count_is_the_first_that_fits():
    shape = ModelShape.of("vit_22b")
    fewest = smallest_gpu_count(shape, "zero3", 80 * GIB, batch_per_gpu=1)
    assert plan(shape, "zero3", fewest).total <= 80 * GIB < plan(shape, "zero3", fewest // 2).total
    assert smallest_gpu_count(shape, "ddp", 80 * GIB) is None  # 16 bytes per parameter never shard


def test_bad_choices_name_the_valid_ones():
    with pytest.raises(ConfigError, match=r"^strategy=zero4 is not one of ddp, zero1, zero2, zero3, zero2_offload, "
                                          r"zero3_offload, fsdp2; did you mean strategy="):
        plan(ModelShape.of("vit_test"), "zero4", 8)
    with pytest.raises(ConfigError, match="no estimator for strategy='fsdp2'"):
        deepspeed_estimate(ModelShape.of("vit_test"), "fsdp2", 8)


@pytest.mark.slow
def test_cli_prints_the_plan_and_every_strategy():
    cmd = [ROOT / "scripts/plan_memory.py", "model=vit_22b", "strategy=zero3", "gpus=64", "batch_per_gpu=4",
           "grad_checkpointing=true"]
    proc = run_script(*cmd)
    assert proc.returncode == 0, proc.stderr
    assert "21,750,546,432 parameters" in proc.stdout and "zero3 on 64 GPUs" in proc.stdout
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("zero3 ") and "GPUs" not in line)
    assert row[1] == row[2] == "6.68"  # ours == DeepSpeed's
    bad = run_script(cmd[0], "strategy=zero4")
    assert bad.returncode == 2 and bad.stderr.startswith("ssl-vit: error: strategy=zero4 is not one of ddp, zero1, ")


def test_the_planner_uses_the_shipped_deepspeed_buffer_sizes():
    for path in sorted((ROOT / "configs/deepspeed").glob("*.json")):
        zero = json.loads(path.read_text())["zero_optimization"]
        assert zero["reduce_bucket_size"] == DEEPSPEED_BUCKET, path.name
        if zero["stage"] == 3:
            assert zero["stage3_max_live_parameters"] == ZERO3_MAX_LIVE, path.name
