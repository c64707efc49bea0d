"""The evaluation protocols `ssl-vit evaluate` (eval=...) and `ssl-vit benchmark` (protocols=[...]) share, in one
table: for each, what of the `eval.*` config decides its result (a benchmark cell's key, so a changed setting
recomputes the cell) and, for the frozen-feature ones, how it runs on extracted features and which scores the
benchmark's table reports. Both commands read this table; neither keeps its own copy.

    linear     L2-regularised logistic regression, the regularisation chosen on a held-out part (ssl_vit.eval.linear)
    knn        DINO's weighted k-NN (ssl_vit.eval.knn)
    fewshot    n-shot linear probes over draws (ssl_vit.eval.fewshot); a count the smallest class cannot fill is left
               out by name (its score None), so the other counts still report
    segmentation, zeroshot, retrieval: run on images, not on pooled features (their settings only here)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssl_vit.eval.fewshot import fewshot_eval
from ssl_vit.eval.knn import knn_eval
from ssl_vit.eval.linear import linear_probe


@dataclass(frozen=True)
class Protocol:
    settings: Callable  # eval config -> {setting: value}: what decides the result
    run: Callable | None = None  # (train_x, train_y, test_x, test_y, eval config, seed) -> the evaluator's details
    scores: Callable | None = None  # (details, eval config) -> {metric: value}, the benchmark's columns


def _fewshot(train_x, train_y, test_x, test_y, e, seed: int) -> dict:
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    smallest = int(torch.bincount(train_y, minlength=num_classes).min())
    shots = [n for n in e.fewshot_shots if n <= smallest]
    details = fewshot_eval(train_x, train_y, test_x, test_y, shots, e.fewshot_draws, e.fewshot_l2, seed) if shots \
        else {"accuracy": {}}
    details["left_out"] = {f"{n}-shot": f"the smallest class has {smallest} training images"
                           for n in e.fewshot_shots if n > smallest}
    return details


PROTOCOLS: dict[str, Protocol] = {
    "linear": Protocol(
        lambda e: {"l2": list(e.l2_values), "val": e.val_fraction},
        lambda tx, ty, sx, sy, e, seed: linear_probe(tx, ty, sx, sy, list(e.l2_values), e.val_fraction, seed),
        lambda details, e: {"linear": details["accuracy"]}),
    "knn": Protocol(
        lambda e: {"k": e.knn_k, "temperature": e.knn_temperature},
        lambda tx, ty, sx, sy, e, seed: knn_eval(tx, ty, sx, sy, e.knn_k, e.knn_temperature),
        lambda details, e: {"k-NN": details["accuracy"]}),
    "fewshot": Protocol(
        lambda e: {"shots": list(e.fewshot_shots), "draws": e.fewshot_draws, "l2": e.fewshot_l2},
        _fewshot,
        lambda details, e: {f"{n}-shot": details["accuracy"].get(f"{n}_shot") for n in e.fewshot_shots}),
    "segmentation": Protocol(lambda e: {"l2": list(e.l2_values), "val": e.val_fraction,
                                        "blocks": e.segmentation_blocks}),
    "zeroshot": Protocol(lambda e: {"templates": list(e.zeroshot_templates)}),
    "retrieval": Protocol(lambda e: {"ks": list(e.retrieval_ks)}),
}
FROZEN_PROTOCOLS = tuple(name for name, protocol in PROTOCOLS.items() if protocol.run is not None)
