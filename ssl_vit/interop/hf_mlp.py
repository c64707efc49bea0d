"""Our MLP kinds under transformers' names: a plain MLP as (up, down) and a gated one as (gate, up, down).

transformers keeps the gate and the value ("up") projections separate (Dinov2SwiGLUFFN, DINOv3ViTGatedMLP,
Aimv2MLP: `gate_proj`, `up_proj`, `down_proj`); ours are timm's `fc1_g`, `fc1_x`, `fc2` (swiglu) or one `fc1`
holding [gate | value] (swiglu_packed, DINOv2's layout, which transformers 4.x saved as `weights_in`).
"""

from __future__ import annotations

import torch

GATED = ("swiglu", "swiglu_packed")


def gated_parts(state: dict, prefix: str, kind: str) -> dict[str, torch.Tensor]:
    """{"gate.weight", "up.weight", "down.weight" (and ".bias" where present)} of our MLP at `prefix`
    ("blocks.3.mlp.")."""
    out = {}
    for param in ("weight", "bias"):
        if kind == "swiglu_packed":
            if f"{prefix}fc1.{param}" in state:
                out[f"gate.{param}"], out[f"up.{param}"] = state[f"{prefix}fc1.{param}"].chunk(2)
        else:
            for ours, theirs in (("fc1_g", "gate"), ("fc1_x", "up")):
                if f"{prefix}{ours}.{param}" in state:
                    out[f"{theirs}.{param}"] = state[f"{prefix}{ours}.{param}"]
        if f"{prefix}fc2.{param}" in state:
            out[f"down.{param}"] = state[f"{prefix}fc2.{param}"]
    return out


def ours_from_gated(parts: dict[str, torch.Tensor], prefix: str, kind: str) -> dict[str, torch.Tensor]:
    """The inverse of `gated_parts`: our MLP's tensors at `prefix` from {"gate.weight", "up.weight", ...}."""
    out = {}
    for param in ("weight", "bias"):
        if f"gate.{param}" not in parts:
            continue
        if kind == "swiglu_packed":
            out[f"{prefix}fc1.{param}"] = torch.cat([parts[f"gate.{param}"], parts[f"up.{param}"]])
        else:
            out[f"{prefix}fc1_g.{param}"], out[f"{prefix}fc1_x.{param}"] = parts[f"gate.{param}"], parts[f"up.{param}"]
        out[f"{prefix}fc2.{param}"] = parts[f"down.{param}"]
    return out
