"""`ssl-vit benchmark`: encoders x data sets x protocols in one command; one table (Markdown, CSV, JSON) and PNGs
(ssl_vit.eval.benchmark_report).

A cell is one (encoder, data set, protocol). Its result goes to <out>/cells/<key>.json as soon as it is computed,
keyed by everything that decides it (the encoder's identity, the data config, the preprocessing, the protocol's
settings, the seed): a killed benchmark run again computes only the missing cells, and an encoder added to the list
computes only its own. Frozen features and patch tokens are cached per (encoder, data set, preprocessing) in
<out>/feature_cache, so an encoder's protocols on one data set extract them once.

Protocols: `linear` (the L-BFGS logistic probe, its L2 chosen on a held-out 20%), `knn` (DINO's weighted k-NN),
`fewshot` (the ViT paper's ridge at eval.fewshot_shots per class; shot counts a class cannot fill are left out),
`vtab` (VTAB-1k: 1,000 training images, the L2 chosen on 800 / 200, ssl_vit.eval.vtab), `segmentation` (DINOv2's
linear protocol; data with masks, an encoder with patch tokens or a feature map), `zeroshot` (data with classes, an
encoder with a text side: an image-text run of ours) and `retrieval` (data with captions, a text side).
`protocols=[auto]` runs each where it applies; a protocol named on its own must apply to every data set and
encoder, else one line says which does not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from ssl_vit.config import BENCHMARK_PROTOCOLS
from ssl_vit.data import dataset_kind, eval_datasets
from ssl_vit.data.subset import labels_of
from ssl_vit.eval.features import FEATURE_KINDS, cache_key, cached, our_feature_kind
from ssl_vit.eval.protocols import FROZEN_PROTOCOLS, PROTOCOLS
from ssl_vit.eval.run import (
    encoder_size,
    frozen_features,
    load_any_encoder,
    load_run_model,
    retrieval_eval,
    zeroshot_eval,
)
from ssl_vit.eval.segmentation import segmentation_eval
from ssl_vit.eval.vtab import vtab_1k
from ssl_vit.interop.native import NativeEncoder, native_kind
from ssl_vit.preprocess import Preprocess, resolve_preprocess
from ssl_vit.progress import progress_bar
from ssl_vit.run_dirs import resolve_run
from ssl_vit.schema import ConfigError, closest_names, validate_config
from ssl_vit.untrusted import describe_error

log = logging.getLogger("ssl_vit")
CELL_FORMAT = 1  # part of every cell's key: a change in what a cell holds recomputes the stored ones
# what a stored cell must hold (write_cell's record; the report reads these)
CELL_FIELDS = ("encoder", "spec", "dataset", "data", "protocol", "img_size", "scores", "chance", "seconds")
LIBRARY_PREFIXES = ("timm:", "hf:", "open_clip:", "dino:", "dinov2:")
TEXT_PROTOCOLS = ("zeroshot", "retrieval")


@dataclass
class Encoder:
    """One encoder of the benchmark, loaded once: its label in the tables, its spec, the module evaluated (a
    library's own model or ours), what identifies its weights, its recorded preprocessing, and its image-text
    model where it has a text side."""

    label: str
    spec: str
    module: Any
    identity: dict
    recorded: Preprocess | None
    text_model: Any = None

    @property
    def dense(self) -> bool:
        return not isinstance(self.module, NativeEncoder) or self.module.dense


@dataclass
class DataSet:
    """One data set of the suite: its label, its data config, and what it offers."""

    label: str
    cfg: DictConfig
    labels: bool = False
    masks: bool = False
    captions: bool = False
    splits: dict = field(default_factory=dict)  # img_size -> (train, test), built once per size

    def at(self, img_size: int, seed: int) -> tuple:
        if img_size not in self.splits:
            try:
                self.splits[img_size] = eval_datasets(self.cfg, img_size, seed)
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"benchmark.datasets.{self.label} (data={self.cfg.name}): {err}") from err
            train, test = self.splits[img_size]
            self.labels, self.masks = bool(test.classes), bool(getattr(test, "segmentation_classes", ()))
            self.captions = dataset_kind(self.cfg.name).captioned
        return self.splits[img_size]


@dataclass
class Cell:
    encoder: Encoder
    data: DataSet
    protocol: str
    img_size: int
    preprocess: Preprocess
    key: str = ""


def run_benchmark(cfg, progress: bool = True) -> dict:
    """Every cell of the benchmark `cfg` (configs/benchmark.yaml) computed or read back; the report's content."""
    validate_config(cfg)
    unsupported = {key: cfg.eval[key] for key in ("window_size", "global_attn_indexes", "pyramid_stride")
                   if cfg.eval[key]}
    if cfg.eval.get("resolution", "fixed") != "fixed":
        unsupported["resolution"] = cfg.eval.resolution
    if unsupported:
        given = ", ".join(f"{key}={value}" for key, value in unsupported.items())
        raise ConfigError(f"eval: ssl-vit benchmark does not take {given} (ssl-vit evaluate does, one encoder at a "
                          "time)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    datasets = select_datasets(cfg)
    encoders = load_encoders(cfg, needs_text=wants_text(cfg.protocols))
    cells = plan_cells(cfg, encoders, datasets)
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else out / "feature_cache"
    results, missing = {}, []
    for cell in cells:
        stored = read_cell(out, cell)
        if stored is None:
            missing.append(cell)
        else:
            results[cell.key] = stored
    log.info("benchmark: %d encoders x %d data sets: %d cells, %d read back from %s, %d to compute", len(encoders),
             len(datasets), len(cells), len(cells) - len(missing), out / "cells", len(missing))
    held: dict = {}  # the current data set's frozen features per encoder, read once for its four protocols
    bar = progress_bar(total=len(missing), desc="benchmark", enabled=progress, unit="cell")
    for number, cell in enumerate(missing, 1):
        bar.set_postfix_str(f"{cell.encoder.label} | {cell.data.label} | {cell.protocol}")
        start = time.perf_counter()
        result = compute_cell(cell, cfg, cache_dir, progress, held)
        result["seconds"] = time.perf_counter() - start
        results[cell.key] = write_cell(out, cell, result)
        log.info("cell %d/%d: %s on %s, %s: %s (%.1f s)", number, len(missing), cell.encoder.label, cell.data.label,
                 cell.protocol, describe_scores(result["scores"]), result["seconds"])
        bar.update()
    bar.close()
    return {"suite": cfg.benchmark.name, "out": str(out),
            "encoders": {e.label: {"spec": e.spec, "identity": e.identity} for e in encoders},
            "datasets": {d.label: OmegaConf.to_container(d.cfg, resolve=True) for d in datasets},
            "cells": [results[cell.key] for cell in cells], "computed": len(missing),
            "read_back": len(cells) - len(missing),
            "config": OmegaConf.to_container(cfg, resolve=True)}


def wants_text(protocols) -> bool:
    return "auto" in protocols or any(p in TEXT_PROTOCOLS for p in protocols)


def select_datasets(cfg) -> list[DataSet]:
    """The suite's data sets (benchmark.datasets), or the subset `datasets` names."""
    suite = cfg.benchmark.datasets or {}
    if not suite:
        raise ConfigError(f"benchmark={cfg.benchmark.name} lists no data sets (benchmark.datasets)")
    names = list(cfg.datasets) if cfg.datasets else list(suite)
    for name in names:
        if name not in suite:
            raise ConfigError(f"datasets: {name!r} is not a data set of benchmark={cfg.benchmark.name}"
                              + closest_names(name, list(suite), prefix=""))
    return [DataSet(name, suite[name]) for name in names]


def encoder_specs(encoders) -> dict[str, str]:
    """{label: spec} of `encoders`: a list of specs (labelled by their names: a run directory's, an encoder
    file's run, a library spec as written), one spec, or {label: spec}."""
    if isinstance(encoders, DictConfig | dict):
        specs = {str(label): str(spec) for label, spec in encoders.items()}
    else:
        listed = [str(spec) for spec in (encoders if isinstance(encoders, ListConfig | list | tuple) else [encoders])]
        specs = {}
        for spec in listed:
            label = spec_label(spec)
            if label in specs:
                raise ConfigError(f"encoders: two encoders are labelled {label!r} ({specs[label]}, {spec}); label "
                                  "them: 'encoders={a: <spec>, b: <spec>}'")
            specs[label] = spec
    if not specs:
        raise ConfigError("encoders: empty; give one or more specs: encoders=[outputs/<run>,timm:resnet18]")
    return specs


def spec_label(spec: str) -> str:
    if spec.startswith(LIBRARY_PREFIXES):
        library, _, rest = spec.partition(":")
        path = Path(rest.split(":", 1)[0])
        return f"{library}:{path.name}" if len(path.parts) > 1 else spec
    path = Path(spec.rstrip("/"))
    return path.parent.name if path.suffix == ".safetensors" else path.name


def load_encoders(cfg, needs_text: bool) -> list[Encoder]:
    """Every encoder loaded before anything is computed (a bad spec ends the command at once, in one line);
    random-weight ones seeded with `seed` (the same weights, so the same cached features, every time)."""
    encoders = []
    for label, spec in encoder_specs(cfg.encoders).items():
        torch.manual_seed(cfg.seed)
        checkpoint = resolve_run(spec)
        try:
            module, identity, recorded = load_any_encoder(checkpoint, cfg.native)
        except ConfigError as err:
            raise ConfigError(f"encoders: {label}: {str(err).removeprefix('checkpoint: ')}") from err
        text_model = text_side(checkpoint, cfg.eval) if needs_text and not isinstance(module, NativeEncoder) else None
        if text_model is not None:
            module = text_model.encoder  # the image tower of the image-text model: the same weights
        encoders.append(Encoder(label, spec, module, identity, recorded, text_model))
    return encoders


def text_side(checkpoint: str, ecfg):
    """The image-text model of a run of ours that has one (objective=clip / siglip, a distilled student through an
    image-text teacher), else None."""
    if checkpoint.startswith(LIBRARY_PREFIXES) or not Path(checkpoint).expanduser().exists():
        return None
    try:
        return load_run_model(checkpoint, ecfg, image_text=True)
    except ConfigError:
        return None


def why_not(protocol: str, encoder: Encoder, data: DataSet) -> str | None:
    """Why `protocol` cannot run for this encoder on this data set, or None."""
    if protocol in ("linear", "knn", "fewshot", "vtab", "zeroshot") and not data.labels:
        return f"data set {data.label} has no class labels"
    if protocol == "segmentation" and not data.masks:
        return f"data set {data.label} has no masks"
    if protocol == "segmentation" and not encoder.dense:
        return f"encoder {encoder.label} gives no feature map"
    if protocol in TEXT_PROTOCOLS and encoder.text_model is None:
        return f"encoder {encoder.label} has no text side (an image-text run of objective=clip / siglip has one)"
    if protocol == "retrieval" and not data.captions:
        return f"data set {data.label} has no captions"
    return None


def plan_cells(cfg, encoders: list[Encoder], datasets: list[DataSet]) -> list[Cell]:
    """The cells to report, in table order (data set, protocol, encoder); ConfigError for a protocol named on its
    own that does not apply everywhere."""
    requested = list(cfg.protocols)
    if "auto" in requested and len(requested) > 1:
        raise ConfigError(f"protocols={requested}: auto stands alone (it means every protocol where it applies)")
    auto = requested == ["auto"]
    protocols = BENCHMARK_PROTOCOLS if auto else requested
    settings = {}
    for encoder in encoders:
        for data in datasets:
            img_size = encoder_size(data.cfg.img_size or cfg.img_size, encoder.module, encoder.recorded)
            data.at(img_size, cfg.seed)
            settings[encoder.label, data.label] = img_size, resolve_preprocess(data.cfg, img_size, encoder.recorded)
    cells = []
    for data in datasets:
        for protocol in protocols:
            for encoder in encoders:
                reason = why_not(protocol, encoder, data)
                if reason and not auto:
                    raise ConfigError(f"protocols={protocol}: {reason}; protocols=[auto] runs each protocol where it "
                                      "applies")
                if reason is None:
                    cell = Cell(encoder, data, protocol, *settings[encoder.label, data.label])
                    cell.key = cell_key(cell, cfg)
                    cells.append(cell)
    if not cells:
        raise ConfigError(f"protocols={requested}: none applies to these encoders and data sets")
    return cells


def feature_kind(encoder: Encoder, requested: str) -> str:
    """eval.features for this encoder: a library's model takes its own summary for the class-token kinds
    (native_kind); ours without a class token or with an attention pool take their pooled embedding for them."""
    if isinstance(encoder.module, NativeEncoder):
        try:
            return native_kind(encoder.module, requested)
        except ValueError as err:
            raise ConfigError(f"encoders: {encoder.label}: {err}") from err
    if requested not in FEATURE_KINDS:
        raise ConfigError(f"eval.features={requested} is not one of {list(FEATURE_KINDS)}")
    return our_feature_kind(encoder.module, requested)


def protocol_settings(protocol: str, cfg) -> dict:
    """What of the configuration decides a protocol's result (part of its cell's key): the shared table's
    (ssl_vit.eval.protocols), and VTAB-1k's own splits."""
    if protocol == "vtab":
        return {"l2": list(cfg.eval.l2_values), "train": cfg.vtab_train, "val": cfg.vtab_val}
    return PROTOCOLS[protocol].settings(cfg.eval)


def cell_key(cell: Cell, cfg) -> str:
    frozen = cell.protocol in (*FROZEN_PROTOCOLS, "vtab")
    return cache_key(format=CELL_FORMAT, encoder=cell.encoder.identity, data=OmegaConf.to_container(cell.data.cfg),
                     preprocess=cell.preprocess.to_json(), protocol=cell.protocol,
                     settings=protocol_settings(cell.protocol, cfg), seed=cfg.seed,
                     features=feature_kind(cell.encoder, cfg.eval.features) if frozen else None,
                     last_k=cfg.eval.last_k if frozen and cfg.eval.features == "last_k" else None)


def read_cell(out: Path, cell: Cell) -> dict | None:
    """The stored record of `cell`, or None: not there (computed), or damaged (computed again, said in one line)."""
    path = out / "cells" / f"{cell.key}.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # unreadable, truncated, not JSON
        problem = f"is unreadable ({describe_error(err)})"
    else:
        problem = cell_problem(record, cell)
    if problem is None:
        return record
    log.warning("benchmark: %s %s: computed again", path, problem)
    return None


def _is_score(value) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def cell_problem(record, cell: Cell) -> str | None:
    """What makes a stored record unusable as `cell`'s (what the report reads, of the right kinds), or None."""
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not a cell record"
    missing = [key for key in CELL_FIELDS if key not in record]
    if missing:
        return f"lacks {missing}"
    for key in ("scores", "chance"):
        if not isinstance(record[key], dict) or not all(isinstance(k, str) and _is_score(v)
                                                        for k, v in record[key].items()):
            return f"has {key}={str(record[key])[:60]}, not a mapping of metric names to numbers"
    if not record["scores"]:
        return "has no scores"
    if record["protocol"] != cell.protocol:
        return f"is of protocol {record['protocol']!r}, not {cell.protocol!r}"
    if not _is_score(record["seconds"]) or record["seconds"] is None or not isinstance(record["img_size"], int):
        return "has a seconds or img_size that is not a number"
    return None


def write_cell(out: Path, cell: Cell, result: dict) -> dict:
    """The cell's record, written atomically (a kill leaves the old file or none, never half of one)."""
    record = {"encoder": cell.encoder.label, "spec": cell.encoder.spec, "dataset": cell.data.label,
              "data": cell.data.cfg.name, "protocol": cell.protocol, "img_size": cell.img_size, **result}
    path = out / "cells" / f"{cell.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return record


def describe_scores(scores: dict) -> str:
    return ", ".join(f"{metric} {'-' if value is None else f'{100 * value:.1f}%'}" for metric, value in scores.items())


def compute_cell(cell: Cell, cfg, cache_dir: Path, progress: bool, held: dict | None = None) -> dict:
    """{"scores": {metric: value}, "chance": {metric: value}, "details": the evaluator's own result}. `held`: frozen
    features kept between cells, by (encoder, data set), of one data set at a time."""
    encoder, seed = cell.encoder, cfg.seed
    encoder_size(cell.img_size, encoder.module, encoder.recorded)  # the size this cell was planned at
    train_set, test_set = cell.data.at(cell.img_size, seed)
    identity = {"encoder": encoder.identity, "data": OmegaConf.to_container(cell.data.cfg),
                "preprocess": cell.preprocess.to_json()}
    if cell.protocol in (*FROZEN_PROTOCOLS, "vtab"):
        held = {} if held is None else held
        key = (encoder.label, cell.data.label)
        if key not in held:
            for other in [k for k in held if k[1] != cell.data.label]:
                del held[other]
            ecfg = OmegaConf.merge(cfg.eval, {"features": feature_kind(encoder, cfg.eval.features)})
            held[key] = frozen_features(encoder.module, {"train": train_set, "test": test_set}, ecfg,
                                        cell.preprocess.view_builder(), cache_dir, identity, progress, None, {})
        return frozen_protocol(cell.protocol, *held[key]["train"], *held[key]["test"], cfg)
    if cell.protocol == "segmentation":
        return segmentation_cell(cell, train_set, test_set, cfg, cache_dir, identity, progress)
    return text_cell(cell, test_set, cfg, progress)


def majority_share(labels: torch.Tensor) -> float:
    return float(torch.bincount(labels).max() / len(labels))


def frozen_protocol(protocol: str, train_x, train_y, test_x, test_y, cfg) -> dict:
    """A frozen-feature cell: the shared table's run and scores (ssl_vit.eval.protocols), or VTAB-1k's."""
    chance = majority_share(test_y)
    if protocol == "vtab":
        details = vtab_1k(train_x, train_y, test_x, test_y, list(cfg.eval.l2_values), cfg.vtab_train, cfg.vtab_val,
                          cfg.seed)
        return {"scores": {"VTAB-1k": details["accuracy"]}, "chance": {"VTAB-1k": chance}, "details": details}
    entry = PROTOCOLS[protocol]
    details = entry.run(train_x, train_y, test_x, test_y, cfg.eval, cfg.seed)
    scores = entry.scores(details, cfg.eval)
    return {"scores": scores, "chance": dict.fromkeys(scores, chance), "details": details}


def segmentation_cell(cell: Cell, train_set, test_set, cfg, cache_dir: Path, identity: dict, progress: bool) -> dict:
    module = cell.encoder.module
    native = isinstance(module, NativeEncoder)
    blocks = 1 if native else cfg.eval.segmentation_blocks
    ecfg = OmegaConf.merge(cfg.eval, {"segmentation_blocks": blocks})

    def cache(split, compute):
        return cached(cache_dir, cache_key(**identity, split=split, kind="patch_tokens", blocks=blocks), compute)

    details = segmentation_eval(module, train_set, test_set, cell.preprocess, ecfg, cfg.seed, progress,
                                module.feature_map if native else None, cache)
    return {"scores": {"mIoU": details["miou"]}, "chance": {"mIoU": details["chance"]["miou"]}, "details": details}


def text_cell(cell: Cell, test_set, cfg, progress: bool) -> dict:
    model = cell.encoder.text_model
    if cell.protocol == "zeroshot":
        details = zeroshot_eval(model, test_set, cell.preprocess.view_builder(("image",)), cfg.eval,
                                cell.data.cfg.name, progress)
        labels = labels_of(test_set)
        chance = majority_share(torch.as_tensor(labels)) if labels is not None else 1 / len(details["classes"])
        return {"scores": {"zero-shot": details["accuracy"]}, "chance": {"zero-shot": chance}, "details": details}
    details = retrieval_eval(model, test_set, cell.preprocess.view_builder(("image",)), cfg.eval, progress)
    k = min(cfg.eval.retrieval_ks)
    scores = {f"image-to-text R@{k}": details["accuracy"][f"image_to_text_R@{k}"],
              f"text-to-image R@{k}": details["accuracy"][f"text_to_image_R@{k}"]}
    return {"scores": scores, "chance": dict.fromkeys(scores, min(1.0, k / details["num_pairs"])), "details": details}
