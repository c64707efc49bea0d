"""Fine-tuning evaluation: the whole encoder plus a fresh zero-initialised linear head (the paper's fine-tuning
head), AdamW with layer-wise learning-rate decay (the BEiT / MAE recipe; the ViT paper used SGD with momentum),
warmup + cosine, optionally at a higher resolution than pre-training (position embeddings resampled in 2-D with
the class slot kept). The caller's encoder is not modified."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ssl_vit.data import ViewBuilder, build_loader
from ssl_vit.optim import apply_schedule, param_groups, schedule
from ssl_vit.progress import progress_bar


class Classifier(nn.Module):
    def __init__(self, encoder, num_classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.embed_dim, num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, images):
        return self.head(self.encoder.pool(self.encoder.forward_features(images)))


@torch.no_grad()
def classification_accuracy(model, dataset, views, batch_size: int = 256) -> float:
    model.eval()
    correct = total = 0
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=lambda items: [views(i) for i in items])
    for items in loader:
        images = torch.stack([i["image"] for i in items])
        labels = torch.tensor([i["label"] for i in items])
        correct += (model(images).argmax(dim=1) == labels).sum().item()
        total += len(labels)
    return correct / total


def finetune(encoder, train_set, test_set, *, mean, std, interpolation: str = "bilinear", crop_pct: float = 1.0,
             resize_mode: str = "shortest", img_size: int | None = None, steps: int = 300,
             batch_size: int = 64, lr: float = 1e-3, min_lr: float = 1e-6, warmup_steps: int = 30,
             weight_decay: float = 0.05, layer_decay: float | None = 0.75, augment: bool = True, seed: int = 0,
             num_workers: int = 0, progress: bool = True) -> dict:
    torch.manual_seed(seed)
    encoder = copy.deepcopy(encoder)
    native = encoder.patch_embed.img_size[0]
    img_size = img_size or native
    if img_size != native:
        encoder.set_img_size(img_size)
    model = Classifier(encoder, len(train_set.classes)).train()
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay, layer_decay, len(encoder.blocks)), lr=lr)
    lrs = schedule(lr, min_lr, steps, warmup_steps)
    train_views = ViewBuilder(("image", "label"), img_size, mean, std, augment=augment, interpolation=interpolation,
                              crop_pct=crop_pct)
    batches = iter(build_loader(train_set, train_views, batch_size, seed=seed, num_workers=num_workers))
    losses = []
    for step in progress_bar(range(steps), desc="finetune", enabled=progress, leave=False):
        apply_schedule(optimizer, float(lrs[step]), weight_decay)
        batch = next(batches)
        loss = F.cross_entropy(model(batch["image"]), batch["label"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    test_views = ViewBuilder(("image", "label"), img_size, mean, std, interpolation=interpolation, crop_pct=crop_pct,
                             resize_mode=resize_mode)
    return {"accuracy": classification_accuracy(model, test_set, test_views), "steps": steps, "img_size": img_size,
            "layer_decay": layer_decay, "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
