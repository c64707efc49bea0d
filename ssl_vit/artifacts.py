"""The files a run leaves for others to use, and how to read them back:

- `encoder.safetensors`: the encoder alone, with its constructor arguments (`model`), its preprocessing and the
  step in the metadata, so that it rebuilds without the run (`load_encoder`);
- `heads.safetensors`: the objective's heads by their names in the objective, with the objective's name and config
  in the metadata (`ssl_vit.objectives.load_trained` rebuilds the whole objective from the two files).

Both are written atomically (temp file + rename): a reader never sees a half-written file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.files import save_safetensors
from ssl_vit.preprocess import Preprocess
from ssl_vit.run_dirs import ENCODER_FILE, HEADS_FILE, resolve_run

FORMAT = "ssl_vit.encoder.v1"


def save_encoder(encoder: VisionTransformer, path: str | Path, preprocess: Preprocess | None = None,
                 **metadata) -> Path:
    """`preprocess` (image size, normalisation, resize rule) becomes the evaluation default for this encoder."""
    return save_encoder_state(encoder.state_dict(), encoder.config, path, preprocess, **metadata)


def save_encoder_state(state: dict, config: ViTConfig, path: str | Path, preprocess: Preprocess | None = None,
                       **metadata) -> Path:
    """`save_encoder` from an encoder's state dict and config (e.g. gathered from a sharded model)."""
    meta = {"format": FORMAT, "model": json.dumps(config.to_dict()), **metadata}
    if preprocess is not None:
        meta["preprocess"] = preprocess.to_json()
    return _write(state, path, meta)


def save_heads(heads: dict, path: str | Path, **metadata) -> Path:
    """heads.safetensors: an objective's heads by their state-dict names, with `metadata` (objective, config, step)."""
    return _write(heads, path, metadata)


def _write(tensors: dict, path: str | Path, metadata: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
                     metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)
    return path


def read_metadata(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def read_preprocess(path: str | Path) -> Preprocess | None:
    """The preprocessing recorded with an encoder file (None for files written before it was recorded)."""
    recorded = read_metadata(path).get("preprocess")
    return Preprocess.from_json(recorded) if recorded else None


def load_encoder(path: str | Path, device: str = "cpu") -> VisionTransformer:
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not an ssl_vit encoder file (metadata format={meta.get('format')!r})")
    model = VisionTransformer(ViTConfig.from_dict(json.loads(meta["model"]), where=str(path)))
    model.load_state_dict(load_file(str(path), device=device))
    return model.to(device)


def load_heads(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the heads' tensors, the metadata) of a heads.safetensors."""
    return load_file(str(path)), read_metadata(path)


def run_files(spec: str | Path) -> tuple[Path, Path]:
    """(encoder.safetensors, heads.safetensors) of a run directory, or of the directory holding the file `spec`."""
    path = Path(resolve_run(spec)).expanduser()  # an output group: its newest run
    run = path.parent if path.is_file() else path
    return run / ENCODER_FILE, run / HEADS_FILE


def run_directory(spec: str | Path) -> Path | None:
    """The run directory behind `spec` (a run, an output group, or a run's encoder file), or None for anything else
    (an import such as timm:..., or a bare encoder file)."""
    encoder_file, _ = run_files(spec)
    run = encoder_file.parent
    return run if encoder_file.is_file() and (run / "config.yaml").is_file() else None


def file_fingerprint(path: str | Path) -> dict:
    """Identify a checkpoint file by path, size and modification time (cheap; changes when it is rewritten): the
    identity of imported weights in the feature cache."""
    stat = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
