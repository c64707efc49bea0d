"""Run directories: which directory is a run, the newest run of an output group, and the `latest` link.

Runs land in `outputs/<objective>-<model>-<data>/<time>/` (an output group per setting) unless `out=DIR` names
the run directory. Each new run of a group points `<group>/latest` at itself, and every command that takes a run
(evaluate, export, analyze, trainer.resume) accepts the group too and uses its newest run, saying which.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENCODER_FILE = "encoder.safetensors"
HEADS_FILE = "heads.safetensors"
LATEST = "latest"
_ANNOUNCED: set[str] = set()
CHECKPOINTS = "checkpoints"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TRACKER_IDS_FILE = "trackers.json"  # the MLflow / W&B run ids, so that a resumed run continues their runs
# What a training run leaves in its directory; any of them makes a directory a run (Hydra's .hydra/ too)
SAMPLE_KEYS_DIR = "sample_keys"
RUN_OUTPUTS = (CHECKPOINTS, METRICS_FILE, SUMMARY_FILE, ENCODER_FILE, HEADS_FILE, "tb", TRACKER_IDS_FILE, "wandb",
               SAMPLE_KEYS_DIR)


def is_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in (*RUN_OUTPUTS, ".hydra"))


def previous_outputs(path: Path) -> list[str]:
    """The outputs of an earlier run in `path` (an empty checkpoints/ or tb/ does not count)."""
    found = []
    for name in RUN_OUTPUTS:
        entry = path / name
        if entry.is_file() or (entry.is_dir() and any(entry.iterdir())):
            found.append(name)
    return found


def newest_run(group: Path) -> Path | None:
    """`group/latest` where it points at a run, else the most recently modified run directory in `group`."""
    latest = group / LATEST
    if latest.is_symlink() and is_run(latest.resolve()):
        return group / os.readlink(latest)
    runs = [child for child in group.iterdir() if child.name != LATEST and is_run(child)] if group.is_dir() else []
    return max(runs, key=lambda run: (run.stat().st_mtime, run.name), default=None)


def resolve_run(spec: str | Path, quiet: bool = False) -> str:
    """`spec` itself, or, for an output group (a directory of runs that is not a run), its newest run, said on
    stderr. Import forms (timm:..., hf:...) and files pass through unchanged."""
    path = Path(spec).expanduser()
    if ":" in str(spec).split("/", 1)[0] or not path.is_dir() or is_run(path):
        return str(spec)
    run = newest_run(path)
    if run is None:
        return str(spec)
    if not quiet and str(spec) not in _ANNOUNCED:  # once per process, however many layers ask
        _ANNOUNCED.add(str(spec))
        print(f"ssl-vit: {spec} is an output group: using its newest run, {run}", file=sys.stderr, flush=True)
    return str(run)


def link_latest(run_dir: Path) -> None:
    """Point `<parent>/latest` at `run_dir` (relative, replaced atomically)."""
    link, temp = run_dir.parent / LATEST, run_dir.parent / f".{LATEST}.{os.getpid()}"
    if link.exists() and not link.is_symlink():
        return  # a real directory called latest: not ours to replace
    temp.unlink(missing_ok=True)
    temp.symlink_to(run_dir.name)
    os.replace(temp, link)


def default_run_dir(out: str | None, group: str, time: str) -> str:
    """hydra.run.dir of a training run: `out` when given, else `<group>/<time>`."""
    return str(out) if out else f"{group}/{time}"


def evaluation_dir(checkpoint: str, data_name: str, time: str) -> str:
    """Where evaluate.py writes: `<run>/eval/<data>` for one of our runs (a run, its group or a file in it), so
    the results sit beside the encoder they describe; `outputs/eval-<data>/<time>` for imports (timm:, hf:, ...)."""
    spec = resolve_run(checkpoint, quiet=True)
    path = Path(spec).expanduser()
    run = path if path.is_dir() else path.parent
    if ":" not in spec.split("/", 1)[0] and (run / ENCODER_FILE).is_file():
        return str(run / "eval" / data_name)
    return f"outputs/eval-{data_name}/{time}"
