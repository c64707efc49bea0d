import math

import numpy as np
import pytest
import torch
from helpers.builders import pretrain_config
from omegaconf import OmegaConf

from ssl_vit.backbone import build_vit
from ssl_vit.config import OptimConfig, peak_lr
from ssl_vit.objectives.base import DataInfo
from ssl_vit.objectives.supervised import Supervised, SupervisedConfig
from ssl_vit.optim import apply_schedule, param_groups, schedule, weight_decay_schedule
from ssl_vit.schema import ConfigError
from ssl_vit.train.build import build_components, build_run, check_config
from ssl_vit.train.trainer import describe_run


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


def _dino_cosine_scheduler(base_value, final_value, total_iters, warmup_iters=0, start_warmup_value=0.0):
    """facebookresearch/dino `utils.cosine_scheduler`, written here from its code (epochs x iterations flattened)."""
    warmup_schedule = np.array([])
    if warmup_iters > 0:
        warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(total_iters - warmup_iters)
    decay = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup_schedule, decay))


@pytest.mark.parametrize(("total", "warmup", "start"), [(12, 2, 0.0), (100, 10, 1e-6), (7, 0, 0.0), (1, 0, 0.0)])
def test_the_cosine_schedule_is_dinos_array(total, warmup, start):
    values = schedule(5e-4, 1e-6, total_steps=total, warmup_steps=warmup, warmup_start=start)
    np.testing.assert_allclose(values, _dino_cosine_scheduler(5e-4, 1e-6, total, warmup, start), rtol=1e-12, atol=0)


def test_warmup_then_cosine_schedule():
    values = schedule(1.0, 0.1, total_steps=12, warmup_steps=3, kind="cosine")
    assert len(values) == 12
    np.testing.assert_allclose(values[:4], [0.0, 0.5, 1.0, 1.0])  # the peak at the last warm-up step and the next
    assert values[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 8 / 9)))  # one step short of the end
    assert np.all(np.diff(values[3:]) <= 0)
    np.testing.assert_allclose(schedule(1.0, 0.0, 5, 0, "linear"), [1, 0.8, 0.6, 0.4, 0.2])
    with pytest.raises(ValueError, match="valid choices"):
        schedule(1.0, 0.0, 5, 0, "step")


def _moco_mae_lr(lr: float, min_lr: float, epoch: float, warmup: float, epochs: float) -> float:
    """MoCo v3's main_moco.py / MAE's util/lr_sched.py adjust_learning_rate at a fractional epoch (MoCo's min_lr: 0)."""
    if epoch < warmup:
        return lr * epoch / warmup
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup) / (epochs - warmup)))


class _IJEPASchedules:
    """I-JEPA's src/utils/schedulers.py as its train.py drives them: WarmupCosineSchedule and CosineWDSchedule,
    each `step()`ped before the iteration that uses the value."""

    def __init__(self, start_lr, ref_lr, final_lr, warmup, total, ref_wd, final_wd):
        self.args = start_lr, ref_lr, final_lr, warmup, total, ref_wd, final_wd
        self._step = 0

    def step(self) -> tuple[float, float]:
        start_lr, ref_lr, final_lr, warmup, total, ref_wd, final_wd = self.args
        self._step += 1
        if self._step < warmup:
            lr = start_lr + float(self._step) / float(max(1, warmup)) * (ref_lr - start_lr)
        else:
            progress = float(self._step - warmup) / float(max(1, total - warmup))
            lr = max(final_lr, final_lr + (ref_lr - final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress)))
        progress = self._step / total
        wd = final_wd + (ref_wd - final_wd) * 0.5 * (1.0 + math.cos(math.pi * progress))
        wd = max(final_wd, wd) if final_wd <= ref_wd else min(final_wd, wd)
        return lr, wd


