"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2021) and its later options.

One `VisionTransformer`, built from a `ViTConfig` (or its fields as keywords); variants are data in `PRESETS`.
Parameter names follow timm's `VisionTransformer` (and its `ParallelScalingBlock` for 22B-style parallel blocks), so
state dicts move between the two without renaming. The forward pass is a chain of small steps:

    tokens, placement = vit.embed_input(images)       # patches embedded (masked ones replaced), position
                                                      # embeddings added, a subset kept, the prefix tokens in front
                                                      # (ssl_vit.backbone.embeddings; dense or NaFlex batches)
    tokens = vit.run_blocks(tokens, placement)        # pre-norm, the L blocks (RoPE placed), final norm
    embedding = vit.pool(tokens)                      # class token or average of patch tokens (+ fc_norm)

`forward_features(images, mask=, mask_token=, keep=)` is the same in one call. The masked-token path, shared by
every masking objective: `mask` (B, N) bool replaces those patch embeddings by `mask_token` before the position
embeddings (iBOT, the ViT paper's masked patch prediction; a (B, N, D) `mask_token` gives each masked patch its own
replacement); `keep` (B, K) indices keeps only those patches after them (MAE's visible patches, I-JEPA's context).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ssl_vit.backbone.blocks import Block, ParallelBlock, block_windows, check_checkpointing
from ssl_vit.backbone.config import ViTConfig
from ssl_vit.backbone.embeddings import (
    GridPlacement,
    PatchEmbed,
    TokenEmbedding,
    resample_pos_embed,
    sincos_pos_embed_2d,
)
from ssl_vit.backbone.init import Linear, check_scheme, init_embeddings
from ssl_vit.backbone.mlp import make_activation
from ssl_vit.backbone.norms import norm_factory
from ssl_vit.backbone.pooling import AttentionPool, pool_tokens
from ssl_vit.backbone.presets import PRESETS
from ssl_vit.backbone.pyramid import ConvNorm
from ssl_vit.backbone.rope import build_rope
from ssl_vit.backbone.stem import HybridPatchEmbed, check_stem
from ssl_vit.geometry import pair
from ssl_vit.naflex import patch_valid
from ssl_vit.partition import full_numel


