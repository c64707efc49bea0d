"""VTAB-1k's protocol on frozen features, as the ViT paper reports VTAB (Zhai et al. 2019, "A Large-scale Study of
Representation Learning with the Visual Task Adaptation Benchmark"): each task keeps 1,000 training images (800
train + 200 val); hyper-parameters are chosen by accuracy on the 200 after training on the 800; the chosen setting
is trained again on all 1,000 and scored once on the whole test set.

VTAB adapts by fine-tuning (the ViT paper sweeps the learning rate over {0.001, 0.003, 0.01, 0.03} at 2,500 steps);
here the adapted model is the linear probe on frozen features (ssl_vit.eval.linear: L-BFGS logistic regression, its
L2 strength the hyper-parameter swept), so the number is VTAB-1k's data regime and selection rule with a linear
head, comparable across encoders, not with the papers' fine-tuned VTAB scores.
"""

from __future__ import annotations

import torch

from ssl_vit.eval.linear import DEFAULT_L2, linear_probe


def vtab_1k(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
            l2_values=DEFAULT_L2, train_size: int = 1000, val_size: int = 200, seed: int = 0) -> dict:
    """The linear probe of VTAB-1k (module docstring): `train_size` training samples drawn with a seeded
    permutation (all of them when there are fewer), `val_size` of those held out to choose the L2 strength."""
    count = min(train_size, len(train_y))
    if val_size >= count:
        raise ValueError(f"VTAB-1k: {val_size} validation images leave none to train on of the {count} there are "
                         f"(vtab_val must be below {count})")
    chosen = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))[:count]
    # held_out_split keeps int(count x fraction) for validation: +0.5 so that float rounding cannot lose one
    result = linear_probe(train_x[chosen], train_y[chosen], test_x, test_y, l2_values, (val_size + 0.5) / count,
                          seed)
    return {**result, "num_train": count, "num_val": val_size}
