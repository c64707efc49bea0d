"""What `ssl-vit benchmark` writes: one table, a row per task (a data set's metric: "digits linear", "digits
5-shot", "synthetic mIoU"), a column per encoder, the chance level of each task and a mean per encoder over the tasks
every encoder has; as Markdown (benchmark.md, also printed), CSV (benchmark.csv: a row per cell and metric) and JSON
(benchmark.json: the configuration, every cell with its evaluator's details), and two PNGs: heatmap.png (tasks x
encoders, coloured by how much of the way from chance to 100% each score goes, annotated with the score) and
fewshot.png (accuracy against shots per class, a line per encoder, a panel per data set).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

CSV_FIELDS = ("encoder", "spec", "dataset", "data", "protocol", "metric", "score", "chance", "img_size", "seconds")


def task_rows(report: dict) -> list[dict]:
    """A row per task in the report's cell order: {"task", "dataset", "protocol", "metric", "chance",
    "scores": {encoder: score or None}}; a task no encoder has a score for (a shot count no class can fill) is
    left out."""
    rows: dict[tuple, dict] = {}
    for cell in report["cells"]:
        for metric, value in cell["scores"].items():
            row = rows.setdefault((cell["dataset"], metric), {
                "task": f"{cell['dataset']} {metric}", "dataset": cell["dataset"], "protocol": cell["protocol"],
                "metric": metric, "chance": cell["chance"].get(metric), "scores": {}})
            row["scores"][cell["encoder"]] = value
    return [row for row in rows.values() if any(v is not None for v in row["scores"].values())]


def encoder_means(rows: list[dict], encoders: list[str]) -> tuple[dict, float | None, int]:
    """({encoder: mean score}, the chance level's mean, number of tasks) over the tasks every encoder has a score
    for (comparable means); where no task is common, each encoder's mean over its own tasks (count 0)."""
    common = [row for row in rows if all(row["scores"].get(e) is not None for e in encoders)]
    if common:
        means = {e: float(np.mean([row["scores"][e] for row in common])) for e in encoders}
        chances = [row["chance"] for row in common if row["chance"] is not None]
        return means, float(np.mean(chances)) if len(chances) == len(common) else None, len(common)
    own = {e: [row["scores"][e] for row in rows if row["scores"].get(e) is not None] for e in encoders}
    return {e: float(np.mean(values)) if values else None for e, values in own.items()}, None, 0


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def markdown_table(report: dict) -> str:
    encoders = list(report["encoders"])
    rows = task_rows(report)
    lines = [f"| task | chance | {' | '.join(encoders)} |", "|---|---:|" + "---:|" * len(encoders)]
    for row in rows:
        present = [v for v in row["scores"].values() if v is not None]
        best = max(present) if len(present) > 1 else None
        cells = [f"**{_percent(v)}**" if v is not None and v == best else _percent(v)
                 for v in (row["scores"].get(e) for e in encoders)]
        lines.append(f"| {row['task']} | {_percent(row['chance'])} | {' | '.join(cells)} |")
    means, chance, count = encoder_means(rows, encoders)
    label = (f"mean ({count} task{'s' if count > 1 else ''} every encoder has)" if count
             else "mean (of each encoder's own tasks)")
    lines.append(f"| {label} | {_percent(chance)} | {' | '.join(_percent(means[e]) for e in encoders)} |")
    return "\n".join(lines)


def csv_rows(report: dict) -> list[dict]:
    return [{"encoder": cell["encoder"], "spec": cell["spec"], "dataset": cell["dataset"], "data": cell["data"],
             "protocol": cell["protocol"], "metric": metric, "score": value, "chance": cell["chance"].get(metric),
             "img_size": cell["img_size"], "seconds": round(cell["seconds"], 3)}
            for cell in report["cells"] for metric, value in cell["scores"].items()]


def write_report(report: dict, out: str | Path, plots: bool = True) -> dict[str, Path]:
    """benchmark.md, benchmark.csv, benchmark.json and (`plots`) heatmap.png, fewshot.png (when there are few-shot
    scores) in `out`; {what: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = task_rows(report)
    encoders = list(report["encoders"])
    means, chance, count = encoder_means(rows, encoders)
    paths = {"markdown": out / "benchmark.md", "csv": out / "benchmark.csv", "json": out / "benchmark.json"}
    paths["markdown"].write_text(markdown_table(report) + "\n")
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(csv_rows(report))
    table = {"tasks": rows, "means": means, "mean_chance": chance, "mean_over_tasks": count}
    paths["json"].write_text(json.dumps({**report, "table": table}, indent=1, default=str) + "\n")
    if plots:
        paths["heatmap"] = plot_heatmap(rows, encoders, out / "heatmap.png")
        curves = plot_fewshot_curves(report, out / "fewshot.png")
        if curves is not None:
            paths["fewshot"] = curves
    return paths


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_heatmap(rows: list[dict], encoders: list[str], path: Path) -> Path:
    """Tasks x encoders: colour = (score - chance) / (1 - chance), the share of the way from guessing to 100%
    (comparable across tasks with different chance levels); each square annotated with the score in %."""
    scores = np.array([[np.nan if row["scores"].get(e) is None else row["scores"][e] for e in encoders]
                       for row in rows], dtype=float)
    chance = np.array([[row["chance"] or 0.0] for row in rows], dtype=float)
    gain = np.clip((scores - chance) / np.maximum(1 - chance, 1e-9), 0, 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(encoders), 0.8 + 0.32 * len(rows)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(gain), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(encoders)):
            if not math.isnan(scores[i, j]):
                ax.text(j, i, f"{100 * scores[i, j]:.1f}", ha="center", va="center", fontsize=8,
                        color="white" if gain[i, j] < 0.6 else "black")
    ax.set_xticks(range(len(encoders)), encoders, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), [f"{row['task']} (chance {_percent(row['chance'])})" for row in rows])
    fig.colorbar(image, ax=ax, shrink=0.8, label="(score - chance) / (100% - chance)")
    ax.set_title("Benchmark: score in % per task and encoder")
    return _save(fig, path)


def plot_fewshot_curves(report: dict, path: Path) -> Path | None:
    """Accuracy against shots per class (log scale), a line per encoder, a panel per data set with scores at two
    shot counts or more, chance dashed; None when there are none."""
    curves: dict[str, dict[str, list]] = {}
    chance: dict[str, float] = {}
    for cell in report["cells"]:
        if cell["protocol"] != "fewshot":
            continue
        points = [(int(m.split("-")[0]), v) for m, v in cell["scores"].items() if v is not None]
        if len(points) > 1:  # a curve needs two shot counts
            curves.setdefault(cell["dataset"], {})[cell["encoder"]] = sorted(points)
            chance[cell["dataset"]] = next(iter(cell["chance"].values()))
    if not curves:
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(4.4 * len(curves), 3.4), squeeze=False, layout="constrained")
    for ax, (dataset, lines) in zip(axes[0], curves.items(), strict=True):
        for encoder, points in lines.items():
            shots, values = zip(*points, strict=True)
            ax.plot(shots, [100 * v for v in values], marker="o", label=encoder)
        ax.axhline(100 * chance[dataset], color="grey", linestyle="--", linewidth=1, label="chance")
        ax.set_xscale("log")
        all_shots = sorted({s for points in lines.values() for s, _ in points})
        ax.set_xticks(all_shots, [str(s) for s in all_shots])
        ax.set_xlabel("training images per class")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"{dataset}: few-shot linear (ridge)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    return _save(fig, path)
