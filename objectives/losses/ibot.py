"""iBOT's patch-level loss (Zhou et al. 2022, used by DINOv2 / DINOv3): the cross-entropy between the teacher's
and the student's patch tokens, on the masked patches only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
