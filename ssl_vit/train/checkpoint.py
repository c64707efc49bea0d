"""Resumable checkpoints: `accelerator.save_state` into a temp directory renamed into place, last K kept; and the
checks that make resuming either exact or a clear error.

Layout under the run's output directory:
    checkpoints/step_00000100/   model, optimizer, RNG states and data stream positions of every rank, the train
                                 state (step, counters)
    encoder.safetensors          the latest encoder alone, for evaluation and export
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from ssl_vit.files import make_readable
from ssl_vit.run_dirs import CHECKPOINTS, RUN_OUTPUTS, previous_outputs, resolve_run
from ssl_vit.schema import ConfigError
from ssl_vit.train.checkpoint_files import UnreadableFile, check_pickled_files, rng_state_problem
from ssl_vit.train.faults import fault_point
from ssl_vit.train.outputs import OutputError, describe_write_failure
from ssl_vit.train.strategy import on_main_process
from ssl_vit.untrusted import UntrustedFile

log = logging.getLogger("ssl_vit")

CHECKPOINT_DIR = CHECKPOINTS
_NAME = re.compile(r"^step_(\d+)$")
MODEL_FILE = "model.safetensors"
TRUST_HINT = "resume with trainer.trust_pickle=true"
TRAIN_STATE_FILE = "custom_checkpoint_0.pkl"  # accelerate's name for the first registered object (TrainState)
DEEPSPEED_DIR = "pytorch_model"  # accelerate's DeepSpeed tag: <checkpoint>/pytorch_model/zero_pp_rank_*
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"  # torch.distributed.checkpoint's shards of FSDP2's model


def checkpoint_format(path: Path) -> str | None:
    """"deepspeed" (ZeRO shards), "dcp" (FSDP2's torch.distributed.checkpoint), "whole" (DDP, one process)."""
    if (path / DEEPSPEED_DIR).is_dir():
        return "deepspeed"
    if (path / FSDP_MODEL_DIR / ".metadata").is_file():
        return "dcp"
    return "whole" if (path / MODEL_FILE).is_file() else None


def written_by(path: Path) -> int:
    """How many processes wrote the checkpoint (one RNG state each)."""
    return sum(1 for _ in Path(path).glob("random_states_*.pkl"))


def rng_file(rank: int) -> str:
    return f"random_states_{rank}.pkl"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp directories of interrupted saves are ignored)."""
    root = Path(out_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def remove_stale_temps(out_dir: str | Path) -> list[Path]:
    """Delete the temp directories of saves and deletions that were interrupted (a kill, a full disk); returns what
    it removed."""
    root = Path(out_dir) / CHECKPOINT_DIR
    stale = sorted(root.glob(".tmp_step_*")) + sorted(root.glob(".old_step_*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def claim_run_dir(out_dir: Path, resume: str | None, overwrite: bool, is_main: bool) -> None:
    """A run directory holds one run: a new run (no trainer.resume) where an earlier one left outputs is refused,
    unless trainer.overwrite, which clears them (on the main process; the caller waits for it)."""
    found = previous_outputs(out_dir)
    if not found or resume:
        return
    if not overwrite:
        raise ConfigError(f"{out_dir} already holds a run ({', '.join(found)}); continue it with "
                          f"trainer.resume=auto, start a new one in a fresh directory (out=DIR), or clear it with "
                          f"trainer.overwrite=true")
    if is_main:
        for name in RUN_OUTPUTS:
            path = out_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        log.info("trainer.overwrite: cleared %s of the earlier run (%s)", out_dir, ", ".join(found))


def resolve_resume(resume: str | None, out_dir: str | Path) -> Path | None:
    """`None` -> no resume; "auto" -> the newest checkpoint in out_dir (None if there is none); else a checkpoint
    directory, which must exist and hold a checkpoint."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resolve_run(resume)).expanduser()
    example = Path(out_dir) / CHECKPOINT_DIR / "step_00000100"
    if not path.is_dir():
        raise ConfigError(f"trainer.resume={resume!r} does not exist or is not a directory; valid values: auto, or "
                          f"a checkpoint directory such as {example}")
    if list_checkpoints(path):  # a run directory: take its newest checkpoint
        return list_checkpoints(path)[-1]
    if not (path / TRAIN_STATE_FILE).is_file():
        raise ConfigError(f"trainer.resume={resume!r} holds no checkpoint (no {TRAIN_STATE_FILE}); valid values: "
                          f"auto, a run directory, or a checkpoint directory such as {example}")
    return path