@pytest.mark.parametrize("objective", ["mocov3_tiny", "mae"])
def test_moco_v3_and_mae_warm_up_as_their_adjust_learning_rate(objective, tmp_path):
    """Both step their lr per iteration at the fractional epoch k / iterations-per-epoch: lr x k / W in the warm-up
    (the peak at step W, not W - 1), then the cosine (steps 10 of 40 here: 2 warm-up epochs of 5 iterations, 8 in
    all)."""
    cfg = pretrain_config(tmp_path, f"objective={objective}", "data.num_samples=16", "trainer.max_steps=40",
                          "optim.warmup_steps=10")
    run = build_run(cfg, *build_components(cfg), world=1)
    peak = peak_lr(cfg.optim, run.global_batch)
    reference = [_moco_mae_lr(peak, cfg.optim.min_lr, k / 5, 2, 8) for k in range(40)]
    np.testing.assert_allclose(run.learning_rates, reference, rtol=1e-12, atol=1e-18)
    assert run.learning_rates[9] < peak == run.learning_rates[10]


def test_ijepa_schedules_lead_by_a_step_from_its_start_lr(tmp_path):
    """I-JEPA's train.py calls scheduler.step() and wd_scheduler.step() before each iteration's forward, and warms
    up from start_lr 2e-4: ours, array for array."""
    cfg = pretrain_config(tmp_path, "objective=ijepa_tiny", "data.img_size=32", "data.num_samples=16",
                          "trainer.max_steps=30", "optim.warmup_steps=6")
    run = build_run(cfg, *build_components(cfg), world=1)
    optim = cfg.optim
    assert (optim.warmup_start, optim.lr, optim.min_lr, optim.weight_decay, optim.weight_decay_end) == (
        2e-4, 1e-3, 1e-6, 0.04, 0.4)  # configs/in1k_vith14_ep300.yaml
    reference = _IJEPASchedules(2e-4, 1e-3, 1e-6, 6, 30, 0.04, 0.4)
    lrs, wds = zip(*(reference.step() for _ in range(30)), strict=True)
    np.testing.assert_allclose(run.learning_rates, lrs, rtol=1e-12)
    np.testing.assert_allclose(run.weight_decays, wds, rtol=1e-12)
    assert run.learning_rates[0] == pytest.approx(2e-4 + 8e-4 / 6) and run.learning_rates[-1] == pytest.approx(1e-6)


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
    np.testing.assert_allclose(values, [0.4 - 0.18 * (1 + math.cos(math.pi * k / 11)) for k in range(11)])


@pytest.mark.parametrize("objective, reference", [
    ("dino_tiny", lambda lr, batch: lr * batch / 256),  # main_dino.py: lr * batch_size_per_gpu * world / 256
    ("mocov3_tiny", lambda lr, batch: lr * batch / 256),  # main_moco.py: lr * batch_size / 256
    ("mae", lambda lr, batch: lr * batch / 256),  # main_pretrain.py: blr * eff_batch_size / 256
    ("dinov2_tiny", lambda lr, batch: lr * math.sqrt(batch / 1024)),  # dinov2 sqrt_wrt_1024
    ("ijepa_tiny", lambda lr, batch: lr),  # I-JEPA gives the lr itself
])
def test_the_peak_lr_follows_the_global_batch_as_each_reference_scales_it(objective, reference, tmp_path):
    """One place scales it, for the global batch: processes x data.batch_size x grad_accum_steps."""
    for world, batch, accumulation in ((1, 64, 1), (2, 32, 1), (2, 8, 4), (1, 16, 2)):
        cfg = pretrain_config(tmp_path, f"objective={objective}", f"data.batch_size={batch}", "data.num_samples=16",
                              f"trainer.grad_accum_steps={accumulation}", "trainer.max_steps=20",
                              *(["data.img_size=32"] if objective == "ijepa_tiny" else []))
        run = build_run(cfg, *build_components(cfg), world=world)
        global_batch = world * batch * accumulation
        assert run.global_batch == global_batch
        assert max(run.learning_rates) == pytest.approx(reference(cfg.optim.lr, global_batch), rel=1e-6)


