"""The GPU suite: one script that measures what a user trains with, writes JSON and prints a table (on one H200:
speed eager 70 s, loader and packing 47 s; the README's Benchmarks section has its figures). Run it whenever a GPU
is at hand; `--device cpu --tiny` runs every section with test-sized models (tests/test_gpu_suite.py keeps it from
rotting).

    python benchmarks/gpu_suite.py                             # CUDA, bf16, ViT-B/16 (and ViT-L/16) at 224 px
    python benchmarks/gpu_suite.py --device cpu --tiny --compile-backend aot_eager   # every section, test-sized,
                                                               # fp32 (~1.5 minutes here; inductor: much longer)
    python benchmarks/gpu_suite.py --sections speed,loader     # a subset

Sections:
- peak: the device's measured matmul throughput (bf16 8192^3 on CUDA, fp32 4096^3 on CPU), the datasheet's dense
  bf16 peak for the GPUs in DATASHEET_TFLOPS, and the SDPA kernels our attention really runs (profiled: flash /
  memory-efficient / cuDNN, or the math fallback).
- speed: every objective's training step through the trainer's own step (accelerate's autocast, the objective's
  micro-steps, clipping, fused AdamW on CUDA, EMA teachers), eager and with trainer.compile's per-block compile:
  images/s, model FLOPs per image, utilisation of the measured and the datasheet peak, peak memory; ViT-B/16 for every
  objective, ViT-L/16 for supervised and MAE, ViT-B/16 at 1024 px global against SAM's windows (eager), ViT-B/16
  on images of aspect ratios 1/4..4 squashed square against NaFlex at 256 patches each (eager); timm's
  ViT-B/16 supervised step (eager, and compiled whole as timm's train.py --torchcompile does) as the reference in the
  same run. Batches are drawn once by the real data path (synthetic shapes, the objective's views) and reused, so the
  rows measure the model, not the loader. FLOPs per image are counted, not estimated: torch.utils.flop_counter over
  one training step (forward and backward of every matmul, convolution and attention; an EMA update and the optimizer
  are not counted), / batch; DeiT's include its teacher's forward. Graphs are shared between rows of one shape, so a
  row's compile seconds are what it compiled itself (the first row of a shape pays the most).
- loader: DINO's multi-crop loader (2 x 224 + 6 x 96 crops; --tiny: the test sizes) in images/s with every core as a
  worker, to set against the DINO rows' consumption: the photometric augmentation in the workers, and on the device
  (data.multicrop_photometric=device: the workers only cut uint8 crops; the device's batched stage timed apart).
- packing: DINO's student (ViT-B/16, 2 x 224 + 6 x 96 crops) one forward per resolution against all of an image's
  crops packed into one sequence with block-diagonal attention (benchmarks/packed_crops.py), forward + backward.
- quality: masked_patch, MAE, DINO and DINOv2 pre-train ViT-Ti/4 on Fashion-MNIST at 32 px (the real pretrain
  path) for a fixed budget of seconds each (steps set from a measured rate; --tiny: 3 steps), then linear probe and
  k-NN on the frozen encoder, next to the random encoder and raw pixels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import timm
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir
from packed_crops import main as measure_packing  # benchmarks/packed_crops.py, beside this script
from safetensors.torch import save_file
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.artifacts import load_encoder
from ssl_vit.cli import register_configs
from ssl_vit.config import EvalConfig
from ssl_vit.data import FashionMNIST, make_loader
from ssl_vit.data.subset import SubsetDataset, limit_samples
from ssl_vit.data.synthetic import SHAPES
from ssl_vit.eval.linear import linear_probe
from ssl_vit.eval.run import run_evaluators
from ssl_vit.optim import build_optimizer
from ssl_vit.train import build_components, pretrain
from ssl_vit.train.strategy import compile_blocks, compile_seconds, enable_tf32, skips_on_device
from ssl_vit.train.trainer import Meter, MicroSteps, _to_device

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SECTIONS = ("peak", "speed", "loader", "packing", "quality")
# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, SXM parts), matched on the device name.
DATASHEET_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.05, "A10G": 70.0}
TEACHER = "regnety_160"  # DeiT's teacher (its paper's RegNetY-16GF), random weights: the cost is what is measured
TINY_TEACHER = "resnet10t"

# Per objective: Hydra overrides at full size and at test size (the test sizes are tests/test_strategies.py's).
OBJECTIVES = {
    "supervised": (["objective=supervised"], ["objective=supervised"]),
    "masked_patch": (["objective=masked_patch"], ["objective=masked_patch"]),
    "mae": (["objective=mae"], ["objective=mae", "objective.decoder_dim=32", "objective.decoder_depth=1",
                                "objective.decoder_heads=2"]),
    "dino": (["objective=dino"], ["objective=dino_tiny", "objective.out_dim=64", "objective.hidden_dim=32",
                                  "objective.bottleneck_dim=16", "objective.local_crops=2"]),
    "dinov2": (["objective=dinov2"], ["objective=dinov2_tiny", "objective.out_dim=64", "objective.ibot_out_dim=64",
                                      "objective.hidden_dim=32", "objective.bottleneck_dim=16",
                                      "objective.local_crops=2"]),
    "clip": (["objective=clip"], ["objective=clip_tiny", "objective.embed_dim=16", "objective.text_width=16",
                                  "objective.text_heads=2", "objective.text_layers=1",
                                  "objective.context_length=16"]),
    "siglip": (["objective=siglip"], ["objective=siglip_tiny", "objective.embed_dim=16", "objective.text_width=16",
                                      "objective.text_heads=2", "objective.text_layers=1",
                                      "objective.context_length=16"]),
    "deit": (["objective=deit", "objective.teacher=timm:{teacher}:{teacher_file}"],
             ["objective=deit", "objective.teacher=timm:{teacher}:{teacher_file}"]),
}
MULTI_CROP = {"dino", "dinov2"}
LARGE = ("supervised", "mae")  # also at ViT-L/16
QUALITY = {  # objective -> overrides, as benchmarks/fashion_mnist_eval.py trains them
    "masked_patch": ["objective=masked_patch"],
    "mae": ["objective=mae", "objective.decoder_dim=128", "objective.decoder_depth=2", "objective.decoder_heads=4"],
    "dino": ["objective=dino_tiny", "optim.lr=5e-4", "optim.weight_decay=0.04", "optim.weight_decay_end=0.4"],
    "dinov2": ["objective=dinov2_tiny", "optim.lr=5e-4", "optim.weight_decay=0.04", "optim.weight_decay_end=0.4"],
}


def compose_config(*overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=list(overrides))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Best TFLOP/s of one size^3 matmul on the device."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def attention_kernels(device: torch.device, tiny: bool) -> list[str]:
    """The SDPA kernels our attention actually dispatches to (forward and backward of one block of the speed rows'
    model, under the rows' autocast), read from the profiler's op names: flash / efficient / cuDNN, or the math
    fallback, which would mean the fused kernels are not used."""
    from ssl_vit.backbone import build_vit

    model = build_vit("vit_test" if tiny else "vit_b16").to(device)
    images = torch.randn(2, 3, 16 if tiny else 224, 16 if tiny else 224, device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(images).float().sum().backward()
    return sorted({event.name for event in profile.events() if event.name.startswith("aten::_scaled_dot_product")
                   or event.name.startswith("aten::_flash") or event.name.startswith("aten::_efficient")})


def datasheet_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in DATASHEET_TFLOPS.items() if key in name), None)


def eager():
    """Counting FLOPs runs the model eagerly: a compiled graph's kernels are invisible to the counter, and a first
    call under its dispatch mode would compile there (hiding the compile from the row's warm-up) or leave dynamo's
    frames marked to skip, so that the timed steps run eager."""
    return torch.compiler.set_stance("force_eager")


class StepRunner:
    """An objective's training step exactly as the Trainer takes it (ssl_vit/train/trainer.py: begin_step, the
    objective's micro-steps through MicroSteps, the EMA update after an applied step), on one process."""

    def __init__(self, accelerator: Accelerator, cfg, compiled: bool, backend: str = "inductor", workers: int = 0):
        objective, dataset, views, _ = build_components(cfg, device_type=accelerator.device.type)
        if compiled:
            compile_blocks(objective, accelerator, backend=backend)
        optimizer = build_optimizer(objective, cfg.optim, num_layers=len(objective.encoder.blocks),
                                    fused=accelerator.device.type == "cuda")
        self.model, self.optimizer = accelerator.prepare(objective, optimizer)
        self.objective, self.accelerator = accelerator.unwrap_model(self.model), accelerator
        loader = iter(make_loader(dataset, views, cfg.data.batch_size, num_workers=workers,
                                  pin_memory=accelerator.device.type == "cuda"))
        self.batches = [_to_device(next(loader), accelerator.device) for _ in range(2)]
        self.views, self.batch_size = views, cfg.data.batch_size
        self.grad_clip, self.step_number = cfg.optim.grad_clip, 0
        self.on_device = skips_on_device(accelerator, self.optimizer)

    def step(self) -> None:
        self.step_number += 1
        self.objective.begin_step(self.step_number, 10_000)
        batch = self.views.on_device(dict(self.batches[self.step_number % len(self.batches)]))  # as the trainer
        micro = MicroSteps(self.accelerator, self.model, self.optimizer, self.grad_clip, self.step_number, Meter(),
                           self.on_device)
        self.objective.micro_steps([batch], micro)
        if self.on_device or bool(micro.applied):  # as the trainer: no host read when fused AdamW decides
            self.objective.after_optimizer_step(self.step_number, 10_000)

    def flops_per_image(self) -> float:
        batch = self.views.on_device(dict(self.batches[0]))  # its blur is not the model's work
        with eager(), FlopCounterMode(display=False) as counter:
            outputs = self.model(batch)
            outputs["loss"].backward()
        self.optimizer.zero_grad(set_to_none=True)
        return counter.get_total_flops() / self.batch_size


class TimmStep:
    """timm's ViT-B/16 (or the test size) supervised step: cross-entropy, backward, AdamW, under the same autocast."""

    def __init__(self, accelerator: Accelerator, arch: dict, batch: int, compiled: bool, backend: str = "inductor"):
        model = timm.models.vision_transformer.VisionTransformer(**arch, num_classes=1000)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=accelerator.device.type == "cuda" or None)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.forward = torch.compile(self.model, backend=backend) if compiled else self.model
        self.accelerator, self.batch_size = accelerator, batch
        device = accelerator.device
        self.images = torch.randn(batch, 3, arch["img_size"], arch["img_size"], device=device)
        self.labels = torch.randint(0, 1000, (batch,), device=device)

    def step(self) -> None:
        with self.accelerator.autocast():
            loss = torch.nn.functional.cross_entropy(self.forward(self.images), self.labels)
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def flops_per_image(self) -> float:
        with eager(), FlopCounterMode(display=False) as counter:
            torch.nn.functional.cross_entropy(self.model(self.images), self.labels).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return counter.get_total_flops() / self.batch_size


def time_steps(runner, device: torch.device, steps: int) -> dict:
    """Warm-up (compiles), then `steps` timed steps; median step, peak memory, compile seconds."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before, start = compile_seconds(), time.perf_counter()
    for _ in range(2):
        runner.step()
    synchronize(device)
    warmup_s, compile_s = time.perf_counter() - start, compile_seconds() - before
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"step_s": step, "images_per_s": runner.batch_size / step, "warmup_s": warmup_s, "compile_s": compile_s,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def speed_section(args, device: torch.device, peak: dict, work: Path, rows: list, save) -> list[dict]:
    """Fills `rows` as they are measured, calling `save` after each: timm's step first, the reference, then every
    objective. On a GPU a row that fails is recorded with its error and the others still run."""
    bf16 = device.type == "cuda"
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=device.type == "cpu")
    enable_tf32(accelerator.device)

    def measure(row: dict, make_runner) -> None:
        rows.append(measure_row(row, make_runner, device, peak, args.steps, keep_going=not args.tiny))
        save()
        accelerator.free_memory()

    teacher_name = TINY_TEACHER if args.tiny else TEACHER
    teacher_file = work / f"{teacher_name}.safetensors"
    # the teacher's classes are the data's (the synthetic shapes)
    save_file(timm.create_model(teacher_name, num_classes=len(SHAPES)).state_dict(), str(teacher_file))
    models = [("vit_test", 16, 8)] if args.tiny else [("vit_b16", 224, args.batch)]
    for compiled in args.compiled_modes:  # the reference: timm's supervised ViT-B/16 (or the test size) step
        model, img_size, batch = models[0]
        arch = (dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2) if args.tiny else
                dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12))
        row = {"objective": "timm supervised", "model": model, "img_size": img_size, "batch": batch,
               "compiled": compiled}
        measure(row, partial(TimmStep, accelerator, arch, batch, compiled, args.compile_backend))
    for model, img_size, batch in models + ([] if args.tiny else [("vit_l16", 224, args.batch // 2)]):
        names = [n for n in args.objectives if model != "vit_l16" or n in LARGE]
        for name in names:
            full, tiny = OBJECTIVES[name]
            overrides = [o.format(teacher=teacher_name, teacher_file=teacher_file)
                         for o in (tiny if args.tiny else full)]
            per_step = batch // 2 if name in MULTI_CROP else batch  # 8 crops per image
            cfg = compose_config(f"model={model}", "data=synthetic", f"data.img_size={img_size}",
                                 f"data.batch_size={per_step}", f"output_dir={work / name}", *overrides)
            for compiled in args.compiled_modes:
                torch.manual_seed(0)
                row = {"objective": name, "model": model, "img_size": img_size, "batch": per_step,
                       "compiled": compiled}
                workers = 0 if args.tiny else min(8, os.cpu_count() or 1)
                measure(row, partial(StepRunner, accelerator, cfg, compiled, args.compile_backend, workers))
    for name, overrides in windowed_rows(args.tiny):  # ViTDet / SAM at high resolution: global against windowed
        model, img_size, batch = ("vit_test", 32, 4) if args.tiny else ("vit_b16", 1024, max(args.batch // 32, 1))
        cfg = compose_config(f"model={model}", "data=synthetic", f"data.img_size={img_size}",
                             f"data.batch_size={batch}", f"output_dir={work / name}", "objective=supervised",
                             *overrides)
        row = {"objective": name, "model": model, "img_size": img_size, "batch": batch, "compiled": False}
        measure(row, partial(StepRunner, accelerator, cfg, False, args.compile_backend, 0))
    for name, overrides in naflex_rows(args.tiny):  # images of mixed aspect ratios: NaFlex against square resizing
        model, img_size, batch = ("vit_test", 16, 8) if args.tiny else ("vit_b16", 256, args.batch)
        slug = name.replace(",", "").replace(" ", "_")  # a comma would read as a Hydra sweep
        cfg = compose_config(f"model={model}", "data=synthetic", f"data.img_size={img_size}",
                             f"data.batch_size={batch}", f"output_dir={work / slug}", "objective=supervised",
                             "data.aspect_ratios=[0.25,0.5,1,2,4]", *overrides)
        row = {"objective": name, "model": model, "img_size": img_size, "batch": batch, "compiled": False}
        measure(row, partial(StepRunner, accelerator, cfg, False, args.compile_backend, 0))
    AcceleratorState._reset_state(reset_partial_state=True)
    return rows


def naflex_rows(tiny: bool) -> list[tuple[str, list[str]]]:
    """Supervised on shapes at aspect ratios 1/4..4 (ViT-B/16, 256 patches per image; --tiny: vit_test, 16): every
    image squashed to the square, against NaFlex at the same patches per image (one bucket, the same batch)."""
    patches = 16 if tiny else 256
    return [("supervised square, mixed aspect", []),
            ("supervised NaFlex, mixed aspect", ["data.resolution=naflex", f"data.naflex.seq_lens=[{patches}]"])]


def windowed_rows(tiny: bool) -> list[tuple[str, list[str]]]:
    """Supervised at high resolution (ViT-B/16 at 1024 px; --tiny: vit_test at 32 px): global attention, SAM ViT-B's
    windows (14, blocks 2, 5, 8, 11 global), and those with decomposed relative positions."""
    window, global_blocks = ("4", "[1]") if tiny else ("14", "[2,5,8,11]")
    windows = [f"model.window_size={window}", f"model.global_attn_indexes={global_blocks}"]
    return [("supervised global", []), ("supervised windowed", windows),
            ("supervised windowed + rel_pos", [*windows, "model.rel_pos=true"])]


def measure_row(row: dict, make_runner, device: torch.device, peak: dict, steps: int, keep_going: bool) -> dict:
    """`row` with its FLOPs per image, timings and utilisation; with `keep_going` (a GPU run: one kernel or compile
    failing keeps the other rows) an exception becomes the row's "error" instead (--tiny: a failure is a bug)."""
    try:
        runner = make_runner()
        row["flops_per_image"] = runner.flops_per_image()
        row.update(time_steps(runner, device, steps))
        print_row(with_utilisation(row, peak))
    except Exception as err:
        if not keep_going:
            raise
        row["error"] = f"{type(err).__name__}: {err}"
        print(f"{row['objective']:<16}{row['model']:<9}{'compiled' if row['compiled'] else 'eager':<9}"
              f"failed: {row['error'][:300]}", flush=True)
    return row


def with_utilisation(row: dict, peak: dict) -> dict:
    achieved = row["flops_per_image"] * row["images_per_s"] / 1e12
    row["achieved_tflop_s"] = achieved
    row["utilisation_measured_peak"] = achieved / peak["measured_tflop_s"]
    row["utilisation_datasheet_peak"] = achieved / peak["datasheet_tflop_s"] if peak["datasheet_tflop_s"] else None
    return row


def print_row(row: dict) -> None:
    memory = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
    datasheet = row["utilisation_datasheet_peak"]
    print(f"{row['objective']:<16}{row['model']:<9}{'compiled' if row['compiled'] else 'eager':<9}"
          f"{row['batch']:>6}{row['images_per_s']:>10.1f}{row['flops_per_image'] / 1e9:>10.2f}"
          f"{row['achieved_tflop_s']:>9.2f}{row['utilisation_measured_peak']:>9.1%}"
          f"{(f'{datasheet:.1%}' if datasheet is not None else '-'):>9}{memory:>8}{row['compile_s']:>9.1f}", flush=True)


def loader_section(args, device: torch.device, work: Path) -> list[dict]:
    """DINO's multi-crop loader alone, every core a worker, in images/s: with the photometric augmentation in the
    workers, and with it on the device (the workers cut uint8 crops; the device's batched stage timed apart)."""
    workers = args.loader_workers or os.cpu_count() or 1
    name = "dino"
    overrides = OBJECTIVES[name][1] if args.tiny else OBJECTIVES[name][0]
    img_size, batch = (16, 8) if args.tiny else (224, 64)
    batches = 3 if args.tiny else 40
    rows = []
    for placement in ("workers", "device"):
        cfg = compose_config("model=vit_test" if args.tiny else "model=vit_b16", "data=synthetic",
                             f"data.img_size={img_size}", f"data.batch_size={batch}", f"output_dir={work / 'loader'}",
                             f"data.multicrop_photometric={placement}", *overrides)
        _, dataset, views, _ = build_components(cfg)
        loader = iter(make_loader(dataset, views, batch, num_workers=workers, pin_memory=device.type == "cuda"))
        next(loader)  # workers started
        start = time.perf_counter()
        drawn = [next(loader) for _ in range(batches)]
        elapsed = time.perf_counter() - start
        row = {"objective": name, "photometric_on": placement, "img_size": img_size, "workers": workers,
               "crop_sizes": views.multicrop.sizes, "images_per_s": batches * batch / elapsed,
               "images_per_s_per_worker": batches * batch / elapsed / workers, "device_stage_images_per_s": None}
        if placement == "device":
            on_device = [_to_device(b, device) for b in drawn[:4]]
            views.on_device(on_device[0])  # warm-up (kernels, kornia's first call)
            synchronize(device)
            start = time.perf_counter()
            for b in on_device:
                views.on_device(b)
            synchronize(device)
            row["device_stage_images_per_s"] = len(on_device) * batch / (time.perf_counter() - start)
        del loader, drawn
        rows.append(row)
        stage = (f"; the device's stage {row['device_stage_images_per_s']:.0f} images/s on {device.type}"
                 if row["device_stage_images_per_s"] else "")
        where = "in the workers" if placement == "workers" else "on the device"
        print(f"DINO multi-crop loader ({'+'.join(map(str, views.multicrop.sizes))} px crops, photometric "
              f"augmentation {where}): {row['images_per_s']:.1f} images/s with {workers} workers "
              f"({row['images_per_s_per_worker']:.1f} per worker){stage}", flush=True)
    return rows


def packing_section(args, device: torch.device, work: Path) -> dict:
    """DINO's student forward + backward per resolution against all crops packed into one sequence
    (benchmarks/packed_crops.py): ViT-B/16, 2 x 224 + 6 x 96 crops, bf16 on CUDA."""
    print(flush=True)
    if args.tiny:
        options = ["--model", "vit_test", "--global-size", "16", "--local-size", "8", "--batch", "4", "--steps", "2"]
    else:
        options = ["--model", "vit_b16", "--batch", "32", "--steps", "10"]
    return measure_packing([*options, "--device", device.type, "--dtype", "bf16" if device.type == "cuda" else "fp32",
                            "--out", str(work / "packed_crops.json")])


def quality_section(args, device: torch.device, work: Path) -> dict:
    """Each self-supervised objective pre-trains ViT-Ti/4 (test size with --tiny) on Fashion-MNIST for a fixed
    budget; linear probe and k-NN of the frozen encoder, against the random encoder and raw pixels."""
    model = (["model=vit_test", "data.img_size=16"] if args.tiny else
             ["model=vit_ti16", "model.patch_size=4", "data.img_size=32"])
    base = [*model, "data=fashion_mnist", "data.batch_size=64", "trainer.progress=false", "trainer.log_every=50",
            "trainer.trackers=[]", "trainer.checkpoint_every=1000000",
            f"data.num_workers={0 if args.tiny else min(8, os.cpu_count() or 1)}"]
    max_samples = 400 if args.tiny else None
    train_set = limit_samples(FashionMNIST(split="train"), max_samples)
    test_set = limit_samples(FashionMNIST(split="test"), max_samples // 2 if max_samples else None)
    ecfg = EvalConfig(evaluators=["linear", "knn"], features="cls_avg")
    rows, pretraining = {}, {}

    def score(encoder, preprocess):
        results, _, _ = run_evaluators(encoder.to(device), train_set, test_set, ecfg, preprocess, progress=False)
        return {"linear": results["linear"]["accuracy"], "knn": results["knn"]["accuracy"]}

    objective, _, _, preprocess = build_components(compose_config(*base, "objective=masked_patch",
                                                                  f"output_dir={work / 'random'}"))
    rows["random init"] = score(objective.encoder, preprocess)
    for name in args.quality_objectives:
        overrides = [*base, *QUALITY[name]]
        steps = 3  # --tiny: a check that each objective trains and is scored, not a measurement
        if not args.tiny:  # steps from a measured rate
            AcceleratorState._reset_state(reset_partial_state=True)
            probe = pretrain(compose_config(*overrides, "trainer.max_steps=12",
                                            f"output_dir={work / (name + '-rate')}"))
            steps = max(20, int(args.quality_seconds * probe["images_per_s"] / 64))
        AcceleratorState._reset_state(reset_partial_state=True)
        summary = pretrain(compose_config(*overrides, f"trainer.max_steps={steps}",
                                          f"optim.warmup_steps={max(10, steps // 20)}", f"output_dir={work / name}"))
        pretraining[name] = {"steps": steps, "wall_s": summary["wall_s"], "images_per_s": summary["images_per_s"]}
        rows[name] = score(load_encoder(work / name / "encoder.safetensors"), preprocess)
    pixels = {split: raw_pixels(dataset) for split, dataset in (("train", train_set), ("test", test_set))}
    rows["raw pixels"] = {"linear": linear_probe(*pixels["train"], *pixels["test"])["accuracy"], "knn": None}
    print(f"\nFashion-MNIST quality after {args.quality_seconds:g} s of pre-training each:")
    print(f"{'encoder':<16}{'linear':>8}{'k-NN':>8}{'steps':>7}")
    for name, row in rows.items():
        knn = f"{100 * row['knn']:.2f}" if row["knn"] is not None else "-"
        steps = pretraining.get(name, {}).get("steps", "")
        print(f"{name:<16}{100 * row['linear']:>8.2f}{knn:>8}{steps:>7}")
    return {"budget_s": args.quality_seconds, "pretraining": pretraining, "results": rows}


def raw_pixels(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 784) pixels in [0, 1] and labels of Fashion-MNIST or a subset of it."""
    base, indices = ((dataset.dataset, dataset.indices) if isinstance(dataset, SubsetDataset)
                     else (dataset, list(range(len(dataset)))))
    images = torch.as_tensor(base.images[indices].reshape(len(indices), -1)).float() / 255
    return images, torch.as_tensor(base.labels[indices]).long()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="test-sized models and data (for CPU checks)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help=f"speed rows, of {list(OBJECTIVES)}")
    parser.add_argument("--quality-objectives", default=",".join(QUALITY), help=f"of {list(QUALITY)}")
    parser.add_argument("--modes", default="eager,compiled", help="speed rows: eager, compiled (trainer.compile)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled rows (aot_eager: the same graphs, no kernels "
                             "generated; a quick check on CPU, where inductor's cold compile takes ~30 s per graph)")
    parser.add_argument("--loader-workers", type=int, default=None, help="loader section (default: every core)")
    parser.add_argument("--batch", type=int, default=128, help="ViT-B/16 images per step (ViT-L/16: half)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per speed row (after two warm-up steps)")
    parser.add_argument("--quality-seconds", type=float, default=60.0, help="pre-training budget per objective")
    parser.add_argument("--work-dir", default=None, help="run directories (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_suite_<device>.json)")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    args.objectives, args.quality_objectives = args.objectives.split(","), args.quality_objectives.split(",")
    modes = args.modes.split(",")
    for given, valid, option in ((sections, SECTIONS, "--sections"), (args.objectives, OBJECTIVES, "--objectives"),
                                 (args.quality_objectives, QUALITY, "--quality-objectives"),
                                 (modes, ("eager", "compiled"), "--modes")):
        unknown = [s for s in given if s not in valid]
        if unknown:
            parser.error(f"unknown {option} {unknown}; valid choices: {list(valid)}")
    args.compiled_modes = [mode == "compiled" for mode in modes]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; use --device cpu --tiny for the CPU check")
    device = torch.device(args.device)
    register_configs()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_suite_"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    start = time.perf_counter()
    dtype, size = (torch.bfloat16, 8192) if device.type == "cuda" else (torch.float32, 1024 if args.tiny else 4096)
    peak = {"dtype": str(dtype).removeprefix("torch."), "measured_tflop_s": matmul_peak(device, dtype, size),
            "datasheet_tflop_s": datasheet_peak(device)}
    peak["attention_kernels"] = attention_kernels(device, args.tiny)
    report = {"benchmark": "gpu_suite", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or platform.machine(), "cores": os.cpu_count(), "tiny": args.tiny,
              "torch": torch.__version__, "timm": timm.__version__, "peak": peak}
    print(f"{report['device']}: measured {peak['dtype']} matmul peak {peak['measured_tflop_s']:.1f} TFLOP/s"
          + (f", datasheet {peak['datasheet_tflop_s']:g}" if peak["datasheet_tflop_s"] else "")
          + f"; attention runs {', '.join(peak['attention_kernels'])}", flush=True)
    out = Path(args.out or f"benchmarks/results/gpu_suite_{device.type}{'_tiny' if args.tiny else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    def save() -> None:
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    if "speed" in sections:
        report["speed"] = []  # filled row by row
    runners = {"speed": lambda: speed_section(args, device, peak, work, report["speed"], save),
               "loader": lambda: loader_section(args, device, work),
               "packing": lambda: packing_section(args, device, work),
               "quality": lambda: quality_section(args, device, work)}
    for section in [s for s in SECTIONS[1:] if s in sections]:
        if section == "speed":
            print(f"\n{'objective':<16}{'model':<9}{'mode':<9}{'batch':>6}{'img/s':>10}{'GFLOP/im':>10}"
                  f"{'TFLOP/s':>9}{'of peak':>9}{'of sheet':>9}{'GiB':>8}{'compile':>9}")
        try:
            report[section] = runners[section]()
        except Exception as err:  # one section failing (e.g. no Fashion-MNIST on this machine) keeps the others
            if args.tiny:  # the CPU check: a failure is a bug
                raise
            report[section] = {"error": f"{type(err).__name__}: {err}"}
            print(f"\n{section} section failed: {report[section]['error']}", flush=True)
        report["wall_s"] = time.perf_counter() - start
        save()  # after every section
    report["wall_s"] = time.perf_counter() - start
    save()
    print(f"\n{report['wall_s']:.0f} s in all -> {out}")
    return report


if __name__ == "__main__":
    report = main()
    failed = [s for s in SECTIONS if isinstance(report.get(s), dict) and "error" in report[s]]
    failed += [f"{r['objective']} {r['model']}" for r in report.get("speed", []) if "error" in r]
    sys.exit(1 if failed else 0)
