import json

import pytest
import torch
from helpers.builders import pretrain_config

from ssl_vit.backbone import build_vit
from ssl_vit.eval.finetune import Classifier, finetune
from ssl_vit.train import pretrain


class Colours(torch.utils.data.Dataset):
    """Noisy solid colours, 4 classes: a task a randomly initialised tiny ViT can be fine-tuned on in seconds
    (a from-scratch ViT needs far longer for shapes or digits: 150 steps on digits reach ~13%)."""

    classes = ("red", "green", "blue", "grey")
    palette = torch.tensor([[200, 30, 30], [30, 200, 30], [30, 30, 200], [128, 128, 128]])

    def __init__(self, count, seed):
        self.count, self.seed = count, seed

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        noise = torch.randint(-60, 60, (3, 16, 16), generator=torch.Generator().manual_seed(self.seed * 10**5 + index))
        label = index % 4
        image = (self.palette[label].view(3, 1, 1) + noise).clamp(0, 255).to(torch.uint8)
        return {"image": image, "label": label}


@pytest.mark.slow
def test_fine_tuning_learns_and_leaves_the_given_encoder_alone():
    torch.manual_seed(0)
    encoder = build_vit("vit_test")
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    result = finetune(encoder, Colours(256, 0), Colours(128, 1), mean=[0.5] * 3, std=[0.25] * 3, steps=60,
                      batch_size=32, lr=2e-3, warmup_steps=5, progress=False)
    assert result["accuracy"] > 0.9, result  # measured 1.0; chance 0.25
    assert result["last_loss"] < result["first_loss"] - 0.5
    assert all(torch.equal(before[k], v) for k, v in encoder.state_dict().items())


@pytest.mark.slow
def test_fine_tuning_at_a_higher_resolution_resamples_positions_and_starts_from_a_zero_head():
    torch.manual_seed(0)
    encoder = build_vit("vit_test")
    classifier = Classifier(encoder, 10)
    assert torch.count_nonzero(classifier.head.weight) == 0 and torch.count_nonzero(classifier.head.bias) == 0
    result = finetune(encoder, Colours(256, 0), Colours(128, 1), mean=[0.5] * 3, std=[0.25] * 3, img_size=24,
                      steps=60, batch_size=32, lr=2e-3, warmup_steps=5, progress=False)
    assert result["img_size"] == 24 and result["accuracy"] > 0.9
    assert encoder.grid_size == (4, 4)  # the caller's encoder is untouched


@pytest.mark.slow
def test_periodic_evaluation_during_pretraining_is_logged(tmp_path):
    pretrain(pretrain_config(tmp_path, "trainer.max_steps=6", "trainer.eval_every=3", "trainer.eval_max_samples=200",
                     "trainer.eval_evaluators=[knn,linear]", "data.num_samples=256"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/knn" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(0 <= r["eval/knn"] <= 1 and 0 <= r["eval/linear"] <= 1 for r in evals)