def check_checkpoint(path: Path, model, world_size: int, allow_inexact: bool, model_name: str | None = None) -> None:
    """Refuse, with the reason, a checkpoint that cannot resume this run exactly: unreadable files, another model's
    weights, or a missing RNG state (unless allow_inexact, which warns instead). Sharded checkpoints (DeepSpeed's
    pytorch_model/, FSDP's) are checked by their own loaders; one written by another number of processes is
    refused, naming scripts/consolidate.py (their shards load only as they were cut). `model_name`: this run's
    model preset, named beside the checkpoint's when they differ."""
    wrote, kind = written_by(path), checkpoint_format(path)
    if wrote and wrote != world_size and kind in ("deepspeed", "dcp"):
        raise ConfigError(f"trainer.resume: {path} was written by {wrote} processes and this run has {world_size}: "
                          f"its {'DeepSpeed ZeRO' if kind == 'deepspeed' else 'FSDP2'} shards resume only on "
                          f"{wrote}; python scripts/consolidate.py {path} --out DIR writes its weights as whole "
                          "files (encoder, heads, training state) on any machine")
    _check_rng_states(path, world_size, allow_inexact)
    if not (path / MODEL_FILE).is_file():
        return
    try:
        with safe_open(str(path / MODEL_FILE), framework="pt") as f:
            saved = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated or foreign files
        raise ConfigError(f"trainer.resume: {path / MODEL_FILE} is unreadable ({type(err).__name__}: "
                          f"{_first_line(err)}); {_other_checkpoints(path)}") from err
    ours = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    problems = [f"{k} is {saved[k]} there, {ours[k]} here" for k in ours if k in saved and saved[k] != ours[k]]
    problems += [f"{k} is missing there" for k in ours if k not in saved]
    problems += [f"{k} is not in this model" for k in saved if k not in ours]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        config = path.parent.parent / "config.yaml"
        theirs = _model_name(config)
        names = (f" (the checkpoint is model={theirs}, this config asks model={model_name})"
                 if theirs and model_name and theirs != model_name else "")
        raise ConfigError(f"trainer.resume: {path} holds a different model{names}: {'; '.join(problems[:3])}{more}. "
                          f"Resume with the configuration of that run"
                          + (f" ({config})" if config.is_file() else ""))


def _model_name(config: Path) -> str | None:
    """model.name in a run's config.yaml, or None (no file, an older or a foreign one)."""
    try:
        return str(OmegaConf.load(config).model.name)
    except Exception:  # absent, unreadable, or without model.name: the message goes without it
        return None


def _check_rng_states(path: Path, world_size: int, allow_inexact: bool) -> None:
    missing = [rng_file(rank) for rank in range(world_size) if not (path / rng_file(rank)).is_file()]
    wrote = written_by(path)
    if missing:
        whose = "that rank" if len(missing) == 1 else "those ranks"
        _inexact(path, f"lacks {', '.join(missing)} (the RNG state of {whose}: written by fewer processes, or "
                       "damaged)", allow_inexact)
    elif wrote > world_size:
        _inexact(path, f"was written by {wrote} processes (this run has {world_size}: the other ranks' RNG states are "
                       "unused)", allow_inexact)


def _inexact(path: Path, reason: str, allow_inexact: bool) -> None:
    if not allow_inexact:
        raise ConfigError(f"trainer.resume: {path} {reason}, so the run cannot continue exactly; set "
                          "trainer.allow_inexact_resume=true to continue anyway")
    log.warning("RESUME IS NOT EXACT: %s %s; this run will not reproduce an uninterrupted one "
                "(trainer.allow_inexact_resume=true)", path, reason)


def check_contents(path: Path, world_size: int, allow_inexact: bool, trust_pickle: bool) -> None:
    """What the main process reads of a checkpoint before it loads: every rank's RNG state (accelerate skips a
    damaged one without a word: refused, or a warning with allow_inexact), and every pickled file as weights only
    (ssl_vit.train.checkpoint_files), unless `trust_pickle`."""
    rng_files = [rng_file(rank) for rank in range(world_size)]
    problems = {name: rng_state_problem(path / name) for name in rng_files}  # a missing one: check_checkpoint's
    damaged = {name: problem for name, problem in problems.items() if problem not in (None, "missing")}
    if damaged:
        name, problem = next(iter(damaged.items()))
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        _inexact(path, f"holds an RNG state accelerate cannot restore: {name} is {problem}{more}", allow_inexact)
    if trust_pickle:
        log.warning("trainer.trust_pickle=true: %s is unpickled without the weights-only check (its files can run "
                    "code)", path)
        return
    try:
        check_pickled_files(path, TRUST_HINT, skip=rng_files, deepspeed=checkpoint_format(path) == "deepspeed")
    except UntrustedFile as err:
        raise ConfigError(f"trainer.resume: {err}") from err
    except UnreadableFile as err:
        raise ConfigError(f"trainer.resume: {err}; {_other_checkpoints(path)}") from err


