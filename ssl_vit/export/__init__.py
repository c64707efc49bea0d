from ssl_vit.export.safetensors import (
    load_encoder,
    read_metadata,
    read_preprocess,
    save_encoder,
    save_encoder_state,
)
from ssl_vit.export.timm import from_timm

__all__ = ["from_timm", "load_encoder", "read_metadata", "read_preprocess", "save_encoder", "save_encoder_state"]
