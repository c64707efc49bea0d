"""Attentive probe (V-JEPA / V-JEPA 2's attentive classifier, AIM's attention pooling): one learned query
cross-attends to all the frozen output tokens of an image, then a LayerNorm and a linear layer classify the pooled
vector. It reads every token, not just the class token, so it suits encoders whose information is spread over
their patches (MAE, I-JEPA), where a linear probe on one pooled vector underrates them.

The tokens (after the final norm, prefix tokens included) are extracted once and standardised per channel with the
training statistics. The probe trains with AdamW (warm-up then cosine, mini-batches) for `epochs`; its learning rate
and weight decay are chosen on a held-out part of the training set (`val_fraction`), then it is retrained on all of
it with the best pair and scored once on the test set. Not convex, unlike the linear probe, hence the sweep.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.eval.features import extract_features
from ssl_vit.eval.linear import held_out_split, standardise
from ssl_vit.progress import progress_bar


class AttentiveProbe(nn.Module):
    """tokens (B, T, D) -> logits (B, C): one query, `num_heads`-head cross-attention, LayerNorm, linear."""

    def __init__(self, dim: int, num_classes: int, num_heads: int = 1):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"attentive probe: width {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.query = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length, dim = tokens.shape
        heads = lambda x: x.view(batch, -1, self.num_heads, dim // self.num_heads).transpose(1, 2)  # noqa: E731
        query = heads(self.q(self.query).expand(batch, -1, -1))
        key, value = (heads(t) for t in self.kv(tokens).chunk(2, dim=-1))
        pooled = F.scaled_dot_product_attention(query, key, value).transpose(1, 2).reshape(batch, dim)
        return self.norm(self.proj(pooled))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(tokens))


def train_probe(tokens: torch.Tensor, labels: torch.Tensor, num_classes: int, num_heads: int, lr: float,
                weight_decay: float, epochs: int, batch_size: int, seed: int = 0) -> AttentiveProbe:
    """AdamW over shuffled mini-batches, one warm-up epoch then a cosine to 0, from a seeded initialisation."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = AttentiveProbe(tokens.shape[-1], num_classes, num_heads)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(len(labels) / batch_size)
    total, warmup = epochs * steps_per_epoch, steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else
                                                 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))
    for _ in range(epochs):
        for index in torch.randperm(len(labels), generator=generator).split(batch_size):
            loss = F.cross_entropy(probe(tokens[index]), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    return probe.eval()


@torch.no_grad()
def probe_accuracy(probe: AttentiveProbe, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    predicted = torch.cat([probe(chunk).argmax(1) for chunk in tokens.split(1024)])
    return float((predicted == labels).float().mean())


def _standardise_tokens(train: torch.Tensor, *others: torch.Tensor):
    """`standardise` (the linear probe's) per channel of (N, T, D) tokens, with the training tokens' statistics."""
    tokens = (train, *others)
    return [rows.view(x.shape) for rows, x in zip(standardise(*(x.reshape(-1, x.shape[-1]) for x in tokens)),
                                                  tokens, strict=True)]


def attentive_probe(train_tokens, train_y, test_tokens, test_y, lr_values, weight_decays, epochs: int = 20,
                    batch_size: int = 256, num_heads: int = 1, val_fraction: float = 0.2, seed: int = 0,
                    progress: bool = False, num_classes: int | None = None) -> dict:
    """Choose (lr, weight decay) on a held-out part of the training set, retrain on all of it, score on the test
    set (module docstring). `num_classes`: the dataset's (default: from the labels)."""
    num_classes = num_classes or int(max(train_y.max(), test_y.max())) + 1
    val_idx, fit_idx = held_out_split(len(train_y), val_fraction, seed)
    fit_x, val_x = _standardise_tokens(train_tokens[fit_idx], train_tokens[val_idx])
    grid = list(itertools.product(map(float, lr_values), map(float, weight_decays)))
    val_accuracy = {}
    for lr, weight_decay in progress_bar(grid, desc="attentive probe sweep", enabled=progress, leave=False):
        probe = train_probe(fit_x, train_y[fit_idx], num_classes, num_heads, lr, weight_decay, epochs, batch_size,
                            seed)
        val_accuracy[lr, weight_decay] = probe_accuracy(probe, val_x, train_y[val_idx])
    best = max(grid, key=lambda pair: (val_accuracy[pair], pair[1], -pair[0]))  # ties: more decay, smaller lr
    train_x, test_x = _standardise_tokens(train_tokens, test_tokens)
    probe = train_probe(train_x, train_y, num_classes, num_heads, *best, epochs, batch_size, seed)
    return {"accuracy": probe_accuracy(probe, test_x, test_y), "lr": best[0], "weight_decay": best[1],
            "val_accuracy": {f"lr={lr:g},wd={wd:g}": acc for (lr, wd), acc in val_accuracy.items()},
            "train_accuracy": probe_accuracy(probe, train_x, train_y), "epochs": epochs, "num_heads": num_heads,
            "tokens": train_tokens.shape[1]}


def token_features(encoder, dataset, views, batch_size: int, progress: bool, desc: str):
    """(N, T, D) output tokens (after the final norm, prefix tokens included) and (N,) labels."""
    return extract_features(encoder, dataset, views, batch_size=batch_size, progress=progress, desc=desc,
                            embed=lambda images: encoder.forward_features(images).flatten(1))


def attentive_eval(encoder, train_set, test_set, views, ecfg, seed: int = 0, progress: bool = True) -> dict:
    """eval=attentive on a labelled dataset."""
    (train_x, train_y), (test_x, test_y) = (token_features(encoder, dataset, views, ecfg.batch_size, progress,
                                                           f"{split} tokens")
                                            for split, dataset in (("train", train_set), ("test", test_set)))
    dim = encoder.embed_dim
    return attentive_probe(train_x.view(len(train_x), -1, dim), train_y, test_x.view(len(test_x), -1, dim), test_y,
                           list(ecfg.attentive_lr_values), list(ecfg.attentive_weight_decays), ecfg.attentive_epochs,
                           ecfg.attentive_batch_size, ecfg.attentive_heads or encoder.config.num_heads,
                           ecfg.val_fraction, seed, progress, len(train_set.classes) or None)
