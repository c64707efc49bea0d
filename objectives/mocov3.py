"""MoCo v3 (Chen, Xie and He 2021, "An Empirical Study of Training Self-Supervised Vision Transformers").

Two augmented views of every image; the backbone + a projector MLP + a predictor MLP embed each (queries), a
momentum encoder (an EMA of backbone + projector, no predictor) embeds the other view (keys). The loss is InfoNCE
of each query against every key of the global batch, the positive being its own image's key, at temperature T,
scaled by 2T and symmetrised over the two views:

    ctr(q, k) = 2T * CE(normalize(q) @ normalize(all_gather(k)).T / T, rank * N + arange(N))
    loss = ctr(q1, k2) + ctr(q2, k1)

As the reference code (facebookresearch/moco-v3, `moco/builder.py`, `MoCo_ViT`): the projector has 3 layers and the
predictor 2 (Linear without bias -> BatchNorm -> ReLU, the last Linear followed by a BatchNorm without affine
parameters), hidden width 4096, output 256; BatchNorm statistics over the global batch (the reference converts to
SyncBatchNorm); the momentum m rises from 0.99 to 1 on a half cosine over the run; the patch projection is frozen at
its random initialisation (the paper's fix for the training instability of ViTs, `stop_grad_conv1`). The views are
BYOL's (DINO's two global crops: blur on the first, blur 0.1 and solarisation 0.2 on the second) at scale (0.08, 1).
Fixed 2-D sin-cos position embeddings unless the model config sets them (the reference's; MAE's table: the same
frequencies in another channel order). `encoder` is the backbone (the reference evaluates and transfers the base
encoder, not the momentum one). Each micro-batch of an accumulated step brings its own keys (the reference has no
accumulation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone import VisionTransformer
from ssl_vit.ema import EMA, teacher_backbone
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.schema import checked


@dataclass
class MoCoV3Config(ObjectiveConfig):
    name: str = "mocov3"
    dim: int = checked(256, ge=1)  # the projector's and the predictor's output
    mlp_dim: int = checked(4096, ge=1)  # their hidden width
    projector_layers: int = checked(3, ge=1)
    predictor_layers: int = checked(2, ge=1)
    temperature: float = checked(0.2, gt=0)  # MoCo v3's ViT setting (1.0 for its ResNets)
    momentum: float = checked(0.99, ge=0, le=1)  # rises to 1 on a half cosine over the run (`momentum_cosine`)
    momentum_cosine: bool = True
    freeze_patch_embed: bool = True  # the patch projection stays at its random init (stop_grad_conv1)
    crop_scale: list[float] = checked(factory=lambda: [0.08, 1.0], gt=0, le=1, length=2)
    # Collapse monitor: the per-dimension std of the normalised queries over the batch is about 1/sqrt(dim) for
    # spread-out embeddings and 0 when they have collapsed to one point; logged as `query_std` (times sqrt(dim)).


def momentum_at(step: int, total_steps: int, base: float, cosine: bool = True) -> float:
    """The momentum of the update that follows optimizer step `step` (1-based): MoCo v3's adjust_moco_momentum at
    iteration `step` of `total_steps`, 1 - (1 + cos(pi step / total)) / 2 * (1 - base); `base` without the cosine."""
    if not cosine:
        return base
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * step / total_steps)) * (1.0 - base)


def _all_reduce_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, differentiable (its gradient is the sum of every rank's); the tensor itself on one process."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return dist_nn.all_reduce(tensor)
    return tensor


class GlobalBatchNorm1d(nn.Module):
    """BatchNorm over the global batch of every rank (as SyncBatchNorm, which runs on GPUs only), in fp32: the
    statistics are two differentiable all-reduces (sum and count, then the centred sum of squares: no cancellation). No
    running statistics: MoCo v3 never evaluates its heads (they normalise by the batch in training, the only mode they
    run in)."""

    def __init__(self, features: int, affine: bool = True, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(features)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = x.float()
        count = torch.full((1,), values.shape[0], dtype=torch.float32, device=x.device)
        totals = _all_reduce_with_grad(torch.cat([values.sum(0), count]))
        mean = totals[:-1] / totals[-1]
        centred = values - mean
        var = _all_reduce_with_grad(centred.square().sum(0)) / totals[-1]  # biased, as BatchNorm's; two passes
        out = centred * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            out = out * self.weight.float() + self.bias.float()
        return out.to(x.dtype)


def build_mlp(layers: int, in_dim: int, hidden_dim: int, out_dim: int) -> nn.Sequential:
    """MoCo v3's MLP: (Linear without bias -> BatchNorm -> ReLU) x (layers - 1), then Linear -> BatchNorm without
    affine parameters (SimCLR's last BN). torch's default Linear init, as the reference."""
    dims = [in_dim] + [hidden_dim] * (layers - 1) + [out_dim]
    modules: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        modules.append(nn.Linear(a, b, bias=False))
        last = i == layers - 1
        modules.append(GlobalBatchNorm1d(b, affine=not last))
        if not last:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, rank-major (no gradient: the keys need none)."""
    if not torch.distributed.is_initialized():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def contrastive_loss(q: torch.Tensor, k: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(MoCo v3's loss of this rank's queries against the global batch's keys, top-1 accuracy of the positives)."""
    q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
    keys = gather_rows(k.detach())
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    labels = torch.arange(q.shape[0], device=q.device) + rank * q.shape[0]
    logits = q @ keys.T / temperature
    accuracy = (logits.detach().argmax(dim=1) == labels).float().mean()
    return F.cross_entropy(logits, labels) * (2 * temperature), accuracy


class MomentumEncoder(nn.Module):
    """The EMA copy of backbone + projector, named as they are in the objective (the EMA pairs them by name)."""

    def __init__(self, backbone: VisionTransformer, projector: nn.Module):
        super().__init__()
        self.backbone, self.projector = backbone, projector


class MoCoV3(Objective):
    config_class = MoCoV3Config
    needs = Requirements(views=("crops",), ema_teacher=True,
                         model_defaults={"pos_embed": "sincos", "weight_init": "mocov3"},
                         preset_defaults={"vit_s16": {"num_heads": 12}})  # vits.py's vit_small (DeiT / timm: 6)
    saved_heads = ("projector.", "predictor.", "momentum.")

    def __init__(self, backbone, cfg: MoCoV3Config, data: DataInfo):
        super().__init__(backbone, cfg, data)
        width = backbone.embed_dim
        self.projector = build_mlp(cfg.projector_layers, width, cfg.mlp_dim, cfg.dim)
        self.predictor = build_mlp(cfg.predictor_layers, cfg.dim, cfg.mlp_dim, cfg.dim)
        if cfg.freeze_patch_embed:
            backbone.patch_embed.proj.requires_grad_(False)
        self.momentum = MomentumEncoder(teacher_backbone(backbone),
                                        build_mlp(cfg.projector_layers, width, cfg.mlp_dim, cfg.dim))
        self.ema = EMA.following({"backbone": self.backbone, "projector": self.projector}, self.momentum)

    def multicrop_options(self) -> dict:
        size = self.data.img_size
        return dict(local_size=size, n_global=2, n_local=0, global_scale=list(self.cfg.crop_scale))

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        self.ema.update(momentum_at(step, total_steps, self.cfg.momentum, self.cfg.momentum_cosine))

    def fp32_shards(self) -> dict[str, torch.Tensor]:
        """The momentum encoder's fp32 EMA averages when its tensors are 16-bit (DeepSpeed's bf16 mode)."""
        return {f"momentum.{name}": shard for name, shard in self.ema.fp32_shards().items()}

    def _embed(self, network, crops: list[torch.Tensor]) -> list[torch.Tensor]:
        """Projector outputs of each view: the backbone runs the views together (its norms are per token), the
        MLP each view apart (its BatchNorm statistics are per view, as the reference's separate calls)."""
        pooled = network.backbone.pool(network.backbone.forward_features(torch.cat(crops)))
        return [network.projector(view) for view in pooled.split(crops[0].shape[0])]

    def forward(self, batch):
        crops = batch["crops"]
        if len(crops) != 2:
            raise ValueError(f"MoCo v3 compares 2 views of each image; the batch has {len(crops)} crops")
        q1, q2 = (self.predictor(z) for z in self._embed(self, crops))
        with torch.no_grad():
            k1, k2 = self._embed(self.momentum, crops)
        loss_12, accuracy_12 = contrastive_loss(q1, k2, self.cfg.temperature)
        loss_21, accuracy_21 = contrastive_loss(q2, k1, self.cfg.temperature)
        queries = F.normalize(torch.cat([q1, q2]).detach().float(), dim=1)
        return {"loss": loss_12 + loss_21, "contrastive_accuracy": (accuracy_12 + accuracy_21) / 2,
                "query_std": queries.std(dim=0).mean() * math.sqrt(self.cfg.dim)}
