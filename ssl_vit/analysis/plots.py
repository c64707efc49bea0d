"""PNG figures of the model inspections (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_pos_embed_similarity(similarity: torch.Tensor, path) -> Path:
    """One small map per patch position (laid out on the grid): its similarity to every other position."""
    rows, cols = similarity.shape[:2]
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 0.6 + 1, rows * 0.6), squeeze=False)
    for r in range(rows):
        for c in range(cols):
            image = axes[r][c].imshow(similarity[r, c].numpy(), vmin=-1, vmax=1, cmap="viridis")
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
    fig.supxlabel("input patch column")
    fig.supylabel("input patch row")
    fig.colorbar(image, ax=axes, shrink=0.6, label="cosine similarity")
    fig.suptitle("Position embedding similarity")
    return _save(fig, path)


def plot_attention_distance(distances: torch.Tensor, path, image_size: int) -> Path:
    layers, heads = distances.shape
    fig, ax = plt.subplots(figsize=(5, 4))
    for head in range(heads):
        ax.scatter(range(1, layers + 1), distances[:, head].numpy(), s=14, label=f"head {head + 1}")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_ylim(0, image_size)
    ax.set_title("Mean attention distance per head")
    if heads <= 16:
        ax.legend(fontsize=6, ncol=2)
    return _save(fig, path)


def plot_rollout(images: torch.Tensor, maps: torch.Tensor, path) -> Path:
    """images: (B, 3, H, W) in [0, 1]; maps: (B, h, w) rollout maps, upsampled and overlaid."""
    count = len(images)
    fig, axes = plt.subplots(2, count, figsize=(2 * count, 4), squeeze=False)
    size = images.shape[-2:]
    upsampled = torch.nn.functional.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    for i in range(count):
        axes[0][i].imshow(images[i].permute(1, 2, 0).numpy())
        axes[1][i].imshow(images[i].permute(1, 2, 0).numpy())
        heat = upsampled[i] / upsampled[i].max().clamp_min(1e-12)
        axes[1][i].imshow(heat.numpy(), cmap="jet", alpha=0.5)
        for row in (0, 1):
            axes[row][i].axis("off")
    fig.suptitle("Attention rollout from the class token")
    return _save(fig, path)


def plot_filter_components(components: torch.Tensor, variance: torch.Tensor, path) -> Path:
    k = len(components)
    cols = min(7, k)
    rows = (k + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.1, rows * 1.2), squeeze=False)
    for index in range(rows * cols):
        ax = axes[index // cols][index % cols]
        ax.axis("off")
        if index < k:
            component = components[index]
            component = (component - component.min()) / (component.max() - component.min()).clamp_min(1e-12)
            ax.imshow(component.permute(1, 2, 0).numpy())
            ax.set_title(f"{100 * variance[index]:.1f}%", fontsize=7)
    fig.suptitle("Principal components of the patch-embedding filters")
    return _save(fig, path)
