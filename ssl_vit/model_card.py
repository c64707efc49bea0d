"""The README.md written beside every export (scripts/export.py): the Hub's front matter (library_name, license,
tags, pipeline_tag, through huggingface_hub's ModelCard), what the encoder is, how it was trained, what it scored,
and how to load it. Everything in it is read from the run directory (config.yaml, .hydra/overrides.yaml,
summary.json, eval/*/results.json, the periodic evaluations in metrics.jsonl) or from the encoder file itself; an
import from another library (timm:, hf:, open_clip:) gets the architecture, preprocessing and loading alone.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from ssl_vit.artifacts import run_directory
from ssl_vit.run_dirs import METRICS_FILE, SUMMARY_FILE

CARD_FILE = "README.md"
LIBRARY_NAMES = {"hf": "transformers", "timm": "timm", "open_clip": "open_clip", "onnx": "onnx",
                 "safetensors": "ssl-vit", "detectron2": "detectron2"}  # the Hub's library_name of each export target
ARCHITECTURE_KEYS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_dim", "mlp_ratio",
                     "class_token", "global_pool", "num_registers", "dist_token", "qk_norm", "parallel_block",
                     "layer_scale", "pre_norm", "stem", "window_size", "global_attn_indexes", "rel_pos",
                     "neck_channels")


def write_model_card(out_dir: str | Path, source: str, target: str, how_to_load: str, encoder, preprocess,
                     license: str = "other") -> Path:
    """The card of an export to `target` (a key of LIBRARY_NAMES); `license` is a Hub license id (the weights' terms
    follow the data they were trained on, which the run does not know: "other" unless the user says)."""
    run = run_directory(source)
    lines = [f"# {_title(run, encoder)}", "", f"Exported by ssl-vit from `{source}` for **{target}**.", "",
             "## Load", "", "```python", how_to_load, "```", "", "## Architecture", "", *_architecture(encoder), ""]
    if preprocess is not None:
        lines += ["## Preprocessing", "", *(f"- {k}: {v}" for k, v in asdict(preprocess).items()), ""]
    if run is not None:
        lines += _training(run)
    path = Path(out_dir) / CARD_FILE
    front = _front_matter(run, target, license)
    ModelCard(f"---\n{front.to_yaml()}\n---\n\n" + "\n".join(lines).rstrip() + "\n").save(path)
    return path


def _front_matter(run: Path | None, target: str, license: str) -> ModelCardData:
    tags = ["ssl-vit", "vision-transformer", "image-feature-extraction"]
    if run is not None:
        tags.append(_config(run)["objective"]["name"].split(":")[-1])
    return ModelCardData(library_name=LIBRARY_NAMES[target], license=license, tags=tags,
                         pipeline_tag="zero-shot-image-classification" if target == "open_clip"
                         else "image-feature-extraction")


def _title(run: Path | None, encoder) -> str:
    name = "ViT"
    if run is not None:
        config = _config(run)
        name = f"{config['model']['name']} pre-trained with {config['objective']['name'].split(':')[-1]}"
    return f"{name} ({encoder.config.embed_dim} wide, {encoder.config.depth} blocks, " \
           f"{sum(p.numel() for p in encoder.parameters()) / 1e6:.2f}M parameters)"


def _architecture(encoder) -> list[str]:
    return [f"- {key}: {getattr(encoder.config, key)}" for key in ARCHITECTURE_KEYS 
            if getattr(encoder.config, key) is not None]


def _config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def _training(run: Path) -> list[str]:
    config = _config(run)
    summary = json.loads((run / SUMMARY_FILE).read_text()) if (run / SUMMARY_FILE).is_file() else {}
    objective = {k: v for k, v in config["objective"].items() if v is not None}
    data = {k: v for k, v in config["data"].items() if v is not None and k in
            ("name", "root", "urls", "num_samples", "img_size", "batch_size", "augment", "captions")}
    optim = {k: v for k, v in config.get("optim", {}).items() if v is not None}
    lines = ["## Training", ""]
    if summary:
        step, batch = summary.get("step"), summary.get("global_batch")
        seen = f", {step * batch:,} images seen (global batch {batch})" if step and batch else ""
        loss = _number((summary.get("last") or {}).get("loss"))
        lines += [f"- steps: {step} of {summary.get('max_steps')}{seen}; strategy {summary.get('strategy')} on "
                  f"{summary.get('world_size')} process(es)", f"- final loss: {loss}"]
    lines += [f"- objective: `{json.dumps(objective)}`", f"- data: `{json.dumps(data)}`",
              f"- optimiser: `{json.dumps(optim)}`", ""]
    command = _command(run)
    if command:
        lines += ["Trained with:", "", "```bash", command, "```", ""]
    results = _evaluations(run)
    if results:
        lines += ["## Evaluation", "", "| data | evaluator | metric | value |", "|---|---|---|---|", *results, ""]
    return lines


def _number(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _command(run: Path) -> str | None:
    """The training command from Hydra's record of the overrides (None for a run started in-process)."""
    overrides_file = run / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        return None
    return " ".join(["python scripts/pretrain.py", *map(shlex.quote, yaml.safe_load(overrides_file.read_text()) or [])])


def _evaluations(run: Path) -> list[str]:
    """Table rows: each `eval/<data>/results.json` (scripts/evaluate.py), then the last periodic evaluation."""
    rows = []
    for results_file in sorted((run / "eval").glob("*/results.json")):
        recorded = json.loads(results_file.read_text())
        data = recorded.get("data", results_file.parent.name)
        for evaluator, result in recorded.get("results", {}).items():
            for metric, value in result.items():
                if metric != "accuracy" and not metric.startswith("top"):
                    continue  # a setting (k, l2, temperature) or a count
                named = value if isinstance(value, dict) else {"": value}  # few-shot: per shot; retrieval: per k
                rows += [f"| {data} | {evaluator} | {metric}{f' {part}' if part else ''} | {score:.4f} |"
                         for part, score in named.items()]
    metrics = run / METRICS_FILE
    logged = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    periodic = [row for row in logged if any(key.startswith("eval/") for key in row)]
    if periodic:
        last = periodic[-1]
        rows += [f"| training data, step {last['step']} | {key.removeprefix('eval/')} | accuracy | {value:.4f} |"
                 for key, value in last.items() if key.startswith("eval/") and isinstance(value, float)]
    return rows
