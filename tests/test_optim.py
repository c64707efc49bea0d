import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from objectives.base import DataInfo
from objectives.supervised import Supervised, SupervisedConfig
from ssl_vit.config import OptimConfig
from ssl_vit.optim import apply_schedule, param_groups, schedule, weight_decay_schedule
from ssl_vit.vit import build_vit


def test_no_weight_decay_on_biases_norms_pos_embed_and_tokens():
    model = Supervised(build_vit("vit_test", num_registers=2), SupervisedConfig(), DataInfo(4, 16))
    groups = param_groups(model, weight_decay=0.1)
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    assert {"backbone.pos_embed", "backbone.cls_token", "backbone.reg_token", "backbone.blocks.0.norm1.weight",
            "backbone.blocks.0.attn.qkv.bias", "head.0.bias"} <= no_decay
    assert {"backbone.blocks.0.attn.qkv.weight", "backbone.patch_embed.proj.weight", "head.2.weight"} <= decay
    assert len(no_decay | decay) == len(list(model.parameters()))


def test_parameters_partitioned_by_zero3_keep_their_weight_decay():
    """zero.Init leaves each parameter an empty 1-D tensor with its real shape in ds_shape (DeepSpeed's
    partition_parameters); grouping by the tensor's own ndim put every weight in the no-decay group under ZeRO-3
    (found as a CLIP ZeRO-3 run drifting from DDP at weight decay 0.2)."""
    model = Supervised(build_vit("vit_test"), SupervisedConfig(), DataInfo(4, 16))
    whole = [(g["names"], g["weight_decay"]) for g in param_groups(model, weight_decay=0.1)]
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    assert [(g["names"], g["weight_decay"]) for g in param_groups(model, weight_decay=0.1)] == whole


def test_layer_decay_scales_learning_rate_by_depth():
    model = build_vit("vit_test")  # depth 2
    groups = param_groups(model, 0.05, layer_decay=0.5, num_layers=2)
    scale = {n: g["lr_scale"] for g in groups for n in g["names"]}
    assert scale["pos_embed"] == 0.125 and scale["blocks.0.mlp.fc1.weight"] == 0.25
    assert scale["blocks.1.mlp.fc1.weight"] == 0.5 and scale["norm.weight"] == 1.0


def test_warmup_then_cosine_schedule():
    values = schedule(1.0, 0.1, total_steps=12, warmup_steps=2, kind="cosine")
    assert len(values) == 12
    np.testing.assert_allclose(values[:3], [0.0, 0.5, 1.0])
    assert values[-1] == pytest.approx(0.1)
    middle = 2 + 9 / 2  # the cosine's midpoint: halfway between base and final
    np.testing.assert_allclose(np.interp(middle, np.arange(12), values), 0.55, atol=1e-6)
    assert np.all(np.diff(values[2:]) <= 0)
    np.testing.assert_allclose(schedule(1.0, 0.0, 5, 0, "linear"), [1, 0.75, 0.5, 0.25, 0])
    with pytest.raises(ValueError, match="valid choices"):
        schedule(1.0, 0.0, 5, 0, "step")


def test_apply_schedule_respects_group_scales():
    model = build_vit("vit_test")
    optimizer = torch.optim.AdamW(param_groups(model, 0.05, layer_decay=0.5, num_layers=2))
    apply_schedule(optimizer, lr=2.0, weight_decay=0.3)
    for group in optimizer.param_groups:
        assert group["lr"] == 2.0 * group["lr_scale"]
        assert group["weight_decay"] == (0.3 if group["wd_scale"] else 0.0)


def test_weight_decay_schedule_is_constant_or_a_cosine_to_its_end():
    constant = OmegaConf.structured(OptimConfig(weight_decay=0.05))
    np.testing.assert_allclose(weight_decay_schedule(constant, 4), [0.05] * 4)
    dino = OmegaConf.structured(OptimConfig(weight_decay=0.04, weight_decay_end=0.4))
    values = weight_decay_schedule(dino, 11)
    np.testing.assert_allclose(values, [0.4 - 0.18 * (1 + math.cos(math.pi * k / 10)) for k in range(11)])
