"""Weight initialisation schemes, applied by every layer in its own constructor.

DeepSpeed's zero.Init partitions a module's parameters as soon as that module's constructor returns, so an
`init_weights()` pass at the end of a model's constructor would only see empty shards (measured: qkv kept PyTorch's
std 0.042 instead of 0.02). Here each layer initialises itself in `reset_parameters()` (called by its constructor,
as torch's layers do), and a model built on the meta device is materialised with `materialize()`: `to_empty` then
every module's `reset_parameters()`.

Schemes (`model.weight_init`):
- `timm`: timm's ViT default: trunc-normal(0.02) Linear weights, zero biases, PyTorch's default for the patch
  projection, trunc-normal(0.02) position embeddings, normal(1e-6) class / register tokens.
- `jax`: the ViT paper's code (google-research/vision_transformer, big_vision): xavier-uniform kernels (q, k, v
  each as its own matrix), MLP biases normal(1e-6), other biases zero, lecun-normal patch projection, normal(0.02)
  position embeddings (vision_transformer's models_vit.py; big_vision's vit.py draws normal(1/sqrt(width))), zero
  class token.
- `torch`: PyTorch's defaults for Linear and the patch projection (kaiming-uniform), timm's for the embeddings.
- `mocov3`: MoCo v3's `vits.py`: xavier-uniform Linear weights (q, k, v each as its own matrix), zero biases, the
  patch projection xavier-uniform over (D, C x P x P), normal(1e-6) class token (position embeddings: its fixed
  sin-cos, which objective=mocov3 builds).
- `ijepa`: I-JEPA's `init_model` (src/helper.py): trunc-normal(0.02) Linear weights with no depth rescaling (its
  re-initialisation undoes the model's `fix_init_weight`), zero biases, the patch projection trunc-normal(0.02)
  with a zero bias (the model's own `_init_weights`), trunc-normal(0.02) tokens and learned positions.
- `dinov3`: DINOv3's `init_weights_vit` (dinov3/models/vision_transformer.py): trunc-normal(0.02) Linear weights,
  zero biases, the patch projection and its bias uniform(+-1/sqrt(fan_in)) (its PatchEmbed.reset_parameters),
  normal(0.02) class and register (storage) tokens.
- `mae`: MAE's `initialize_weights` (models_mae.py): xavier-uniform Linear weights over the whole matrix (the fused
  qkv as one), zero biases, the patch projection xavier-uniform over (D, C x P x P), normal(0.02) class token.
- `xavier` (internal: MAE's decoder and heads): xavier-uniform over the whole matrix, zero bias.
Classification heads start at zero in every scheme (the paper's fine-tuning head, section 3.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

WEIGHT_INITS = ("timm", "jax", "torch", "mocov3", "ijepa", "dinov3", "mae")
_SCHEMES = (*WEIGHT_INITS, "xavier")
ROLES = ("dense", "mlp", "fused", "zero")


def check_scheme(scheme: str) -> None:
    if scheme not in _SCHEMES:
        raise ValueError(f"weight_init {scheme!r} is not one of {list(WEIGHT_INITS)}")


def _xavier_rows(weight: torch.Tensor, splits: Sequence[int] | None) -> None:
    """xavier-uniform, each block of `splits` output rows as its own (rows x in) matrix (fused q/k/v)."""
    start = 0
    for rows in splits or [weight.shape[0]]:
        bound = math.sqrt(6.0 / (rows + weight.shape[1]))
        nn.init.uniform_(weight[start:start + rows], -bound, bound)
        start += rows


@torch.no_grad()
def init_linear(layer: nn.Linear, scheme: str, role: str = "dense", splits: Sequence[int] | None = None) -> None:
    if role == "zero":
        nn.init.zeros_(layer.weight)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)
        return
    if scheme == "torch":
        nn.Linear.reset_parameters(layer)
        return
    if scheme in ("timm", "ijepa", "dinov3"):
        nn.init.trunc_normal_(layer.weight, std=0.02)
    elif scheme in ("jax", "mocov3"):
        _xavier_rows(layer.weight, splits if role == "fused" else None)
    else:  # xavier, mae: the whole matrix (a fused qkv as one)
        nn.init.xavier_uniform_(layer.weight)
    if layer.bias is not None:
        if scheme == "jax" and role == "mlp":
            nn.init.normal_(layer.bias, std=1e-6)
        else:
            nn.init.zeros_(layer.bias)


@torch.no_grad()
def init_patch_projection(conv: nn.Conv2d, scheme: str) -> None:
    if scheme == "jax":  # flax's lecun_normal: truncated normal, std 1/sqrt(fan_in) after truncation
        fan_in = conv.weight[0].numel()
        std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
        nn.init.trunc_normal_(conv.weight, std=std, a=-2 * std, b=2 * std)  # torch's bounds are absolute
        if conv.bias is not None:
            nn.init.zeros_(conv.bias)
    elif scheme in ("xavier", "mocov3", "mae"):  # MAE, MoCo v3: the projection as a (D, P*P*C) matrix
        nn.init.xavier_uniform_(conv.weight.view(conv.weight.shape[0], -1))
        if conv.bias is not None:
            nn.init.zeros_(conv.bias)
    elif scheme == "ijepa":
        nn.init.trunc_normal_(conv.weight, std=0.02)
        if conv.bias is not None:
            nn.init.zeros_(conv.bias)
    elif scheme == "dinov3":
        bound = 1.0 / math.sqrt(conv.weight[0].numel())
        nn.init.uniform_(conv.weight, -bound, bound)
        if conv.bias is not None:
            nn.init.uniform_(conv.bias, -bound, bound)
    else:  # timm keeps PyTorch's default for the patch projection
        nn.Conv2d.reset_parameters(conv)


@torch.no_grad()
def init_embeddings(pos_embed: torch.Tensor | None, tokens: Sequence[torch.Tensor | None], scheme: str) -> None:
    if pos_embed is not None:
        if scheme == "jax":
            nn.init.normal_(pos_embed, std=0.02)
        else:
            nn.init.trunc_normal_(pos_embed, std=0.02)
    for token in tokens:
        if token is not None:
            if scheme == "jax":
                nn.init.zeros_(token)
            elif scheme == "ijepa":
                nn.init.trunc_normal_(token, std=0.02)
            elif scheme in ("dinov3", "mae"):
                nn.init.normal_(token, std=0.02)
            else:
                nn.init.normal_(token, std=1e-6)


class Linear(nn.Linear):
    """nn.Linear that initialises itself by `scheme` and `role` (dense, mlp, fused with `splits`, zero)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, scheme: str = "timm",
                 role: str = "dense", splits: Sequence[int] | None = None):
        check_scheme(scheme)
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {list(ROLES)}")
        self.scheme, self.role, self.splits = scheme, role, list(splits) if splits else None  # before reset
        super().__init__(in_features, out_features, bias)

    def reset_parameters(self) -> None:
        init_linear(self, self.scheme, self.role, self.splits)


