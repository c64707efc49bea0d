"""What the timm importers share: reading a timm block's activation and layer-scale init value."""

from __future__ import annotations

import torch
from timm.layers import GELU, GELUTanh, LayerScale, QuickGELU
from torch import nn


def layer_scale_init(model: nn.Module) -> float | None:
    """The layer-scale init value the timm model was built with (its `init_values`), or None without layer scale.

    Rules, first that applies: timm's `LayerScale` keeps `init_values` as an attribute (every timm release this
    package supports); else the constructor arguments timm recorded (`_model_args` / `pretrained_model_args`);
    else the gammas, when they all hold one value (an untrained model). A trained model that recorded nothing is an
    error: pass `layer_scale=` to `from_timm`.
    """
    scales = [m for m in model.modules() if isinstance(m, LayerScale)]
    if not scales:
        return None
    recorded = {float(m.init_values) for m in scales if getattr(m, "init_values", None) is not None}
    if len(recorded) == 1:
        return recorded.pop()
    for args in (getattr(model, "_model_args", None), getattr(model, "pretrained_model_args", None)):
        if args and args.get("init_values") is not None:
            return float(args["init_values"])
    gammas = torch.cat([m.gamma.detach().flatten().float() for m in scales])
    if gammas.numel() and bool((gammas == gammas[0]).all()):
        return float(gammas[0])
    raise ValueError("cannot tell the layer-scale init value of this timm model (no init_values recorded and the "
                     "gammas differ); pass it as from_timm(model, layer_scale=...)")


def activation_name(act: nn.Module) -> str:
    """Our `act_layer` name for a timm block's MLP activation (ValueError for one we do not have)."""
    if isinstance(act, QuickGELU):
        return "quick_gelu"
    if isinstance(act, GELUTanh) or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    if isinstance(act, (nn.GELU, GELU)):  # timm's GELU is F.gelu, exact
        return "gelu"
    raise ValueError(f"unsupported timm MLP activation {type(act).__name__}; supported: GELU, GELU(tanh), QuickGELU")
