"""One process of benchmarks/scale.py, started by `accelerate launch --config_file <strategy>`: builds the
supervised objective the way the trainer does (make_accelerator, zero.Init under ZeRO-3, accelerate.prepare), runs
a few AdamW steps on random images and writes this rank's memory and step times to <out>/rank<r>.json.

Memory is measured from a baseline taken after imports and process-group set-up, before the model exists:
model states = resident memory after the first step (params, grads, optimizer states and the strategy's buffers;
activations freed), peak = the process's peak resident memory (and the CUDA allocator's peak on a GPU). Pages the
kernel swapped out count as memory too (VmSwap), so a host run that only fits with swap still reports what the rank
holds: the peak is then the larger of the kernel's peak RSS and resident + swapped memory sampled every 5 ms.
"""

import argparse
import json
import resource
import threading
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from omegaconf import OmegaConf

from ssl_vit.backbone import build_vit
from ssl_vit.config import OptimConfig
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.supervised import SupervisedConfig
from ssl_vit.optim import build_optimizer
from ssl_vit.train.strategy import StrategySettings, construction_context, make_accelerator, strategy_name, unshard

MIB = 1024**2


def rss() -> int:
    """Memory held now, bytes (Linux): resident plus swapped-out pages."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return sum(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("VmRSS", "VmSwap"))


class PeakWatch(threading.Thread):
    """Samples rss() every 5 ms: the kernel's peak RSS (ru_maxrss) does not see memory that was swapped out."""

    def __init__(self):
        super().__init__(daemon=True)
        self.highest, self.stopping = 0, threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.005):
            self.highest = max(self.highest, rss())

    def peak(self) -> int:
        return max(self.highest, rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = OmegaConf.create({"trainer": {"precision": args.precision, "grad_accum_steps": 1},
                            "data": {"batch_size": args.batch}, "optim": {"grad_clip": 1.0}})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(StrategySettings.from_config(cfg), args.out)
    cuda = accelerator.device.type == "cuda"
    set_seed(0)
    baseline = rss()
    watch = PeakWatch()
    watch.start()
    with construction_context(accelerator):
        backbone = build_vit(args.model, img_size=args.img_size, **({"depth": args.depth} if args.depth else {}))
        objective = build_objective(OmegaConf.structured(SupervisedConfig()), backbone,
                                    DataInfo(1000, args.img_size, [0.5] * 3, [0.5] * 3))
    optim_cfg = OmegaConf.structured(OptimConfig(lr=1e-4))
    optimizer = build_optimizer(objective, optim_cfg, num_layers=len(objective.encoder.blocks))
    built = rss() - baseline
    model, optimizer = accelerator.prepare(objective, optimizer)
    prepared = rss() - baseline
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batch = {"image": torch.randn(args.batch, 3, args.img_size, args.img_size, device=accelerator.device),
             "label": torch.randint(0, 1000, (args.batch,), device=accelerator.device)}
    times, states = [], None
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model(batch)["loss"]
        accelerator.backward(loss)
        unshard(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        if step == 0:  # after backward and the step: activations freed, gradients still held
            states = (torch.cuda.memory_allocated() if cuda else rss() - baseline)
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    report = {"strategy": strategy_name(accelerator), "rank": accelerator.process_index,
              "world_size": accelerator.num_processes, "device": accelerator.device.type,
              "model_states_mib": states / MIB, "built_mib": built / MIB, "prepared_mib": prepared / MIB,
              "peak_rss_mib": (watch.peak() - baseline) / MIB,
              "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB if cuda else None,
              "step_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]}
    Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
