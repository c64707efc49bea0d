"""The backbone: one Vision Transformer, its parts one concept per file.

    config.py      ViTConfig (every setting, frozen; presets, the Hydra schema, interop and saved encoders use it)
    presets.py     named partial configs (ViT-Ti..22B, hybrids, test sizes)
    vit.py         VisionTransformer: embeddings -> blocks -> pool, as composable steps
    embeddings.py  patch embedding, position tables, input -> tokens + placement (dense and NaFlex alike)
    attention.py   self-attention (SDPA; windows, relative positions, DINOv3's key-bias mask)
    mlp.py         the feed-forward network and its activations
    norms.py       the normalisation layers
    blocks.py      the pre-norm and parallel blocks, activation checkpointing
    rope.py        2-D rotary position embeddings (DINOv3's, RoPE-ViT's axial and mixed)
    windows.py     ViTDet / SAM window partition and relative-position tables
    pyramid.py     ViTDet's simple feature pyramid
    stem.py        the hybrid ResNet-v2 stem
    init.py        weight-initialisation schemes that survive ZeRO-3's partitioned construction
"""

from ssl_vit.backbone.blocks import CHECKPOINTING, Block, ParallelBlock, TransformerBlock
from ssl_vit.backbone.config import ACTIVATIONS, GLOBAL_POOLS, POS_EMBED_INTERP_MODES, POS_EMBEDS, ViTConfig
from ssl_vit.backbone.embeddings import GridPlacement, PatchEmbed, resample_pos_embed, sincos_pos_embed_2d
from ssl_vit.backbone.presets import PRESETS
from ssl_vit.backbone.vit import (
    WINDOW_SETTINGS,
    VisionTransformer,
    build_vit,
    count_parameters,
    preset_config,
    with_windows,
)

__all__ = [
    "ACTIVATIONS", "CHECKPOINTING", "GLOBAL_POOLS", "POS_EMBEDS", "POS_EMBED_INTERP_MODES", "PRESETS",
    "WINDOW_SETTINGS", "Block", "GridPlacement", "ParallelBlock", "PatchEmbed", "TransformerBlock", "ViTConfig",
    "VisionTransformer", "build_vit", "count_parameters", "preset_config", "resample_pos_embed",
    "sincos_pos_embed_2d", "with_windows",
]
