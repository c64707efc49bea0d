"""What a checkpoint directory may hold, checked before accelerate, DeepSpeed or torch.distributed.checkpoint read it.

Those libraries unpickle some of a checkpoint's files in full: accelerate its registered objects
(`custom_checkpoint_*.pkl`, weights_only=False), DeepSpeed every shard under `pytorch_model/`
(`torch.load(weights_only=False)` in its checkpoint engine and in zero_to_fp32), DCP its `.metadata` (`pickle.load`)
and the byte items of its `.distcp` files (`torch.load(weights_only=False)`). A crafted checkpoint would run its
code on resume or consolidation. So every file of the directory is read here first, as weights only, with the few
classes each library writes allowed (their construction runs nothing of the file's); a file that passes holds
nothing else for the full unpickler to call. RNG states are read as accelerate reads them and their content checked:
accelerate skips a damaged one with an info-level log, which would make a resume silently inexact.
"""

from __future__ import annotations

import importlib
import io
import os
import random
from pathlib import Path

import numpy as np
import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from torch.distributed.checkpoint import metadata as dcp_metadata

from ssl_vit.untrusted import UntrustedFile, describe_error, dtype_globals, load_tensors, restricted_unpickle

# read by no unpickler: text, the run's safetensors (a JSON header and raw bytes), DCP's data files (their items are
# located through .metadata and checked one by one), DeepSpeed's helper scripts
_NOT_PICKLES = (".safetensors", ".json", ".yaml", ".yml", ".txt", ".md", ".log", ".py", ".distcp")
_TEXT_NAMES = ("latest",)  # DeepSpeed's tag file
RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")  # what accelerate restores on every device
# DeepSpeed's optimizer shards hold its loss scaler, the ZeRO stage enum and fragment addresses (measured: ZeRO-1/2/3
# in fp32 and bf16)
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")
# DCP's .metadata: its dataclasses and enums, the file paths, shapes, dtypes and layouts of the tensors
DCP_GLOBALS = frozenset({
    *(f"{dcp_metadata.__name__}.{name}" for name, value in vars(dcp_metadata).items()
      if isinstance(value, type) and value.__module__ == dcp_metadata.__name__),
    "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.serialization._get_layout", "torch.Size",
    "pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib.WindowsPath", "pathlib.PureWindowsPath",
    "collections.OrderedDict", *dtype_globals()})


def _resolve(names) -> list:
    found = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # another DeepSpeed release: what it lacks cannot be in its files
            continue
    return found


def pickled_files(path: Path, skip=()) -> list[Path]:
    """The files of checkpoint `path` that a library unpickles (every file but text, safetensors and DCP data),
    through symbolic links too (a library follows a linked directory; each real one is walked once)."""
    found, walked = [], set()
    for directory, subdirectories, files in os.walk(path, followlinks=True):
        real = os.path.realpath(directory)
        if real in walked:  # a link back up the tree
            subdirectories[:] = []
            continue
        walked.add(real)
        found += [Path(directory, name) for name in files if name not in skip and Path(name).suffix not in
                  _NOT_PICKLES and name not in _TEXT_NAMES and os.path.isfile(os.path.join(directory, name))]
    return sorted(found)


class UnreadableFile(ValueError):
    """A checkpoint file that is damaged or not what its name says (one line naming it and its reader's error)."""


def check_pickled_files(path: Path, trust_hint: str, skip=(), deepspeed: bool = False) -> None:
    """Read every pickled file of checkpoint `path` (but `skip`) as weights only, DCP's `.metadata` and the byte
    items it lists included; UntrustedFile naming the first that holds more and `trust_hint`, UnreadableFile naming
    a damaged one. `deepspeed`: a DeepSpeed checkpoint (its classes allowed)."""
    files = pickled_files(path, skip)
    allowed = [*TORCH_SAFE_GLOBALS, *(_resolve(DEEPSPEED_GLOBALS) if deepspeed else [])]
    for file in files:
        try:
            _check_file(file, trust_hint, allowed)
        except UntrustedFile:
            raise
        except Exception as err:  # torch's, zipfile's or pickle's own errors for a damaged file
            raise UnreadableFile(f"{file} is unreadable ({describe_error(err)})") from err


def _check_file(file: Path, trust_hint: str, allowed: list) -> None:
    if file.name.endswith(".metadata"):
        _check_dcp(file, trust_hint, allowed)
        return
    try:
        load_tensors(file, trust_hint, allowed=allowed, mmap=True)  # the storages stay on disk
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        load_tensors(file, trust_hint, allowed=allowed)  # the legacy (non-zip) format has no mmap


def _check_dcp(file: Path, trust_hint: str, allowed: list) -> None:
    """DCP's metadata, then each byte item it lists (the objects beside the tensors: optimizer settings, ...)."""
    metadata = restricted_unpickle(file, DCP_GLOBALS, trust_hint)
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"{file} is not torch.distributed.checkpoint metadata (it holds a {type(metadata).__name__})")
    items: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), dcp_metadata.BytesStorageMetadata):
            items.setdefault(str(info.relative_path), []).append((index.fqn, info))
    for relative, entries in items.items():
        with open(file.parent / relative, "rb") as data:
            for fqn, info in entries:
                where = f"{file.parent / relative} (item {fqn})"
                if getattr(info, "transform_descriptors", None):  # compressed or otherwise transformed
                    raise ValueError(f"{where} is stored through transforms {list(info.transform_descriptors)}, "
                                     "which this check does not read")
                data.seek(info.offset)
                load_tensors(io.BytesIO(data.read(info.length)), trust_hint, allowed=allowed, name=where)


def rng_state_problem(file: Path) -> str | None:
    """Why accelerate could not restore the RNG state in `file` ("missing", "unreadable (...)", "lacks ...",
    "damaged (...)"), or None when it can: read as accelerate reads it (weights only, its globals), and each state
    set on a fresh generator."""
    if not file.is_file():
        return "missing"
    try:
        states = load_tensors(file, "", allowed=TORCH_SAFE_GLOBALS)
    except Exception as err:  # truncated, foreign or crafted: accelerate's load fails the same way
        return f"unreadable ({describe_error(err)})"
    keys = [*RNG_KEYS, *(["torch_cuda_manual_seed"] if torch.cuda.is_available() else [])]
    if not isinstance(states, dict) or any(key not in states for key in keys):
        return f"lacks {[k for k in keys if not isinstance(states, dict) or k not in states]}"
    try:
        random.Random().setstate(states["random_state"])
        np.random.RandomState().set_state(states["numpy_random_seed"])
        torch.Generator().set_state(states["torch_manual_seed"])
    except Exception as err:  # a state of the wrong shape or type
        return f"damaged ({describe_error(err)})"
    return None
