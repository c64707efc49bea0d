"""Frozen features, extracted once per (encoder, data, options) and cached on disk.

Feature kinds: `cls` (the class token after the final norm), `avg` (mean of the patch tokens), `cls_avg` (both
concatenated), `last_k` (the class tokens of the last k blocks concatenated, as DINO's linear evaluation; the
average patch token per block for models without a class token), and `pooled` (the encoder's own embedding).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, default_collate

from ssl_vit.data.errors import NoUsableSamplesError
from ssl_vit.data.naflex import stack_images, to_device
from ssl_vit.eval.readable import ReadableSamples, collate_readable
from ssl_vit.interop.native import NativeEncoder, native_kind
from ssl_vit.naflex import masked_mean, patch_valid
from ssl_vit.progress import progress_bar
from ssl_vit.untrusted import describe_error, weights_only_refusal

log = logging.getLogger(__name__)
FEATURE_KINDS = ("cls", "avg", "cls_avg", "last_k", "pooled")


def labelled_view(views, sample: dict, index: int) -> tuple:
    """(image, label) of a sample, through the encoder's eval views."""
    out = views(sample)
    return out["image"], out["label"]


def collate_labelled(views, items: list[tuple]) -> tuple:
    """(images: a tensor or a NaFlex batch, labels) of (image, label) pairs."""
    images, labels = zip(*items, strict=True)
    return stack_images(views, list(images)), default_collate(list(labels))




def our_feature_kind(encoder, requested: str) -> str:
    """The feature kind `requested` (eval.features) means for one of our encoders: the class-token kinds become the
    encoder's pooled embedding where it has no class token (SigLIP's MAP head, AIMv2's mean) or pools by attention
    (Perception Encoder: the class token is one input of its attention pool, which gives the image's embedding);
    evaluate and benchmark both ask this."""
    if requested in ("cls", "cls_avg") and (encoder.cls_token is None or encoder.global_pool == "map"):
        return "pooled"
    return requested


def features_from_tokens(encoder, images: torch.Tensor, kind: str, last_k: int = 4) -> torch.Tensor:
    if isinstance(encoder, NativeEncoder):  # a library's own model: its summary or its token mean
        return encoder.features(images, native_kind(encoder, kind), last_k)
    if kind not in FEATURE_KINDS:
        raise ValueError(f"unknown feature kind {kind!r}; valid choices: {list(FEATURE_KINDS)}")
    prefix = encoder.num_prefix_tokens
    has_cls = encoder.cls_token is not None
    if kind in ("cls", "cls_avg") and not has_cls:
        raise ValueError(f"feature kind {kind!r} needs a class token; this encoder has none (use 'avg' or 'pooled')")
    valid = patch_valid(images)
    if kind == "last_k":
        blocks = encoder.forward_intermediates(images, last_k)
        return torch.cat([t[:, 0] if has_cls else masked_mean(t[:, prefix:], valid) for t in blocks], dim=-1)
    tokens = encoder.forward_features(images)
    if kind == "pooled":
        return encoder.pool(tokens, valid)
    if kind == "cls":
        return tokens[:, 0]
    average = masked_mean(tokens[:, prefix:], valid)
    return average if kind == "avg" else torch.cat([tokens[:, 0], average], dim=-1)


@torch.no_grad()
def extract_features(encoder, dataset, views, kind: str = "cls", last_k: int = 4, batch_size: int = 256,
                     num_workers: int = 0, device: str | torch.device | None = None, progress: bool = True,
                     desc: str = "features", embed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, F) float32 features and (N,) labels of a map-style dataset, in dataset order, encoder in eval mode, on
    `device` (None: where the encoder is, which is not moved: during training it is the live model on its device).
    `embed`: images -> features, instead of the feature `kind` of the encoder's tokens (a distilled student's
    adaptor: then `encoder` is the module holding it).

    Samples that cannot be read (BadSampleError: a corrupt or empty image file) are left out with their labels, so
    N can be smaller than len(dataset); the first few are logged by name and the total at the end."""
    was_training = encoder.training
    encoder.eval()
    if device is not None:
        encoder.to(device)
    device = next(encoder.parameters()).device
    readable = ReadableSamples(dataset, functools.partial(labelled_view, views), "the features")
    loader = DataLoader(readable, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        collate_fn=functools.partial(collate_readable, collate=functools.partial(collate_labelled,
                                                                                                   views)))
    features, labels, dropped = [], [], 0
    for batch, bad in progress_bar(loader, desc=desc, enabled=progress, leave=False):
        dropped += bad
        if batch is not None:
            images, targets = batch
            images = to_device(images, device)
            embedded = embed(images) if embed is not None else features_from_tokens(encoder, images, kind, last_k)
            features.append(embedded.float().cpu())
            labels.append(targets)
    encoder.train(was_training)
    if dropped:
        log.warning("%s: dropped %d of %d samples that could not be read (the first ones are named above)", desc,
                    dropped, len(dataset))
    if not features:
        raise NoUsableSamplesError(f"{desc}: none of the {len(dataset)} samples could be read")
    return torch.cat(features), torch.cat(labels)


def cache_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_cache(path: Path) -> tuple[dict | None, str | None]:
    """(the cache file's {"features", "labels"}, None), or (None, what is wrong with it): unreadable, holding more
    than tensors (read as weights only, never unpickled in full), or not two tensors of one length."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, foreign, crafted: torch's, zipfile's or pickle's own errors
        refused = weights_only_refusal(err)
        return None, (f"holds more than tensors ({refused}; read as weights only, nothing of it ran)" if refused
                      else f"is unreadable ({describe_error(err)})")
    if not (isinstance(saved, dict) and all(isinstance(saved.get(k), torch.Tensor) for k in ("features", "labels"))
            and len(saved["features"]) == len(saved["labels"])):
        return None, "does not hold {features, labels} of one length"
    return saved, None


def cached(cache_dir: str | Path | None, key: str, compute):
    """Load (features, labels) from cache_dir/<key>.pt, or compute and store them (atomically)."""
    if cache_dir is None:
        return compute()
    path = Path(cache_dir) / f"{key}.pt"
    if path.exists():
        saved, problem = read_cache(path)
        if problem is None:
            return saved["features"], saved["labels"]
        log.warning("feature cache %s %s: computed again", path, problem)
    features, labels = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({"features": features, "labels": labels}, tmp)
    os.replace(tmp, path)
    return features, labels
