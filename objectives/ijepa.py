"""I-JEPA (Assran et al. 2023, "Self-Supervised Learning from Images with a Joint-Embedding Predictive Architecture").

From one context block of an image, predict the representations of several target blocks of the same image: the
context encoder (the shared backbone) sees only the context block's patches; a narrow predictor ViT takes the
encoded context tokens and, for each target block, one mask token per target patch (each with the predictor's
fixed sin-cos position of that patch), and predicts the target encoder's layer-normalised output tokens there
(smooth L1). The target encoder is an EMA of the context encoder (momentum linear from 0.996 to 1 over the run;
`momentum_stretch` lays the ramp over a longer span, as the reference's `ipe_scale`), run on the whole image. Both
encoders' tokens pass the final LayerNorm, per token, as the reference's (with average pooling ours holds it as
`fc_norm`, which `pool` applies after averaging).

Masks as the reference's `MaskCollator` (facebookresearch/ijepa, src/masks/multiblock.py): per batch one target
block size (scale 0.15-0.2 of the grid, aspect 0.75-1.5, from one uniform draw) and one context size (scale
0.85-1, square); per image 4 target blocks and 1 context block placed at random, the context block restricted to
the patches outside every target block (relaxed one target at a time when no placement keeps more than `min_keep`
patches in 20 tries); every image's index lists cut to the shortest in the batch. Drawn in the forward from
torch's generator (restored on resume). The backbone options the method uses (no class token, average pooling,
fixed sin-cos positions) apply where the model config leaves them unset. `encoder` is the target encoder (the
reference evaluates and releases it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone import Block, VisionTransformer, sincos_pos_embed_2d
from ssl_vit.backbone.init import Linear
from ssl_vit.ema import EMA, teacher_backbone
from ssl_vit.objectives.base import DataInfo, Objective, ObjectiveConfig, Requirements
from ssl_vit.objectives.patches import refuse_hybrid
from ssl_vit.schema import checked


@dataclass
class IJEPAConfig(ObjectiveConfig):
    name: str = "ijepa"
    predictor_dim: int = checked(384, ge=1)
    predictor_depth: int = checked(12, ge=1)
    predictor_heads: int | None = checked(None, ge=1)  # None: the encoder's number of heads (the reference's)
    num_targets: int = checked(4, ge=1)
    target_scale: list[float] = checked(factory=lambda: [0.15, 0.2], gt=0, le=1, length=2)
    target_aspect_ratio: list[float] = checked(factory=lambda: [0.75, 1.5], gt=0, length=2)
    context_scale: list[float] = checked(factory=lambda: [0.85, 1.0], gt=0, le=1, length=2)
    min_keep: int = checked(10, ge=0)  # a block placement keeps more than this many patches
    momentum: float = checked(0.996, ge=0, le=1)  # linear to momentum_end over momentum_stretch x the run
    momentum_end: float = checked(1.0, ge=0, le=1)
    momentum_stretch: float = checked(1.0, ge=1)  # the reference's ipe_scale (1.0 in its released configs)


def momentum_at(step: int, total_steps: int, start: float, end: float, stretch: float) -> float:
    """The momentum of the update after optimizer step `step` (1-based): the reference's momentum_scheduler, whose
    i-th value (from 0) is start + i (end - start) / (total x stretch)."""
    return start + (step - 1) * (end - start) / (total_steps * stretch)


class MultiBlockMasks:
    """I-JEPA's multi-block masks for a (rows, cols) patch grid; `__call__(batch, generator)` -> (context indices
    (B, Kc), target indices (num_targets, B, Kt)), each row sorted, raster order."""

    def __init__(self, grid, num_targets: int = 4, target_scale=(0.15, 0.2), target_aspect=(0.75, 1.5),
                 context_scale=(0.85, 1.0), min_keep: int = 10, tries_per_relaxation: int = 20):
        self.rows, self.cols = grid
        self.num_targets, self.min_keep, self.tries = num_targets, min_keep, tries_per_relaxation
        self.target_scale, self.target_aspect, self.context_scale = target_scale, target_aspect, context_scale
        for kind, scale, aspect in (("target", target_scale, target_aspect), ("context", context_scale, (1.0, 1.0))):
            h, w = min(self.block_sizes(scale, aspect), key=lambda size: size[0] * size[1])
            if h * w <= min_keep:
                raise ValueError(f"objective.min_keep={min_keep}: a {kind} block can be drawn {h} x {w} patches "
                                 f"(scale {list(scale)}, aspect {list(aspect)} of a {self.rows} x {self.cols} grid), "
                                 "which can never keep more; lower objective.min_keep or raise data.img_size")

    def block_size(self, scale, aspect, u: float) -> tuple[int, int]:
        """The uniform draw `u` sets both the area (a share `scale` of the grid) and the aspect ratio h / w; each
        side stays below the grid's."""
        area = int(self.rows * self.cols * (scale[0] + u * (scale[1] - scale[0])))
        ratio = aspect[0] + u * (aspect[1] - aspect[0])
        h, w = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        return min(h, self.rows - 1), min(w, self.cols - 1)

    def block_sizes(self, scale, aspect) -> set[tuple[int, int]]:
        """Every size `block_size` gives over the draws u in [0, 1]: it is constant between the points where the
        area's floor or a side's rounding changes, so its values at those points and between them are all of them
        (the size is not monotonic in u: the area and the ratio grow together)."""
        cells, span, slope = self.rows * self.cols, scale[1] - scale[0], aspect[1] - aspect[0]
        areas = range(int(cells * scale[0]), int(cells * scale[1]) + 1)
        points = {0.0, 1.0}
        if span > 0:
            points.update((area / cells - scale[0]) / span for area in areas)
        if slope != 0:  # where sqrt(area x ratio) or sqrt(area / ratio) crosses a half-integer
            for area in filter(None, areas):
                for side in range(max(self.rows, self.cols) + 1):
                    half = (side + 0.5) ** 2
                    points.update(((half / area - aspect[0]) / slope, (area / half - aspect[0]) / slope))
        inside = sorted(u for u in points if 0.0 <= u <= 1.0)
        draws = inside + [(a + b) / 2 for a, b in zip(inside, inside[1:], strict=False)]
        return {self.block_size(scale, aspect, u) for u in draws}

    def place(self, size, generator, allowed: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices of a block of `size` at a random top-left corner within the allowed regions, its complement
        as a (rows, cols) bool grid). When `tries` placements in a row keep `min_keep` patches or fewer, the last
        allowed region is dropped (then the one before, ...); with none left a placement keeps the whole block,
        which the start-up check makes larger than `min_keep` (ValueError naming them otherwise)."""
        h, w = size
        allowed = allowed or []
        for attempt in range((len(allowed) + 1) * self.tries):
            top = int(torch.randint(0, self.rows - h, (1,), generator=generator))
            left = int(torch.randint(0, self.cols - w, (1,), generator=generator))
            block = torch.zeros(self.rows, self.cols, dtype=torch.bool)
            block[top:top + h, left:left + w] = True
            kept = block
            for region in allowed[:len(allowed) - attempt // self.tries]:
                kept = kept & region
            indices = kept.flatten().nonzero().flatten()
            if len(indices) > self.min_keep:
                return indices, ~block
        raise ValueError(f"objective.min_keep={self.min_keep}: a {h} x {w} block on the {self.rows} x {self.cols} "
                         f"patch grid keeps at most {h * w} patches; lower objective.min_keep or raise data.img_size")

    def __call__(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        target_size = self.block_size(self.target_scale, self.target_aspect, float(torch.rand(1, generator=generator)))
        context_size = self.block_size(self.context_scale, (1.0, 1.0), float(torch.rand(1, generator=generator)))
        targets, contexts = [], []
        for _ in range(batch):
            placed = [self.place(target_size, generator) for _ in range(self.num_targets)]
            targets.append([indices for indices, _ in placed])
            contexts.append(self.place(context_size, generator, [outside for _, outside in placed])[0])
        shortest_target = min(len(t) for image in targets for t in image)
        shortest_context = min(len(c) for c in contexts)
        target = torch.stack([torch.stack([t[:shortest_target] for t in image]) for image in targets], dim=1)
        return torch.stack([c[:shortest_context] for c in contexts]), target


def take(tokens: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tokens (B, N, D), indices (B, K) -> (B, K, D)."""
    return torch.gather(tokens, 1, indices[..., None].expand(-1, -1, tokens.shape[-1]))


