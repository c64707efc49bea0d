"""The encoder as one safetensors file, with the constructor arguments in its metadata, so it rebuilds alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ssl_vit.preprocess import Preprocess
from ssl_vit.vit import VisionTransformer

FORMAT = "ssl_vit.encoder.v1"


def save_encoder(encoder: VisionTransformer, path: str | Path, preprocess: Preprocess | None = None,
                 **metadata) -> Path:
    """Write atomically (temp file + rename): a reader never sees a half-written file. `preprocess` (image size,
    normalisation, resize rule) becomes the evaluation default for this encoder."""
    return save_encoder_state(encoder.state_dict(), encoder.config, path, preprocess, **metadata)


def save_encoder_state(state: dict, config: dict, path: str | Path, preprocess: Preprocess | None = None,
                       **metadata) -> Path:
    """`save_encoder` from an encoder's state dict and constructor config (e.g. gathered from a sharded model)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    meta = {"format": FORMAT, "model": json.dumps(config), **{k: str(v) for k, v in metadata.items()}}
    if preprocess is not None:
        meta["preprocess"] = preprocess.to_json()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
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
    model = VisionTransformer(**json.loads(meta["model"]))
    model.load_state_dict(load_file(str(path), device=device))
    return model.to(device)
