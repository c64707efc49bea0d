"""Evaluation during pre-training (`trainer.eval_every`): frozen-feature evaluators on stratified subsets of the
data's evaluation splits, and, for image-text objectives, zero-shot and retrieval, run on the main process."""

from __future__ import annotations

from dataclasses import dataclass

from ssl_vit.config import EvalConfig
from ssl_vit.data import eval_datasets
from ssl_vit.data.subset import limit_samples
from ssl_vit.eval.run import FEATURE_EVALUATORS, TEXT_EVALUATORS, run_evaluators
from ssl_vit.objectives import Requirements
from ssl_vit.preprocess import Preprocess
from ssl_vit.schema import ConfigError


@dataclass
class PeriodicEvaluation:
    evaluators: list[str]
    train_set: object
    test_set: object
    preprocess: Preprocess
    data_name: str

    @property
    def needs_model(self) -> bool:
        """Whether an evaluator needs the whole image-text model, not only the encoder."""
        return any(name in TEXT_EVALUATORS for name in self.evaluators)

    @classmethod
    def from_config(cls, cfg, needs: Requirements, preprocess: Preprocess) -> PeriodicEvaluation:
        """The evaluators and sets `trainer.eval_*` names; ConfigError for an evaluator the objective or the data
        cannot take."""
        evaluators = list(cfg.trainer.eval_evaluators)
        valid = list(FEATURE_EVALUATORS) + (list(TEXT_EVALUATORS) if needs.image_text else [])
        unknown = [e for e in evaluators if e not in valid]
        if unknown:
            text_only = set(unknown) & set(TEXT_EVALUATORS) and not needs.image_text
            raise ConfigError(f"unknown trainer.eval_evaluators {unknown} for objective={cfg.objective.name}; valid "
                              f"choices: {valid}" + (" (zeroshot and retrieval need an image-text objective)"
                                                     if text_only else ""))
        try:
            train, test = eval_datasets(cfg.data, preprocess.img_size, cfg.seed)
        except ConfigError as err:
            raise ConfigError(f"trainer.eval_every needs labelled train/test data: {err}") from err
        if not test.classes and any(e != "retrieval" for e in evaluators):
            raise ConfigError(f"data={cfg.data.name} has no class labels (image-text pairs): trainer.eval_evaluators "
                              f"can only be [retrieval] here, got {evaluators}")
        train, test = (limit_samples(d, cfg.trainer.eval_max_samples, cfg.seed) for d in (train, test))
        return cls(evaluators, train, test, preprocess, cfg.data.name)

    def __call__(self, encoder, model=None) -> dict[str, float]:
        """Scores by name (`eval/<evaluator>[_<metric>]`); zeroshot / retrieval use `model`, an image-text objective
        whose image tower is `encoder`."""
        # class token + patch average (the default), or the patch average of an encoder without a class token
        features = "cls_avg" if encoder.cls_token is not None else "avg"
        settings = EvalConfig(evaluators=self.evaluators, features=features, fewshot_shots=[5], fewshot_draws=2)
        was_training = encoder.training
        results, _, _ = run_evaluators(encoder, self.train_set, self.test_set, settings, self.preprocess,
                                       progress=False, model=model, data_name=self.data_name)
        encoder.train(was_training)
        scores = {}
        for name, result in results.items():
            accuracy = result["accuracy"]
            scores.update({f"eval/{name}_{k}": v for k, v in accuracy.items()} if isinstance(accuracy, dict)
                          else {f"eval/{name}": accuracy})
        return scores