class PatchProjection(nn.Conv2d):
    """The patch embedding's strided convolution, initialised by `scheme`."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size, bias: bool = True, *, scheme: str = "timm"):
        check_scheme(scheme)
        self.scheme = scheme
        super().__init__(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def reset_parameters(self) -> None:
        init_patch_projection(self, self.scheme)


class LayerScale(nn.Module):
    """x * gamma, gamma initialised to `init_value` (timm's parameter name, so weights move both ways)."""

    def __init__(self, dim: int, init_value: float):
        super().__init__()
        self.init_value = init_value
        self.gamma = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.gamma.fill_(self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """A model built on the meta device -> real tensors on `device`, every module re-initialised by its own rule."""
    model.to_empty(device=device)
    for module in reversed(list(model.modules())):  # children first: a parent may override them (MAE's pos_embed)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return model


@contextmanager
def writable(*params: torch.Tensor):
    """Write access to parameters that DeepSpeed ZeRO-3 may have partitioned (gathered; rank 0's values are kept
    and re-partitioned on exit); a no-op for ordinary tensors. For objectives that overwrite a backbone parameter
    after building it (MAE's fixed sin-cos position embeddings)."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed  # heavy: only where ZeRO-3 partitioned something

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
        yield


def rng_devices() -> list[int]:
    """The CUDA devices whose generators `torch.random.fork_rng` must save and restore (torch.manual_seed seeds
    them all)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


@contextmanager
def whole_modules():
    """Build modules that stay whole and outside the trained model (a frozen teacher) even inside DeepSpeed's
    zero.Init, which would otherwise partition them as it partitions the model, and outside transformers' own ZeRO-3
    hook (`without_transformers_zero3`); a no-op without them."""
    try:  # heavy (deepspeed): only where a frozen teacher is built
        from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
    except ImportError:
        with without_transformers_zero3():
            yield
        return
    shutdown_init_context()  # DeepSpeed's own pair, used around its engine's construction
    try:
        with without_transformers_zero3():
            yield
    finally:
        restore_init_context()


@contextmanager
def without_transformers_zero3():
    """transformers builds models under deepspeed.zero.Init while a ZeRO-3 config is registered with it (accelerate
    registers one): off inside, for models built whole on one rank."""
    try:  # heavy: only where a model is built whole; without transformers nothing registered a config with it
        from transformers.integrations import deepspeed as hf_deepspeed
    except ModuleNotFoundError:
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_")


@contextmanager
def fp32_random_init():
    """Inside: `torch.nn.init`'s random initialisers draw into an fp32 copy of a 16-bit tensor, then round it in.
    DeepSpeed's zero.Init creates a bf16 run's parameters in bf16 before any layer initialises them; drawn in bf16,
    trunc-normal and uniform values are coarse and the random stream differs from an fp32 run's. Drawn in fp32,
    a bf16 run starts from the fp32 run's weights, rounded, whatever builds them (our layers, timm's ResNet, open_clip's
    and PyTorch's defaults all initialise through torch.nn.init)."""
    originals = {name: getattr(nn.init, name) for name in _RANDOM_INITS}

    def in_fp32(draw):
        def wrapped(tensor, *args, **kwargs):
            if tensor.dtype not in (torch.bfloat16, torch.float16):
                return draw(tensor, *args, **kwargs)
            with torch.no_grad():
                full = tensor.float()
                draw(full, *args, **kwargs)
                tensor.copy_(full)
            return tensor
        return wrapped

    for name, draw in originals.items():
        setattr(nn.init, name, in_fp32(draw))
    try:
        yield
    finally:
        for name, draw in originals.items():
            setattr(nn.init, name, draw)
