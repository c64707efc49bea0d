"""DINOv3's Gram anchoring (Simeoni et al. 2025): keeps the patch-to-patch similarities of the student close to
those of an earlier teacher, so that dense features stay sharp in long runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
