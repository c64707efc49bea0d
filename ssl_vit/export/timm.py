"""Import a timm VisionTransformer as an ssl_vit encoder (same parameter names, so the weights load as they are)."""

from __future__ import annotations

from torch import nn

from ssl_vit.vit import VisionTransformer


def from_timm(model: nn.Module) -> VisionTransformer:
    """Rebuild a timm `VisionTransformer` (standard or 22B-style parallel blocks) as ours, weights included."""
    from timm.models.vision_transformer import Block, ParallelScalingBlock
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    if not isinstance(model, TimmViT):
        raise ValueError(f"only timm VisionTransformer models can be imported, not {type(model).__name__}")
    block = model.blocks[0]
    parallel = isinstance(block, ParallelScalingBlock)
    if not parallel and not isinstance(block, Block):
        raise ValueError(f"unsupported timm block {type(block).__name__}; supported: Block, ParallelScalingBlock")
    if model.global_pool not in ("token", "avg"):
        raise ValueError(f"unsupported timm global_pool {model.global_pool!r}; supported: 'token', 'avg'")
    attn = block if parallel else block.attn
    norm = block.in_norm if parallel else block.norm1
    kwargs = dict(
        img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size,
        in_chans=model.patch_embed.proj.in_channels, num_classes=getattr(model, "num_classes", 0),
        embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=attn.num_heads,
        mlp_dim=(block.in_split[0] if parallel else block.mlp.fc1.out_features),
        class_token=model.cls_token is not None, global_pool=model.global_pool, num_registers=model.num_reg_tokens,
        no_embed_class=model.no_embed_class,
        qkv_bias=(block.in_proj.bias is not None) if parallel else (block.attn.qkv.bias is not None),
        qk_norm=not isinstance(attn.q_norm, nn.Identity), norm_bias=norm.bias is not None, norm_eps=norm.eps,
        pre_norm=not isinstance(model.norm_pre, nn.Identity), parallel_block=parallel,
        # Presence only: the loaded weights set the layer-scale values.
        layer_scale=None if isinstance(block.ls if parallel else block.ls1, nn.Identity) else 1.0,
    )
    ours = VisionTransformer(**kwargs)
    ours.load_state_dict(model.state_dict(), strict=True)
    return ours
