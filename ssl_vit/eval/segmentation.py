"""Dense evaluation: DINOv2's linear segmentation protocol on frozen patch tokens (single scale).

The encoder's patch tokens (after the final norm; `blocks=k` concatenates the last k blocks' patch tokens, as
DINOv2's "+ms" head reads 4) are extracted once per image on its (h, w) grid. A linear layer maps each token to
class logits; the logits are upsampled bilinearly to the mask's resolution and scored by cross-entropy over the
labelled pixels (255 ignored). Because upsampling is linear, the problem is convex in the layer's weights, so, as the
linear probe (ssl_vit.eval.linear), it is solved full-batch with L-BFGS (no learning rate or epochs to tune) on
standardised tokens, its L2 strength chosen on a held-out part of the training images (`sweep_l2`: the grid
extended past an edge while it improves; scored by mIoU), then refit on all of them and scored once on the test set.

Scores (mmsegmentation's definitions, from one confusion matrix over every test pixel): IoU per class =
TP / (TP + FP + FN), mIoU = the mean over the classes present in the test masks or predicted; pixel accuracy =
correct / labelled pixels.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import tv_tensors

from ssl_vit.data.errors import NoUsableSamplesError
from ssl_vit.data.segmentation import IGNORE_INDEX
from ssl_vit.data.views import eval_transform
from ssl_vit.eval.linear import CHUNK_ELEMENTS, held_out_split, standardise, sweep_l2
from ssl_vit.eval.readable import ReadableSamples, collate_readable
from ssl_vit.progress import progress_bar

log = logging.getLogger(__name__)
MAX_ITER = 200


class MaskedView:
    """(image normalised as `preprocess` says, mask) of a sample, the encoder's eval transform applied to both (the
    mask nearest-neighbour)."""

    def __init__(self, preprocess):
        self.spatial = eval_transform(preprocess.img_size, preprocess.interpolation, preprocess.crop_pct,
                                      preprocess.resize_mode)
        self.mean = torch.tensor(preprocess.mean).view(-1, 1, 1)
        self.std = torch.tensor(preprocess.std).view(-1, 1, 1)

    def __call__(self, sample: dict, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if "mask" not in sample:
            raise ValueError("eval=segmentation needs samples with masks (data=synthetic, tuxpaint_seg or segfolder)")
        image, mask = self.spatial(tv_tensors.Image(sample["image"]), tv_tensors.Mask(sample["mask"]))
        return (image.as_subclass(torch.Tensor).float() / 255 - self.mean) / self.std, mask.as_subclass(torch.Tensor)


def patch_tokens(encoder, images: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """(B, D x blocks, h, w): the patch tokens of the last `blocks` blocks (the last after the final norm, as
    `forward_features`; earlier ones as `forward_intermediates` gives them), on the encoder's grid."""
    grid = encoder.patch_embed.grid_for(images.shape[-2], images.shape[-1])
    layers = [encoder.forward_features(images)] if blocks == 1 else encoder.forward_intermediates(images, blocks)
    tokens = torch.cat([t[:, encoder.num_prefix_tokens:] for t in layers], dim=-1)
    return tokens.transpose(1, 2).reshape(len(images), -1, *grid)


@torch.no_grad()
def extract_dense(encoder, dataset, preprocess, blocks: int = 1, batch_size: int = 64, progress: bool = True,
                  desc: str = "patch tokens", dense_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D, h, w) float32 patch tokens and (N, H, W) int64 masks of a dataset, in order, the encoder in eval mode
    where it is. `dense_fn`: images -> (B, D, h, w), instead of the encoder's own tokens."""
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device
    loader = DataLoader(ReadableSamples(dataset, MaskedView(preprocess), "the segmentation evaluation"),
                        batch_size=batch_size, shuffle=False, collate_fn=collate_readable)
    features, masks = [], []
    for batch, _ in progress_bar(loader, desc=desc, enabled=progress, leave=False):
        if batch is None:
            continue
        images, targets = batch
        images = images.to(device)
        dense = dense_fn(images) if dense_fn is not None else patch_tokens(encoder, images, blocks)
        features.append(dense.float().cpu())
        masks.append(targets.long())
    encoder.train(was_training)
    if not features:
        raise NoUsableSamplesError(f"{desc}: none of the {len(dataset)} samples could be read")
    return torch.cat(features), torch.cat(masks)


def _standardise_channels(train: torch.Tensor, *others: torch.Tensor):
    """`standardise` (the linear probe's) per channel of (N, D, h, w) tokens, with the training tokens' statistics."""
    rows = [x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]) for x in (train, *others)]
    return [r.view(x.shape[0], *x.shape[2:], -1).permute(0, 3, 1, 2)
            for r, x in zip(standardise(*rows), (train, *others), strict=True)]


