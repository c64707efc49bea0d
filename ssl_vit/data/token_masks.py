"""iBOT's token masks for the global crops (BEiT's block masking, as DINOv2 draws them): drawn per batch in the
loader's collate (`ViewBuilder.collate`, from the batch's seed), as DINOv2's `collate_data_and_cast` does, so the
training process neither draws them in a Python loop nor reads a data-dependent count back from the device: the
batch carries the (N, patches) bool masks and the flat indices of the masked patches (row-major), which pick the
masked tokens with `index_select`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def block_mask(grid: tuple[int, int], num_masked: int, generator: torch.Generator, min_block: int = 4,
               max_aspect: float = 1 / 0.3, attempts: int = 10, max_block: int | None = None) -> torch.Tensor:
    """BEiT's block masking as DINOv2's `MaskingGenerator` draws it: rectangles of area uniform between `min_block`
    and what is left to mask (at most `max_block`; DINOv2 caps it at half the patches) and log-uniform aspect ratio,
    narrower and lower than the grid, are added until `num_masked` patches are masked or 10 draws in a row fail.
    With fewer than `min_block` patches left the area is drawn between the two (the uniform of reversed bounds),
    so the last block is not a tiny filler. Returns a (rows, cols) bool mask with at most `num_masked` set."""
    rows, cols = grid
    max_block = (rows * cols) // 2 if max_block is None else max_block
    mask = torch.zeros(rows, cols, dtype=torch.bool)

    def uniform(low, high):
        return low + (high - low) * float(torch.rand((), generator=generator))

    count = 0
    while count < num_masked:
        left = min(num_masked - count, max_block)
        added = 0
        for _ in range(attempts):
            area = uniform(min_block, left)
            aspect = math.exp(uniform(-math.log(max_aspect), math.log(max_aspect)))
            h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if not (h < rows and w < cols):
                continue
            top = int(torch.randint(0, rows - h + 1, (), generator=generator))
            start = int(torch.randint(0, cols - w + 1, (), generator=generator))
            new = int((~mask[top:top + h, start:start + w]).sum())
            if 0 < new <= left:
                mask[top:top + h, start:start + w] = True
                added = new
                break
        if not added:
            break
        count += added
    return mask


def ibot_masks(batch: int, grid: tuple[int, int], ratio=(0.1, 0.5), probability: float = 0.5,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch, rows * cols) bool masks as DINOv2 draws them: int(batch * probability) images get a block mask, their
    ratios spread over `ratio` (image i draws from the i-th of equal sub-intervals), the others none; the order of
    images is shuffled."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    patches = grid[0] * grid[1]
    masked = int(batch * probability)
    bounds = torch.linspace(ratio[0], ratio[1], masked + 1)
    masks = torch.zeros(batch, patches, dtype=torch.bool)
    for i in range(masked):
        r = float(bounds[i] + (bounds[i + 1] - bounds[i]) * torch.rand((), generator=generator))
        masks[i] = block_mask(grid, int(patches * r), generator).flatten()
    return masks[torch.randperm(batch, generator=generator)]


@dataclass(frozen=True)
class GlobalCropMasks:
    """What the collate draws for a multi-crop objective with a masked-token loss: masks for the `n_global` global
    crops of every image, on a `grid` of patches."""

    grid: tuple[int, int]
    n_global: int
    ratio: tuple[float, float] = (0.1, 0.5)
    probability: float = 0.5

    def draw(self, batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """{"global_masks": (n_global * batch, patches) bool, crop-major as the crops are stacked;
        "global_mask_indices": the flat indices of its true entries}."""
        masks = ibot_masks(self.n_global * batch, tuple(self.grid), tuple(self.ratio), self.probability, generator)
        return {"global_masks": masks, "global_mask_indices": masks.flatten().nonzero().squeeze(1)}