class Predictor(nn.Module):
    """The I-JEPA predictor: context tokens (B, Kc, D) at `context` indices + one mask token per target index ->
    predictions (T * B, Kt, D) of the target tokens, target block-major."""

    def __init__(self, embed_dim: int, dim: int, depth: int, heads: int, grid):
        super().__init__()
        self.embed = Linear(embed_dim, dim, scheme="ijepa")
        self.mask_token = nn.Parameter(torch.empty(1, 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4 * dim, norm_layer=lambda d: nn.LayerNorm(d, eps=1e-6),
                                           weight_init="ijepa") for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.proj = Linear(dim, embed_dim, scheme="ijepa")
        self.grid = tuple(grid)
        self.register_buffer("pos_embed", torch.empty(1, grid[0] * grid[1], dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        # (no depth rescaling: the reference's init_model redraws every Linear after its fix_init_weight)
        self.pos_embed.copy_(sincos_pos_embed_2d(self.grid, self.pos_embed.shape[-1]))

    def forward(self, context_tokens: torch.Tensor, context: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batch = context_tokens.shape[0]
        pos = self.pos_embed.to(context_tokens.dtype).expand(batch, -1, -1)
        x = self.embed(context_tokens) + take(pos, context)
        queries = torch.cat([take(pos, t) for t in targets]) + self.mask_token.to(x.dtype)  # (T * B, Kt, dim)
        x = torch.cat([x.repeat(len(targets), 1, 1), queries], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.proj(self.norm(x)[:, context.shape[1]:])


class IJEPA(Objective):
    config_class = IJEPAConfig
    needs = Requirements(views=("image",), ema_teacher=True, drops_patches=True,
                         model_defaults={"pos_embed": "sincos", "class_token": False, "global_pool": "avg",
                                         "weight_init": "ijepa"})
    saved_heads = ("backbone.", "predictor.")  # the context encoder and the predictor, to continue training

    def __init__(self, backbone, cfg: IJEPAConfig, data: DataInfo):
        super().__init__(backbone, cfg, data)
        refuse_hybrid(backbone, "ijepa")
        heads = cfg.predictor_heads or backbone.config.num_heads
        if cfg.predictor_dim % heads:
            raise ValueError(f"objective.predictor_dim={cfg.predictor_dim} is not divisible by {heads} heads (set "
                             "objective.predictor_heads)")
        self.predictor = Predictor(backbone.embed_dim, cfg.predictor_dim, cfg.predictor_depth, heads,
                                   backbone.grid_size)
        self.target = teacher_backbone(backbone)
        self.ema = EMA.following(self.backbone, self.target)
        self.masks = MultiBlockMasks(backbone.grid_size, cfg.num_targets, tuple(cfg.target_scale),
                                     tuple(cfg.target_aspect_ratio), tuple(cfg.context_scale), cfg.min_keep)

    @property
    def encoder(self) -> VisionTransformer:
        return self.target

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        cfg = self.cfg
        self.ema.update(momentum_at(step, total_steps, cfg.momentum, cfg.momentum_end, cfg.momentum_stretch))

    def fp32_shards(self) -> dict[str, torch.Tensor]:
        """The target encoder's fp32 EMA averages when its tensors are 16-bit (DeepSpeed's bf16 mode)."""
        return {f"target.{name}": shard for name, shard in self.ema.fp32_shards().items()}

    def loss_for(self, images: torch.Tensor, context: torch.Tensor, targets: torch.Tensor) -> dict:
        """The loss for given masks: context (B, Kc) and targets (T, B, Kt) patch indices."""
        if tuple(self.backbone.patch_embed.grid_for(*images.shape[-2:])) != tuple(self.masks_grid):
            raise ValueError(f"I-JEPA's predictor is built for {self.data.img_size} px images (a {self.masks_grid} "
                             f"grid), this batch has {tuple(images.shape[-2:])}")
        prefix = self.backbone.num_prefix_tokens
        with torch.no_grad():
            full = self.tokens(self.target, images)[:, prefix:]
            full = F.layer_norm(full.float(), full.shape[-1:])
            wanted = torch.cat([take(full, t) for t in targets])  # (T * B, Kt, D), target block-major
        encoded = self.tokens(self.backbone, images, context)[:, prefix:]
        predicted = self.predictor(encoded, context, targets)
        loss = F.smooth_l1_loss(predicted.float(), wanted)
        # health: how much the predictions vary across patches and images (0 when collapsed to a constant)
        spread = predicted.detach().float().flatten(0, 1).std(dim=0).mean()
        sizes = torch.tensor([float(context.shape[1]), float(targets.shape[-1])], device=loss.device)
        return {"loss": loss, "prediction_std": spread, "context_patches": sizes[0], "target_patches": sizes[1]}

    @staticmethod
    def tokens(vit: VisionTransformer, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Output tokens after the final LayerNorm: `norm` (token pooling) or `fc_norm` (average pooling, where
        `norm` is the identity), applied to every token."""
        return vit.fc_norm(vit.forward_features(images, keep=keep))

    @property
    def masks_grid(self) -> tuple[int, int]:
        return self.masks.rows, self.masks.cols

    def forward(self, batch):
        images = batch["image"]
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        context, targets = self.masks(images.shape[0], generator)
        return self.loss_for(images, context.to(images.device), targets.to(images.device))