def load_checkpoint(accelerator, path: Path, model, allow_inexact: bool = False, model_name: str | None = None,
                    trust_pickle: bool = False) -> None:
    """Check (the files' contents on the main process), then load model, optimizer, every rank's RNG state and the
    registered train state."""
    check_checkpoint(path, accelerator.unwrap_model(model), accelerator.num_processes, allow_inexact, model_name)
    on_main_process(accelerator, check_contents, path, accelerator.num_processes, allow_inexact, trust_pickle)
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # pickle, zip and shape errors from torch.load / load_state_dict
        raise ConfigError(f"trainer.resume: {path} cannot be loaded ({type(err).__name__}: {_first_line(err)}); "
                          f"{_other_checkpoints(path)}") from err


def data_position_file(rank: int) -> str:
    return f"data_position_{rank}.pt"


def read_data_position(path: Path, rank: int, world_size: int, num_workers: int, allow_inexact: bool) -> dict | None:
    """The data loader state rank `rank` saved in checkpoint `path` (`save_checkpoint`'s data_position), or None
    when it cannot continue the stream exactly (none saved, or saved by another number of processes or loader
    workers): refused then, unless allow_inexact (the stream continues with fresh draws, with a warning)."""
    file = path / data_position_file(rank)
    saved = None
    if file.is_file():
        try:
            saved = torch.load(file, map_location="cpu", weights_only=True)
            if not (isinstance(saved, dict) and {"world_size", "num_workers", "loader"} <= set(saved)):
                raise ValueError("not a data stream position ({world_size, num_workers, loader})")
        except Exception as err:  # a truncated or foreign file: pickle / zip errors
            raise ConfigError(f"trainer.resume: {file} is unreadable ({type(err).__name__}: {_first_line(err)}); "
                              f"{_other_checkpoints(path)}") from err
    if saved is None:
        reason = f"holds no data stream position for rank {rank} ({file.name}; written by an older version?)"
    elif (saved["world_size"], saved["num_workers"]) != (world_size, num_workers):
        reason = (f"holds the data stream position of {saved['world_size']} process(es) x {saved['num_workers']} "
                  f"loader worker(s) and this run has {world_size} x {num_workers} (data.num_workers="
                  f"{saved['num_workers']} gives that run's workers)")
    else:
        return saved["loader"]
    if not allow_inexact:
        raise ConfigError(f"trainer.resume: {path} {reason}, so the run cannot continue its data stream exactly; set "
                          "trainer.allow_inexact_resume=true to continue with fresh draws")
    log.warning("RESUME IS NOT EXACT: %s %s; the data stream continues with fresh draws "
                "(trainer.allow_inexact_resume=true)", path, reason)
    return None


def save_checkpoint(accelerator, out_dir: str | Path, step: int, keep: int, data_position: dict | None = None) -> Path:
    """Collective: every rank must call it. Returns the final checkpoint directory. `data_position`: this rank's
    data loader state ({"world_size", "num_workers", "loader"}), saved beside its RNG state. A failed write (disk
    full, read-only) removes the temp directory, keeps every complete checkpoint and raises OutputError."""
    root = Path(out_dir) / CHECKPOINT_DIR
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        if data_position is not None:
            torch.save(data_position, tmp / data_position_file(accelerator.process_index))
        accelerator.wait_for_everyone()
    except Exception as err:  # OSError, torch's RuntimeError, safetensors' own error type
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write checkpoint {final.name} in {root}: {describe_write_failure(root, err)}; "
                          f"complete checkpoints kept: {[p.name for p in list_checkpoints(out_dir)] or 'none'}"
                          ) from err
    fault_point("checkpoint_written", step)
    if accelerator.is_main_process:
        make_readable(tmp)  # accelerate's save_state writes model.safetensors for the owner alone
        stale = root / f".old_{final.name}"
        if final.exists():  # re-saving a step (e.g. after a stop): swap, so a complete copy always exists
            final.rename(stale)
        tmp.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
        for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
            trash = root / f".old_{old.name}"  # out of the readers' view first: a kill mid-delete leaves no half
            shutil.rmtree(trash, ignore_errors=True)  # an earlier deletion's leftover
            try:
                old.rename(trash)
            except OSError as err:  # e.g. leftovers a network filesystem still holds: keep it, say so
                log.warning("could not remove the old checkpoint %s (%s); it stays", old, err)
                continue
            fault_point("checkpoint_rotating", step)
            shutil.rmtree(trash, ignore_errors=True)
    accelerator.wait_for_everyone()
    fault_point("checkpoint_saved", step)
    return final


def _first_line(err: BaseException) -> str:
    """The first sentence of an error message (library messages run on for lines)."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = text.splitlines()[0]
    return line.split(". ")[0][:200]


def _other_checkpoints(path: Path) -> str:
    others = [p for p in list_checkpoints(path.parent.parent) if p.resolve() != path.resolve()]
    if not others:
        return "no other checkpoint of this run exists"
    return f"an earlier checkpoint of this run may still be good: trainer.resume={others[-1]}"
