"""Tiny objects several test files build: configs composed as the CLI composes them, objectives on a tiny batch,
synthetic shards, idx files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from ssl_vit.backbone import build_vit
from ssl_vit.cli import register_configs
from ssl_vit.data.shards import write_shards
from ssl_vit.data.sources import open_source
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.clip import CLIP, SigLIP
from ssl_vit.objectives.mae import MAEConfig
from ssl_vit.train.build import build_components

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CLIP_TOWERS = dict(embed_dim=16, context_length=16, text_width=16, text_heads=2, text_layers=1)
WORDS = ["red", "green", "blue", "small", "large", "disc", "star", "ring"]
LIGHT_DECODER = dict(decoder_dim=32, decoder_depth=1, decoder_heads=2)


def pretrain_config(out_dir, *overrides):
    """configs/pretrain.yaml as the CLI composes it, on vit_test, quiet, writing to out_dir."""
    register_configs()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[
            "model=vit_test", "data.batch_size=8", "trainer.log_every=1",
            "trainer.progress=false", "trainer.trackers=[]", f"output_dir={out_dir}", *overrides])


def objective_and_batch(*overrides):
    """The objective a config builds (vit_test, 16 synthetic samples) and a collated batch of 6 of its views."""
    register_configs()
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose("pretrain", ["model=vit_test", "data.num_samples=16", "output_dir=unused", *overrides])
    objective, dataset, views, _ = build_components(cfg)
    batch = torch.utils.data.default_collate([views(dataset[i]) for i in range(6)])
    return objective, batch


def clip_model(kind="clip", model_overrides=None, **overrides):
    """CLIP or SigLIP on vit_test (pre-norm) with one-block 16-wide text towers."""
    model_class = CLIP if kind == "clip" else SigLIP
    cfg = OmegaConf.structured(model_class.config_class(**{**CLIP_TOWERS, **overrides}))
    backbone = build_vit("vit_test", **{"pre_norm": True, **(model_overrides or {})})
    return model_class(backbone, cfg, DataInfo(0, 16))


def clip_batch(model, n=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    captions = [f"a {WORDS[i % 8]} {WORDS[(3 * i + 1) % 8]} number {i}" for i in range(n)]
    return {"image": torch.randn(n, 3, 16, 16, generator=generator), "text": model.text_tokenizer()(captions)}


def mae_objective(model="vit_test", img_size=None, **options):
    """MAE with a one-block 32-wide decoder."""
    cfg = OmegaConf.structured(MAEConfig(**{**LIGHT_DECODER, **options}))
    backbone = build_vit(model, **({"img_size": img_size} if img_size else {}))
    return build_objective(cfg, backbone, DataInfo(8, backbone.patch_embed.img_size[0]))


def randomise(module: nn.Module) -> None:
    """Give every parameter random values (norm scales and biases included) so parity tests see them all."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05).add_(1.0 if p.ndim == 1 and p.numel() > 0 else 0.0)


def synthetic_shards(out_dir, count=40, per_shard=16, img_size=16):
    samples, classes = open_source("synthetic", num_samples=count, img_size=img_size, seed=3)
    return write_shards(samples, out_dir, source="synthetic", samples_per_shard=per_shard, classes=classes)


def write_idx(path, array, gz):
    """An idx file (Fashion-MNIST's format) of uint8 values."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with (gzip.open if gz else open)(path, "wb") as file:
        file.write(data)
