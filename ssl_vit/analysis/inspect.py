"""The paper's model inspections (section 4.5), as arrays: position-embedding similarity, mean attention
distance per head and layer, attention rollout from the class token, and principal components of the
patch-embedding filters. Plotting lives in `ssl_vit.analysis.plots`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pos_embed_similarity(encoder) -> torch.Tensor:
    """(H, W, H, W) cosine similarity between the position embeddings of every pair of patch positions."""
    rows, cols = encoder.grid_size
    patches = F.normalize(encoder.patch_pos_embed().detach()[0].float(), dim=-1)  # (H*W, D)
    return (patches @ patches.T).reshape(rows, cols, rows, cols)


def patch_distances(grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between patch centres, raster order."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1).float() * patch_size
    return torch.cdist(centres, centres)


def mean_attention_distance(attentions: list[torch.Tensor], grid: tuple[int, int], patch_size: int,
                            num_prefix_tokens: int = 1) -> torch.Tensor:
    """(layers, heads) attention-weighted mean pixel distance from each query patch to the key patches,
    averaged over queries and images. Only patch-to-patch attention counts, renormalised over the patch keys."""
    distances = patch_distances(grid, patch_size)
    out = []
    for attention in attentions:  # (B, heads, n, n)
        patch = attention[:, :, num_prefix_tokens:, num_prefix_tokens:].float()
        patch = patch / patch.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        out.append((patch * distances).sum(dim=-1).mean(dim=(0, 2)))
    return torch.stack(out)


def attention_rollout(attentions: list[torch.Tensor], head_fusion: str = "mean") -> torch.Tensor:
    """(B, n, n) rollout (Abnar & Zuidema 2020): fuse heads, add the identity for the residual path,
    renormalise rows, multiply through the layers (first layer rightmost)."""
    fuse = {"mean": lambda a: a.mean(dim=1), "max": lambda a: a.amax(dim=1), "min": lambda a: a.amin(dim=1)}
    if head_fusion not in fuse:
        raise ValueError(f"unknown head_fusion {head_fusion!r}; valid choices: {list(fuse)}")
    rollout = None
    for attention in attentions:
        fused = fuse[head_fusion](attention.float())
        fused = fused + torch.eye(fused.shape[-1])
        fused = fused / fused.sum(dim=-1, keepdim=True)
        rollout = fused if rollout is None else fused @ rollout
    return rollout


def class_token_rollout_maps(attentions: list[torch.Tensor], grid: tuple[int, int], num_prefix_tokens: int = 1,
                             head_fusion: str = "mean") -> torch.Tensor:
    """(B, H, W) how much of the class token's rolled-out attention lands on each patch."""
    rollout = attention_rollout(attentions, head_fusion)
    return rollout[:, 0, num_prefix_tokens:].reshape(-1, *grid)


def patch_embedding_components(encoder, num_components: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the patch-embedding filters: ((k, C, P, P) components, (k,) explained variance
    ratios). Each of the D filters is one sample of dimension C*P*P."""
    weight = encoder.patch_embed.proj.weight.detach().float()  # (D, C, P, P)
    flat = weight.flatten(1)
    flat = flat - flat.mean(dim=0)
    _, singular, components = torch.linalg.svd(flat, full_matrices=False)
    k = min(num_components, components.shape[0])
    variance = singular.pow(2)
    return components[:k].reshape(k, *weight.shape[1:]), (variance / variance.sum())[:k]
