"""Masked patch prediction, the ViT paper's self-supervised objective (section 4.6, appendix B.1.2).

A fraction (`mask_ratio`, default 50%) of each image's patch embeddings is corrupted before the position
embeddings are added: of those, 80% become a learned [mask] embedding, 10% the embedding of a random other patch
from the batch, 10% stay unchanged. For every corrupted patch the model predicts, from its output token:

- `mean_colour` (default): the patch's mean colour, each channel quantised to `bits` bits (3 bits: 512 classes);
- `subpatch_colour`: the same for each cell of a `subpatch_grid` x `subpatch_grid` grid inside the patch;
- `pixels`: the patch's pixels (L2 regression).

Targets come from the un-normalised pixels in [0, 1] (the `pixels` view). Colour classes are ordered R-major:
class = (r * L + g) * L + b with L = 2**bits levels and r = min(floor(value * L), L - 1), so with 3 bits
(0.2, 0.5, 0.9) -> (1, 4, 7) -> 103.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone.init import Linear
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.objectives.patches import patchify, per_sample_shuffle, refuse_hybrid
from ssl_vit.schema import checked


class Target(str, Enum):
    mean_colour = "mean_colour"
    subpatch_colour = "subpatch_colour"
    pixels = "pixels"


@dataclass
class MaskedPatchConfig(ObjectiveConfig):
    name: str = "masked_patch"
    mask_ratio: float = checked(0.5, gt=0, le=1)
    mask_token_prob: float = checked(0.8, ge=0, le=1)
    random_patch_prob: float = checked(0.1, ge=0, le=1)
    keep_prob: float = checked(0.1, ge=0, le=1)
    target: Target = Target.mean_colour
    bits: int = checked(3, ge=1, le=8)  # per channel: 2**(3 * bits) colour classes
    subpatch_grid: int = checked(4, ge=1)


def quantise_colour(colour: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., 3) colours in [0, 1] -> (...,) class indices in [0, 2**(3*bits)), R-major."""
    levels = 2**bits
    q = (colour.clamp(0, 1) * levels).floor().long().clamp_(max=levels - 1)
    return (q[..., 0] * levels + q[..., 1]) * levels + q[..., 2]


