"""Encoders from every source a run can start from or evaluate: one spec string, one loader.

    outputs/<run> or .../encoder.safetensors   ours (the recorded preprocessing)
    timm:<model name>                          timm's architecture, random weights (no model hub here)
    timm:<model name>:<file>                   + weights from a timm checkpoint (.safetensors / .pth / .bin, or
                                               the original ViT AugReg .npz) through timm's own loader
    timm:<dir>                                 a timm model directory (config.json + weights; our --to timm)
    hf:<dir>                                   transformers ViTModel / Dinov2Model / CLIPVisionModel /
                                               SiglipVisionModel / DINOv3ViTModel
    open_clip:<dir>                            an open_clip model directory (open_clip_config.json; our --to open_clip)
    open_clip:<model name>:<file>              an open_clip checkpoint file for a named open_clip architecture
    dino:<file>, dinov2:<file>                 a training checkpoint of the reference DINO / DINOv2 code: the
                                               teacher, and with model.init_heads the student, heads and centres
                                               (ssl_vit.interop.dino; the architecture is model='s)

Each import keeps its library's position-embedding resampling for other image sizes (recorded in the encoder's
config, used by `set_img_size` and on the fly): timm and open_clip resample bicubic with antialiasing, transformers
and DINOv2 bicubic without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ssl_vit.artifacts import (
    ENCODER_FILE,
    file_fingerprint,
    load_encoder,
    load_heads,
    read_metadata,
    read_preprocess,
    run_files,
)
from ssl_vit.backbone import VisionTransformer, ViTConfig
from ssl_vit.interop.dino import load_reference_checkpoint
from ssl_vit.interop.hf import load_hf_dir
from ssl_vit.interop.native import NativeEncoder
from ssl_vit.interop.open_clip import load_open_clip_spec
from ssl_vit.interop.timm import load_timm_spec
from ssl_vit.preprocess import Preprocess
from ssl_vit.run_dirs import resolve_run
from ssl_vit.untrusted import file_kind, refusing_pickles

SOURCES = ("<encoder file or run dir>", "timm:<name>[:<file>]", "timm:<dir>", "hf:<dir>", "open_clip:<dir>",
           "open_clip:<name>:<file>", "dino:<checkpoint.pth>", "dinov2:<checkpoint.pth>")
NATIVE_MODES = ("never", "fallback", "always")
REFERENCE_CHECKPOINTS = ("dino", "dinov2")  # training checkpoints of the reference code (ssl_vit.interop.dino)
LIBRARIES = {"timm": load_timm_spec, "hf": load_hf_dir, "open_clip": load_open_clip_spec}


@dataclass
class Pretrained:
    encoder: VisionTransformer | NativeEncoder  # NativeEncoder only where load_pretrained's `native` allows it
    preprocess: Preprocess | None  # the source's own preprocessing, when it records one
    identity: dict  # what makes the weights unique (for the feature cache)
    # The objective's weights beyond the encoder by its state-dict names, and the objective that trained them: read
    # when asked (load_pretrained's `heads`, for model.init_heads); None otherwise, or where the source has none.
    heads: tuple[dict[str, torch.Tensor], str] | None = None
    architecture_given: bool = False  # built to the run's model= config (a source that records no architecture)


def load_pretrained(spec: str, architecture: Callable[[], ViTConfig] | None = None, heads: bool = False,
                    native: str = "never") -> Pretrained:
    """The encoder a spec names (see the module docstring); ValueError / FileNotFoundError naming the problem.
    `architecture`: the encoder config for sources that record none (the reference DINO / DINOv2 checkpoints);
    `heads`: also read the weights beyond the encoder (None where the source has none). `native` (timm:, hf:,
    open_clip:): "never" (a ViT, converted; anything else is refused in one line), "fallback" (a ViT converted,
    anything else wrapped as its library runs it: ssl_vit.interop.native), "always" (wrapped, ViTs too)."""
    if native not in NATIVE_MODES:
        raise ValueError(f"native={native!r} is not one of {list(NATIVE_MODES)}")
    library, _, rest = spec.partition(":")
    if library in REFERENCE_CHECKPOINTS:
        if architecture is None:
            raise ValueError(f"{spec}: a {library} training checkpoint records no architecture; it starts a "
                             "pre-training run (model.init_from with the model= preset it was trained with)")
        encoder, preprocess, identity, rest_of_it = load_reference_checkpoint(library, rest, architecture(), heads)
        return Pretrained(encoder, preprocess, identity, rest_of_it, architecture_given=True)
    if library in LIBRARIES:
        with refusing_pickles(spec):
            return Pretrained(*LIBRARIES[library](rest, native))
    return _from_ours(spec, heads)


def _from_ours(spec: str, heads: bool = False) -> Pretrained:
    path = Path(resolve_run(spec)).expanduser()  # an output group: its newest run
    if path.is_dir():
        path = path / ENCODER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{spec!r} is not an encoder file or a run directory with {ENCODER_FILE}; "
                                f"valid forms: {list(SOURCES)}")
    kind = file_kind(path)
    if kind not in ("safetensors", "unknown", "empty"):  # another format, named; others: safetensors' own error
        raise ValueError(f"{spec!r} is {kind}, not an ssl_vit encoder file (safetensors); weights of another "
                         f"library load through its spec: timm:<model name>:{spec}, open_clip:<model name>:{spec}, "
                         f"dino:{spec} or dinov2:{spec} (valid forms: {list(SOURCES)})")
    try:
        encoder = load_encoder(path)
    except Exception as err:  # safetensors' own errors for truncated / foreign files, bad metadata
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(f"{spec!r} is not a readable ssl_vit encoder file ({first})") from err
    heads_path = run_files(path)[1]
    return Pretrained(encoder, read_preprocess(path), file_fingerprint(path),
                      _our_heads(heads_path, path) if heads and heads_path.is_file() else None)


def _our_heads(path: Path, encoder_path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """heads.safetensors, which must be of the encoder's step (a kill between the two writes leaves them apart)."""
    heads, meta = load_heads(path)
    steps = meta.get("step"), read_metadata(encoder_path).get("step")
    if steps[0] != steps[1]:
        raise ValueError(f"{path} is of step {steps[0]} and {encoder_path.name} of step {steps[1]} (a kill between "
                         f"the two writes?); resume that run (trainer.resume=auto) to write both again")
    return heads, meta.get("objective", "?")
