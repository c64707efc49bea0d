"""The pre-training loop. accelerate owns devices, processes, mixed precision and gradient accumulation; the loop
knows nothing objective-specific: it asks the objective for a loss dict and steps the optimizer.

Outputs in the run directory: `metrics.jsonl` (one JSON line per logged step), TensorBoard events under `tb/`,
`checkpoints/step_*` (exact resume), `encoder.safetensors` (latest encoder) and `summary.json` (end of the run).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from objectives import OBJECTIVES, DataInfo, build_objective
from ssl_vit.config import ConfigError, Precision, model_kwargs, to_container
from ssl_vit.data import ViewBuilder, build_dataset, make_loader
from ssl_vit.export import save_encoder
from ssl_vit.train.checkpoint import resolve_resume, save_checkpoint
from ssl_vit.train.optim import apply_schedule, build_optimizer, schedule
from ssl_vit.vit import PRESETS, build_vit, count_parameters

log = logging.getLogger("ssl_vit")


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class TrainState:
    """The loop's own counters; saved and restored with every checkpoint."""

    step: int = 0
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0
    skipped_samples: int = 0  # bad samples the data stream skipped (corrupt images, missing keys)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def build_components(cfg):
    """The objective (with its backbone), dataset and view builder a config names; ConfigError on a bad value."""
    preset = cfg.model.name
    if preset not in PRESETS:
        raise ConfigError(f"unknown model {preset!r}; valid choices: {sorted(PRESETS)}")
    if cfg.objective.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {cfg.objective.name!r}; valid choices: {sorted(OBJECTIVES)}")
    img_size = cfg.data.img_size or PRESETS[preset].get("img_size", 224)
    try:
        backbone = build_vit(preset, img_size=img_size, **model_kwargs(cfg.model))
    except ValueError as err:
        raise ConfigError(f"model={preset} at data.img_size={img_size}: {err}") from err
    backbone.set_grad_checkpointing(cfg.model.grad_checkpointing)
    try:
        dataset = build_dataset(cfg.data, img_size)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"data={cfg.data.name}: {err}") from err
    if "label" in OBJECTIVES[cfg.objective.name].views and not dataset.classes:
        raise ConfigError(f"objective={cfg.objective.name} needs class labels but data={cfg.data.name} declares no "
                          "classes: set data.num_classes")
    info = DataInfo(len(dataset.classes), img_size, list(cfg.data.mean), list(cfg.data.std))
    try:
        objective = build_objective(cfg.objective, backbone, info)
    except ValueError as err:
        raise ConfigError(f"objective={cfg.objective.name}: {err}") from err
    views = ViewBuilder(objective.views, img_size, cfg.data.mean, cfg.data.std, cfg.data.augment,
                        cfg.data.crop_scale)
    return objective, dataset, views


def periodic_eval_sets(cfg, img_size: int):
    """The (train, test) subsets that `trainer.eval_every` evaluates on: the first eval_max_samples of each."""
    from torch.utils.data import Subset

    from ssl_vit.eval.run import EVALUATORS, eval_datasets  # lazily: the evaluators import the engine's optim

    unknown = [e for e in cfg.trainer.eval_evaluators if e not in EVALUATORS or e == "finetune"]
    if unknown:
        raise ConfigError(f"unknown trainer.eval_evaluators {unknown}; valid choices: ['linear', 'knn', 'fewshot']")
    try:
        train, test = eval_datasets(cfg.data, img_size)
    except ConfigError as err:
        raise ConfigError(f"trainer.eval_every needs labelled train/test data: {err}") from err
    limit = cfg.trainer.eval_max_samples
    return tuple(Subset(d, range(min(limit, len(d)))) if len(d) > limit else d for d in (train, test))


def periodic_eval(encoder, eval_sets, cfg) -> dict[str, float]:
    from ssl_vit.config import EvalConfig
    from ssl_vit.eval.run import run_evaluators

    ecfg = EvalConfig(evaluators=list(cfg.trainer.eval_evaluators), fewshot_shots=[5], fewshot_draws=2)
    was_training = encoder.training
    results, _, _ = run_evaluators(encoder, *eval_sets, ecfg, cfg.data.mean, cfg.data.std, progress=False)
    encoder.train(was_training)
    scores = {}
    for name, result in results.items():
        accuracy = result["accuracy"]
        scores.update({f"eval/{name}_{k}": v for k, v in accuracy.items()} if isinstance(accuracy, dict)
                      else {f"eval/{name}": accuracy})
    return scores


