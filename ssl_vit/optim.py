"""AdamW with parameter groups, and per-step schedules precomputed as arrays (as DINO does)."""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from torch import nn

from ssl_vit.partition import full_shape


def _layer_id(name: str, num_layers: int) -> int:
    """0 for embeddings, i + 1 for block i, num_layers + 1 for everything after the blocks (norm, heads)."""
    if any(key in name for key in ("patch_embed", "pos_embed", "cls_token", "dist_token", "reg_token")):
        return 0
    match = re.search(r"blocks\.(\d+)\.", name)
    return int(match.group(1)) + 1 if match else num_layers + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None,
                 num_layers: int | None = None, decay_all: bool = False,
                 patch_embed_lr_scale: float = 1.0) -> list[dict]:
    """Groups keyed by (decay or not, layer, frozen steps, patch embedding, owner prefix). Each group carries
    `lr_scale`, `wd_scale` and `frozen_until` (lr 0 before that step: the model's `frozen_parameters()`, e.g.
    DINO's last layer) for the schedules.

    With `layer_decay`, block i gets lr_scale = layer_decay ** (num_layers + 1 - layer_id) (BEiT / MAE fine-tuning).
    `decay_all`: every parameter decays (MoCo v3 hands `model.parameters()` to AdamW as one group).
    `patch_embed_lr_scale`: the patch embedding's lr multiplier (DINOv2 / DINOv3: `patch_embed_lr_mult` 0.2).
    The model's `lr_scales()` (name prefix -> multiplier) give each prefix's parameters groups of their own.
    """
    # Biases and norm scales (all 1-D parameters), and what modules list in no_weight_decay() (position
    # embeddings, learned tokens) get no weight decay.
    skip = set().union(*(m.no_weight_decay() for m in model.modules() if hasattr(m, "no_weight_decay")))
    frozen = model.frozen_parameters() if hasattr(model, "frozen_parameters") else {}
    scaled = model.lr_scales() if hasattr(model, "lr_scales") else {}
    groups: dict[tuple, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = decay_all or (len(full_shape(param)) > 1 and name.rsplit(".", 1)[-1] not in skip)
        layer = _layer_id(name, num_layers) if layer_decay is not None else 0
        lr_scale = layer_decay ** (num_layers + 1 - layer) if layer_decay is not None else 1.0
        patch = "patch_embed" in name and patch_embed_lr_scale != 1.0
        lr_scale *= patch_embed_lr_scale if patch else 1.0
        frozen_until = max((steps for prefix, steps in frozen.items() if name.startswith(prefix)), default=0)
        owner = next((prefix for prefix in scaled if name.startswith(prefix)), None)
        lr_scale *= scaled[owner] if owner is not None else 1.0
        group = groups.setdefault((decay, layer, frozen_until, patch, owner), {
            "params": [], "names": [], "weight_decay": weight_decay if decay else 0.0,
            "wd_scale": 1.0 if decay else 0.0, "lr_scale": lr_scale, "frozen_until": frozen_until,
        })
        group["params"].append(param)
        group["names"].append(name)
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg, num_layers: int | None = None, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over `param_groups`; `fused`: one fused kernel per step (for CUDA, where it is the fastest)."""
    if cfg.name != "adamw":
        raise ValueError(f"unknown optimizer {cfg.name!r}; valid choices: ['adamw']")
    if cfg.layer_decay is not None and num_layers is None:  # an objective: its encoder's blocks
        num_layers = len(model.encoder.blocks)
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay, num_layers, getattr(cfg, "decay_all", False),
                          getattr(cfg, "patch_embed_lr_scale", 1.0))
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, fused=fused or None)
    if any(group["frozen_until"] for group in groups):
        hold_frozen_groups(optimizer)
    return optimizer


def hold_frozen_groups(optimizer: torch.optim.Optimizer) -> None:
    """Frozen groups (`frozen` set by `apply_schedule`) as DINO freezes its last layer, which drops the layer's
    gradients: Adam's moments and step count stay at their start, so Adam starts afresh when the group unfreezes
    (a zero lr alone would let the moments fill during the freeze). Done as step hooks on the optimizer DeepSpeed
    wraps too (its flat partitions keep their groups' keys): before the step the group's gradients are zeroed,
    after it its state is reset to a fresh Adam's (state that exists, so that a checkpoint of the freeze has every
    key a resumed optimizer expects: DCP refuses a missing one)."""
    def zero_gradients(opt, args, kwargs):
        for group in opt.param_groups:
            if group.get("frozen"):
                for param in group["params"]:
                    param.grad = torch.zeros_like(param) if param.grad is None else param.grad.zero_()

    def restart_state(opt, args, kwargs):
        for group in opt.param_groups:
            if group.get("frozen"):
                for param in group["params"]:
                    for value in opt.state.get(param, {}).values():
                        if torch.is_tensor(value):
                            value.zero_()

    optimizer.register_step_pre_hook(zero_gradients)
    optimizer.register_step_post_hook(restart_state)


def schedule(base: float, final: float, total_steps: int, warmup_steps: int = 0, kind: str = "cosine",
             warmup_start: float = 0.0, warmup_inclusive: bool = True, lead: int = 0) -> np.ndarray:
    """Value at every step, as DINO's `utils.cosine_scheduler` builds it: a linear warm-up from `warmup_start` that
    reaches `base` at its last step (an inclusive linspace), then a decay with progress k / n over its n steps (the
    cosine, or a straight line, heads for `final` and stops one step short of it).

    warmup_inclusive=False: warm-up step k of W is at start + (base - start) k / W and the peak comes at step W
    (MoCo v3's and MAE's `adjust_learning_rate`, I-JEPA's WarmupCosineSchedule). lead=1: step k takes the value of
    step k + 1 (I-JEPA steps its schedulers before each iteration), so the last step reaches `final`."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown schedule {kind!r}; valid choices: ['cosine', 'linear', 'constant']")
    warmup_steps = min(warmup_steps, total_steps)
    position = np.arange(total_steps) + lead
    if warmup_inclusive:
        warmup = np.linspace(warmup_start, base, warmup_steps)
    else:
        warmup = warmup_start + (base - warmup_start) * np.arange(warmup_steps) / max(warmup_steps, 1)
    warmup = np.append(warmup, base)  # indexable at every position; np.where takes the decay from step W on
    progress = (position - warmup_steps) / max(total_steps - warmup_steps, 1)
    if kind == "cosine":
        decay = final + 0.5 * (base - final) * (1 + np.cos(math.pi * progress))
    elif kind == "linear":
        decay = base + (final - base) * progress
    else:
        decay = np.full(total_steps, float(base))
    return np.where(position < warmup_steps, warmup[np.minimum(position, warmup_steps)], decay)


def weight_decay_schedule(cfg, total_steps: int) -> np.ndarray:
    """Weight decay at every step: constant `cfg.weight_decay`, or with `cfg.weight_decay_end` a cosine from it
    towards that value over the run, no warmup (DINO's schedule)."""
    if cfg.weight_decay_end is None:
        return np.full(total_steps, cfg.weight_decay)
    lead = getattr(cfg, "schedule_lead", 0)
    return schedule(cfg.weight_decay, cfg.weight_decay_end, total_steps, 0, "cosine", lead=lead)


def apply_schedule(optimizer: torch.optim.Optimizer, lr: float, weight_decay: float, step: int = 0) -> None:
    """Set every group's lr and weight decay for optimizer step `step` (0-based); `frozen`: whether it is held."""
    for group in optimizer.param_groups:
        group["frozen"] = step < group.get("frozen_until", 0)
        group["lr"] = 0.0 if group["frozen"] else lr * group.get("lr_scale", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_scale", 1.0)