def colour_targets(pixels: torch.Tensor, patch_size: int, bits: int, grid: int = 1) -> torch.Tensor:
    """(B, C, H, W) in [0, 1] -> (B, N, grid*grid) colour classes of each patch's grid x grid cells."""
    patches = patchify(pixels, patch_size)  # (B, N, P, P, C)
    B, N, P, _, C = patches.shape
    if P % grid:
        raise ValueError(f"patch size {P} is not divisible by subpatch_grid {grid}")
    cells = patches.reshape(B, N, grid, P // grid, grid, P // grid, C).mean(dim=(3, 5))  # (B, N, g, g, C)
    return quantise_colour(cells.reshape(B, N, grid * grid, C), bits)


def corruption(tokens: torch.Tensor, mask_ratio: float, probs: tuple[float, float, float],
               mask_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERT-style corruption of round(N * mask_ratio) random patches per image, as the backbone's masked-token path
    takes it: (replaced (B, N) bool, the (B, N, D) replacements: the mask token or a random other patch of the
    batch), then a (B, N) bool mask of corrupted patches (those predicted) and a (B, N) long tensor of what happened
    to each (0 untouched, 1 mask embedding, 2 random other patch, 3 corrupted but kept)."""
    B, N, D = tokens.shape
    num_corrupt = round(N * mask_ratio)
    _, rank = per_sample_shuffle(B, N, tokens.device)  # rank of each position in a random order
    corrupted = rank < num_corrupt  # exactly num_corrupt per image, at random positions
    choice = torch.rand(B, N, device=tokens.device)
    use_mask = corrupted & (choice < probs[0])
    use_random = corrupted & (choice >= probs[0]) & (choice < probs[0] + probs[1])
    donors = tokens.reshape(B * N, D)[torch.randint(B * N, (B, N), device=tokens.device)]
    replacements = torch.where(use_random[..., None], donors, mask_token.to(tokens.dtype).expand(B, N, D))
    kind = corrupted.long() * 3 - use_mask.long() * 2 - use_random.long()
    return use_mask | use_random, replacements, corrupted, kind


def corrupt_patches(tokens: torch.Tensor, mask_ratio: float, probs: tuple[float, float, float],
                    mask_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`corruption` applied: (the corrupted tokens, the (B, N) mask of corrupted patches, what happened to each)."""
    replaced, replacements, corrupted, kind = corruption(tokens, mask_ratio, probs, mask_token)
    return torch.where(replaced[..., None], replacements, tokens), corrupted, kind


class MaskedPatch(Objective):
    config_class = MaskedPatchConfig
    needs = Requirements(views=("image", "pixels"))
    naflex_refusal = "its targets are the raw `pixels` of a fixed-size crop, which NaFlex batches do not carry"
    saved_heads = ("mask_token", "head.")  # to continue pre-training

    def __init__(self, backbone, cfg: MaskedPatchConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        probs = (cfg.mask_token_prob, cfg.random_patch_prob, cfg.keep_prob)
        if not 0 < cfg.mask_ratio <= 1 or min(probs) < 0 or abs(sum(probs) - 1) > 1e-6:
            raise ValueError(f"need 0 < mask_ratio <= 1 and mask/random/keep probabilities >= 0 summing to 1, "
                             f"got mask_ratio={cfg.mask_ratio} and {probs}")
        self.probs = probs
        refuse_hybrid(backbone, "masked_patch")
        patch = backbone.patch_embed.patch_size
        if patch[0] != patch[1]:
            raise ValueError(f"masked_patch needs square patches, got {patch}")
        self.patch_size = patch[0]
        target = Target(cfg.target)
        self.cells = cfg.subpatch_grid**2 if target == Target.subpatch_colour else 1
        if target == Target.pixels:
            out_dim = self.patch_size**2 * 3
        else:
            if target == Target.subpatch_colour and self.patch_size % cfg.subpatch_grid:
                raise ValueError(f"patch size {self.patch_size} is not divisible by "
                                 f"subpatch_grid={cfg.subpatch_grid}")
            out_dim = self.cells * 2 ** (3 * cfg.bits)
        self.target = target
        self.mask_token = nn.Parameter(torch.empty(1, 1, backbone.embed_dim))
        self.head = Linear(backbone.embed_dim, out_dim, scheme="timm")
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"mask_token"}

    def forward(self, batch):
        vit = self.backbone
        images, pixels = batch["image"], batch["pixels"]
        grid = vit.patch_embed.grid_for(images.shape[-2], images.shape[-1])
        patches = vit.patch_embed(images)
        replaced, replacements, corrupted, _ = corruption(patches, self.cfg.mask_ratio, self.probs, self.mask_token)
        tokens = vit.embed_patches(patches, grid, mask=replaced, mask_token=replacements)
        out = vit.run_blocks(tokens, grid)[:, vit.num_prefix_tokens:]
        predictions = self.head(out[corrupted])  # (M, out_dim): corrupted patches only
        if self.target == Target.pixels:
            target = patchify(pixels, self.patch_size)[corrupted].flatten(1)
            loss = F.mse_loss(predictions.float(), target)
            return {"loss": loss, "corrupted_fraction": corrupted.float().mean()}
        grid_cells = self.cfg.subpatch_grid if self.target == Target.subpatch_colour else 1
        target = colour_targets(pixels, self.patch_size, self.cfg.bits, grid_cells)[corrupted]  # (M, cells)
        logits = predictions.float().reshape(target.shape[0], self.cells, -1)  # the loss in fp32 under bf16
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        accuracy = (logits.argmax(dim=-1) == target).float().mean()
        return {"loss": loss, "acc": accuracy, "corrupted_fraction": corrupted.float().mean()}
