"""Weighted k-NN classification as in DINO: cosine similarity, the k nearest training samples vote for their
class with weight exp(similarity / temperature), the class with the largest vote wins."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def knn_predict(train_x, train_y, test_x, k: int = 20, temperature: float = 0.07, num_classes: int | None = None,
                chunk: int = 1024) -> torch.Tensor:
    num_classes = num_classes or int(train_y.max()) + 1
    k = min(k, len(train_y))
    train = F.normalize(train_x.float(), dim=1)
    predictions = []
    for start in range(0, len(test_x), chunk):
        similarity = F.normalize(test_x[start:start + chunk].float(), dim=1) @ train.T
        top_sim, top_idx = similarity.topk(k, dim=1)
        votes = torch.zeros(len(top_idx), num_classes).scatter_add_(1, train_y[top_idx], (top_sim / temperature).exp())
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions)


def knn_eval(train_x, train_y, test_x, test_y, k: int = 20, temperature: float = 0.07) -> dict:
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    predictions = knn_predict(train_x, train_y, test_x, k, temperature, num_classes)
    return {"accuracy": (predictions == test_y).float().mean().item(), "k": k, "temperature": temperature}
