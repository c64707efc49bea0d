"""What a run writes besides checkpoints, kept consistent with them across kills and resumes.

- `metrics.jsonl`: one JSON object per logged step (non-finite values written as null). A resumed run first drops
  the rows logged after the step it resumes from, so steps never go backwards; TensorBoard does the same through
  `purge_step`.
- `encoder.safetensors`: always the encoder of the newest checkpoint; a run resumed at its last step rewrites it
  when a kill came between the checkpoint and the encoder. A run's further encoders (distill's extra students,
  `<run>/students/<name>/`) are written before it, so its step vouches for theirs.
- `summary.json`: written at the end of every invocation, also when training stops on divergence or bad data.

Write failures (disk full, read-only, permissions) become `OutputError`, naming the path and the cause.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import resource
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from ssl_vit.artifacts import ENCODER_FILE, HEADS_FILE, read_metadata, save_encoder_state, save_heads
from ssl_vit.run_dirs import METRICS_FILE, SAMPLE_KEYS_DIR, SUMMARY_FILE
from ssl_vit.train.trackers import Trackers


class OutputError(RuntimeError):
    """An output could not be written; the message names the path and the cause."""


_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "the file size limit is exceeded (ulimit -f)",
}


def describe_write_failure(directory: str | Path, err: BaseException) -> str:
    """The cause of a failed write, in words. torch.save reports a full disk as "enforce fail at
    inline_container.cc ... file write failed" without an errno and safetensors as "... (os error 28)", so the
    message and the directory itself are examined too."""
    for cause in (err, err.__cause__, err.__context__):
        code = getattr(cause, "errno", None)
        if code is None and cause is not None:
            found = re.search(r"os error (\d+)", str(cause))
            code = int(found.group(1)) if found else None
        if code in _CAUSES:
            return _CAUSES[code]
    directory = Path(directory)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        stats = os.statvfs(directory)
        if stats.f_flag & os.ST_RDONLY:
            return _CAUSES[errno.EROFS]
        free = stats.f_bavail * stats.f_frsize
        if free < 64 * 2**20:
            return f"{_CAUSES[errno.ENOSPC]} ({free / 2**20:.1f} MiB free)"
    except OSError:
        pass
    if not os.access(directory, os.W_OK):
        return _CAUSES[errno.EACCES]
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"{_CAUSES[errno.EFBIG]}: {limit} bytes"
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0][:200] if first else ''}"


@contextmanager
def writing(path: str | Path, what: str):
    """Turn a failed write of `what` at `path` into an OutputError with the cause."""
    try:
        yield
    except Exception as err:  # OSError, torch's RuntimeError, safetensors' own error type
        if isinstance(err, OutputError):
            raise
        raise OutputError(f"cannot write {what} {path}: {describe_write_failure(Path(path).parent, err)}") from err


def check_writable(directory: str | Path) -> None:
    """Create the directory and write a probe file in it: an unusable output directory fails before training."""
    directory = Path(directory)
    probe = directory / f".write_test_{os.getpid()}"
    with writing(directory, "to the output directory"):
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()


def json_safe(value):
    """Non-finite floats -> None (JSON has no NaN), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def append_metrics(out_dir: Path, row: dict) -> None:
    path = out_dir / METRICS_FILE
    with writing(path, "metrics"), open(path, "a") as f:
        f.write(json.dumps(json_safe(row)) + "\n")


def drop_metrics_after(out_dir: Path, step: int) -> int:
    """Keep the rows of metrics.jsonl up to `step` (rows a killed run logged past its last checkpoint go);
    returns how many rows were dropped."""
    return drop_rows_after(out_dir / METRICS_FILE, step, "metrics")


