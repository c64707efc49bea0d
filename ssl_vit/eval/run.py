"""Evaluate a frozen encoder with the evaluators a config names; JSON + a printed table.

Frozen-feature evaluators (linear, knn, fewshot), the attentive probe and fine-tuning take any encoder and a
labelled dataset; segmentation (DINOv2's linear protocol on patch tokens) a dataset with masks; zeroshot and
retrieval take an image-text model's run directory (objective=clip / siglip, or a distilled student through an
image-text teacher's adaptor) and a test set with class names (zeroshot) or captions (retrieval)."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from ssl_vit.artifacts import run_directory
from ssl_vit.backbone import with_windows
from ssl_vit.backbone.pyramid import SimpleFeaturePyramid
from ssl_vit.data import eval_datasets
from ssl_vit.data.naflex import NaFlexEvalViews
from ssl_vit.data.subset import labels_of
from ssl_vit.eval.attentive import attentive_eval
from ssl_vit.eval.features import FEATURE_KINDS, cache_key, cached, extract_features, our_feature_kind
from ssl_vit.eval.finetune import finetune
from ssl_vit.eval.protocols import FROZEN_PROTOCOLS, PROTOCOLS
from ssl_vit.eval.segmentation import patch_tokens, segmentation_eval
from ssl_vit.eval.zeroshot import (
    class_names,
    embed_pairs,
    retrieval_recall,
    templates_for,
    zeroshot_accuracy,
    zeroshot_classifier,
)
from ssl_vit.interop.native import NativeEncoder, native_kind
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.objectives import load_trained
from ssl_vit.preprocess import Preprocess, resolve_preprocess
from ssl_vit.run_dirs import resolve_run
from ssl_vit.schema import ConfigError, validate_config

log = logging.getLogger("ssl_vit")
FEATURE_EVALUATORS = FROZEN_PROTOCOLS  # linear, knn, fewshot: on extracted features
TEXT_EVALUATORS = ("zeroshot", "retrieval")  # need an image-text model
MASK_EVALUATORS = ("segmentation",)  # need a dataset with masks
NAFLEX_EVALUATORS = (*FEATURE_EVALUATORS, *TEXT_EVALUATORS)  # those that take eval.resolution=naflex


def load_any_encoder(spec: str, native: bool = False):
    """An encoder from any source `ssl_vit.interop.sources` reads (ours, timm:, hf:, open_clip:; a library's model
    that is not a ViT, or any with `native`, as its library runs it). Returns (encoder, identity for the feature
    cache, its recorded preprocessing or None); ConfigError on a bad spec."""
    try:
        source = load_pretrained(spec, native="always" if native else "fallback")
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        raise ConfigError(f"checkpoint: {err}") from err
    return source.encoder, source.identity, source.preprocess


def evaluate(cfg, progress: bool = True) -> dict:
    validate_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    checkpoint = resolve_run(cfg.checkpoint)  # an output group: its newest run
    encoder, encoder_identity, recorded = load_any_encoder(checkpoint, cfg.get("native", False))
    model, embed, dense = None, None, None
    ecfg, features = cfg.eval, cfg.eval.features
    if isinstance(encoder, NativeEncoder):
        if cfg.eval.get("resolution", "fixed") == "naflex":
            raise ConfigError(f"eval.resolution=naflex: {checkpoint} runs as its library's own model, which reads "
                              "image tensors; NaFlex evaluation takes ViTs of ours (or those that convert)")
        features, evaluators = native_settings(cfg, encoder)
        ecfg = OmegaConf.merge(cfg.eval, {"evaluators": evaluators, "features": features})
        dense = encoder.feature_map if encoder.dense else None
    else:
        text = any(name in TEXT_EVALUATORS for name in cfg.eval.evaluators)
        if text or cfg.eval.features not in FEATURE_KINDS:
            model = load_run_model(checkpoint, cfg.eval, text)
            encoder = model.encoder
            embed, dense = adaptor_features(model, cfg.eval.features)
        if features in FEATURE_KINDS and our_feature_kind(encoder, features) != features:
            log.info("eval.features=%s: this encoder %s; its pooled embedding (global_pool=%s) instead", features,
                     "has no class token" if encoder.cls_token is None else "pools by attention", encoder.global_pool)
            features = our_feature_kind(encoder, features)
            ecfg = OmegaConf.merge(cfg.eval, {"features": features})
        check_evaluator_settings(ecfg, encoder)
    img_size = encoder_size(cfg.data.img_size, encoder, recorded)
    encoder = windowed(cfg.eval, encoder, model)
    if cfg.eval.pyramid_stride is not None and "segmentation" in ecfg.evaluators:
        dense = pyramid_dense(encoder, cfg.eval.pyramid_stride, cfg.seed, dense)
    preprocess = resolve_preprocess(cfg.data, img_size, recorded)
    try:
        train_set, test_set = eval_datasets(cfg.data, img_size, cfg.seed)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"data={cfg.data.name}: {err}") from err
    identity = {"encoder": encoder_identity, "data": dict(cfg.data), "preprocess": preprocess.to_json()}
    if not test_set.classes and any(e not in ("retrieval", *MASK_EVALUATORS) for e in ecfg.evaluators):
        takes = [e for e in ("retrieval", *MASK_EVALUATORS) if e != "segmentation"
                 or getattr(test_set, "segmentation_classes", ())]
        raise ConfigError(f"data={cfg.data.name} has no class labels: it takes eval={' | '.join(takes)}, got "
                          f"{list(ecfg.evaluators)}")
    if "segmentation" in ecfg.evaluators and not getattr(test_set, "segmentation_classes", ()):
        raise ConfigError(f"eval=segmentation needs masks; data={cfg.data.name} has none (datasets with masks: "
                          "synthetic, tuxpaint_seg, segfolder)")
    cache_dir = feature_cache_dir(cfg.cache_dir, checkpoint) if cfg.cache_features else None
    results, timings, feature_dim = run_evaluators(encoder, train_set, test_set, ecfg, preprocess,
                                                   cache_dir, identity, cfg.seed, progress, model=model,
                                                   data_name=cfg.data.name, embed=embed, dense=dense)
    return {"checkpoint": checkpoint, "data": cfg.data.name, "features": features,
            "preprocess": asdict(preprocess), "num_train": len(train_set), "num_test": len(test_set),
            "num_classes": len(test_set.classes), "chance": chance_levels(test_set, results),
            "feature_dim": feature_dim, "results": results, "timings": timings}


def encoder_size(requested: int | None, encoder, recorded) -> int:
    """`requested` (data.img_size), else the recorded preprocessing's size, else the encoder's; the encoder set to
    it (ours resample their position embeddings as their config says; a library's model as its library does)."""
    native = encoder.img_size if isinstance(encoder, NativeEncoder) else encoder.patch_embed.img_size[0]
    img_size = requested or (recorded.img_size if recorded else native)
    if img_size != native:
        try:
            encoder.set_img_size(img_size)
        except (ValueError, AssertionError, RuntimeError) as err:
            raise ConfigError(f"data.img_size={img_size}: {err}") from err
    return img_size


def windowed(ecfg, encoder, model=None):
    """The encoder with eval.window_size / eval.global_attn_indexes applied (ssl_vit.backbone.with_windows), after it
    was set to its evaluation size; ConfigError for what cannot run windowed."""
    if not ecfg.window_size:
        if ecfg.global_attn_indexes:
            raise ConfigError(f"eval.global_attn_indexes={list(ecfg.global_attn_indexes)} needs eval.window_size > 0")
        return encoder
    if isinstance(encoder, NativeEncoder) or model is not None:
        what = encoder.describe() if isinstance(encoder, NativeEncoder) else "a model's tower (text, adaptors)"
        raise ConfigError(f"eval.window_size={ecfg.window_size}: only an encoder of ours runs windowed, not {what}")
    try:
        return with_windows(encoder, ecfg.window_size, list(ecfg.global_attn_indexes))
    except ValueError as err:
        raise ConfigError(f"eval.window_size={ecfg.window_size}: {err}") from err


def pyramid_dense(encoder, stride: int, seed: int, dense=None):
    """images -> the `stride` level of ViTDet's simple feature pyramid (ssl_vit.backbone.pyramid, seeded with `seed`)
    over the encoder's last feature map; ConfigError for a stride it has not, or an encoder that is not ours."""
    if isinstance(encoder, NativeEncoder) or dense is not None:
        raise ConfigError(f"eval.pyramid_stride={stride}: the pyramid reads the patch tokens of an encoder of ours")
    torch.manual_seed(seed)
    patch = encoder.patch_embed.stride[0]
    try:
        pyramid = SimpleFeaturePyramid(encoder.embed_dim, patch).to(next(encoder.parameters()).device).eval()
    except ValueError as err:
        raise ConfigError(f"eval.pyramid_stride={stride}: {err}") from err
    if stride not in pyramid.strides:
        raise ConfigError(f"eval.pyramid_stride={stride} is not a level of the pyramid on patch size {patch} "
                          f"(valid: {pyramid.strides})")
    level = pyramid.names[pyramid.strides.index(stride)]
    return lambda images: pyramid(patch_tokens(encoder, images))[level]


def native_evaluators(encoder: NativeEncoder) -> tuple[str, ...]:
    """What a library's own model takes: the frozen-feature evaluators, and segmentation where it gives a map."""
    return (*FEATURE_EVALUATORS, *(MASK_EVALUATORS if encoder.dense else ()))


def native_settings(cfg, encoder: NativeEncoder) -> tuple[str, list[str]]:
    """A library's own model: (its feature kind, the evaluators it takes: `native_evaluators`; others in the list
    are left out with a warning, and a list of only others is refused)."""
    takes = native_evaluators(encoder)
    evaluators = [name for name in cfg.eval.evaluators if name in takes]
    others = [name for name in cfg.eval.evaluators if name not in takes]
    if not evaluators:
        raise ConfigError(f"eval: {encoder.describe()} takes {list(takes)}, not {others}")
    if others:
        log.warning("eval: %s takes %s; left out: %s", encoder.describe(), list(takes), others)
    if "segmentation" in evaluators and cfg.eval.segmentation_blocks != 1:
        raise ConfigError(f"eval.segmentation_blocks={cfg.eval.segmentation_blocks}: {encoder.describe()} gives its "
                          "last feature map only (valid: 1)")
    try:
        kind = native_kind(encoder, cfg.eval.features)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    log.info("checkpoint=%s: %s; features %r for eval.features=%s", cfg.checkpoint, encoder.describe(), kind,
             cfg.eval.features)
    return kind, evaluators


def feature_cache_dir(configured: str | None, checkpoint: str) -> Path:
    """cache_dir when set; else under the evaluated run (<run>/eval/feature_cache), or for an import (timm:, hf:,
    an encoder file outside a run) under $SSL_VIT_CACHE (default ~/.cache/ssl_vit)/features."""
    if configured:
        return Path(configured).expanduser()
    run = run_directory(checkpoint)
    if run is not None:
        return run / "eval" / "feature_cache"
    return Path(os.environ.get("SSL_VIT_CACHE", "~/.cache/ssl_vit")).expanduser() / "features"


def chance_levels(test_set, results: dict) -> dict:
    """What guessing scores on this test set, per evaluator: the most frequent class's share for classification
    (1 / classes when the labels cannot be read without decoding), k / pairs for retrieval recall@k, and for
    segmentation what predicting the most frequent training pixel class everywhere scores."""
    chance = {}
    if test_set.classes:
        labels = labels_of(test_set)
        top = (np.bincount(labels).max() / len(labels) if labels is not None and len(labels)
               else 1 / len(test_set.classes))
    for name, result in results.items():
        if name == "retrieval":
            chance[name] = {key: min(1.0, int(key.rsplit("@", 1)[1]) / result["num_pairs"])
                            for key in result["accuracy"]}
        elif name == "segmentation":
            chance[name] = result["chance"]
        elif test_set.classes:
            chance[name] = float(top)
    return chance


def check_evaluator_settings(ecfg, encoder) -> None:
    """Settings that do not fit this encoder: ConfigError naming the value and what fits."""
    if getattr(ecfg, "resolution", "fixed") == "naflex":
        others = [name for name in ecfg.evaluators if name not in NAFLEX_EVALUATORS]
        if others:
            raise ConfigError(f"eval.resolution=naflex runs eval={list(NAFLEX_EVALUATORS)}, not {others} (they "
                              "read fixed-size images: segmentation masks, fine-tuning and attentive batches)")
        if ecfg.window_size or ecfg.pyramid_stride:
            raise ConfigError("eval.resolution=naflex with eval.window_size / eval.pyramid_stride: windows and the "
                              "pyramid partition one grid per batch; evaluate NaFlex without them")
        refusal = encoder.naflex_refusal() if hasattr(encoder, "naflex_refusal") else \
            "a library's own model reads image tensors"
        if refusal:
            raise ConfigError(f"eval.resolution=naflex: {refusal}")
    depth, heads = len(encoder.blocks), encoder.config.num_heads
    if "segmentation" in ecfg.evaluators and ecfg.segmentation_blocks > depth:
        raise ConfigError(f"eval.segmentation_blocks={ecfg.segmentation_blocks} is more than the encoder's {depth} "
                          f"blocks (valid: 1..{depth})")
    if "attentive" in ecfg.evaluators and encoder.embed_dim % (ecfg.attentive_heads or heads):
        raise ConfigError(f"eval.attentive_heads={ecfg.attentive_heads} does not divide the encoder's width "
                          f"{encoder.embed_dim}")


def run_evaluators(encoder, train_set, test_set, ecfg, preprocess: Preprocess, cache_dir=None, identity=None,
                   seed: int = 0, progress: bool = True, model=None,
                   data_name: str = "", embed=None, dense=None) -> tuple[dict, dict, int | None]:
    """The evaluators `ecfg.evaluators` names, on one encoder, its inputs prepared as `preprocess` says; features
    are extracted once (cached when `cache_dir` and `identity` are given), by `embed` (images -> features: an
    adaptor of a distilled student, `adaptor_features`) where given, and patch features by `dense` (its patch
    adaptor) for segmentation. zeroshot and retrieval use `model` (an
    image-text model whose image tower is `encoder`) on the test set. Returns (results, timings in seconds,
    feature dimension)."""
    needs_model = [name for name in ecfg.evaluators if name in TEXT_EVALUATORS]
    if needs_model and model is None:
        raise ConfigError(f"evaluator(s) {needs_model} need an image-text model (objective=clip or siglip, or a "
                          "distill run with an image-text teacher)")
    results, timings, feature_dim = {}, {}, None
    views = eval_views(preprocess, ecfg, encoder)
    if any(name in FEATURE_EVALUATORS for name in ecfg.evaluators):
        features = frozen_features(model if embed is not None else encoder, {"train": train_set, "test": test_set},
                                   ecfg, views, cache_dir, identity, progress, embed, timings)
        (train_x, train_y), (test_x, test_y) = features["train"], features["test"]
        feature_dim = train_x.shape[1]
    runners = {  # the frozen-feature protocols as the shared table runs them (ssl_vit.eval.protocols)
        **{name: functools.partial(PROTOCOLS[name].run, train_x, train_y, test_x, test_y, ecfg, seed)
           for name in FEATURE_EVALUATORS if name in ecfg.evaluators},
        "finetune": lambda: finetune(encoder, train_set, test_set, mean=preprocess.mean, std=preprocess.std,
                                     interpolation=preprocess.interpolation, crop_pct=preprocess.crop_pct,
                                     resize_mode=preprocess.resize_mode, img_size=ecfg.finetune_img_size,
                                     steps=ecfg.finetune_steps,
                                     batch_size=ecfg.finetune_batch_size, lr=ecfg.finetune_lr,
                                     layer_decay=ecfg.finetune_layer_decay, augment=ecfg.finetune_augment,
                                     seed=seed, progress=progress),
        "zeroshot": lambda: zeroshot_eval(model, test_set, eval_views(preprocess, ecfg, encoder, ("image",)), ecfg,
                                          data_name, progress),
        "retrieval": lambda: retrieval_eval(model, test_set, eval_views(preprocess, ecfg, encoder, ("image",)),
                                            ecfg, progress),
        "segmentation": lambda: segmentation_eval(encoder, train_set, test_set, preprocess, ecfg, seed, progress,
                                                  dense),
        "attentive": lambda: attentive_eval(encoder, train_set, test_set, preprocess.view_builder(), ecfg, seed,
                                            progress),
    }
    for name in ecfg.evaluators:
        start = time.perf_counter()
        results[name] = runners[name]()
        timings[f"{name}_s"] = time.perf_counter() - start
    return results, timings, feature_dim


def eval_views(preprocess: Preprocess, ecfg, encoder, views=("image", "label")):
    """The encoder's eval transform: `preprocess`'s fixed-size one, or with eval.resolution=naflex each whole image
    at its own aspect ratio within eval.seq_len patches (default: the patches of preprocess.img_size)."""
    if getattr(ecfg, "resolution", "fixed") != "naflex":
        return preprocess.view_builder(views)
    return NaFlexEvalViews.for_encoder(preprocess, encoder.patch_embed.patch_size[0], getattr(ecfg, "seq_len", None),
                                       views)


def frozen_features(module, splits: dict, ecfg, views, cache_dir, identity, progress: bool, embed,
                    timings: dict) -> dict:
    """{split: (features, labels)} of each data set through `views` (`eval_views`), extracted once (cached when
    `cache_dir` and `identity` are given); each split's seconds go into `timings`."""
    features = {}
    shape = views.cache_fields()
    for split, dataset in splits.items():
        key = cache_key(**(identity or {}), split=split, kind=ecfg.features, last_k=ecfg.last_k, **shape)
        start = time.perf_counter()
        features[split] = cached(cache_dir if identity else None, key, lambda d=dataset, s=split: extract_features(
            module, d, views, ecfg.features, ecfg.last_k, ecfg.batch_size, progress=progress, desc=f"{s} features",
            embed=embed))
        timings[f"features_{split}_s"] = time.perf_counter() - start
    return features


def load_run_model(checkpoint: str, ecfg, image_text: bool):
    """The objective of a run directory: an image-text model for zeroshot / retrieval (`image_text`), one with
    adaptors for eval.features=<adaptor>; ConfigError naming why not."""
    try:
        model = load_trained(checkpoint, image_text=image_text)
        if image_text:
            model.text_tokenizer()  # a distilled student's text side is its teacher's: there, or said here
        return model
    except ValueError as err:
        if image_text:
            raise ConfigError(f"eval={'+'.join(ecfg.evaluators)}: {err}") from err
        raise ConfigError(f"unknown eval.features {ecfg.features!r}; valid choices: {list(FEATURE_KINDS)}, or an "
                          f"adaptor's name for a run of objective=distill ({err})") from err


def adaptor_features(model, features: str):
    """(images -> summary features, images -> (B, D, h, w) patch features) of adaptor `features` of a distilled
    student (objective=distill's `summary_features`, `patch_features`), or (None, None) for a feature kind of the
    encoder's tokens (FEATURE_KINDS); ConfigError for neither."""
    if features in FEATURE_KINDS:
        return None, None
    names = list(getattr(model, "feature_names", []))
    if features not in names:
        raise ConfigError(f"unknown eval.features {features!r}; valid choices: {list(FEATURE_KINDS)}"
                          + (f" or this run's adaptors {names}" if names else ""))
    def dense(images):
        patches = model.patch_features(images, features)
        grid = model.encoder.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        return patches.transpose(1, 2).reshape(len(images), -1, *grid)

    return functools.partial(model.summary_features, name=features), dense


def zeroshot_eval(model, test_set, views, ecfg, data_name: str, progress: bool = False) -> dict:
    templates = templates_for(data_name, list(ecfg.zeroshot_templates) or model.zeroshot_templates)
    names = class_names(test_set)
    device = next(model.parameters()).device
    classifier = zeroshot_classifier(model, model.text_tokenizer(), names, templates, device)
    embedded = embed_pairs(model, test_set, views, None, need_text=False,
                           batch_size=ecfg.batch_size, device=device, progress=progress, desc="zero-shot")
    scores = zeroshot_accuracy(embedded["image"], embedded["labels"], classifier.float().cpu())
    return {**scores, "classes": names, "templates": templates, "num_test": len(embedded["labels"])}


def retrieval_eval(model, test_set, views, ecfg, progress: bool = False) -> dict:
    device = next(model.parameters()).device
    embedded = embed_pairs(model, test_set, views, model.text_tokenizer(),
                           need_text=True, batch_size=ecfg.batch_size, device=device, progress=progress,
                           desc="retrieval")
    recalls = retrieval_recall(embedded["image"], embedded["text"], embedded["captions"], list(ecfg.retrieval_ks))
    return {"accuracy": recalls, "num_pairs": len(embedded["captions"]), "skipped": embedded["skipped"]}


def result_rows(report: dict) -> list[tuple[str, float, float | None, float]]:
    """(metric, score, chance level or None, seconds) rows for the table."""
    rows = []
    for name, result in report["results"].items():
        seconds, chance = report["timings"][f"{name}_s"], report.get("chance", {}).get(name)
        if name == "segmentation":
            chance = chance or {}
            rows += [("segmentation mIoU", result["miou"], chance.get("miou"), seconds),
                     ("segmentation pixel acc", result["pixel_accuracy"], chance.get("pixel_accuracy"), seconds)]
        elif isinstance(result["accuracy"], dict):
            rows += [(f"{name} {part.replace('_', '-')}", value, chance.get(part) if isinstance(chance, dict)
                      else chance, seconds) for part, value in result["accuracy"].items()]
        else:
            rows.append((name, result["accuracy"], chance, seconds))
    return rows


def print_table(report: dict) -> None:
    extraction = report["timings"].get("features_train_s", 0) + report["timings"].get("features_test_s", 0)
    features = (f", {report['features']} features of dim {report['feature_dim']}; extraction {extraction:.1f} s"
                if report["feature_dim"] else "")
    classes = f", {report['num_classes']} classes" if report.get("num_classes") else ""
    print(f"{report['checkpoint']} on {report['data']} ({report['num_train']} train / {report['num_test']} test"
          f"{classes}{features})")
    rows = result_rows(report)
    width = max([18] + [len(metric) + 2 for metric, *_ in rows])
    print(f"{'evaluator':<{width}}{'score':>10}{'chance':>10}{'time s':>9}")
    for metric, value, chance, seconds in rows:
        guess = f"{100 * chance:>9.2f}%" if chance is not None else f"{'-':>10}"
        print(f"{metric:<{width}}{100 * value:>9.2f}%{guess}{seconds:>9.2f}")


def write_report(report: dict, out_dir: str | Path) -> Path:
    path = Path(out_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path
