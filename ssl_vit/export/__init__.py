from ssl_vit.export.safetensors import load_encoder, read_metadata, save_encoder

__all__ = ["load_encoder", "read_metadata", "save_encoder"]
