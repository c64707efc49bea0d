"""The KoLeo regulariser (Sablayrolles et al. 2019, DINOv2): spreads the class tokens of a batch apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def koleo_loss(features: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Kozachenko-Leonenko entropy regulariser (DINOv2): -mean log of each L2-normalised row's distance to its
    nearest other row. Finite for duplicate rows (distance 0 -> -log(eps))."""
    x = F.normalize(features.float(), dim=-1, eps=eps)
    dots = x @ x.t()
    dots.fill_diagonal_(-2.0)  # never one's own neighbour
    nearest = dots.argmax(dim=1)
    distances = (x - x[nearest]).norm(dim=-1)
    return -torch.log(distances + eps).mean()