def test_the_start_up_line_says_the_lr_as_given_and_as_scaled_and_a_rule_needs_its_base(tmp_path):
    cfg = pretrain_config(tmp_path, "objective=dinov2_tiny", "data.batch_size=16")
    assert "lr 0.002 per 1024 images (sqrt) -> 0.0003536 at global batch 32" in describe_run(
        cfg, 32, check_config(cfg).needs)
    ijepa = pretrain_config(tmp_path, "objective=ijepa_tiny")
    assert "(lr 0.001, weight decay" in describe_run(ijepa, 32, check_config(ijepa).needs)
    with pytest.raises(ConfigError, match=r"optim.lr_scaling=linear needs optim.lr_base_batch"):
        peak_lr(OmegaConf.structured(OptimConfig(lr_scaling="linear")), 64)
    assert peak_lr(OmegaConf.structured(OptimConfig(lr=1e-3, lr_base_batch=256)), 64) == 1e-3  # none: as given


def test_dinov2_and_dinov3_param_groups_take_layerwise_decay_and_the_patch_embedding_multiplier(tmp_path):
    """dinov2 / dinov3 utils/param_groups.py: lr multiplier layerwise_decay ** (num_layers + 1 - layer_id) (0 for
    the patch embedding and tokens, blocks i + 1, the rest num_layers + 1), times patch_embed_lr_mult (0.2) for
    names containing "patch_embed"."""
    for objective, decay in (("dinov2_tiny", 0.9), ("dinov3_tiny", 0.98)):
        cfg = pretrain_config(tmp_path, f"objective={objective}", "model=vit_test", "data.num_samples=16",
                              "data.img_size=32")
        run = build_run(cfg, *build_components(cfg), world=1)
        layers = len(run.objective.encoder.blocks)

        def reference(name: str, layers: int = layers, decay: float = decay) -> float:
            if any(k in name for k in ("patch_embed", "pos_embed", "cls_token", "reg_token")):
                layer = 0
            elif ".blocks." in f".{name}":
                layer = int(name.split("blocks.")[1].split(".")[0]) + 1
            else:
                layer = layers + 1
            return decay ** (layers + 1 - layer) * (0.2 if "patch_embed" in name else 1.0)

        for group in run.optimizer.param_groups:
            for name in group["names"]:
                assert group["lr_scale"] == pytest.approx(reference(name), rel=1e-12), name
        assert any("patch_embed" in n for g in run.optimizer.param_groups if g["lr_scale"] < 0.2 for n in g["names"])


def test_dinov3_trains_with_its_7b_recipe(tmp_path):
    """dinov3_vit7b16_pretrain.yaml: AdamW betas (0.9, 0.99), the lr constant after its warm-up, weight decay constant
    0.04, clip 30, layerwise decay 0.98, patch-embed lr x 0.2; teacher temperature warm-up over 100 of 1000 epochs,
    momentum constant 0.994; a plain Linear last layer (no weight norm)."""
    cfg = pretrain_config(tmp_path, "objective=dinov3", "model=vit_test", "data.num_samples=16", "data.img_size=32",
                          "trainer.max_steps=40", "objective.out_dim=64", "objective.ibot_out_dim=64",
                          "objective.hidden_dim=32", "objective.bottleneck_dim=16")
    optim = cfg.optim
    assert (optim.beta1, optim.beta2, optim.schedule, optim.weight_decay, optim.weight_decay_end, optim.grad_clip,
            optim.layer_decay, optim.patch_embed_lr_scale) == (0.9, 0.99, "constant", 0.04, None, 30.0, 0.98, 0.2)
    run = build_run(cfg, *build_components(cfg), world=1)
    peak = peak_lr(optim, run.global_batch)
    np.testing.assert_allclose(run.learning_rates[optim.warmup_steps - 1:], peak, rtol=1e-12)
    assert set(run.weight_decays) == {0.04}
    objective = run.objective
    assert cfg.objective.warmup_teacher_temp_fraction == 0.1 and cfg.objective.weight_norm is False
    assert {objective.teacher_momentum(k, 40) for k in (1, 20, 40)} == {0.994}
    assert not hasattr(objective.head.last_layer, "weight_g") and not hasattr(objective.head.last_layer,
                                                                               "parametrizations")
