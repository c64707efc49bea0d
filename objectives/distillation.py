"""The parts of self-distillation (DINO, Caron et al. 2021) that do not depend on the loop: the projection head, the
cross-entropy between teacher and student views, the teacher's centring and its temperature schedule.

Conventions: crops are stacked along the batch dimension, crop-major ((n_crops * B, K) logits: crop 0's B rows,
then crop 1's, ...); the teacher sees only the global crops, which come first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.init import Linear


class WeightNormLinear(nn.Module):
    """A bias-free linear layer with weight normalisation, W = g * V / ||V|| per output row (DINO's last layer).
    With `fixed_norm` (DINO's `norm_last_layer`), g is 1 and not learned. Written out rather than with torch's
    parametrization so that its two parameters shard like any other under ZeRO-3 and FSDP2."""

    def __init__(self, in_features: int, out_features: int, fixed_norm: bool = True):
        super().__init__()
        self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_g = None if fixed_norm else nn.Parameter(torch.empty(out_features, 1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight_v, std=0.02)
        if self.weight_g is not None:
            self.weight_g.fill_(1.0)  # as DINO: every prototype starts at norm 1, then g is learned

    def weight(self) -> torch.Tensor:
        direction = F.normalize(self.weight_v, dim=1)
        return direction if self.weight_g is None else self.weight_g * direction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


class DINOHead(nn.Module):
    """MLP (nlayers, GELU, hidden width) -> bottleneck -> L2 normalisation -> K prototypes, the last layer
    weight-normalised (`weight_norm=True`, DINO) or a plain linear layer (as DINOv2 offers)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 nlayers: int = 3, norm_last_layer: bool = True, weight_norm: bool = True):
        super().__init__()
        if nlayers < 1:
            raise ValueError(f"nlayers={nlayers} is invalid: must be >= 1")
        dims = [in_dim] + [hidden_dim] * (nlayers - 1) + [bottleneck_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(Linear(a, b, scheme="timm"))  # DINO: trunc-normal(0.02) weights, zero biases
            if i < nlayers - 1:
                layers.append(nn.GELU())
        self.mlp = nn.Sequential(*layers)
        self.last_layer = (WeightNormLinear(bottleneck_dim, out_dim, fixed_norm=norm_last_layer) if weight_norm
                           else Linear(bottleneck_dim, out_dim, bias=False, scheme="timm"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, eps=1e-6 if x.dtype == torch.float32 else 1e-3))


def dino_loss(student: torch.Tensor, teacher: torch.Tensor, centre: torch.Tensor, student_temp: float,
              teacher_temp: float, n_global: int = 2) -> torch.Tensor:
    """Mean over all (teacher global crop i, student crop v) pairs with v != i of
    -sum_k softmax((t_i - c) / T_t)_k * log_softmax(s_v / T_s)_k, averaged over the batch.

    student: (n_crops * B, K) logits, teacher: (n_global * B, K) logits, crop-major; centre: (1, K)."""
    return cross_view_loss(student, centred_probs(teacher, centre, teacher_temp), student_temp, n_global)


def centred_probs(teacher: torch.Tensor, centre: torch.Tensor, teacher_temp: float) -> torch.Tensor:
    """DINO's teacher targets softmax((t - c) / T_t), in fp32, without gradient."""
    return F.softmax((teacher.float() - centre.float()) / teacher_temp, dim=-1).detach()


def cross_view_loss(student: torch.Tensor, teacher_probs: torch.Tensor, student_temp: float,
                    n_global: int = 2, local_weight: float = 1.0) -> torch.Tensor:
    """The cross-entropy of `dino_loss` from teacher probabilities ((n_global * B, K), e.g. Sinkhorn-Knopp's).
    `local_weight` scales the pairs of a local student crop (DINOv3 lowers it to 0.5); the sum is still divided by
    the number of pairs, as DINOv3 weighs its global and local terms by their shares of the pairs."""
    n_crops = student.shape[0] * n_global // teacher_probs.shape[0]
    if n_crops < 2 or student.shape[0] % n_crops or teacher_probs.shape[0] % n_global:
        raise ValueError(f"{student.shape[0]} student rows are not n_crops x batch for {teacher_probs.shape[0]} "
                         f"teacher rows of {n_global} global crops")
    log_p = F.log_softmax(student.float() / student_temp, dim=-1).chunk(n_crops)
    q = teacher_probs.detach().chunk(n_global)
    total, pairs = student.new_zeros((), dtype=torch.float32), 0
    for i, q_i in enumerate(q):
        for v, log_p_v in enumerate(log_p):
            if v != i:
                term = (-q_i * log_p_v).sum(dim=-1).mean()
                total = total + (term if v < n_global or local_weight == 1.0 else local_weight * term)
                pairs += 1
    return total / pairs


def gram_loss(student: torch.Tensor, teacher: torch.Tensor, remove_negative: bool = False) -> torch.Tensor:
    """DINOv3's Gram anchoring: the mean squared difference between the per-image Gram matrices of the L2-normalised
    patch features (patch-to-patch cosine similarities), in fp32. student, teacher: (B, N, D); `remove_negative`
    sets negative similarities to 0 in both first."""
    if student.shape != teacher.shape:
        raise ValueError(f"Gram anchoring compares the same patches: student {tuple(student.shape)}, teacher "
                         f"{tuple(teacher.shape)}")
    s, t = F.normalize(student.float(), dim=-1), F.normalize(teacher.detach().float(), dim=-1)
    gram_s, gram_t = s @ s.transpose(-1, -2), t @ t.transpose(-1, -2)
    if remove_negative:
        gram_s, gram_t = gram_s.clamp_min(0), gram_t.clamp_min(0)
    return F.mse_loss(gram_s, gram_t)


@torch.no_grad()
def updated_centre(centre: torch.Tensor, teacher: torch.Tensor, momentum: float = 0.9,
                   all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """c <- m c + (1 - m) mean of the teacher logits over the global batch: every rank's rows, their sum and count
    all-reduced when `all_reduce_sum` is given (ranks may hold different numbers of rows, e.g. masked patches).
    With no rows anywhere the centre stays."""
    totals = torch.cat([teacher.float().sum(dim=0), teacher.new_full((1,), teacher.shape[0], dtype=torch.float32)])
    if all_reduce_sum is not None:
        totals = all_reduce_sum(totals)
    batch_sum, rows = totals[:-1], totals[-1]
    if rows == 0:
        return centre
    return centre * momentum + batch_sum[None] / rows * (1 - momentum)


def teacher_temperature_schedule(start: float, end: float, warmup_steps: int, total_steps: int) -> np.ndarray:
    """Linear from `start` to `end` over `warmup_steps`, then `end` (DINO's 0.04 -> 0.04, or 0.04 -> 0.07)."""
    warmup = min(warmup_steps, total_steps)
    return np.concatenate([np.linspace(start, end, warmup), np.full(total_steps - warmup, end)])



def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) over ranks in place when a process group is up; the tensor itself on one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
        torch.distributed.all_reduce(tensor, op=ops[op])
    return tensor


@torch.no_grad()
def sinkhorn_knopp(teacher: torch.Tensor, teacher_temp: float, iterations: int = 3) -> torch.Tensor:
    """DINOv2's teacher targets (SwAV's Sinkhorn-Knopp): exp(t / T) made, in fp32 over the global batch of all
    ranks, into an assignment whose prototypes are used equally: every sample's row sums to 1, every prototype's
    column to about B / K. teacher: (B, K) logits on this rank; returns (B, K)."""
    scores = teacher.float() / teacher_temp
    local_max = scores.max() if scores.numel() else scores.new_full((), -math.inf)  # a rank may have no rows
    scores = scores - all_reduce(local_max.clone(), "max")  # no overflow in exp; cancels in the sums below
    q = scores.exp().t()  # (K, B)
    prototypes = q.shape[0]
    samples = all_reduce(torch.tensor(float(q.shape[1]), device=q.device))
    if samples == 0:  # no rows on any rank (e.g. no masked patch anywhere)
        return scores
    q /= all_reduce(q.sum())
    for _ in range(iterations):
        q /= all_reduce(q.sum(dim=1, keepdim=True))  # each prototype: total 1 / K
        q /= prototypes
        q /= q.sum(dim=0, keepdim=True)  # each sample: total 1 / B
        q /= samples
    return (q * samples).t()


def koleo_loss(features: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Kozachenko-Leonenko entropy regulariser (DINOv2): -mean log of each L2-normalised row's distance to its
    nearest other row. Finite for duplicate rows (distance 0 -> -log(eps))."""
    x = F.normalize(features.float(), dim=-1, eps=eps)
    dots = x @ x.t()
    dots.fill_diagonal_(-2.0)  # never one's own neighbour
    nearest = dots.argmax(dim=1)
    distances = (x - x[nearest]).norm(dim=-1)
    return -torch.log(distances + eps).mean()


def masked_patch_loss(student: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor,
                      student_temp: float) -> torch.Tensor:
    """iBOT's loss: cross-entropy between the teacher's patch targets and the student's patch logits on the masked
    patches only, averaged per image over its masked patches, then over images. student: (B, N, K) logits,
    teacher_probs: (B, N, K), mask: (B, N) bool."""
    per_patch = -(teacher_probs * F.log_softmax(student.float() / student_temp, dim=-1)).sum(dim=-1)
    weights = mask.float()
    return ((per_patch * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)).mean()


def masked_tokens(tokens: torch.Tensor, mask: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
    """The (M, D) rows of (B, N, D) patch tokens where the (B, N) mask is true, in row-major order: `tokens[mask]`,
    or, given the mask's flat `indices` (drawn with it in the collate), an index_select that does not wait for
    the device to count them."""
    if indices is None:
        return tokens[mask]
    return tokens.flatten(0, 1).index_select(0, indices)


def masked_tokens_loss(student: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor,
                       student_temp: float, indices: torch.Tensor | None = None) -> torch.Tensor:
    """`masked_patch_loss` computed on the masked tokens only (what the heads see: (M, K) rows for the M = mask.sum()
    masked patches in row-major order of the (B, N) mask, `masked_tokens`), so that the patch heads never run on
    visible patches."""
    per_token = -(teacher_probs * F.log_softmax(student.float() / student_temp, dim=-1)).sum(dim=-1)
    image = indices // mask.shape[1] if indices is not None else mask.nonzero()[:, 0]  # each masked token's image
    return (per_token / mask.sum(dim=1).float().clamp(min=1.0)[image]).sum() / mask.shape[0]
