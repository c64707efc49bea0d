"""Linear-probe solver speed: ours (scipy L-BFGS-B on a torch loss, float32 matmuls, warm starts along the L2 path)
against scikit-learn's LogisticRegression(solver="lbfgs") on the same standardised features, in the same run.

    python benchmarks/linear_probe_speed.py                   # digits ViT features, digits and Fashion-MNIST pixels
    python benchmarks/linear_probe_speed.py --max-train 10000 --repeats 3 --datasets digits,fashion_mnist

Datasets: digits_vit = the tests' features (sklearn's digits through a random tiny ViT, 1,438 x 64); digits and
fashion_mnist = raw pixels (1,438 x 64; up to 60,000 x 784, --max-train). Per dataset (features standardised with
the training statistics, float32 for both solvers):
- one fit at --l2 from zero (sklearn: C = 1 / (l2 * n)), both to sklearn's stopping rule (max |gradient| <= 1e-4) and
  the same --max-iter;
- the whole probe: L2 chosen on a held-out 20% of the training set, refit on all of it at the chosen value, scored on
  the test set. Ours is `linear_probe` (strong to weak, warm-started, grid extended past a winning edge); sklearn fits
  the values ours tried on the same split, each from zero ("sklearn") and warm-started strong to weak
  (`warm_start=True`, "sklearn warm").
Reported: wall seconds (best of --repeats, solvers interleaved, after an untimed warm-up), the objective (mean
cross-entropy + l2/2 ||W||^2 in float64, the same function for all), test accuracy, sklearn's iterations. The machine
may be shared: the 1-minute load average after each timed run is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from ssl_vit.backbone import build_vit
from ssl_vit.data import Digits, FashionMNIST, ViewBuilder
from ssl_vit.eval.features import extract_features
from ssl_vit.eval.linear import DEFAULT_L2, accuracy, linear_probe, logistic_objective, solve_logistic, standardise

LARGE = 10_000_000  # feature values (samples x features) above which --large-repeats applies


def load(name: str, max_train: int | None):
    """(train_x, train_y, test_x, test_y): raw pixels in [0, 1], or (digits_vit) the tests' features of sklearn's
    digits: class token + average patch token of a randomly initialised tiny ViT (seed 0) at 16 px."""
    if name == "digits_vit":
        torch.manual_seed(0)
        encoder = build_vit("vit_test")
        views = ViewBuilder(("image", "label"), 16, [0.3] * 3, [0.4] * 3)
        return tuple(t for split in ("train", "test")
                     for t in extract_features(encoder, Digits(split), views, kind="cls_avg", progress=False))
    dataset = Digits if name == "digits" else FashionMNIST
    (train_x, train_y), (test_x, test_y) = [
        (torch.tensor(d.images.reshape(len(d), -1)).float() / 255, torch.tensor(d.labels).long())
        for d in (dataset(split=split) for split in ("train", "test"))]
    if max_train:
        train_x, train_y = train_x[:max_train], train_y[:max_train]
    return train_x, train_y, test_x, test_y


def sklearn_fit(x, y, l2, max_iter, warm_from=None):
    """LogisticRegression(lbfgs) at C = 1 / (l2 * n); `warm_from` = (W, b) starts it there (sklearn's warm_start)."""
    model = LogisticRegression(C=1 / (l2 * len(y)), max_iter=max_iter, warm_start=warm_from is not None)
    if warm_from is not None:
        model.coef_, model.intercept_ = warm_from[0].T.double().numpy(), warm_from[1].double().numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x.numpy(), y.numpy())
    return (torch.from_numpy(model.coef_.T.copy()).float(), torch.from_numpy(model.intercept_.copy()).float(),
            int(model.n_iter_[0]))


def sklearn_single(x, y, l2, max_iter):
    weight, bias, iterations = sklearn_fit(x, y, l2, max_iter)
    return weight, bias, iterations, iterations < max_iter  # sklearn stops at max_iter with a ConvergenceWarning


def sklearn_probe(train_x, train_y, test_x, test_y, l2_values, max_iter, warm, val_fraction=0.2, seed=0) -> dict:
    """`linear_probe`'s protocol (same split, standardisation, tie rule, the same L2 values), fitted by sklearn: each
    value from zero, or (warm) strong to weak from the previous value's solution, the refit from the chosen one's."""
    order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed))
    num_val = max(1, int(len(order) * val_fraction))
    val_idx, fit_idx = order[:num_val], order[num_val:]
    fit_x, val_x = standardise(train_x[fit_idx], train_x[val_idx])
    solutions, val_accuracy, previous, iterations = {}, {}, None, 0
    for l2 in sorted(l2_values, reverse=True):
        *solutions[l2], steps = sklearn_fit(fit_x, train_y[fit_idx], l2, max_iter, previous if warm else None)
        previous, iterations = solutions[l2], iterations + steps
        val_accuracy[l2] = accuracy(val_x, train_y[val_idx], *solutions[l2])
    best = max(val_accuracy, key=lambda l2: (val_accuracy[l2], l2))
    train_std, test_std = standardise(train_x, test_x)
    weight, bias, steps = sklearn_fit(train_std, train_y, best, max_iter, solutions[best] if warm else None)
    return {"l2": best, "accuracy": accuracy(test_std, test_y, weight, bias), "iterations": iterations + steps,
            "train_objective": logistic_objective(train_std, train_y, weight, bias, best)}


