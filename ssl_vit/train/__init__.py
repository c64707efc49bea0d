"""The training engine. Attributes load lazily, so that objectives can import the engine's helper modules
(`ssl_vit.train.ema`, `ssl_vit.train.optim`) without importing the loop, which imports the objectives."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "OutputError": "ssl_vit.train.outputs",
    "TrainState": "ssl_vit.train.loop",
    "TrainingDiverged": "ssl_vit.train.guard",
    "build_components": "ssl_vit.train.loop",
    "pretrain": "ssl_vit.train.loop",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ssl_vit.train' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
