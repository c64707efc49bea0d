"""Is the shard pipeline fast enough to feed training? Samples/s of the WebDataset loader with 0, 1 and 2 workers,
against the images/s a training step consumes, and training fed by the loader against training on one fixed
in-memory batch (the loader's real cost when both share this machine's cores), in one run.

    python benchmarks/data_speed.py                     # 224 px jpg shards, vit_ti16 and vit_s16, batch 32 (~4 min)
    python benchmarks/data_speed.py --samples 512 --models vit_ti16

The loader decodes jpg, applies a random resized crop + flip and normalises (the training views).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ssl_vit.backbone import build_vit
from ssl_vit.data import ShardStream, ViewBuilder
from ssl_vit.data.shards import write_shards
from ssl_vit.data.sources import open_source
from ssl_vit.preprocess import IMAGENET_MEAN, IMAGENET_STD


def loader_rate(stream, views, batch_size, workers, batches) -> float:
    loader = stream.loader(views, batch_size, seed=0, num_workers=workers, need_label=True)
    iterator = iter(loader)
    next(iterator)  # worker start-up and first shard open are not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    rate = batches * batch_size / (time.perf_counter() - start)
    del iterator, loader
    return rate


def train_rates(model_name, img_size, batch_size, steps, stream, views, workers) -> dict:
    model = build_vit(model_name, img_size=img_size, num_classes=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    iterator = iter(stream.loader(views, batch_size, seed=1, num_workers=workers, need_label=True))
    fixed = next(iterator)
    fixed.pop("skipped")
    step(fixed)  # warm-up
    in_memory = statistics.median(step(fixed) for _ in range(steps))
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(iterator)
        batch.pop("skipped")
        step(batch)
    fed = (time.perf_counter() - start) / steps
    return {"in_memory_images_per_s": batch_size / in_memory, "loader_fed_images_per_s": batch_size / fed,
            "loader_workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=10, help="timed loader batches per worker setting")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per model and setting")
    parser.add_argument("--models", default="vit_ti16,vit_s16")
    parser.add_argument("--out", default="benchmarks/results/data_speed.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        samples, classes = open_source("synthetic", num_samples=args.samples, img_size=args.img_size)
        summary = write_shards(samples, tmp, source="synthetic", samples_per_shard=256, image_format="jpg",
                               classes=classes)
        stream = ShardStream(tmp, num_classes=len(classes), resampled=True, shuffle_buffer=256)
        views = ViewBuilder(("image", "label"), args.img_size, IMAGENET_MEAN, IMAGENET_STD, augment=True)
        loader = {w: loader_rate(stream, views, args.batch, w, args.batches) for w in (0, 1, 2)}
        training = {m: train_rates(m, args.img_size, args.batch, args.steps, stream, views, workers=1)
                    for m in args.models.split(",")}

    report = {"benchmark": "data_speed", "img_size": args.img_size, "batch": args.batch,
              "shard_bytes_per_sample": summary["bytes"] / summary["samples"], "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "loader_samples_per_s": loader,
              "training": training}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"shards: {args.samples} synthetic jpg images at {args.img_size} px, "
          f"{report['shard_bytes_per_sample'] / 1024:.1f} KiB/sample; batch {args.batch}")
    print(f"{'loader workers':<16}{'samples/s':>10}")
    for workers, rate in loader.items():
        print(f"{workers:<16}{rate:>10.1f}")
    print(f"{'model':<10}{'train img/s (in memory)':>26}{'(fed by loader, 1 worker)':>28}{'loader/consumption':>20}")
    for model, row in training.items():
        print(f"{model:<10}{row['in_memory_images_per_s']:>26.1f}{row['loader_fed_images_per_s']:>28.1f}"
              f"{loader[1] / row['in_memory_images_per_s']:>19.1f}x")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