def bench_dataset(name, args) -> dict:
    train_x, train_y, test_x, test_y = load(name, args.max_train if name == "fashion_mnist" else None)
    train_std, test_std = standardise(train_x, test_x)
    l2 = args.l2

    def ours_fit():
        solution = solve_logistic(train_std, train_y, 10, l2, max_iter=args.max_iter)
        return solution.weight, solution.bias, solution.iterations, solution.converged

    def ours_probe():
        result = linear_probe(train_x, train_y, test_x, test_y, args.grid, max_iter=args.max_iter)
        tried.clear()
        tried.extend(float(v) for v in result["val_accuracy"])
        return result

    tried = []
    tasks = {
        "fit": {"ours": ours_fit, "sklearn": lambda: sklearn_single(train_std, train_y, l2, args.max_iter)},
        "probe": {"ours": ours_probe,  # runs first: sklearn fits the values it tried
                  "sklearn": lambda: sklearn_probe(train_x, train_y, test_x, test_y, tried, args.max_iter, False),
                  "sklearn warm": lambda: sklearn_probe(train_x, train_y, test_x, test_y, tried, args.max_iter, True)},
    }
    rows = {task: {} for task in tasks}
    repeats = args.repeats if train_x.numel() < LARGE else args.large_repeats
    for _ in range(repeats):  # solvers interleaved, so that all see the same load; the best time is kept
        for task, solvers in tasks.items():
            for solver, function in solvers.items():
                start = time.perf_counter()
                result = function()
                seconds = time.perf_counter() - start
                print(f"  {name} {task} {solver}: {seconds:.2f} s", flush=True)
                if solver not in rows[task] or seconds < rows[task][solver]["wall_s"]:
                    rows[task][solver] = {"wall_s": seconds, "load_average_after": os.getloadavg()[0],
                                          **summarise(task, result, train_std, train_y, test_std, test_y, l2)}
    return {"train": list(train_x.shape), "test": list(test_x.shape), "l2": l2, "results": rows}


def summarise(task, result, train_std, train_y, test_std, test_y, l2) -> dict:
    if task == "fit":
        weight, bias, iterations, converged = result
        return {"objective": logistic_objective(train_std, train_y, weight, bias, l2), "iterations": iterations,
                "converged": converged, "test_accuracy": accuracy(test_std, test_y, weight, bias)}
    row = {"objective": result["train_objective"], "test_accuracy": result["accuracy"], "l2": result["l2"]}
    if "iterations" in result:  # sklearn's, all fits of the probe
        row["iterations"] = result["iterations"]
    else:
        row.update(values_tried=len(result["val_accuracy"]), l2_grid_extended=result["l2_grid_extended"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="digits_vit,digits,fashion_mnist")
    parser.add_argument("--max-train", type=int, default=None, help="first N Fashion-MNIST training images")
    parser.add_argument("--l2", type=float, default=1e-3, help="L2 of the single fit (sklearn C = 1 / (l2 * n))")
    parser.add_argument("--grid", type=float, nargs="+", default=list(DEFAULT_L2))
    parser.add_argument("--max-iter", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per solver (the best is kept)")
    parser.add_argument("--large-repeats", type=int, default=1, help="the same, for over 10M feature values")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/linear_probe_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with threadpool_limits(limits=args.threads):
        warm_up = torch.randn(64, 8), torch.arange(64) % 4  # first calls' one-off costs (library loading) untimed
        solve_logistic(*warm_up, 4, 1.0), sklearn_fit(*warm_up, 1.0, 100)
        datasets = {name: bench_dataset(name, args) for name in args.datasets.split(",")}
    report = {"benchmark": "linear_probe_speed", "threads": args.threads, "repeats": args.repeats,
              "large_repeats": args.large_repeats,
              "max_iter": args.max_iter, "grid": args.grid, "machine": platform.processor() or platform.machine(),
              "load_average_before_after": [load_before[0], os.getloadavg()[0]], "datasets": datasets}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{'dataset':<26}{'task':<18}{'solver':<14}{'wall s':>8}{'x ours':>8}{'objective':>12}{'test acc':>10}"
          f"{'iters':>7}")
    for name, data in datasets.items():
        label = f"{name} {data['train'][0]}x{data['train'][1]}"
        for task, solvers in data["results"].items():
            title = f"fit l2={data['l2']:g}" if task == "fit" else "probe (sweep)"
            ours_s = solvers["ours"]["wall_s"]
            for solver, row in solvers.items():
                objective = row["objective"]
                chosen = f" l2={row['l2']:g}" if task == "probe" else ""
                print(f"{label:<26}{title:<18}{solver:<14}{row['wall_s']:>8.2f}{row['wall_s'] / ours_s:>7.1f}x"
                      f"{objective:>12.6f}{100 * row['test_accuracy']:>9.2f}%{row.get('iterations') or '':>7}{chosen}")
                label, title = "", ""
    print(f"load average before/after: {report['load_average_before_after']}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
