"""One sharded checkpoint as whole files, on CPU, in one process: DeepSpeed ZeRO-1/2/3 through DeepSpeed's own
`zero_to_fp32` (the fp32 master weights, buffers and frozen parameters, gathered from every rank's shard), FSDP2's
`torch.distributed.checkpoint` directories through DCP's `dcp_to_torch_save`, and a DDP / single-process checkpoint
as it is. The objective's `artifacts` split the full state into the run's two files:

    encoder.safetensors   the encoder (load_encoder, evaluate, export), as the run writes it
    heads.safetensors     the heads, teacher heads and centres (ssl_vit.objectives.load_trained)
    training_state.pt     {"model": the full state dict, "optimizer": the optimizer's state (FSDP2, DDP: whole;
                          DeepSpeed: None, its zero_to_fp32 recovers weights, not Adam's moments), "train_state":
                          step and counters, "world_size": the processes that wrote it, "format"}

The objective's structure comes from the run the checkpoint belongs to (its heads.safetensors records the
objective and its config): scripts/consolidate.py rebuilds it and calls `write_consolidated`.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ssl_vit.artifacts import save_encoder_state, save_heads
from ssl_vit.extras import require
from ssl_vit.run_dirs import ENCODER_FILE, HEADS_FILE, resolve_run
from ssl_vit.train.checkpoint import (
    DEEPSPEED_DIR,
    FSDP_MODEL_DIR,
    MODEL_FILE,
    TRAIN_STATE_FILE,
    checkpoint_format,
    list_checkpoints,
    written_by,
)
from ssl_vit.train.checkpoint_files import check_pickled_files
from ssl_vit.untrusted import load_tensors

FSDP_OPTIMIZER_DIR = "optimizer_0"
TRAINING_STATE_FILE = "training_state.pt"
TRUST_HINT = "consolidate with --trust-pickle"


def find_checkpoint(spec: str) -> Path:
    """A checkpoint directory, or a run (or output group) directory: its newest checkpoint."""
    path = Path(resolve_run(spec)).expanduser()
    found = list_checkpoints(path)
    return found[-1] if found else path


def load_plain(file: str | Path, trust_pickle: bool = False):
    """torch.load of a file that should hold only tensors and plain containers (weights_only); one that holds other
    Python objects is refused in one line (UntrustedFile), since unpickling them runs their code, unless the user
    trusts it."""
    return load_tensors(file, TRUST_HINT, trust_pickle)


def full_state(path: Path, trust_pickle: bool = False) -> tuple[dict, dict | None]:
    """(the objective's full fp32 state dict, the whole optimizer state or None) of a checkpoint directory;
    `trust_pickle` lets files with arbitrary pickled objects load (see `load_plain`)."""
    kind = checkpoint_format(path)
    if kind is None:
        raise ValueError(f"{path} is not a checkpoint of this project (no {DEEPSPEED_DIR}/, {FSDP_MODEL_DIR}/ or "
                         f"{MODEL_FILE}); a checkpoint is a directory like <run>/checkpoints/step_00000100")
    if kind == "deepspeed":
        require("deepspeed", f"{path} (a DeepSpeed ZeRO checkpoint)")
    if not trust_pickle:  # DeepSpeed's zero_to_fp32 and DCP's conversion unpickle in full: checked first
        check_pickled_files(path, TRUST_HINT, deepspeed=kind == "deepspeed")
    if kind == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # heavy: DeepSpeed only

        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its per-shard progress lines
                return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_DIR)), None
        except (ValueError, KeyError, RuntimeError) as err:  # e.g. ZeRO-1 in bf16: DeepSpeed's BF16_Optimizer
            raise ValueError(f"{path}: DeepSpeed's zero_to_fp32 cannot read this checkpoint ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})") from err
    if kind == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # only for FSDP2 checkpoints

        with tempfile.TemporaryDirectory() as tmp:
            loaded = {}
            for name, directory in (("model", FSDP_MODEL_DIR), ("optimizer", FSDP_OPTIMIZER_DIR)):
                if (path / directory / ".metadata").is_file():
                    dcp_to_torch_save(str(path / directory), f"{tmp}/{name}.pt")
                    loaded[name] = load_plain(f"{tmp}/{name}.pt", trust_pickle)[name]
        return loaded["model"], loaded.get("optimizer")
    optimizer = path / "optimizer.bin"
    return load_file(str(path / MODEL_FILE)), (load_plain(optimizer, trust_pickle) if optimizer.is_file() else None)


def write_consolidated(objective, state: dict, optimizer: dict | None, checkpoint: Path, out: str | Path,
                       preprocess=None, trust_pickle: bool = False) -> dict[str, Path]:
    """Write encoder.safetensors, heads.safetensors and training_state.pt of `checkpoint` (whose full `state` and
    `optimizer` `full_state` read) into `out`, split by the objective the run trained (structure only needed)."""
    ours = objective.state_dict()
    missing = [name for name in ours if name not in state]
    if missing:
        raise ValueError(f"{checkpoint} does not hold this run's model: {missing[:3]} missing")
    state = {name: state[name].to(ours[name].dtype) for name in ours}  # the run's own tensors, in its dtypes
    artifacts = objective.artifacts(state)
    train_state = load_plain(checkpoint / TRAIN_STATE_FILE, trust_pickle)  # accelerate's save of TrainState
    step = train_state.get("step")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for member, (config, files) in objective.member_artifacts(state).items():  # distill's further students
        (out / member).mkdir(parents=True, exist_ok=True)
        written[f"{member}/encoder"] = save_encoder_state(files.encoder, config, out / member / ENCODER_FILE,
                                                          preprocess, step=step, **files.metadata)
        written[f"{member}/heads"] = save_heads(files.heads, out / member / HEADS_FILE, step=step, **files.metadata)
    written |= {
        "encoder": save_encoder_state(artifacts.encoder, objective.encoder.config, out / ENCODER_FILE, preprocess,
                                      step=step, **artifacts.metadata),
        "heads": save_heads(artifacts.heads, out / HEADS_FILE, step=step, **artifacts.metadata),
        "training_state": out / TRAINING_STATE_FILE,
    }
    torch.save({"format": checkpoint_format(checkpoint), "model": state, "optimizer": optimizer,
                "train_state": train_state, "world_size": written_by(checkpoint), "source": str(checkpoint)},
               written["training_state"])
    return written


__all__ = ["find_checkpoint", "full_state", "load_plain", "write_consolidated"]
