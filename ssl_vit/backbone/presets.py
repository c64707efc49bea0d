"""The presets: named partial `ViTConfig`s (plain keyword dicts), data rather than subclasses."""

from __future__ import annotations

# Presets are plain keyword arguments; anything not given takes the VisionTransformer default.
# What Perception Encoder's models share (see vit_b16_pe below)
_PE = dict(global_pool="map", pool_heads=8, pool_include_prefix=True, pos_embed="learned_rope", rope_kind="axial",
           rope_theta=10000.0, pre_norm=True, norm_eps=1e-5)
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
    # ----- The encoder families of 2024-26, each as timm 1.0.31 defines it (timm name in the comment) -----
    # DINOv2 ViT-g/14 (vit_giant_patch14_dinov2; DINOv2's vit_giant2): packed SwiGLU of (int(1536 x 4 x 2/3) + 7)
    # // 8 x 8 = 4096, layer scale 1e-5, 518 px, position tables resampled as DINOv2 does (bicubic, no antialias).
    "vit_g14_dinov2": dict(patch_size=14, img_size=518, embed_dim=1536, depth=40, num_heads=24, mlp_dim=4096,
                           mlp_kind="swiglu_packed", act_layer="silu", layer_scale=1e-5, pos_embed_antialias=False),
    # DINOv3 ViT-H+/16 and ViT-7B/16 (vit_huge_plus_patch16_dinov3, vit_7b_patch16_dinov3): DINOv3's RoPE (periods
    # 100 ** (2i / (D/2))), 4 registers, SwiGLU, no QKV bias, LayerNorm eps 1e-5, layer scale 1e-5.
    "vit_hplus16_dinov3": dict(patch_size=16, embed_dim=1280, depth=32, num_heads=20, mlp_dim=5120,
                               mlp_kind="swiglu", act_layer="silu", pos_embed="rope", rope_theta=100.0,
                               num_registers=4, qkv_bias=False, norm_eps=1e-5, layer_scale=1e-5),
    "vit_7b16_dinov3": dict(patch_size=16, embed_dim=4096, depth=40, num_heads=32, mlp_dim=8192,
                            mlp_kind="swiglu", act_layer="silu", pos_embed="rope", rope_theta=100.0,
                            num_registers=4, qkv_bias=False, norm_eps=1e-5, layer_scale=1e-5),
    # SigLIP So400m/14 at 224 (vit_so400m_patch14_siglip_224; transformers' SiglipVisionConfig of
    # google/siglip-so400m-patch14-224: 4304 wide MLP, gelu_pytorch_tanh) and SigLIP 2 So400m/16 at 256
    # (vit_so400m_patch16_siglip_256, v2 weights): no class token, the MAP head. timm's patch14 entry builds exact
    # GELU; SigLIP's own weights use the tanh form, which this preset keeps (big_vision, transformers).
    "vit_so400m14_siglip": dict(patch_size=14, embed_dim=1152, depth=27, num_heads=16, mlp_dim=4304,
                                class_token=False, global_pool="map", act_layer="gelu_tanh"),
    "vit_so400m16_siglip2": dict(patch_size=16, img_size=256, embed_dim=1152, depth=27, num_heads=16, mlp_dim=4304,
                                 class_token=False, global_pool="map", act_layer="gelu_tanh"),
    # AIMv2 L/14 and H/14 (aimv2_large_patch14_224, aimv2_huge_patch14_224; apple/ml-aim): SwiGLU, RMSNorm eps 1e-5
    # (also on the patch embeddings), no attention / MLP biases, no class token, the final norm on every token then
    # the average.
    "vit_l14_aimv2": dict(patch_size=14, embed_dim=1024, depth=24, num_heads=8, mlp_dim=2816, mlp_kind="swiglu",
                          act_layer="silu", norm_layer="rmsnorm", norm_eps=1e-5, patch_norm=True, qkv_bias=False,
                          proj_bias=False, class_token=False, global_pool="avg", fc_norm=False),
    "vit_h14_aimv2": dict(patch_size=14, embed_dim=1536, depth=24, num_heads=12, mlp_dim=4096, mlp_kind="swiglu",
                          act_layer="silu", norm_layer="rmsnorm", norm_eps=1e-5, patch_norm=True, qkv_bias=False,
                          proj_bias=False, class_token=False, global_pool="avg", fc_norm=False),
    # Perception Encoder core B/16, L/14, G/14 (vit_pe_core_base_patch16_224, vit_pe_core_large_patch14_336,
    # vit_pe_core_gigantic_patch14_448; facebookresearch/perception_models): a learned position table and RoPE-ViT's
    # axial RoPE together (theta 10000, indices offset by 1 except G's, rescaled onto the pre-training grid), a
    # LayerNorm before the blocks (no patch bias), eps 1e-5, and an 8-head attention pool of MLP ratio 4 over the
    # class token and the patches. transformers has no PE vision model (PerceptionLM loads it through timm).
    "vit_b16_pe": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, **_PE, rope_offset=1.0,
                       rope_ref_grid=(14, 14)),
    "vit_l14_pe": dict(patch_size=14, img_size=336, embed_dim=1024, depth=24, num_heads=16, **_PE, rope_offset=1.0,
                       rope_ref_grid=(24, 24)),
    "vit_g14_pe": dict(patch_size=14, img_size=448, embed_dim=1536, depth=50, num_heads=16, mlp_dim=8960,
                       pool_mlp_dim=6144, class_token=False, **_PE, rope_ref_grid=(32, 32)),
    # The families at test size: AIMv2's block and pooling, SigLIP's MAP head, DINOv2-g's packed SwiGLU (88: DINOv2's
    # width rule at ratio 4, as transformers' Dinov2Config rebuilds it).
    "vit_test_aimv2": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=88,
                           mlp_kind="swiglu", act_layer="silu", norm_layer="rmsnorm", norm_eps=1e-5, patch_norm=True,
                           qkv_bias=False, proj_bias=False, class_token=False, global_pool="avg", fc_norm=False),
    "vit_test_siglip": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=96,
                            class_token=False, global_pool="map", act_layer="gelu_tanh"),
    "vit_test_pe": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, **_PE, rope_offset=1.0,
                        rope_ref_grid=(2, 2)),
    "vit_test_dinov2": dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=88,
                            mlp_kind="swiglu_packed", act_layer="silu", layer_scale=1e-5),
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

