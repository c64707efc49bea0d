"""DINO's image-level loss (Caron et al. 2021): the cross-entropy between the teacher's and the student's views, the
teacher's centring (a running mean, or DINOv2's Sinkhorn-Knopp) and its temperature schedule.

Conventions: crops are stacked along the batch dimension, crop-major ((n_crops * B, K) logits: crop 0's B rows,
then crop 1's, ...); the teacher sees only the global crops, which come first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ssl_vit.collectives import all_reduce


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
