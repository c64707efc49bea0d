"""Linear probe: the L2 sweep's grid extension and the L-BFGS-B solver (float32 / float64, warm starts, device)."""

import math

import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression

from ssl_vit.data import Digits
from ssl_vit.eval.linear import (
    DEFAULT_L2,
    _LogisticLoss,
    linear_probe,
    logistic_objective,
    solve_logistic,
    standardise,
    sweep_l2,
)


@pytest.fixture(scope="module")
def digit_pixels():
    """sklearn's digits as raw 64-pixel features: real data, fits in a fraction of a second."""
    def load(split):
        data = Digits(split)
        return torch.tensor(data.images.reshape(len(data), -1)).float(), torch.tensor(data.labels).long()
    return (*load("train"), *load("test"))


def peaked_at(optimum):
    """A fake fit: validation accuracy falls with the distance (in decades) from `optimum`; records its calls."""
    calls = []

    def fit_and_score(l2, warm_from):
        calls.append((l2, warm_from))
        return 1.0 - abs(math.log10(l2) - math.log10(optimum)) / 100
    return fit_and_score, calls


def test_sweep_extends_the_grid_past_the_winning_edge_until_accuracy_stops_improving():
    fit_and_score, calls = peaked_at(1e-8)
    scores, best, extended = sweep_l2(fit_and_score, DEFAULT_L2)
    assert best == 1e-8 and extended == ["down"]
    assert sorted(scores) == [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]  # 1e-9 tried, worse: stop
    # strong to weak, each fit warm-started from its stronger neighbour, the extension included
    path = [0.1, 0.01, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9]
    assert calls == list(zip(path, [None, *path[:-1]], strict=True))


def test_sweep_extension_upwards_is_bounded():
    fit_and_score, _ = peaked_at(1e9)
    scores, best, extended = sweep_l2(fit_and_score, DEFAULT_L2, max_extensions=4)
    assert extended == ["up"] and max(scores) == 1e3 and best == 1e3  # still at the edge: the bound stopped it
    assert len(scores) == len(DEFAULT_L2) + 4


def test_sweep_with_an_interior_best_does_not_extend():
    fit_and_score, calls = peaked_at(1e-3)
    scores, best, extended = sweep_l2(fit_and_score, DEFAULT_L2)
    assert best == 1e-3 and extended == [] and sorted(scores) == sorted(DEFAULT_L2) and len(calls) == 5


def test_sweep_ties_go_to_the_stronger_regulariser_and_a_tie_ends_the_extension():
    scores, best, extended = sweep_l2(lambda l2, warm_from: 0.9 if l2 >= 1e-2 else 0.8, DEFAULT_L2)
    assert extended == ["up"] and sorted(scores)[-1] == 1.0 and best == 1.0  # 1.0 ties 0.1: no gain, stop there


def test_probe_extends_a_too_strong_grid_down_on_real_data(digit_pixels):
    narrow = linear_probe(*digit_pixels, l2_values=[1.0, 10.0])
    fixed = linear_probe(*digit_pixels, l2_values=[1.0, 10.0], max_extensions=0)
    assert fixed["l2"] == 1.0 and fixed["l2_grid_extended"] == []
    assert narrow["l2_grid_extended"] == ["down"] and narrow["l2"] < 0.1
    values = narrow["val_accuracy"]
    assert values[str(narrow["l2"])] > values["1.0"] and set(values) > {"1.0", "10.0", "0.1"}
    assert narrow["accuracy"] > fixed["accuracy"] + 0.05  # 0.88 -> 0.97 on digits


def test_probe_extends_up_when_label_noise_favours_strong_regularisation(digit_pixels):
    train_x, train_y, test_x, test_y = digit_pixels
    generator = torch.Generator().manual_seed(0)
    relabel = torch.rand(len(train_y), generator=generator) < 0.7  # 70% of the training labels drawn at random
    noisy_y = torch.where(relabel, torch.randint(0, 10, train_y.shape, generator=generator), train_y)
    extended = linear_probe(train_x, noisy_y, test_x, test_y, l2_values=[1e-3, 1e-2])
    fixed = linear_probe(train_x, noisy_y, test_x, test_y, l2_values=[1e-3, 1e-2], max_extensions=0)
    assert fixed["l2"] == 1e-2 and extended["l2_grid_extended"] == ["up"] and extended["l2"] > 1e-2
    assert extended["accuracy"] > fixed["accuracy"]  # scored on the clean test labels