class VisionTransformer(TokenEmbedding, nn.Module):
    """ViT backbone. `num_classes=0` (the default) gives an encoder whose `forward` returns the pooled embedding.

    Built from a `ViTConfig`, or from its fields as keywords (`VisionTransformer(embed_dim=384, depth=12)`); the
    config is kept, frozen, as `self.config` (what a saved encoder records)."""

    def __init__(self, config: ViTConfig | None = None, **settings):
        super().__init__()
        if config is not None and settings:
            raise TypeError("VisionTransformer takes a ViTConfig or its fields as keywords, not both")
        config = config if config is not None else ViTConfig(**settings)
        self.config = config
        c = config
        check_scheme(c.weight_init)
        make_activation(c.act_layer)  # a bad name fails here, naming the choices
        check_stem(c.stem, c.stem_layers, c.stem_channels, c.stem_width)
        norm_layer = norm_factory(c)
        embed_dim, depth, num_heads = c.embed_dim, c.depth, c.num_heads

        self.embed_dim = self.num_features = embed_dim
        self.global_pool = c.global_pool
        self.num_prefix_tokens = c.num_prefix_tokens
        self.num_pos_prefix = 0 if c.no_embed_class or not c.has_pos_table else self.num_prefix_tokens
        self.pos_embed_kind = c.pos_embed

        if c.stem == "resnet":
            if c.patch_norm:
                raise ValueError("patch_norm=True with stem=resnet: the hybrid's patch embedding has no norm here")
            self.patch_embed = HybridPatchEmbed(c.img_size, c.patch_size, c.in_chans, embed_dim,
                                                bias=c.has_patch_bias, weight_init=c.weight_init,
                                                layers=c.stem_layers, channels=c.stem_channels, width=c.stem_width)
        else:
            self.patch_embed = PatchEmbed(c.img_size, c.patch_size, c.in_chans, embed_dim, bias=c.has_patch_bias,
                                          weight_init=c.weight_init, norm_layer=norm_layer if c.patch_norm else None)
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim)) if c.class_token else None
        # DeiT's distillation token (timm's VisionTransformerDistilled: right after the class token)
        self.dist_token = nn.Parameter(torch.empty(1, 1, embed_dim)) if c.dist_token else None
        self.reg_token = nn.Parameter(torch.empty(1, c.num_registers, embed_dim)) if c.num_registers else None
        self.pos_embed = (nn.Parameter(torch.empty(1, self.num_pos_prefix + self.patch_embed.num_patches, embed_dim),
                                       requires_grad=c.pos_embed != "sincos")
                          if c.has_pos_table else None)
        self.rope = (build_rope(c.rope_kind, embed_dim // num_heads, depth, num_heads, c.rope_theta,
                                c.rope_min_period, c.rope_max_period, c.rope_normalize, c.rope_shift, c.rope_jitter,
                                c.rope_rescale, offset=c.rope_offset, ref_grid=c.rope_ref_grid)
                     if c.has_rope else None)
        # DINOv3 holds the key bias at zero (with RoPE it would rotate with the key's position); RoPE-ViT and
        # Perception Encoder keep it
        mask_k_bias = c.has_rope and c.rope_kind == "dinov3"
        self.norm_pre = norm_layer(embed_dim) if c.pre_norm else nn.Identity()

        drop_rates = [c.drop_path * i / max(depth - 1, 1) for i in range(depth)]  # stochastic depth grows linearly
        windows = block_windows(depth, c.window_size, c.global_attn_indexes, c.rel_pos, c.pos_embed, c.parallel_block,
                                self.patch_embed.grid_size)
        self.windowed = bool(c.window_size or c.rel_pos)  # blocks that need every patch token on its grid

        def spatial(window: int) -> dict:  # a block's window and relative-position table size (ViTDet / SAM)
            if not self.windowed:
                return {}
            table = ((window, window) if window else self.patch_embed.grid_size) if c.rel_pos else None
            return {"window": window, "rel_pos_size": table}

        self.blocks = nn.Sequential(*[
            (ParallelBlock if c.parallel_block else Block)(
                embed_dim, num_heads, c.mlp_hidden, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, norm_layer=norm_layer,
                layer_scale=c.layer_scale, drop_path=rate, attn_drop=c.attn_drop, proj_drop=c.proj_drop,
                weight_init=c.weight_init, act_layer=c.act_layer, mask_k_bias=mask_k_bias,
                **({"mlp_kind": c.mlp_kind, "proj_bias": c.proj_bias} if not c.parallel_block else {}),
                **spatial(window))
            for rate, window in zip(drop_rates, windows, strict=True)
        ])
        # As in timm: average pooling normalises after pooling (fc_norm), token and attention pooling before (norm)
        self.norm = nn.Identity() if c.has_fc_norm else norm_layer(embed_dim)
        self.fc_norm = norm_layer(embed_dim) if c.has_fc_norm else nn.Identity()
        self.attn_pool = (AttentionPool(embed_dim, c.pool_heads or num_heads, c.pool_mlp_dim or c.mlp_hidden,
                                        norm_layer, c.act_layer, c.weight_init)
                          if c.global_pool == "map" else None)
        # SAM's neck (segment-anything's image encoder): 1x1 then 3x3 convolution, each bias-free with a channel
        # LayerNorm, over the last patch map (`forward_neck`); 0: none
        channels = c.neck_channels
        self.neck = (nn.Sequential(ConvNorm(embed_dim, channels, 1), ConvNorm(channels, channels, 3))
                     if channels else None)
        # A classification head starts at zero (the paper's fine-tuning head, section 3.2).
        self.head = Linear(embed_dim, c.num_classes, role="zero") if c.num_classes > 0 else nn.Identity()
        self.reset_parameters()

    @property
    def weight_init(self) -> str:
        return self.config.weight_init

    @property
    def pos_embed_interp(self) -> str:
        """How position embeddings are resampled for another grid (set_img_size and on the fly): timm's default is
        bicubic + antialias; DINOv2 / HF transformers weights expect bicubic without antialiasing."""
        return self.config.pos_embed_interp

    @property
    def pos_embed_antialias(self) -> bool:
        return self.config.pos_embed_antialias

    # ----- construction helpers -----
    def reset_parameters(self) -> None:
        """Initialise this module's own parameters (position embeddings, tokens) by `weight_init`; every layer
        initialises itself in its own constructor (see ssl_vit.backbone.init: this survives DeepSpeed's zero.Init)."""
        learned = self.pos_embed if self.pos_embed_kind in ("learned", "learned_rope") else None
        init_embeddings(learned, (self.cls_token, self.dist_token, self.reg_token), self.weight_init)
        if self.pos_embed_kind == "sincos":
            with torch.no_grad():
                self.pos_embed.copy_(sincos_pos_embed_2d(self.grid_size, self.embed_dim, self.num_pos_prefix))

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """Activation checkpointing per block: True / "full", "selective" (see CHECKPOINTING), or False."""
        policy = check_checkpointing(enable)
        for block in self.blocks:
            block.checkpointing = policy
        if hasattr(self.patch_embed, "set_grad_checkpointing"):  # a hybrid's ResNet: per stage (timm's), full
            self.patch_embed.set_grad_checkpointing(policy is not None)

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    def _resample_pos_embed(self, pos_embed: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        return resample_pos_embed(pos_embed, grid, self.grid_size, self.num_pos_prefix,
                                  mode=self.pos_embed_interp, antialias=self.pos_embed_antialias)

    def resample_from(self, pos_embed: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """A position table of this model's layout made for another `grid`, resampled to this model's grid as this
        model resamples (its pos_embed_interp and pos_embed_antialias)."""
        return resample_pos_embed(pos_embed, self.grid_size, grid, self.num_pos_prefix,
                                  mode=self.pos_embed_interp, antialias=self.pos_embed_antialias)

    def set_img_size(self, img_size: int | Sequence[int]) -> None:
        """Permanently resample the position embeddings for a new image size (fine-tuning at higher resolution)."""
        img_size = pair(img_size)
        new_grid = self.patch_embed.grid_for(*img_size)
        if self.pos_embed is not None:
            self.pos_embed = nn.Parameter(self._resample_pos_embed(self.pos_embed.data, new_grid),
                                          requires_grad=self.pos_embed.requires_grad)
        self.patch_embed.resize(img_size)
        self.config = self.config.replace(img_size=tuple(img_size))  # a saved encoder rebuilds with this grid

    # ----- the blocks -----
    def run_blocks(self, tokens: torch.Tensor, placement=None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-norm, all blocks (each activation-checkpointed when set), then the final norm. `placement`: where
        the patch tokens sit, as `embed_input` returns it; or the patch grid (and `keep`, as given to
        `embed_patches`) of a dense batch built step by step; None only for a backbone whose blocks need no
        places (no RoPE, no windows)."""
        x = self.norm_pre(tokens)
        for block, rope, spatial, mask in self.block_inputs(self._placement(placement, keep)):
            x = block(x, rope, grid=spatial, attn_mask=mask)
        return self.norm(x)

    @staticmethod
    def _placement(placement, keep=None):
        if placement is None or hasattr(placement, "attention_mask"):
            return placement
        return GridPlacement(tuple(placement), keep)

    def block_inputs(self, placement):
        """(block, its rope tables, the grid windows need, the attention mask) for each block."""
        depth = len(self.blocks)
        if placement is None:
            if self.rope is not None:
                raise ValueError(f"this backbone has rotary position embeddings (pos_embed={self.pos_embed_kind!r}): "
                                 "the blocks need the patch grid, run_blocks(tokens, grid, keep)")
            if self.windowed:
                raise ValueError("windowed attention (window_size) and relative positions (rel_pos) need every patch "
                                 "token on its grid: run_blocks(tokens, grid)")
            return [(block, None, None, None) for block in self.blocks]
        ropes = placement.rope_tables(self.rope, depth) if self.rope is not None else [None] * depth
        spatial = placement.spatial_grid() if self.windowed else None
        mask = placement.attention_mask(self.num_prefix_tokens)
        return [(block, rope, spatial, mask) for block, rope in zip(self.blocks, ropes, strict=True)]

    def forward_features(self, images: torch.Tensor | dict, mask: torch.Tensor | None = None,
                         mask_token: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Output tokens (B, prefix + N or K, D), after the final norm; `mask`, `keep`: see `embed_patches`.
        `images` may be a NaFlex batch (ssl_vit.naflex): the tokens then follow its patches, padding included."""
        return self.run_blocks(*self.embed_input(images, mask, mask_token, keep))

    def forward_neck(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w): the last patch tokens on their grid, through SAM's neck where the encoder has one (what
        segment-anything's image encoder and timm's samvit forward_features give)."""
        grid = self.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        tokens = self.forward_features(images)[:, self.num_prefix_tokens:]
        patch_map = tokens.transpose(1, 2).reshape(len(images), -1, *grid)
        return self.neck(patch_map) if self.neck is not None else patch_map

    def pool(self, tokens: torch.Tensor, patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n, D) output tokens -> (B, D) image embedding by `global_pool` (ssl_vit.backbone.pooling); with a
        distillation token: the mean of the class and distillation tokens, as timm's DeiT pre-logits. `patch_valid`
        (B, N): a NaFlex batch's mask, so that the average and the attention pool leave the padding out."""
        return pool_tokens(self, tokens, patch_valid)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False,
                     patch_valid: torch.Tensor | None = None) -> torch.Tensor:
        pooled = self.pool(tokens, patch_valid)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, images: torch.Tensor | dict) -> torch.Tensor:
        return self.forward_head(self.forward_features(images), patch_valid=patch_valid(images))

    def forward_intermediates(self, images: torch.Tensor, last_k: int = 1) -> list[torch.Tensor]:
        """Token outputs (B, n, D) of the last `last_k` blocks, each through the final norm (DINO's eval features)."""
        if not 1 <= last_k <= len(self.blocks):
            raise ValueError(f"last_k must be in [1, {len(self.blocks)}], got {last_k}")
        x, placement = self.embed_input(images)
        inputs = self.block_inputs(placement)
        x, outputs = self.norm_pre(x), []
        for index, (block, rope, spatial, mask) in enumerate(inputs):
            x = block(x, rope, grid=spatial, attn_mask=mask)
            if index >= len(self.blocks) - last_k:
                outputs.append(self.norm(x))
        return outputs

    @torch.no_grad()
    def attention_maps(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Softmax attention weights (B, heads, n, n) of every block, through the explicit attention path."""
        x, placement = self.embed_input(images)
        inputs = self.block_inputs(placement)
        x, maps = self.norm_pre(x), []
        for block, rope, spatial, mask in inputs:
            x, weights = block(x, rope, return_attention=True, grid=spatial, attn_mask=mask)
            maps.append(weights)
        return maps


WINDOW_SETTINGS = ("window_size", "global_attn_indexes", "rel_pos")


def with_windows(encoder: VisionTransformer, window_size: int = 0, global_attn_indexes: Sequence[int] = (),
                 rel_pos: bool | None = None) -> VisionTransformer:
    """`encoder` rebuilt with ViTDet / SAM's windows (its weights; relative-position tables it lacks start at zero,
    as ViTDet adds them to an MAE encoder), so that a globally pre-trained encoder runs windowed at a higher
    resolution. ValueError for settings that do not fit (`block_windows`)."""
    rel_pos = encoder.config.rel_pos if rel_pos is None else rel_pos
    settings = {"window_size": int(window_size), "global_attn_indexes": tuple(int(i) for i in global_attn_indexes),
                "rel_pos": bool(rel_pos)}
    if all(getattr(encoder.config, key) == settings[key] for key in WINDOW_SETTINGS):
        return encoder
    windowed = VisionTransformer(encoder.config.replace(**settings))
    state = encoder.state_dict()
    fresh = [name for name in windowed.state_dict() if name not in state]
    if any("rel_pos" not in name for name in fresh) or any(name not in windowed.state_dict() for name in state
                                                             if "rel_pos" not in name):
        raise ValueError(f"windows change more than the relative-position tables: {fresh[:4]}")
    target = windowed.state_dict()
    for name, value in state.items():  # a table made for another window keeps its length: resampled when used
        if "rel_pos" in name and name in target and target[name].shape != value.shape:
            module, _, param = name.rpartition(".")
            setattr(windowed.get_submodule(module), param, nn.Parameter(value.clone()))
    windowed.load_state_dict({name: value for name, value in state.items() if name in target}, strict=False)
    return windowed.train(encoder.training)


def build_vit(name: str, **overrides) -> VisionTransformer:
    """A preset by name, with keyword overrides (e.g. img_size=384, drop_path=0.1)."""
    return VisionTransformer(preset_config(name, **overrides))


def preset_config(name: str, **overrides) -> ViTConfig:
    """A preset's ViTConfig with keyword overrides; ValueError naming the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid choices: {sorted(PRESETS)}")
    return ViTConfig(**{**PRESETS[name], **overrides})


def count_parameters(module: nn.Module) -> int:
    """Parameter count; a DeepSpeed ZeRO-3 partitioned parameter counts at its full size."""
    return sum(full_numel(p) for p in module.parameters())

