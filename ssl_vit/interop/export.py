"""Export an encoder (or a CLIP / SigLIP model) for another library: the dispatch behind `ssl-vit export`
(scripts/export.py) and `ssl_vit.export`. Each target's writer is its own module here (hf, timm, timm_naflex, onnx,
open_clip, sam, vitdet); this one chooses it, writes the model card and says how to load the result."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ssl_vit.artifacts import load_heads, read_preprocess, run_files, save_encoder
from ssl_vit.interop.hf import default_arch, export_hf
from ssl_vit.interop.onnx import export_onnx
from ssl_vit.interop.open_clip import export_open_clip
from ssl_vit.interop.sam import export_timm_sam
from ssl_vit.interop.sources import LIBRARIES, load_pretrained
from ssl_vit.interop.timm import export_timm
from ssl_vit.interop.timm_naflex import export_timm_naflex
from ssl_vit.interop.vitdet import export_vitdet
from ssl_vit.model_card import write_model_card
from ssl_vit.objectives import load_trained, recorded_objective_class

TARGETS = ("hf", "timm", "onnx", "open_clip", "safetensors", "detectron2")
TIMM_ARCHS = ("vit", "naflexvit")  # --to timm: the classic VisionTransformer, or NaFlexVit (NaFlex batches)


def export(source: str, to: str, out: str, hf_arch: str | None = None, license: str = "other",
           timm_arch: str = "vit") -> str:
    """Write the export of `source` (a run directory, an encoder file or any import form) for library `to` (one of
    TARGETS) into `out`, with its model card (README.md); returns the line telling how to load it. ValueError names
    a bad value or what the target cannot hold."""
    source = str(source)
    if to not in TARGETS:
        raise ValueError(f"to={to!r} is not a target; valid choices: {list(TARGETS)}")
    if timm_arch not in TIMM_ARCHS:
        raise ValueError(f"timm_arch={timm_arch!r}; valid choices: {list(TIMM_ARCHS)}")
    pretrained = load_pretrained(source)
    encoder, preprocess = pretrained.encoder, pretrained.preprocess
    spatial = {key: getattr(encoder.config, key) for key in ("window_size", "rel_pos", "neck_channels")
               if getattr(encoder.config, key)}
    if spatial and to in ("hf", "open_clip", "timm"):
        return _export_windowed(encoder, preprocess, spatial, source, to, out, license)
    if to == "detectron2":
        path, note = export_vitdet(encoder, out)
        if note:
            print(f"export: {note}", file=sys.stderr)
        load = (f"train.init_checkpoint='{path}' with model.backbone.net = ViT(**{path.parent}/vitdet_args.json) "
                "in a ViTDet LazyConfig")
        card = write_model_card(out, source, to, load, encoder, preprocess, license)
        return f"wrote {path} and its model card {card.name}: {load}"
    if to == "open_clip":
        encoder_file, _ = run_files(source)
        try:
            model = load_trained(source, image_text=True)
        except ValueError as err:
            raise ValueError(f"--to open_clip writes an image-text model's two towers: {err}; an encoder alone "
                             f"exports with --to {', '.join(t for t in TARGETS if t != 'open_clip')}") from err
        if not hasattr(model, "text"):
            raise ValueError(f"--to open_clip writes a clip / siglip run's two towers; {source} is objective="
                             f"{model.cfg.name}, whose image embedding comes from an adaptor head open_clip cannot "
                             "hold (--to safetensors keeps the encoder and its adaptors)")
        path = export_open_clip(model, out, read_preprocess(encoder_file))
        load = f"open_clip.create_model_and_transforms('local-dir:{path}')"
    elif to == "hf":
        arch = hf_arch or default_arch(encoder.config)
        path = export_hf(encoder, out, arch, _clip_projection(source) if arch == "clip" else None, preprocess)
        load = f"transformers.AutoModel.from_pretrained('{path}')"
    elif to == "timm" and timm_arch == "naflexvit":
        path = export_timm_naflex(encoder, out, preprocess)
        load = f"timm.create_model('local-dir:{path}', pretrained=True)  # NaFlexVit: images or NaFlex dicts"
    elif to == "timm":
        path = export_timm(encoder, out, preprocess)
        load = f"timm.create_model('local-dir:{path}', pretrained=True)"
    elif to == "onnx":
        path, error = export_onnx(encoder, out, preprocess)
        load = f"onnxruntime.InferenceSession('{path}')  # onnxruntime vs torch: max abs difference {error:.2e}"
    else:
        path = save_encoder(encoder, Path(out) / "encoder.safetensors", preprocess, source=source)
        load = f"ssl_vit.artifacts.load_encoder('{path}')  # or checkpoint={path.parent} in ssl-vit's scripts"
        if _copy_adaptors(source, Path(out)):
            load += f"; its adaptors: ssl_vit.objectives.load_trained('{path.parent}')"
    card = write_model_card(out, source, to, load, encoder, preprocess, license)
    return f"wrote {path} and its model card {card.name}: {load}"


def _export_windowed(encoder, preprocess, spatial: dict, source: str, to: str, out: str, license: str) -> str:
    """An encoder with ViTDet / SAM parts: timm's SAM ViT holds them (a prefix token dropped is said on stderr);
    transformers' and open_clip's ViTs do not (one line)."""
    if to != "timm":
        raise ValueError(f"--to {to}: this encoder has ViTDet / SAM parts ({spatial}) that a {to} ViT does not hold; "
                         "--to timm (timm's SAM ViT), onnx or safetensors keep them")
    path, note = export_timm_sam(encoder, out, preprocess)
    if note:
        print(f"export: {note}", file=sys.stderr)
    load = f"timm.create_model('local-dir:{path}', pretrained=True)  # timm's SAM ViT"
    card = write_model_card(out, source, to, load, encoder, preprocess, license)
    return f"wrote {path} and its model card {card.name}: {load}"


def _copy_adaptors(source: str, out: Path) -> bool:
    """A distilled student's adaptor heads (heads.safetensors of an objective with adaptors: objective=distill) go
    with its encoder, so that the export evaluates through them (eval.features=<teacher>, zero-shot through an
    image-text teacher's adaptor) and `ssl_vit.objectives.load_trained` rebuilds the student from it."""
    _, heads = run_files(source)
    if source.split(":", 1)[0] in LIBRARIES or not heads.is_file():
        return False
    name = load_heads(heads)[1].get("objective", "")
    if not hasattr(recorded_objective_class(name), "feature_names"):
        return False
    shutil.copyfile(heads, out / heads.name)
    return True


def _clip_projection(source: str):
    """A CLIP / SigLIP run's image projection (heads.safetensors beside the encoder), for --hf-arch clip."""
    _, heads = run_files(source)
    if source.split(":", 1)[0] in LIBRARIES or not heads.is_file():
        return None
    return load_heads(heads)[0].get("image_proj.weight")
