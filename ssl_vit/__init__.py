"""ssl-vit: pre-train Vision Transformers with supervised, self-supervised and multimodal objectives.

The Python API (ssl_vit/api.py), for notebooks and other frameworks:

    import ssl_vit
    run = ssl_vit.pretrain("objective=masked_patch", "model=vit_test", "trainer.max_steps=3", out="runs/mp")
    results = ssl_vit.evaluate(run, "data=digits", "eval=knn")
    model = ssl_vit.create_model("vit_s16", num_registers=4)      # a VisionTransformer, as timm.create_model
    encoder = ssl_vit.load_encoder("timm:vit_small_patch16_224")  # a VisionEncoder, from any import form
    ssl_vit.export(run, "hf", "exported/hf")                      # as `ssl-vit export run --to hf --out ...`

`ssl_vit.VisionEncoder` (ssl_vit/encoder.py) is the entry point for using a trained encoder elsewhere. Names are
imported on first use: `import ssl_vit` itself loads neither torch nor the data stack.
"""

from __future__ import annotations

import importlib

from ssl_vit._version import __version__

_LAZY = {"VisionEncoder": "ssl_vit.encoder", "mlp_projector": "ssl_vit.encoder", "pretrain": "ssl_vit.api",
         "evaluate": "ssl_vit.api", "create_model": "ssl_vit.api", "load_encoder": "ssl_vit.api",
         "export": "ssl_vit.interop.export"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'ssl_vit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["VisionEncoder", "__version__", "create_model", "evaluate", "export", "load_encoder", "mlp_projector",
           "pretrain"]
