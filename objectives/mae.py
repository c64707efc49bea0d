"""Masked autoencoders (He et al. 2022).

Mask `mask_ratio` (75%) of each image's patches at random (argsort of noise, per sample); the encoder, which is the
shared backbone, runs on the visible patches only, so it costs about (1 - mask_ratio) of a full pass. A light
decoder takes the encoded visible tokens plus a learned mask token for each hidden patch, with fixed 2-D sin-cos
position embeddings, and predicts every patch's pixels; the loss is the MSE on the masked patches, against pixels
normalised per patch (`norm_pix_loss`). As in MAE, the encoder's position embeddings are fixed sin-cos by default.
After pre-training, `encoder` is a plain ViT used as is by evaluation and export.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ssl_vit.backbone import Block, sincos_pos_embed_2d
from ssl_vit.backbone.init import Linear, writable
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.objectives.patches import patchify, per_sample_shuffle, refuse_hybrid, unpatchify
from ssl_vit.schema import checked


@dataclass
class MAEConfig(ObjectiveConfig):
    name: str = "mae"
    mask_ratio: float = checked(0.75, ge=0, lt=1)
    decoder_dim: int = checked(512, ge=1)
    decoder_depth: int = checked(8, ge=1)
    decoder_heads: int = checked(16, ge=1)
    norm_pix_loss: bool = True
    # encoder position embeddings: fixed 2-D sin-cos (MAE) instead of learned; nothing to fix with model.pos_embed
    # rope or none (the encoder adds none)
    fixed_pos_embed: bool = True


def normalise_patches(target: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-patch mean / (unbiased) variance normalisation of (B, N, P*P*C) targets, as in MAE."""
    mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
    return (target - mean) / (var + eps) ** 0.5, mean, var


def mae_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, norm_pix_loss: bool) -> torch.Tensor:
    """Mean squared error over the patches where mask == 1 (pred, target: (B, N, P*P*C); mask: (B, N))."""
    if norm_pix_loss:
        target = normalise_patches(target)[0]
    per_patch = (pred.float() - target.float()).pow(2).mean(dim=-1)  # fp32 when the weights are bf16
    return (per_patch * mask).sum() / mask.sum()