def _chunks(features: torch.Tensor, masks: torch.Tensor, num_classes: int):
    """(features, masks) in chunks whose upsampled logits hold about CHUNK_ELEMENTS numbers."""
    size = max(1, CHUNK_ELEMENTS // (num_classes * masks[0].numel()))
    return zip(features.split(size), masks.split(size), strict=True)


def segmentation_logits(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        size: tuple[int, int]) -> torch.Tensor:
    """(N, C, H, W): a linear layer on every patch token, upsampled bilinearly to `size`."""
    logits = torch.einsum("ndhw,dc->nchw", features, weight) + bias.view(1, -1, 1, 1)
    return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


def fit_linear_head(features: torch.Tensor, masks: torch.Tensor, num_classes: int, l2: float,
                    max_iter: int = MAX_ITER, init=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (D, C) weight and (C,) bias minimising the mean cross-entropy over labelled pixels + l2/2 ||W||^2, by
    L-BFGS (strong Wolfe line search), from `init` or zero."""
    weight = (init[0].clone() if init else torch.zeros(features.shape[1], num_classes)).requires_grad_(True)
    bias = (init[1].clone() if init else torch.zeros(num_classes)).requires_grad_(True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, history_size=20, tolerance_grad=1e-6,
                                  tolerance_change=1e-9, line_search_fn="strong_wolfe")
    labelled = int((masks != IGNORE_INDEX).sum())

    def closure():
        optimizer.zero_grad()
        total = 0.5 * l2 * weight.square().sum()
        total.backward()
        for chunk, target in _chunks(features, masks, num_classes):
            logits = segmentation_logits(chunk, weight, bias, tuple(masks.shape[-2:]))
            loss = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum") / labelled
            loss.backward()
            total = total + loss.detach()
        return total

    optimizer.step(closure)
    return weight.detach(), bias.detach()


@torch.no_grad()
def confusion_matrix(features, masks, weight, bias, num_classes: int) -> torch.Tensor:
    """(C, C) counts of (true class, predicted class) over the labelled pixels."""
    counts = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    for chunk, target in _chunks(features, masks, num_classes):
        predicted = segmentation_logits(chunk, weight, bias, tuple(target.shape[-2:])).argmax(1)
        keep = target != IGNORE_INDEX
        counts += torch.bincount(target[keep] * num_classes + predicted[keep],
                                 minlength=num_classes * num_classes).view(num_classes, num_classes)
    return counts


def scores(confusion: torch.Tensor, class_names=None) -> dict:
    """mIoU, pixel accuracy and the IoU of each class present (in the masks or the predictions)."""
    confusion = confusion.double()
    true_positive = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - true_positive
    present = union > 0
    iou = true_positive[present] / union[present]
    names = list(class_names) if class_names else [str(i) for i in range(len(confusion))]
    return {"miou": float(iou.mean()), "pixel_accuracy": float(true_positive.sum() / confusion.sum()),
            "iou": {names[i]: float(true_positive[i] / union[i]) for i in present.nonzero().flatten().tolist()}}


def constant_prediction_scores(train_masks, test_masks, num_classes: int) -> dict:
    """Chance level: the mIoU and pixel accuracy of predicting the training masks' most frequent class everywhere."""
    train = train_masks[train_masks != IGNORE_INDEX].flatten()
    majority = int(torch.bincount(train, minlength=num_classes).argmax())
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    confusion[:, majority] = torch.bincount(test_masks[test_masks != IGNORE_INDEX].flatten(), minlength=num_classes)
    result = scores(confusion)
    return {"miou": result["miou"], "pixel_accuracy": result["pixel_accuracy"]}


def linear_segmentation(train_features, train_masks, test_features, test_masks, num_classes: int, l2_values,
                        val_fraction: float = 0.2, seed: int = 0, class_names=None, max_iter: int = MAX_ITER) -> dict:
    """Choose the L2 strength by validation mIoU on a held-out `val_fraction` of the training images, refit on all
    of them, score on the test images."""
    val_idx, fit_idx = held_out_split(len(train_masks), val_fraction, seed)
    fit_x, val_x = _standardise_channels(train_features[fit_idx], train_features[val_idx])
    fit_y, val_y = train_masks[fit_idx], train_masks[val_idx]
    solutions = {}

    def fit_and_score(l2, warm_from):
        solutions[l2] = fit_linear_head(fit_x, fit_y, num_classes, l2, max_iter, solutions.get(warm_from))
        return scores(confusion_matrix(val_x, val_y, *solutions[l2], num_classes))["miou"]

    val_miou, best, extended = sweep_l2(fit_and_score, l2_values)
    train_x, test_x = _standardise_channels(train_features, test_features)
    weight, bias = fit_linear_head(train_x, train_masks, num_classes, best, max_iter, solutions[best])
    result = scores(confusion_matrix(test_x, test_masks, weight, bias, num_classes), class_names)
    return {"accuracy": result["miou"], **result, "l2": best,
            "val_miou": {str(k): val_miou[k] for k in sorted(val_miou)}, "l2_grid_extended": extended,
            "num_classes": num_classes, "grid": list(train_features.shape[-2:]),
            "chance": constant_prediction_scores(train_masks, test_masks, num_classes),
            "mask_size": list(train_masks.shape[-2:])}


def segmentation_eval(encoder, train_set, test_set, preprocess, ecfg, seed: int = 0, progress: bool = True,
                      dense_fn=None, cache=None) -> dict:
    """eval=segmentation: DINOv2's linear protocol (module docstring) on a dataset with masks. `cache(split,
    compute)`: where given, the patch tokens of a split come from it (ssl-vit benchmark's feature cache)."""
    names = tuple(getattr(test_set, "segmentation_classes", ()) or ())
    if not names:
        raise ValueError("eval=segmentation needs a dataset with masks: data=synthetic, tuxpaint_seg or segfolder")
    blocks = ecfg.segmentation_blocks

    def tokens(split: str, dataset):
        def compute():
            return extract_dense(encoder, dataset, preprocess, blocks, ecfg.batch_size, progress,
                                 f"{split} patch tokens", dense_fn)
        return cache(split, compute) if cache is not None else compute()

    train, test = tokens("train", train_set), tokens("test", test_set)
    return {**linear_segmentation(*train, *test, len(names), list(ecfg.l2_values), ecfg.val_fraction, seed, names),
            "blocks": blocks, "num_train": len(train[1]), "num_test": len(test[1])}
