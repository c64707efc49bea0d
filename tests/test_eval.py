"""Evaluators against scikit-learn / numpy on the same features, and feature extraction."""

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import NearestNeighbors

from ssl_vit.backbone import build_vit
from ssl_vit.data import Digits, ViewBuilder
from ssl_vit.eval.features import cache_key, cached, extract_features, features_from_tokens
from ssl_vit.eval.fewshot import fewshot_eval, ridge_fit
from ssl_vit.eval.knn import knn_eval, knn_predict
from ssl_vit.eval.linear import fit_logistic, linear_probe, standardise
from ssl_vit.eval.run import chance_levels, feature_cache_dir, print_table
from ssl_vit.eval.segmentation import constant_prediction_scores


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


def test_the_feature_cache_lives_under_the_evaluated_run_or_the_user_cache_never_the_working_directory(
        tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "encoder.safetensors").write_bytes(b"x")
    (run / "config.yaml").write_text("model: {}\n")
    assert feature_cache_dir(None, str(run)) == run / "eval" / "feature_cache"
    assert feature_cache_dir(None, str(run / "encoder.safetensors")) == run / "eval" / "feature_cache"
    monkeypatch.setenv("SSL_VIT_CACHE", str(tmp_path / "cache"))
    assert feature_cache_dir(None, "timm:vit_tiny_patch16_224") == tmp_path / "cache" / "features"
    monkeypatch.delenv("SSL_VIT_CACHE")
    assert feature_cache_dir(None, "timm:vit_tiny_patch16_224") == Path.home() / ".cache" / "ssl_vit" / "features"
    assert feature_cache_dir("~/mine", str(run)) == Path.home() / "mine"


class _Labelled:
    def __init__(self, targets, classes):
        self.targets, self.classes = targets, classes


def test_each_score_is_printed_beside_what_guessing_gets(capsys):
    """Chance: the most frequent test class's share (1 / classes without readable labels), k / pairs for
    retrieval recall@k, the constant most-frequent-class prediction for segmentation."""
    results = {"linear": {"accuracy": 0.9}, "fewshot": {"accuracy": {"1_shot": 0.5, "5_shot": 0.7}},
               "retrieval": {"accuracy": {"image_to_text_R@1": 0.2, "text_to_image_R@5": 0.6}, "num_pairs": 20},
               "segmentation": {"accuracy": 0.4, "miou": 0.4, "pixel_accuracy": 0.8,
                                "chance": {"miou": 0.25, "pixel_accuracy": 0.5}}}
    chance = chance_levels(_Labelled([0, 0, 0, 1, 2], ["a", "b", "c"]), results)
    assert chance == {"linear": 0.6, "fewshot": 0.6, "retrieval": {"image_to_text_R@1": 0.05,
                      "text_to_image_R@5": 0.25}, "segmentation": {"miou": 0.25, "pixel_accuracy": 0.5}}
    assert chance_levels(_Labelled(None, ["a", "b", "c", "d"]), {"knn": {"accuracy": 0.5}}) == {"knn": 0.25}
    report = {"checkpoint": "run", "data": "digits", "num_train": 10, "num_test": 5, "num_classes": 3,
              "feature_dim": None, "results": results, "chance": chance,
              "timings": {f"{name}_s": 1.0 for name in results}}
    print_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "run on digits (10 train / 5 test, 3 classes)"
    assert lines[1].split() == ["evaluator", "score", "chance", "time", "s"]
    assert lines[2].split() == ["linear", "90.00%", "60.00%", "1.00"]
    assert lines[4].split() == ["fewshot", "5-shot", "70.00%", "60.00%", "1.00"]
    assert lines[5].split() == ["retrieval", "image-to-text-R@1", "20.00%", "5.00%", "1.00"]
    assert lines[7].split() == ["segmentation", "mIoU", "40.00%", "25.00%", "1.00"]


def test_segmentation_chance_is_the_most_frequent_training_class_predicted_everywhere():
    train = torch.tensor([[[0, 1], [1, 1]], [[1, 2], [255, 1]]])  # class 1 is the most frequent; 255 ignored
    test = torch.tensor([[[0, 1], [2, 2]]])
    chance = constant_prediction_scores(train, test, num_classes=3)
    # everything predicted 1: pixel accuracy 1/4; IoU of 1 = 1/4, of 0 and 2 = 0 (present in the masks)
    assert chance == {"miou": pytest.approx(1 / 12), "pixel_accuracy": 0.25}
