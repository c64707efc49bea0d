"""ssl-vit: pre-train Vision Transformers with supervised, self-supervised and multimodal objectives.

`ssl_vit.VisionEncoder` (ssl_vit/encoder.py) is the entry point for using a trained encoder elsewhere."""


def __getattr__(name):  # lazily: `import ssl_vit.config` should not import torch
    if name in ("VisionEncoder", "mlp_projector"):
        from ssl_vit import encoder

        return getattr(encoder, name)
    raise AttributeError(f"module 'ssl_vit' has no attribute {name!r}")