def configure_threads(requested: int | None, accelerator: Accelerator) -> int:
    """`accelerate launch` sets OMP_NUM_THREADS=1 for CPU runs; give each local process its share of the cores."""
    if requested is None and accelerator.device.type != "cpu":
        return torch.get_num_threads()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    threads = requested or max(1, len(os.sched_getaffinity(0)) // max(local, 1))
    torch.set_num_threads(threads)
    return threads


def parameter_digest(module: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in name order: equal digests mean bitwise-equal replicas."""
    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Meter:
    """Sums detached scalars between log steps without synchronising; `summary` reduces across processes."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for key, value in values.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
            self.counts[key] = self.counts.get(key, 0) + 1

    def summary(self, accelerator: Accelerator) -> dict[str, float]:
        if not self.sums:
            return {}
        keys = sorted(self.sums)
        means = torch.stack([self.sums[k] / self.counts[k] for k in keys])
        if accelerator.num_processes > 1:
            means = accelerator.reduce(means, reduction="mean")
        self.sums, self.counts = {}, {}
        return dict(zip(keys, means.tolist(), strict=True))


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _flat_hparams(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_hparams(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, int | float | str | bool) else str(value)
    return flat


def pretrain(cfg) -> dict:
    """Run (or resume) pre-training as `cfg` says; returns the run summary (also written to summary.json)."""
    tcfg = cfg.trainer
    out_dir = Path(cfg.output_dir)
    accumulation = tcfg.grad_accum_steps
    if accumulation < 1 or tcfg.max_steps < 1:
        raise ConfigError(f"trainer.grad_accum_steps ({accumulation}) and trainer.max_steps ({tcfg.max_steps}) "
                          "must be >= 1")
    accelerator = Accelerator(
        mixed_precision="bf16" if tcfg.precision == Precision.bf16 else "no",
        gradient_accumulation_steps=accumulation,
        log_with="tensorboard" if tcfg.tensorboard else None,
        project_dir=str(out_dir),
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes but they did not join one process group (each sees "
            f"{accelerator.num_processes}); on CPU launch with ACCELERATE_USE_CPU=1, e.g. ACCELERATE_USE_CPU=1 "
            "accelerate launch --config_file configs/accelerate/cpu_ddp2.yaml scripts/pretrain.py"
        )
    is_main = accelerator.is_main_process
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines drown the progress bar
    threads = configure_threads(tcfg.cpu_threads, accelerator)
    set_seed(cfg.seed)  # identical initialisation on every rank
    objective, dataset, views = build_components(cfg)
    encoder = objective.encoder
    optimizer = build_optimizer(objective, cfg.optim, num_layers=len(encoder.blocks))
    lrs = schedule(cfg.optim.lr, cfg.optim.min_lr, tcfg.max_steps, cfg.optim.warmup_steps, cfg.optim.schedule)

    eval_sets = periodic_eval_sets(cfg, encoder.patch_embed.img_size[0]) if tcfg.eval_every > 0 else None
    model, optimizer = accelerator.prepare(objective, optimizer)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    resume_dir = resolve_resume(tcfg.resume, out_dir)
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))  # model, optimizer, every rank's RNG, the train state
    else:
        set_seed(cfg.seed + accelerator.process_index)  # from here on, ranks draw different masks / dropout

    world = accelerator.num_processes
    loader = make_loader(dataset, views, cfg.data.batch_size, rank=accelerator.process_index, world_size=world,
                         seed=cfg.seed, start=state.step * accumulation, num_workers=cfg.data.num_workers,
                         pin_memory=accelerator.device.type == "cuda")
    batches = iter(loader)
    end_step = min(tcfg.max_steps, tcfg.stop_at_step or tcfg.max_steps)
    global_batch = cfg.data.batch_size * world * accumulation

    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out_dir / "config.yaml", resolve=True)
        if tcfg.tensorboard:
            accelerator.init_trackers("tb", config=_flat_hparams(to_container(cfg)))
        log.info("%s on %s: %s, %d encoder parameters, %d process(es) x %d thread(s), global batch %d; %s",
                 cfg.objective.name, cfg.data.name, cfg.model.name, count_parameters(encoder), world, threads,
                 global_batch, f"resumed from {resume_dir} at step {state.step}" if resume_dir else "new run")
    progress = tqdm(total=end_step, initial=state.step, disable=not (is_main and tcfg.progress),
                    desc="pretrain", dynamic_ncols=True)
    meter = Meter()
    run_start = interval_start = time.perf_counter()
    start_step = interval_step = state.step
    record: dict = {}
    checkpoint = None

    while state.step < end_step:
        apply_schedule(optimizer, float(lrs[state.step]), cfg.optim.weight_decay)
        finite = torch.ones((), device=accelerator.device)
        for _ in range(accumulation):
            batch = next(batches)
            if "skipped" in batch:
                state.skipped_samples += int(batch.pop("skipped").sum())
            batch = _to_device(batch, accelerator.device)
            with accelerator.accumulate(model):
                outputs = model(batch)
                finite = finite * torch.isfinite(outputs["loss"].detach())
                accelerator.backward(outputs["loss"])
                if accelerator.sync_gradients:
                    stepped = bool(accelerator.gather(finite[None]).min() > 0) if world > 1 else bool(finite)
                    if stepped:
                        if cfg.optim.grad_clip:
                            outputs["grad_norm"] = accelerator.clip_grad_norm_(model.parameters(),
                                                                               cfg.optim.grad_clip)
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            meter.add(outputs)
        state.step += 1
        if stepped:
            state.consecutive_nonfinite = 0
            accelerator.unwrap_model(model).after_optimizer_step(state.step, tcfg.max_steps)
        else:
            state.nonfinite_steps += 1
            state.consecutive_nonfinite += 1
            if is_main:
                log.warning("non-finite loss at step %d: update skipped (%d in a row, %d in all)", state.step,
                            state.consecutive_nonfinite, state.nonfinite_steps)
        diverged = state.consecutive_nonfinite >= tcfg.max_consecutive_nonfinite
        if state.step % tcfg.log_every == 0 or state.step == end_step or diverged:
            now = time.perf_counter()
            record = {"step": state.step, **meter.summary(accelerator), "lr": float(lrs[state.step - 1]),
                      "images_per_s": global_batch * (state.step - interval_step) / max(now - interval_start, 1e-9),
                      "nonfinite_steps": state.nonfinite_steps, "skipped_samples": state.skipped_samples}
            interval_start, interval_step = now, state.step
            if is_main:
                with open(out_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                if tcfg.tensorboard:
                    accelerator.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=state.step)
                progress.set_postfix(loss=f"{record.get('loss', math.nan):.4f}", lr=f"{record['lr']:.2e}",
                                     img_s=f"{record['images_per_s']:.1f}")
        progress.update(1)
        if diverged:
            checkpoint = save_checkpoint(accelerator, out_dir, state.step, tcfg.keep_checkpoints)
            progress.close()
            accelerator.end_training()
            raise NonFiniteLossError(
                f"the loss was non-finite for {state.consecutive_nonfinite} consecutive steps (up to step "
                f"{state.step}); every one was skipped, so the weights are the last good ones, saved in "
                f"{checkpoint}. Lower optim.lr, set optim.grad_clip, use precision fp32, or check the data; "
                f"the limit is trainer.max_consecutive_nonfinite={tcfg.max_consecutive_nonfinite}."
            )

        if eval_sets is not None and (state.step % tcfg.eval_every == 0 or state.step == end_step):
            if is_main:
                scores = periodic_eval(accelerator.unwrap_model(model).encoder, eval_sets, cfg)
                with open(out_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.step, **scores}) + "\n")
                if tcfg.tensorboard:
                    accelerator.log(scores, step=state.step)
                log.info("step %d: %s", state.step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
            accelerator.wait_for_everyone()
        if state.step % tcfg.checkpoint_every == 0 or state.step == end_step:
            checkpoint = save_checkpoint(accelerator, out_dir, state.step, tcfg.keep_checkpoints)
            if is_main:
                save_encoder(accelerator.unwrap_model(model).encoder, out_dir / "encoder.safetensors",
                             step=state.step, objective=cfg.objective.name)
    progress.close()

    elapsed = time.perf_counter() - run_start
    digests = gather_object([parameter_digest(accelerator.unwrap_model(model))])
    summary = {
        "step": state.step, "max_steps": tcfg.max_steps, "finished": state.step >= tcfg.max_steps,
        "world_size": world, "threads_per_process": threads, "global_batch": global_batch,
        "images_per_s": global_batch * (state.step - start_step) / max(elapsed, 1e-9), "wall_s": elapsed,
        "nonfinite_steps": state.nonfinite_steps, "skipped_samples": state.skipped_samples, "last": record,
        "param_digests": digests, "replicas_in_sync": len(set(digests)) == 1,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "encoder": str(out_dir / "encoder.safetensors"),
    }
    if is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not summary["replicas_in_sync"]:
            log.error("model replicas differ across processes after training: %s", digests)
        if summary["finished"]:
            log.info("done: %d steps, %.1f images/s; encoder at %s", state.step, summary["images_per_s"],
                     summary["encoder"])
        else:
            log.info("stopped at step %d of %d; continue with trainer.resume=auto hydra.run.dir=%s",
                     state.step, tcfg.max_steps, out_dir)
    accelerator.end_training()
    return summary
