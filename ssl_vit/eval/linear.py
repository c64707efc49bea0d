"""Linear probe: multinomial logistic regression on frozen features.

Solved full-batch with L-BFGS in torch: frozen features of evaluation sets fit in memory, the problem is convex and
smooth, so L-BFGS reaches the optimum in a few hundred iterations with no learning rate or epoch count to tune,
deterministically, on CPU or GPU. (Mini-batch SGD/AdamW, as in DINO's linear eval, is the choice when features do
not fit in memory or the probe runs on augmented views.) Features are standardised with the training statistics;
the L2 strength is chosen on a held-out part of the training set, then the probe is refit on all of it and scored
once on the test set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_L2 = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def standardise(train: torch.Tensor, *others: torch.Tensor, eps: float = 1e-6):
    mean, std = train.mean(dim=0), train.std(dim=0) + eps
    return [(x - mean) / std for x in (train, *others)]


def fit_logistic(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float, max_iter: int = 500,
                 tolerance: float = 1e-7) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise mean cross-entropy + l2/2 * ||W||^2 (bias not penalised) by full-batch L-BFGS; returns (W, b).

    sklearn's LogisticRegression(C) is the same problem with l2 = 1 / (C * n_samples).
    """
    x = x.double()
    weight = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, tolerance_grad=tolerance,
                                  tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach().float(), bias.detach().float()


def accuracy(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    return ((x @ weight + bias).argmax(dim=1) == y).float().mean().item()


def linear_probe(train_x, train_y, test_x, test_y, l2_values=DEFAULT_L2, val_fraction: float = 0.2,
                 seed: int = 0, max_iter: int = 500) -> dict:
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))
    num_val = max(1, int(len(order) * val_fraction))
    val_idx, fit_idx = order[:num_val], order[num_val:]
    fit_x, val_x = standardise(train_x[fit_idx], train_x[val_idx])
    val_accuracy = {}
    for l2 in l2_values:
        weight, bias = fit_logistic(fit_x, train_y[fit_idx], num_classes, l2, max_iter)
        val_accuracy[l2] = accuracy(val_x, train_y[val_idx], weight, bias)
    best = max(val_accuracy, key=lambda l2: (val_accuracy[l2], l2))  # ties: the stronger regulariser
    train_std, test_std = standardise(train_x, test_x)
    weight, bias = fit_logistic(train_std, train_y, num_classes, best, max_iter)
    return {"accuracy": accuracy(test_std, test_y, weight, bias), "l2": best,
            "val_accuracy": {str(k): v for k, v in val_accuracy.items()},
            "train_accuracy": accuracy(train_std, train_y, weight, bias)}