def test_probe_with_a_grid_around_the_optimum_does_not_extend(digit_pixels):
    result = linear_probe(*digit_pixels, l2_values=[1e-4, 1e-3, 1e-2])
    assert result["l2_grid_extended"] == [] and set(result["val_accuracy"]) == {"0.0001", "0.001", "0.01"}
    assert result["l2"] == 1e-3 and result["accuracy"] > 0.95


def test_loss_and_gradient_equal_autograd_on_the_same_objective():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 7, generator=generator, dtype=torch.float64), torch.randint(0, 4, (50,), generator=generator)
    weight = torch.randn(7, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=generator, dtype=torch.float64, requires_grad=True)
    l2 = 0.3
    expected = F.cross_entropy(x @ weight + bias, y) + 0.5 * l2 * weight.pow(2).sum()
    expected.backward()
    loss, grad = _LogisticLoss(x, y, 4, l2, torch.float64)(torch.cat([weight.flatten(), bias]).detach().numpy())
    assert loss == pytest.approx(expected.item(), abs=1e-12)
    torch.testing.assert_close(torch.from_numpy(grad), torch.cat([weight.grad.flatten(), bias.grad]),
                               rtol=0, atol=1e-12)


@pytest.mark.slow
def test_float32_features_reach_the_float64_and_sklearn_optimum_at_a_tight_tolerance(digit_pixels):
    train_x, train_y, _, _ = digit_pixels
    (x,) = standardise(train_x)
    l2 = 1e-3
    single = solve_logistic(x, train_y, 10, l2, max_iter=5000, tolerance=1e-7)
    double = solve_logistic(x.double(), train_y, 10, l2, max_iter=5000, tolerance=1e-7)
    assert single.converged and double.converged
    assert single.float64_polish  # float32 rounding stalls above 1e-7: float64 finished the descent
    reference = LogisticRegression(C=1 / (l2 * len(train_y)), max_iter=5000, tol=1e-8)
    reference.fit(x.double().numpy(), train_y.numpy())
    weight, bias = torch.from_numpy(reference.coef_.T), torch.from_numpy(reference.intercept_)
    optimum = logistic_objective(x, train_y, weight, bias, l2)
    for solution in (single, double):
        assert logistic_objective(x, train_y, solution.weight, solution.bias, l2) == pytest.approx(optimum, abs=1e-8)


def test_warm_starts_along_the_l2_path_save_evaluations_at_the_same_objective(digit_pixels):
    train_x, train_y, _, _ = digit_pixels
    (x,) = standardise(train_x)
    path = sorted(DEFAULT_L2, reverse=True)
    cold = [solve_logistic(x, train_y, 10, l2) for l2 in path]
    warm, previous = [], None
    for l2 in path:
        warm.append(solve_logistic(x, train_y, 10, l2, init=previous))
        previous = (warm[-1].weight, warm[-1].bias)
    assert sum(s.evaluations for s in warm) < 0.8 * sum(s.evaluations for s in cold)
    for l2, a, b in zip(path, cold, warm, strict=True):
        assert a.converged and b.converged
        assert b.objective <= a.objective + 1e-5, l2  # as good as a cold start (both stop at |gradient| <= 1e-4)
    restarted = solve_logistic(x, train_y, 10, path[-1], init=previous)
    assert restarted.iterations == 0  # starting at a solution: nothing to do


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_probe_on_gpu_features_matches_cpu(digit_pixels):
    train_x, train_y, test_x, test_y = digit_pixels
    (x,) = standardise(train_x)
    on_cpu = solve_logistic(x, train_y, 10, 1e-3, tolerance=1e-6)
    on_gpu = solve_logistic(x.cuda(), train_y.cuda(), 10, 1e-3, tolerance=1e-6)
    assert on_gpu.weight.is_cuda
    assert on_gpu.objective == pytest.approx(on_cpu.objective, abs=1e-7)
    cpu_result = linear_probe(train_x, train_y, test_x, test_y)
    gpu_result = linear_probe(train_x.cuda(), train_y.cuda(), test_x.cuda(), test_y.cuda())
    assert gpu_result["l2"] == cpu_result["l2"] and abs(gpu_result["accuracy"] - cpu_result["accuracy"]) <= 0.01
