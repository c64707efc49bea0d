"""From input to token sequence, for dense image batches and NaFlex batches alike.

`PatchEmbed` projects P x P patches (a Conv2d, or the same weights over a NaFlex batch's flat patches); the
position tables (`resample_pos_embed` to another grid, MAE's fixed `sincos_pos_embed_2d`); and `TokenEmbedding`,
the part of `VisionTransformer` that turns its input into tokens: `embed_input(images or NaFlex batch, mask=,
mask_token=, keep=)` -> (tokens, placement). The placement (`GridPlacement` for a dense batch, the batch's
`ssl_vit.naflex.NaFlexLayout` for a NaFlex one) is all the blocks need to know of where the patch tokens sit: their
rotary tables, the grid windows partition, the attention mask. So the backbone's forward has one path; the one
question of input kind is asked here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.backbone.config import POS_EMBED_INTERP_MODES
from ssl_vit.backbone.init import PatchProjection
from ssl_vit.geometry import check_divisible, pair
from ssl_vit.naflex import NaFlexLayout, is_naflex


def _check_pos_embed_interp(mode: str) -> None:
    if mode not in POS_EMBED_INTERP_MODES:
        raise ValueError(f"pos_embed_interp {mode!r} is not one of {list(POS_EMBED_INTERP_MODES)}")


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: Sequence[int],
    old_grid: Sequence[int],
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resample (1, prefix + H*W, D) position embeddings to a new (H', W') grid by 2-D interpolation.

    The prefix slots (class token, registers) are kept as they are; grids may be non-square; computed in fp32.
    The defaults (bicubic, antialiased) are timm's `resample_abs_pos_embed`; `antialias=False` is DINOv2's and HF
    transformers' `interpolate_pos_encoding` (F.interpolate to the target size, no antialiasing). The two differ when
    growing too: PyTorch's antialiased bicubic uses PIL's kernel (a = -0.5), the plain one a = -0.75.
    """
    _check_pos_embed_interp(mode)
    new_grid, old_grid = pair(tuple(new_grid)), pair(tuple(old_grid))
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    if grid.shape[1] != old_grid[0] * old_grid[1]:
        raise ValueError(f"position embedding has {grid.shape[1]} patch slots, not {old_grid[0]}x{old_grid[1]}")
    if new_grid == old_grid:
        return pos_embed
    dim = grid.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode=mode, antialias=antialias, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def sincos_pos_embed_2d(grid: Sequence[int], dim: int, num_prefix_tokens: int = 0,
                        temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings (MAE), shape (1, prefix + H*W, dim); prefix slots are zeros.

    Channel layout as in MAE's released weights: [sin(col), cos(col), sin(row), cos(row)], each of dim/4 frequencies
    1 / temperature**(i / (dim/4)). MAE's code calls the column half "emb_h" (its meshgrid puts w first); HF
    transformers builds [h | w] and swaps the halves to load those weights. Grids may be non-square.
    """
    if dim % 4:
        raise ValueError(f"sin-cos position embeddings need a width divisible by 4, got {dim}")
    rows, cols = pair(tuple(grid))
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    row, col = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                              indexing="ij")
    angle_col, angle_row = col.flatten().outer(omega), row.flatten().outer(omega)
    embed = torch.cat([angle_col.sin(), angle_col.cos(), angle_row.sin(), angle_row.cos()], dim=1)
    embed = torch.cat([torch.zeros(num_prefix_tokens, dim, dtype=torch.float64), embed])
    return embed.float().unsqueeze(0)


class PatchEmbed(nn.Module):
    """Cut images into P x P patches and map each linearly to D: exactly a Conv2d with kernel = stride = P.

    The hybrid stem (`ssl_vit.stem.HybridPatchEmbed`) has the same interface: img_size, patch_size, grid_size,
    num_patches, stride (image pixels per token side), grid_for, resize, forward -> (B, N, D)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, bias=True, weight_init="timm",
                 norm_layer=None):
        super().__init__()
        self.img_size, self.patch_size = pair(img_size), pair(patch_size)
        check_divisible(self.img_size, self.patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = PatchProjection(in_chans, embed_dim, self.patch_size, bias=bias, scheme=weight_init)
        # a norm of each patch embedding (timm's PatchEmbed norm_layer: AIMv2's RMSNorm); None: none
        self.norm = norm_layer(embed_dim) if norm_layer is not None else nn.Identity()

    @property
    def stride(self) -> tuple[int, int]:
        return self.patch_size

    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        check_divisible((height, width), self.patch_size)
        return height // self.patch_size[0], width // self.patch_size[1]

    def resize(self, img_size: tuple[int, int]) -> None:
        self.grid_size = self.grid_for(*img_size)
        self.img_size, self.num_patches = tuple(img_size), self.grid_size[0] * self.grid_size[1]

    def embed_flat(self, patches: torch.Tensor) -> torch.Tensor:
        """(B, N, P * P * C) flat patches (row, column, channel: ssl_vit.naflex) -> (B, N, D): the same
        projection as a linear layer over the flattened kernel."""
        weight = self.proj.weight
        expected = weight[0].numel()
        if patches.shape[-1] != expected:
            raise ValueError(f"NaFlex patches have {patches.shape[-1]} values each, this patch embedding takes "
                             f"{self.patch_size[0]}x{self.patch_size[1]}x{weight.shape[1]} = {expected}")
        return F.linear(patches.to(weight.dtype), weight.permute(0, 2, 3, 1).flatten(1), self.proj.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W), or a NaFlex batch's flat patches (B, N, P * P * C) (`embed_flat`)."""
        if images.ndim == 3:
            return self.norm(self.embed_flat(images))
        self.grid_for(images.shape[-2], images.shape[-1])
        # In the weights' dtype (bf16 weights under DeepSpeed's bf16 mode; a no-op otherwise), as HF's ViT does.
        return self.norm(self.proj(images.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2))



@dataclass(frozen=True)
class GridPlacement:
    """A dense batch's patch tokens: all of one `grid` in raster order, or only those at `keep` (B, K) indices
    (MAE's visible patches, I-JEPA's context). The same three answers as `ssl_vit.naflex.NaFlexLayout`."""

    grid: tuple[int, int]
    keep: torch.Tensor | None = None

    def rope_tables(self, rope: nn.Module, depth: int) -> list:
        """Each block's rotary (sin, cos) tables of these patches (the same for every block, or per block)."""
        tables = rope(self.grid, self.keep)
        return tables if isinstance(tables, list) else [tables] * depth

    def spatial_grid(self) -> tuple[int, int]:
        """The grid windowed blocks and relative positions partition; ValueError when patches were dropped."""
        if self.keep is not None:
            raise ValueError("windowed attention (window_size) and relative positions (rel_pos) need every patch "
                             "token on its grid; run them without dropping patches (as ViTDet fine-tunes an MAE "
                             "encoder)")
        return self.grid

    def attention_mask(self, num_prefix_tokens: int) -> None:
        return None

    @property
    def valid(self) -> None:
        """Every token is an image's (a NaFlex layout's mask is its padding)."""
        return None


class TokenEmbedding:
    """Input -> token sequence, as a part of `VisionTransformer` (a mixin: the parameters, `patch_embed`,
    `cls_token`, `dist_token`, `reg_token`, `pos_embed`, stay the model's own, under timm's names).

    The steps, which masking objectives call one by one: `patch_embed` (images -> (B, N, D)), `embed_patches` (mask
    replaced, positions added, a subset kept, the prefix in front), or `embed_input` for either input kind."""

    def patch_pos_embed(self, grid: Sequence[int] | None = None) -> torch.Tensor | None:
        """(1, H*W, D) position embeddings of the patch slots, resampled when `grid` differs from the native one;
        None without added position embeddings (pos_embed rope or none)."""
        pos = self.pos_embed
        if pos is None:
            return None
        if grid is not None and tuple(grid) != self.grid_size:
            pos = self._resample_pos_embed(pos, grid)
        return pos[:, self.num_pos_prefix:]

    def add_pos(self, tokens: torch.Tensor, grid: Sequence[int] | None = None) -> torch.Tensor:
        pos = self.patch_pos_embed(grid)
        return tokens if pos is None else tokens + pos

    def prepend_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Put the class token, the distillation token and registers (each with its position embedding, if it has
        one) in front."""
        prefix = [t for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if not prefix:
            return tokens
        prefix = torch.cat(prefix, dim=1)
        if self.num_pos_prefix:
            prefix = prefix + self.pos_embed[:, : self.num_pos_prefix]
        return torch.cat([prefix.expand(tokens.shape[0], -1, -1), tokens], dim=1)

    def embed_patches(self, patches: torch.Tensor, grid: Sequence[int], mask: torch.Tensor | None = None,
                      mask_token: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Patch embeddings (B, N, D) of a `grid` -> the input token sequence: patches where `mask` (B, N) is true
        replaced by `mask_token` ((1, 1, D), or (B, N, D) per patch), position embeddings added, only the patches at
        `keep` (B, K) indices kept, the prefix tokens in front."""
        if mask is not None:
            patches = torch.where(mask[..., None], mask_token.to(patches.dtype), patches)
        tokens = self.add_pos(patches, grid)
        if keep is not None:
            tokens = torch.gather(tokens, 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
        return self.prepend_tokens(tokens)

    def embed(self, images: torch.Tensor, mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> torch.Tensor:
        """Images -> the input token sequence (`embed_patches` of their patch embeddings)."""
        return self.embed_input(images, mask, mask_token, keep)[0]

    def embed_input(self, images: torch.Tensor | dict, mask: torch.Tensor | None = None,
                    mask_token: torch.Tensor | None = None, keep: torch.Tensor | None = None):
        """Images (B, C, H, W) or a NaFlex batch (ssl_vit.naflex) -> (input tokens, their placement); `mask`,
        `mask_token`, `keep` as in `embed_patches` (on a NaFlex batch the kept slots keep their places and
        validity: padding stays masked)."""
        if not is_naflex(images):
            grid = self.patch_embed.grid_for(images.shape[-2], images.shape[-1])
            return self.embed_patches(self.patch_embed(images), grid, mask, mask_token, keep), \
                GridPlacement(grid, keep)
        layout = self.naflex_layout(images)
        tokens = self.embed_naflex(images, layout, mask, mask_token)
        if keep is not None:
            prefix = self.num_prefix_tokens
            kept = torch.gather(tokens[:, prefix:], 1, keep[..., None].expand(-1, -1, tokens.shape[-1]))
            tokens, layout = torch.cat([tokens[:, :prefix], kept], dim=1), layout.kept(keep)
        return tokens, layout

    # ----- NaFlex batches: images at their own sizes as padded flat patches (ssl_vit.naflex) -----
    def naflex_layout(self, batch: dict) -> NaFlexLayout:
        """The batch's layout; ValueError where this backbone cannot read NaFlex batches."""
        refusal = self.naflex_refusal()
        if refusal:
            raise ValueError(refusal)
        return NaFlexLayout.of(batch)

    def naflex_refusal(self) -> str | None:
        """Why this backbone cannot read NaFlex batches, or None."""
        if not isinstance(self.patch_embed, PatchEmbed):
            return "NaFlex batches need the patch stem (model.stem=patch): a hybrid's ResNet reads whole images"
        if self.windowed:
            return ("NaFlex batches with windowed attention or relative positions (window_size, rel_pos) are not "
                    "built: windows partition one grid")
        return None

    def naflex_pos_embed(self, layout: NaFlexLayout) -> torch.Tensor | None:
        """(B, N, D): each patch's position embedding from its image's own grid (resampled once per distinct
        grid, as a dense batch of that grid gets them), zero on padding; None without added ones. The parameter is
        read once: under ZeRO-3 a read may gather it, and the count of distinct grids differs between ranks."""
        table = self.pos_embed
        if table is None:
            return None

        def rows(grid, index):
            grid_table = table if tuple(grid) == self.grid_size else self._resample_pos_embed(table, grid)
            # index_select, not table[index]: the backward of advanced indexing (index_put_ with accumulate) sums
            # the many images of one grid in a thread-dependent order on the CPU (runs differed by 1 ulp)
            flat = grid_table[0, self.num_pos_prefix:].index_select(0, index.reshape(-1))
            return flat.reshape(*index.shape, -1)

        pos = layout.per_image(rows)
        return pos * layout.valid[..., None].to(pos.dtype)

    def embed_naflex(self, batch: dict, layout: NaFlexLayout, mask: torch.Tensor | None = None,
                     mask_token: torch.Tensor | None = None) -> torch.Tensor:
        """A NaFlex batch -> its input token sequence (B, prefix + N, D): `embed_patches` with per-image
        positions."""
        patches = self.patch_embed(batch["patches"])  # through the module: ZeRO-3 gathers its weights as usual
        if mask is not None:
            patches = torch.where(mask[..., None], mask_token.to(patches.dtype), patches)
        pos = self.naflex_pos_embed(layout)
        return self.prepend_tokens(patches if pos is None else patches + pos)  # promoted as add_pos is (autocast)