class MAE(Objective):
    config_class = MAEConfig
    # weight_init: models_mae.py's initialize_weights
    needs = Requirements(model_defaults={"weight_init": "mae"}, drops_patches=True)
    naflex_refusal = ("its encoder keeps a random 25% of each image's patches, a count the padded NaFlex images do "
                      "not share (per-image keep counts are not built)")
    # the decoder and the mask token, to continue pre-training (its position embeddings are fixed, rebuilt)
    saved_heads = ("decoder_embed.", "mask_token", "decoder_blocks.", "decoder_norm.", "decoder_pred.")
    @classmethod
    def requirements(cls, cfg) -> Requirements:
        if not cfg.fixed_pos_embed:
            return cls.needs
        return replace(cls.needs, init_from="its fixed sin-cos position embeddings would replace the source's; set "
                                            "objective.fixed_pos_embed=false")

    def __init__(self, backbone, cfg: MAEConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        if not 0 <= cfg.mask_ratio < 1:
            raise ValueError(f"mask_ratio must be in [0, 1), got {cfg.mask_ratio}")
        refuse_hybrid(backbone, "mae")
        patch = backbone.patch_embed.patch_size
        if patch[0] != patch[1]:
            raise ValueError(f"MAE needs square patches, got {patch}")
        self.patch_size = patch[0]
        in_chans = backbone.patch_embed.proj.in_channels
        self.fixes_pos_embed = cfg.fixed_pos_embed and backbone.pos_embed is not None
        if self.fixes_pos_embed:
            backbone.pos_embed.requires_grad_(False)

        # MAE's decoder init: xavier-uniform Linear weights, zero biases (each layer in its own constructor).
        dim = cfg.decoder_dim
        self.decoder_embed = Linear(backbone.embed_dim, dim, scheme="xavier")
        self.mask_token = nn.Parameter(torch.empty(1, 1, dim))
        self.decoder_blocks = nn.ModuleList([
            Block(dim, cfg.decoder_heads, 4 * dim, norm_layer=lambda d: nn.LayerNorm(d, eps=1e-6),
                  weight_init="xavier")
            for _ in range(cfg.decoder_depth)
        ])
        self.decoder_norm = nn.LayerNorm(dim, eps=1e-6)
        self.register_buffer("decoder_pos_embed", torch.empty(1, backbone.num_prefix_tokens + backbone.grid_size[0]
                                                              * backbone.grid_size[1], dim), persistent=False)
        self.decoder_pred = Linear(dim, self.patch_size**2 * in_chans, scheme="xavier")
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The mask token, the decoder's fixed position embeddings and (fixed_pos_embed) the encoder's."""
        nn.init.normal_(self.mask_token, std=0.02)
        vit = self.backbone
        self.decoder_pos_embed.copy_(sincos_pos_embed_2d(vit.grid_size, self.cfg.decoder_dim, vit.num_prefix_tokens))
        if self.fixes_pos_embed:
            with writable(vit.pos_embed):
                vit.pos_embed.copy_(sincos_pos_embed_2d(vit.grid_size, vit.embed_dim, vit.num_pos_prefix))

    def no_weight_decay(self) -> set[str]:
        return {"mask_token"}

    def num_visible(self, num_patches: int) -> int:
        """int(N * (1 - mask_ratio)), as MAE's `random_masking` (25 of 64 patches at 0.6, 9 of 100 at 0.9)."""
        return int(num_patches * (1 - self.cfg.mask_ratio))

    def encode_visible(self, images: torch.Tensor):
        """Encode a random subset of each image's patches. Returns (encoded tokens, mask with 1 = hidden in
        original patch order, the permutation that restores the original order, the patch grid)."""
        grid = self.backbone.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        B, N = images.shape[0], grid[0] * grid[1]
        keep = self.num_visible(N)
        shuffle, restore = per_sample_shuffle(B, N, images.device)
        mask = torch.ones(B, N, device=images.device)
        mask[:, :keep] = 0
        mask = torch.gather(mask, 1, restore)
        return self.backbone.forward_features(images, keep=shuffle[:, :keep]), mask, restore, grid

    def decode(self, encoded: torch.Tensor, restore: torch.Tensor, grid) -> torch.Tensor:
        """Encoded (prefix + visible) tokens -> (B, N, P*P*C) pixel predictions for every patch, in raster order."""
        prefix = self.backbone.num_prefix_tokens
        x = self.decoder_embed(encoded)
        B, _, dim = x.shape
        N = restore.shape[1]
        patches = torch.cat([x[:, prefix:], self.mask_token.to(x.dtype).expand(B, N - x.shape[1] + prefix, dim)], 1)
        patches = torch.gather(patches, 1, restore[..., None].expand(-1, -1, dim))  # unshuffle
        x = torch.cat([x[:, :prefix], patches], dim=1)
        pos = self.decoder_pos_embed if tuple(grid) == self.backbone.grid_size else sincos_pos_embed_2d(
            grid, dim, prefix).to(x.device)
        x = x + pos.to(x.dtype)
        for block in self.decoder_blocks:
            x = block(x)
        return self.decoder_pred(self.decoder_norm(x))[:, prefix:]

    def forward(self, batch):
        images = batch["image"]
        encoded, mask, restore, grid = self.encode_visible(images)
        pred = self.decode(encoded, restore, grid)
        target = patchify(images, self.patch_size).flatten(2)
        if self.cfg.mask_ratio == 0:  # cost baseline: nothing hidden, so reconstruct every patch
            mask = torch.ones_like(mask)
        return {"loss": mae_loss(pred, target, mask, self.cfg.norm_pix_loss)}

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reconstructed images in the input's normalised space, (B, N) mask with 1 = hidden)."""
        encoded, mask, restore, grid = self.encode_visible(images)
        pred = self.decode(encoded, restore, grid)
        if self.cfg.norm_pix_loss:  # predictions live in per-patch normalised space: undo with the true statistics
            _, mean, var = normalise_patches(patchify(images, self.patch_size).flatten(2))
            pred = pred * (var + 1e-6) ** 0.5 + mean
        return unpatchify(pred, grid), mask
