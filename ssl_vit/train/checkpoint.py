"""Resumable checkpoints: `accelerator.save_state` into a temp directory renamed into place, last K kept.

Layout under the run's output directory:
    checkpoints/step_00000100/   model, optimizer, RNG states of every rank, the train state (step, counters)
    encoder.safetensors          the latest encoder alone, for evaluation and export
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d+)$")


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp directories of interrupted saves are ignored)."""
    root = Path(out_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def resolve_resume(resume: str | None, out_dir: str | Path) -> Path | None:
    """`None` -> no resume; "auto" -> the newest checkpoint in out_dir (None if there is none); else a path."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a checkpoint directory; use 'auto' or a path "
                                f"such as {Path(out_dir) / CHECKPOINT_DIR / 'step_00000100'}")
    return path


def save_checkpoint(accelerator, out_dir: str | Path, step: int, keep: int) -> Path:
    """Collective: every rank must call it. Returns the final checkpoint directory."""
    root = Path(out_dir) / CHECKPOINT_DIR
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        stale = root / f".old_{final.name}"
        if final.exists():  # re-saving a step (e.g. after a stop): swap, so a complete copy always exists
            final.rename(stale)
        tmp.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
        for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
