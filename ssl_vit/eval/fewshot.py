"""Few-shot linear evaluation of the ViT paper: regularised least squares from frozen features to {-1, 1}^K
targets, solved in closed form, for n shots per class, averaged over several random draws of the shots."""

from __future__ import annotations

import torch

DEFAULT_SHOTS = (1, 5, 10, 25)


def ridge_fit(x: torch.Tensor, targets: torch.Tensor, l2: float) -> torch.Tensor:
    """argmin_W ||[x, 1] W - targets||^2 + l2 ||W||^2, by whichever normal equations are smaller (n << d here)."""
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1).double()
    targets = targets.double()
    n, d = x.shape
    if n < d:  # dual form: W = X^T (X X^T + l2 I)^-1 Y
        return x.T @ torch.linalg.solve(x @ x.T + l2 * torch.eye(n, dtype=x.dtype), targets)
    return torch.linalg.solve(x.T @ x + l2 * torch.eye(d, dtype=x.dtype), x.T @ targets)


def ridge_predict(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1).double()
    return (x @ weight).argmax(dim=1)


def fewshot_eval(train_x, train_y, test_x, test_y, shots=DEFAULT_SHOTS, draws: int = 5, l2: float = 1.0,
                 seed: int = 0) -> dict:
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    mean, std = train_x.mean(dim=0), train_x.std(dim=0) + 1e-6  # a fixed scale makes one l2 fit all shot counts
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    by_class = [torch.nonzero(train_y == c).flatten() for c in range(num_classes)]
    generator = torch.Generator().manual_seed(seed)
    results = {}
    for n in shots:
        if any(len(idx) < n for idx in by_class):
            raise ValueError(f"{n}-shot needs {n} training samples of every class; the smallest class has "
                             f"{min(len(idx) for idx in by_class)}")
        accuracies = []
        for _ in range(draws):
            chosen = torch.cat([idx[torch.randperm(len(idx), generator=generator)[:n]] for idx in by_class])
            targets = 2 * torch.nn.functional.one_hot(train_y[chosen], num_classes) - 1
            weight = ridge_fit(train_x[chosen], targets, l2)
            accuracies.append((ridge_predict(weight, test_x) == test_y).float().mean().item())
        results[f"{n}_shot"] = sum(accuracies) / len(accuracies)
    return {"accuracy": results, "draws": draws, "l2": l2}
