"""Evaluators against scikit-learn / numpy on the same features, and feature extraction."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import NearestNeighbors

from ssl_vit.data import Digits, ViewBuilder
from ssl_vit.eval.features import cache_key, cached, extract_features, features_from_tokens
from ssl_vit.eval.fewshot import fewshot_eval, ridge_fit
from ssl_vit.eval.knn import knn_eval, knn_predict
from ssl_vit.eval.linear import fit_logistic, linear_probe, standardise
from ssl_vit.vit import build_vit


@pytest.fixture(scope="module")
def digit_features():
    """Features of sklearn's digits from a random tiny ViT (16 px, 4x4 patches): real images, a real encoder."""
    torch.manual_seed(0)
    encoder = build_vit("vit_test")
    views = ViewBuilder(("image", "label"), 16, [0.3] * 3, [0.4] * 3)
    train = extract_features(encoder, Digits("train"), views, kind="cls_avg", progress=False)
    test = extract_features(encoder, Digits("test"), views, kind="cls_avg", progress=False)
    return (*train, *test)


@pytest.mark.slow
def test_logistic_fit_matches_sklearn(digit_features):
    train_x, train_y, test_x, test_y = digit_features
    train_x, test_x = standardise(train_x, test_x)
    l2 = 1e-3
    weight, bias = fit_logistic(train_x, train_y, 10, l2)
    ours = ((test_x @ weight + bias).argmax(1) == test_y).float().mean().item()
    reference = LogisticRegression(C=1 / (l2 * len(train_y)), max_iter=5000, tol=1e-8)
    theirs = reference.fit(train_x.numpy(), train_y.numpy()).score(test_x.numpy(), test_y.numpy())
    assert abs(ours - theirs) <= 0.01, (ours, theirs)
    np.testing.assert_allclose(weight.numpy(), reference.coef_.T, atol=2e-2)


@pytest.mark.slow
def test_linear_probe_sweep_is_within_a_point_of_sklearn(digit_features):
    train_x, train_y, test_x, test_y = digit_features
    result = linear_probe(train_x, train_y, test_x, test_y)
    grid = {"1e-05", "0.0001", "0.001", "0.01", "0.1"}
    extra = set(result["val_accuracy"]) - grid  # the grid is extended past an edge while the edge value wins
    assert grid <= set(result["val_accuracy"])
    assert bool(extra) == bool(result["l2_grid_extended"])
    sx, tx = standardise(train_x, test_x)
    sklearn = LogisticRegression(C=1 / (result["l2"] * len(train_y)), max_iter=5000).fit(sx.numpy(), train_y.numpy())
    assert abs(result["accuracy"] - sklearn.score(tx.numpy(), test_y.numpy())) <= 0.01
    assert result["accuracy"] > 0.5  # far above chance (0.1) on digits


def test_knn_predictions_are_identical_to_a_sklearn_brute_force_reference(digit_features):
    train_x, train_y, test_x, test_y = digit_features
    k, temperature = 20, 0.07
    ours = knn_predict(train_x, train_y, test_x, k, temperature)
    neighbours = NearestNeighbors(n_neighbors=k, metric="cosine", algorithm="brute").fit(train_x.numpy())
    distance, index = neighbours.kneighbors(test_x.numpy())
    votes = np.zeros((len(test_x), 10))
    for row in range(len(test_x)):
        np.add.at(votes[row], train_y.numpy()[index[row]], np.exp((1 - distance[row]) / temperature))
    assert np.array_equal(ours.numpy(), votes.argmax(axis=1))
    assert knn_eval(train_x, train_y, test_x, test_y)["accuracy"] == (ours == test_y).float().mean().item()


@pytest.mark.parametrize("n, d", [(6, 10), (30, 4)])  # dual (n < d) and primal forms
def test_fewshot_closed_form_equals_lstsq_on_the_ridge_system(n, d):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, d)), rng.choice([-1.0, 1.0], size=(n, 3))
    l2 = 0.7
    augmented = np.concatenate([x, np.ones((n, 1))], axis=1)
    stacked_x = np.concatenate([augmented, np.sqrt(l2) * np.eye(d + 1)])
    stacked_y = np.concatenate([y, np.zeros((d + 1, 3))])
    expected = np.linalg.lstsq(stacked_x, stacked_y, rcond=None)[0]
    np.testing.assert_allclose(ridge_fit(torch.from_numpy(x), torch.from_numpy(y), l2).numpy(), expected,
                               atol=1e-10)


def test_fewshot_on_a_separable_hand_case():
    train_x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    train_y = torch.tensor([0, 0, 1, 1])
    test_x, test_y = torch.tensor([[0.8, 0.0], [0.0, 0.7]]), torch.tensor([0, 1])
    result = fewshot_eval(train_x, train_y, test_x, test_y, shots=(1, 2), draws=3, l2=0.1)
    assert result["accuracy"] == {"1_shot": 1.0, "2_shot": 1.0}
    with pytest.raises(ValueError, match="3-shot needs 3 training samples of every class"):
        fewshot_eval(train_x, train_y, test_x, test_y, shots=(3,))


def test_feature_kinds():
    encoder = build_vit("vit_test", depth=3).eval()
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        tokens = encoder.forward_features(images)
        cls = features_from_tokens(encoder, images, "cls")
        torch.testing.assert_close(cls, tokens[:, 0])
        torch.testing.assert_close(features_from_tokens(encoder, images, "avg"), tokens[:, 1:].mean(1))
        assert features_from_tokens(encoder, images, "cls_avg").shape == (2, 64)
        last = features_from_tokens(encoder, images, "last_k", last_k=2)
        assert last.shape == (2, 64)
        torch.testing.assert_close(last[:, 32:], cls)  # the last block's normed class token comes last
    with pytest.raises(ValueError, match="needs a class token"):
        features_from_tokens(build_vit("vit_test_22b"), images, "cls")


def test_feature_cache_computes_once(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return torch.ones(3, 2), torch.tensor([0, 1, 0])

    key = cache_key(checkpoint="a", kind="cls")
    first = cached(tmp_path, key, compute)
    second = cached(tmp_path, key, compute)
    assert len(calls) == 1 and torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert cache_key(checkpoint="a", kind="avg") != key
