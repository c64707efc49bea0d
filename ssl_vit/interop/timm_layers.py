"""What the timm importers share: reading a timm block's activation, MLP, norms and layer-scale init value."""

from __future__ import annotations

import torch
from timm.layers import GELU, GELUTanh, GluMlp, LayerScale, Mlp, QuickGELU, RmsNorm, SwiGLU
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
    if isinstance(act, nn.SiLU):
        return "silu"
    raise ValueError(f"unsupported timm MLP activation {type(act).__name__}; supported: GELU, GELU(tanh), QuickGELU, "
                     "SiLU")


def mlp_settings(mlp: nn.Module) -> dict:
    """Our mlp_kind, mlp_dim, act_layer and proj_bias for a timm block's MLP: `Mlp`, `SwiGLU`, or `GluMlp` with the
    gate first (`SwiGLUPacked`: DINOv2's); ValueError for the others."""
    if not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity):
        raise ValueError(f"this timm model's MLP has a norm inside ({type(mlp.norm).__name__}, scale_mlp_norm), "
                         "which ssl-vit's ViT does not build")
    if type(mlp) is Mlp:
        kind, hidden, bias = "mlp", mlp.fc1.out_features, mlp.fc1.bias is not None
    elif type(mlp) is SwiGLU:
        kind, hidden, bias = "swiglu", mlp.fc1_g.out_features, mlp.fc1_g.bias is not None
    elif type(mlp) is GluMlp and not mlp.gate_last:
        kind, hidden, bias = "swiglu_packed", mlp.fc2.in_features, mlp.fc1.bias is not None
    else:
        raise ValueError(f"unsupported timm MLP {type(mlp).__name__}" + (" with the gate last" if isinstance(
            mlp, GluMlp) else "") + "; supported: Mlp, SwiGLU, SwiGLUPacked (GluMlp, gate first)")
    if (mlp.fc2.bias is not None) != bias:
        raise ValueError("this timm model's MLP has a bias on one projection only, which ssl-vit's ViT does not build")
    return dict(mlp_kind=kind, mlp_dim=hidden, act_layer=activation_name(mlp.act), proj_bias=bias)


def norm_settings(norm: nn.Module) -> dict:
    """Our norm_layer, norm_eps and norm_bias for a timm norm layer (LayerNorm, RmsNorm); ValueError otherwise."""
    if isinstance(norm, RmsNorm | nn.RMSNorm):
        if getattr(norm, "weight", None) is None:
            raise ValueError("this timm model's RMSNorm has no scale (affine=False), which ssl-vit's ViT does not "
                             "build")
        return dict(norm_layer="rmsnorm", norm_eps=float(norm.eps or 1e-6))
    if isinstance(norm, nn.LayerNorm):
        return dict(norm_layer="layernorm", norm_eps=float(norm.eps), norm_bias=norm.bias is not None)
    raise ValueError(f"unsupported timm norm layer {type(norm).__name__}; supported: LayerNorm, RmsNorm")
