"""ssl-vit: pre-train Vision Transformers with supervised, self-supervised and multimodal objectives.

`ssl_vit.VisionEncoder` (ssl_vit/encoder.py) is the entry point for using a trained encoder elsewhere."""

import os

import torch

# DeepSpeed (imported by accelerate wherever it is installed, e.g. in unwrap_model) warns "Setting accelerator to
# CPU" on every import without a GPU; naming the accelerator it would pick anyway keeps CPU runs quiet.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"

from ssl_vit.encoder import VisionEncoder, mlp_projector  # noqa: E402

__all__ = ["VisionEncoder", "mlp_projector"]
