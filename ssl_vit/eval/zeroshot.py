"""Zero-shot classification and image-text retrieval with an image-text model (objectives/clip.py).

Zero-shot (CLIP's protocol, open_clip's `build_zero_shot_classifier`): each class name is put into every prompt
template, the prompts are embedded and L2-normalised, averaged per class and re-normalised; an image's logits are
100 x (normalised image embedding . class embedding), its prediction the arg-max.

Retrieval: images and their captions of a held-out split, both embedded and normalised; image->text recall@k is the
fraction of images whose caption is among the k texts most similar to it, text->image the converse. Identical
captions are interchangeable (synthetic shapes repeat captions): a retrieved text counts when its caption is the
image's caption.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils.data import DataLoader, default_collate

from ssl_vit.data.errors import MissingTextError
from ssl_vit.data.naflex import stack_images, to_device
from ssl_vit.data.registry import dataset_kind
from ssl_vit.eval.readable import ReadableSamples, collate_readable
from ssl_vit.progress import progress_bar

log = logging.getLogger(__name__)

def templates_for(data_name: str, configured=None) -> list[str]:
    """The prompts `configured` (eval.zeroshot_templates, objective.templates), else the dataset kind's own."""
    templates = list(configured or dataset_kind(data_name).templates)
    bad = [t for t in templates if "{}" not in t]
    if bad:
        raise ValueError(f"zero-shot templates must contain '{{}}' for the class name: {bad}")
    return templates


def class_names(dataset) -> list[str]:
    """Readable class names: folder names with underscores as spaces ('T-shirt/top' stays)."""
    names = list(getattr(dataset, "classes", None) or [])
    if not names:
        raise ValueError("zero-shot classification needs class names; this dataset declares none")
    return [str(name).replace("_", " ") for name in names]


@torch.no_grad()
def zeroshot_classifier(model, tokenizer, classnames, templates, device="cpu") -> torch.Tensor:
    """(embed_dim, num_classes) class embeddings (open_clip's build_zero_shot_classifier)."""
    from open_clip.zero_shot_classifier import build_zero_shot_classifier  # heavy: only when zero-shot runs

    was_training = model.training
    model.eval()
    weights = build_zero_shot_classifier(model, tokenizer, classnames, templates, num_classes_per_batch=None,
                                         device=device)
    model.train(was_training)
    return weights


def image_text_pair(views, tokenizer, need_text: bool, sample: dict, index: int) -> tuple:
    """(image, token ids, caption, label or -1) of a sample; a sample without a caption is refused when text is
    needed."""
    image = views(sample)["image"]
    text = sample.get("text") or ""
    if need_text and not text:
        raise MissingTextError(f"sample {index} has no caption")
    tokens = tokenizer(text) if need_text else torch.zeros(0, dtype=torch.long)
    return image, tokens, text, int(sample.get("label", -1))


def _collate_pairs(views, readable: list) -> tuple:
    tokens, _, labels = default_collate([(t, 0, y) for _, t, _, y in readable])
    return stack_images(views, [item[0] for item in readable]), tokens, [item[2] for item in readable], labels


@torch.no_grad()
def embed_pairs(model, dataset, views, tokenizer, need_text: bool, batch_size: int = 256, device="cpu",
                progress: bool = False, desc: str = "embedding") -> dict:
    """Normalised image (and text) embeddings of a map-style dataset, in order, with captions and labels; samples
    that cannot be read (or lack a caption when text is needed) are left out and counted in `skipped`."""
    was_training = model.training
    model.eval()
    pairs = ReadableSamples(dataset, functools.partial(image_text_pair, views, tokenizer, need_text),
                            "the embeddings")
    collate = functools.partial(collate_readable, collate=functools.partial(_collate_pairs, views))
    loader = DataLoader(pairs, batch_size=batch_size, collate_fn=collate)
    images, texts, captions, labels, skipped = [], [], [], [], 0
    for batch, dropped in progress_bar(loader, desc=desc, enabled=progress, leave=False):
        skipped += dropped
        if batch is None:
            continue
        pixels, tokens, caption, label = batch
        images.append(model.encode_image(to_device(pixels, device), normalize=True).float().cpu())
        if need_text:
            texts.append(model.encode_text(tokens.to(device), normalize=True).float().cpu())
        captions += caption
        labels.append(label)
    model.train(was_training)
    if not images:
        raise ValueError("no readable samples to embed")
    if skipped:
        log.warning("%d sample(s) left out of the embeddings (unreadable or without a caption)", skipped)
    return {"image": torch.cat(images), "text": torch.cat(texts) if texts else None, "captions": captions,
            "labels": torch.cat(labels), "skipped": skipped}


def zeroshot_accuracy(image_embeddings: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor) -> dict:
    logits = 100.0 * image_embeddings @ classifier
    top1 = (logits.argmax(dim=1) == labels).float().mean().item()
    k = min(5, classifier.shape[1])
    topk = (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).float().mean().item()
    return {"accuracy": top1, f"top{k}": topk}


def retrieval_recall(image_embeddings: torch.Tensor, text_embeddings: torch.Tensor, captions: list[str],
                     ks=(1, 5, 10)) -> dict[str, float]:
    """Image->text and text->image recall@k of paired embeddings (row i of each is pair i); a retrieved item
    counts when its caption equals the query's (see the module docstring)."""
    if len(image_embeddings) != len(text_embeddings) or len(captions) != len(image_embeddings):
        raise ValueError(f"need one caption per image: {len(image_embeddings)} images, {len(text_embeddings)} texts, "
                         f"{len(captions)} captions")
    index = {caption: i for i, caption in enumerate(dict.fromkeys(captions))}
    ids = torch.tensor([index[c] for c in captions])
    same = ids[:, None] == ids[None, :]  # (images, texts): the text is a caption of the image
    similarity = image_embeddings @ text_embeddings.T
    out = {}
    for k in ks:
        k_eff = min(k, len(captions))
        to_text = similarity.topk(k_eff, dim=1).indices  # (images, k) text indices
        to_image = similarity.topk(k_eff, dim=0).indices  # (k, texts) image indices
        out[f"image_to_text_R@{k}"] = same.gather(1, to_text).any(dim=1).float().mean().item()
        out[f"text_to_image_R@{k}"] = same.gather(0, to_image).any(dim=0).float().mean().item()
    return out
