"""ssl-vit: pre-train Vision Transformers with supervised, self-supervised and multimodal objectives.

`ssl_vit.VisionEncoder` (ssl_vit/encoder.py) is the entry point for using a trained encoder elsewhere."""

from ssl_vit.encoder import VisionEncoder, mlp_projector

__all__ = ["VisionEncoder", "mlp_projector"]
