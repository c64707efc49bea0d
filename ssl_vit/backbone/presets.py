"""The presets: named partial `ViTConfig`s (plain keyword dicts), data rather than subclasses."""

from __future__ import annotations

# Presets are plain keyword arguments; anything not given takes the VisionTransformer default.
_SHAPES: dict[str, dict] = {
    # Tiny sizes for tests and CPU smoke runs (4x4 patches on small images).
    "vit_test": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2),
    "vit_test_22b": dict(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2,
        qkv_bias=False, norm_bias=False, qk_norm=True, parallel_block=True, class_token=False, global_pool="avg",
    ),
    "vit_tiny": dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4),
    # A hybrid for tests: a one-stage ResNet-v2 (stride 4) and 2x2 patches of its map, 4x4 tokens at 32 px.
    "vit_tiny_r": dict(img_size=32, patch_size=2, embed_dim=32, depth=2, num_heads=2, stem="resnet",
                       stem_layers=[1], stem_channels=[128], stem_width=32),
    # The paper's table (Dosovitskiy et al. 2021, Table 1) plus ViT-g and ViT-22B.
    "vit_ti16": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_s16": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_b16": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_l16": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
    "vit_h14": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16),
    "vit_g14": dict(patch_size=14, embed_dim=1408, depth=40, num_heads=16, mlp_dim=6144),
    # The paper's hybrids (section 3.1): ResNet-50 with stage 4's blocks moved into stage 3 (stride 16), 1x1 patches;
    # timm's vit_base_r50_s16_224 (timm has no L/16 hybrid: its vit_large_r50_s32 keeps ResNet-50's four stages).
    "vit_b16_r50": dict(patch_size=1, embed_dim=768, depth=12, num_heads=12, stem="resnet", stem_layers=[3, 4, 9]),
    "vit_l16_r50": dict(patch_size=1, embed_dim=1024, depth=24, num_heads=16, stem="resnet", stem_layers=[3, 4, 9]),
    # Dehghani et al. 2023: parallel attention + MLP from one LayerNorm, QK-norm, no QKV / LayerNorm biases.
    "vit_22b": dict(
        patch_size=14, embed_dim=6144, depth=48, num_heads=48, mlp_dim=24576,
        qkv_bias=False, norm_bias=False, qk_norm=True, parallel_block=True, class_token=False, global_pool="avg",
    ),
}
# Every preset initialises as big_vision (`jax`: the paper's code; model.weight_init overrides). Measured with
# benchmarks/init_schemes.py (vit_tiny, supervised, synthetic shapes, 300 steps, 3 seeds; mean [min, max]; the
# supervised head then trunc-normal(0.02) in every scheme, before objective.head_init):
#   init    train acc %           k-NN acc %            train loss
#   timm    20.2 [16.8, 22.5]     21.3 [12.8, 27.9]     1.95 [1.82, 2.06]   (trunc-normal 0.02: starves width 64)
#   jax     35.8 [34.3, 38.3]     35.5 [32.4, 40.1]     1.53 [1.48, 1.55]
#   torch   26.4 [20.9, 34.2]     29.2 [25.6, 36.0]     1.78 [1.57, 1.93]
# so jax is the default of the tiny presets too. VisionTransformer(...) built directly keeps timm's init.
PRESETS: dict[str, dict] = {name: {"weight_init": "jax", **shape} for name, shape in _SHAPES.items()}

