"""The non-image views every view builder gives the same way: the class label and the tokenised caption."""

from __future__ import annotations

from ssl_vit.data.errors import MissingTextError


def label_and_text(views, sample: dict, tokenizer=None) -> dict:
    """{"label": ..., "text": ...}, those of the two that `views` names; a missing label is a KeyError naming what
    the samples have, a missing caption a MissingTextError (the loaders skip and count it)."""
    out = {}
    if "label" in views:
        if "label" not in sample:
            raise KeyError(f"the objective needs 'label' but the dataset's samples have {sorted(sample)}")
        out["label"] = sample["label"]
    if "text" in views:
        text = sample.get("text")
        if not text:
            where = sample.get("meta", {}).get("path") or sample.get("key") or "a sample"
            raise MissingTextError(f"{where} has no caption")
        out["text"] = tokenizer(text) if tokenizer is not None else text
    return out