def drop_rows_after(path: Path, step: int, what: str) -> int:
    """Keep the JSON lines of `path` whose "step" is at most `step`, and none cut by a kill; returns how many were
    dropped. The rewrite is atomic."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        with writing(path, what):
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
    return len(lines) - len(kept)


def write_summary(out_dir: Path, summary: dict) -> None:
    path = out_dir / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, "the summary"):
        tmp.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
        os.replace(tmp, path)


class SampleKeys:
    """`sample_keys/rank_<r>.jsonl` (trainer.record_sample_keys): one {"step", "keys"} line per step, the keys of the
    samples this rank trained that step on (shard streams: "<shard file>/<key>"; map-style data: the index), to
    audit a loss spike or check an exact resume. A resumed run first drops the lines past the step it resumes from.
    """

    def __init__(self, out_dir: Path, rank: int, step: int):
        self.path = out_dir / SAMPLE_KEYS_DIR / f"rank_{rank}.jsonl"
        with writing(self.path, "the sample keys"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_rows_after(self.path, step, "the sample keys")

    def write(self, step: int, keys: list) -> None:
        with writing(self.path, "the sample keys"), open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "keys": keys}) + "\n")


class RunOutputs:
    """The main process's writer of one run's outputs; on other ranks every method does nothing."""

    def __init__(self, accelerator, out_dir: Path, trackers=("tensorboard",)):
        self.accelerator, self.out_dir = accelerator, out_dir
        self.active = accelerator.is_main_process
        self.tracker_names, self.trackers = list(trackers), None

    def open(self, step: int, config, hparams: dict) -> int:
        """Start (or continue at `step`) a run: drop metrics rows past it, save the config, start the trackers
        (TensorBoard with `purge_step`, so that events a killed run logged past the checkpoint are hidden). Returns
        the rows dropped."""
        if not self.active:
            return 0
        dropped = drop_metrics_after(self.out_dir, step)
        with writing(self.out_dir / "config.yaml", "the config"):
            OmegaConf.save(config, self.out_dir / "config.yaml", resolve=True)
        self.trackers = Trackers(self.tracker_names, self.out_dir, step, hparams)
        return dropped

    def log(self, row: dict, tracker_prefix: str = "") -> None:
        """One metrics.jsonl row (with its "step") and its numbers in every tracker."""
        if not self.active:
            return
        append_metrics(self.out_dir, row)
        if self.trackers is not None:
            self.trackers.log({f"{tracker_prefix}{k}": v for k, v in row.items() if k != "step"}, row["step"])

    def close(self, summary: dict | None) -> None:
        """The summary to the trackers, which then end."""
        if self.active and self.trackers is not None:
            self.trackers.finish(summary)
            self.trackers = None

    @property
    def encoder_path(self) -> Path:
        return self.out_dir / ENCODER_FILE

    def save_encoder(self, encoder_state: dict | None, config: dict, step: int, preprocess=None, member: str = "",
                     **metadata) -> None:
        """encoder.safetensors from the encoder's state dict (the main process holds it; consolidated first when
        the model is sharded), rebuilt by `load_encoder` with `config`; `member`: the run's further encoder of that
        key, in its directory under the run's (`Objective.member_artifacts`)."""
        if self.active:
            path = self.out_dir / member / ENCODER_FILE
            with writing(path, "the encoder"):
                path.parent.mkdir(parents=True, exist_ok=True)
                save_encoder_state(encoder_state, config, path, preprocess, step=step, **metadata)

    def save_heads(self, heads: dict | None, step: int, member: str = "", **metadata) -> None:
        """heads.safetensors: the objective's heads by their state-dict names (`Objective.artifacts`)."""
        if self.active:
            path = self.out_dir / member / HEADS_FILE
            with writing(path, "the heads"):
                save_heads(heads, path, step=step, **metadata)

    def encoder_step(self) -> int | None:
        """The step recorded in encoder.safetensors (None when there is none or it is unreadable)."""
        try:
            return int(read_metadata(self.out_dir / ENCODER_FILE)["step"])
        except Exception:  # missing, or cut by a kill: rewritten by the caller
            return None

    def summary(self, summary: dict) -> None:
        if self.active:
            write_summary(self.out_dir, summary)
