"""The Trainer: one invocation of pre-training (a new run, or a resumed one), as methods over two contracts only:
the objective's (objectives/base.py) and the strategy's verbs (ssl_vit/train/strategy.py). accelerate owns devices,
processes, mixed precision and gradient accumulation.

`pretrain(cfg)`: validate the config, make the accelerator the launch config describes, build the run's parts
(ssl_vit/train/build.py), then train: every step applies the precomputed lr / weight decay, lets the objective drive
its micro-steps, checks the update, logs, checkpoints and evaluates on schedule; at the end (or on a failure) a
summary. Outputs in the run directory (ssl_vit/train/outputs.py): `metrics.jsonl`, TensorBoard events under `tb/`,
`checkpoints/step_*` (exact resume), `encoder.safetensors` + `heads.safetensors` (ssl_vit.artifacts) and
`summary.json`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from ssl_vit.backbone import VisionTransformer, count_parameters
from ssl_vit.backbone.init import rng_devices, without_transformers_zero3
from ssl_vit.config import peak_lr
from ssl_vit.data import describe_dataset, loader_workers, make_loader
from ssl_vit.data.errors import SkipLog
from ssl_vit.objectives import Requirements
from ssl_vit.optim import apply_schedule
from ssl_vit.progress import progress_bar
from ssl_vit.run_dirs import link_latest
from ssl_vit.schema import to_container
from ssl_vit.train.build import Run, build_components, build_run, check_config, init_source
from ssl_vit.train.checkpoint import (
    claim_run_dir,
    list_checkpoints,
    load_checkpoint,
    read_data_position,
    remove_stale_temps,
    resolve_resume,
    save_checkpoint,
)
from ssl_vit.train.evaluation import PeriodicEvaluation
from ssl_vit.train.faults import fault_point, injected_error, poisoned
from ssl_vit.train.guard import DivergenceAdvice, UpdateGuard
from ssl_vit.train.outputs import OutputError, RunOutputs, SampleKeys, check_writable
from ssl_vit.train.stop_requests import EXIT_FAILED, StopRequests, resume_command, stop_status
from ssl_vit.train.strategy import (
    Preparation,
    StrategySettings,
    check_compile,
    check_dtypes,
    compile_seconds,
    construction_context,
    full_state_dict,
    fused_optimizer,
    is_sharded,
    make_accelerator,
    on_main_process,
    optimizer_step,
    parameter_dtype,
    parameter_norm,
    prepare_model,
    replica_digest,
    skips_on_device,
    strategy_name,
    unshard,
)
from ssl_vit.train.watchdog import StepWatchdog

log = logging.getLogger("ssl_vit")


def pretrain(cfg) -> dict:
    """Run (or resume) pre-training as `cfg` says; returns the run summary (also written to summary.json)."""
    checked = check_config(cfg)  # validated and the objective's needs read once: every step below reads these
    needs = checked.needs
    out_dir = Path(cfg.output_dir)
    accelerator = make_accelerator(StrategySettings.from_config(cfg, ema_teacher=needs.ema_teacher), out_dir)
    if cfg.trainer.compile:  # before building: a refused strategy says so at once
        check_compile(accelerator)
    if accelerator.is_main_process:
        check_writable(out_dir)
    claim_run_dir(out_dir, cfg.trainer.resume, cfg.trainer.overwrite, accelerator.is_main_process)
    accelerator.wait_for_everyone()  # the main process has cleared an overwritten directory
    if accelerator.is_main_process and cfg.out is None and HydraConfig.initialized():
        link_latest(out_dir)  # the default layout, outputs/<group>/<time>: <group>/latest is this run
    threads = configure_threads(cfg.trainer.cpu_threads, accelerator)
    set_seed(cfg.seed)  # identical initialisation on every rank
    source = init_source(cfg)
    with construction_context(accelerator):
        components = build_components(cfg, source, accelerator.device.type, checked)
    run = build_run(cfg, *components, world=accelerator.num_processes, fused=fused_optimizer(accelerator))
    evaluation = PeriodicEvaluation.from_config(cfg, needs, run.preprocess) if cfg.trainer.eval_every > 0 else None
    OmegaConf.set_readonly(cfg, True)  # built: from here on the run reads its config, never writes it
    begin = Beginning(to_container(cfg), cfg.seed, cfg.data, describe_run(cfg, run.global_batch, needs), threads,
                      Preparation.from_config(cfg, out_dir))
    return Trainer(run, accelerator, cfg.trainer, out_dir, DivergenceAdvice.from_config(cfg), begin, evaluation).train()


@dataclass(frozen=True)
class Beginning:
    """What the Trainer begins a run with besides the built `Run`: the config to record, the seed, the data config
    (batch size, loader workers), the start-up line's head, the CPU threads, how the model is prepared."""

    config: dict
    seed: int
    data: Any
    describe: str
    threads: int
    preparation: Preparation


def describe_run(cfg, global_batch: int, needs: Requirements) -> str:
    """The start-up line's head: the options asked for (objective=dino_tiny, not its method's name dino), the
    optimiser's recipe (the lr as given and as scaled to the global batch) and the run directory."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    optim = cfg.optim
    decay = f"{optim.weight_decay:g}"
    if optim.weight_decay_end is not None:
        decay += f" -> {optim.weight_decay_end:g}"
    lr = f"{optim.lr:g}"
    if optim.lr_scaling != "none":
        lr += (f" per {optim.lr_base_batch} images ({optim.lr_scaling}) -> {peak_lr(optim, global_batch):.4g} at "
               f"global batch {global_batch}")
    objective = choices.get('objective', cfg.objective.name)
    return (f"objective={objective} optim={choices.get('optim', optim.name)} "
            f"(lr {lr}, weight decay {decay}, gradient clipping {optim.grad_clip or 'off'}) "
            f"model={cfg.model.name}{_preset_defaults(cfg, objective, needs)} data={cfg.data.name} -> "
            f"{cfg.output_dir}")


def _preset_defaults(cfg, objective: str, needs: Requirements) -> str:
    """' (objective=mocov3's reference: num_heads=12)' where the objective changes the preset's architecture."""
    if cfg.model.get("init_from"):
        return ""
    given = {k: v for k, v in needs.preset_defaults.get(cfg.model.name, {}).items() if cfg.model.get(k) is None}
    return f" (objective={objective}'s reference: {', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""


def configure_threads(requested: int | None, accelerator: Accelerator) -> int:
    """`accelerate launch` sets OMP_NUM_THREADS=1 for CPU runs; give each local process its share of the cores."""
    if requested is None and accelerator.device.type != "cpu":
        return torch.get_num_threads()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    threads = requested or max(1, len(os.sched_getaffinity(0)) // max(local, 1))
    torch.set_num_threads(threads)
    return threads


@dataclass
class TrainState:
    """The loop's own counters; saved and restored with every checkpoint."""

    step: int = 0
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0
    # bad samples every rank met (corrupt images, missing keys), each once: the run's totals as of the last log
    # step or checkpoint (the main process alone saves this state); map-style data's by index, a set as a list
    skipped_samples: int = 0
    bad_indices: list = field(default_factory=list)
    last_record: dict = field(default_factory=dict)  # the newest metrics row, for the summary of a resumed run

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in asdict(self).items():  # the loop's own counters; anything else a file holds is left
            if key in state:
                if not isinstance(state[key], type(value)):
                    raise ValueError(f"the train state's {key} is a {type(state[key]).__name__}, not a "
                                     f"{type(value).__name__}")
                setattr(self, key, state[key])


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


class MicroSteps:
    """One optimizer step's micro-steps as the objective drives them (`Objective.micro_steps`, the `Engine` of
    objectives/base.py): `forward` through the distributed model, `step` = forward, backward and, on the micro-step
    that syncs, the global gradient norm (clipped at `grad_clip`; it decides whether the update is usable) and the
    optimizer step. Under DeepSpeed the engine has already stepped (or skipped) inside backward. `applied` (a 0-d
    bool tensor) says whether the update was applied; with `on_device` (fused AdamW) that is decided, and stays,
    on the device."""

    def __init__(self, accelerator: Accelerator, model, optimizer, grad_clip: float | None, step: int, meter: Meter,
                 on_device: bool = False, loss_factor: float = 1.0):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.loss_factor = loss_factor  # NaFlex loss scaling (data.naflex.loss_scale): every micro-step's loss x this
        self.grad_clip, self.step_number, self.meter, self.on_device = grad_clip, step, meter, on_device
        self.applied = torch.zeros((), dtype=torch.bool)
        self.loss_finite = torch.ones((), dtype=torch.bool, device=accelerator.device)  # on this rank

    def forward(self, batch: dict) -> dict:
        return self.model(batch)

    def step(self, batch: dict, loss_scale: float = 1.0) -> dict:
        accelerator = self.accelerator
        loss_scale *= self.loss_factor
        with accelerator.accumulate(self.model):
            outputs = self.model(batch)
            outputs["loss"] = poisoned(outputs["loss"], self.step_number)
            self.loss_finite &= torch.isfinite(outputs["loss"].detach())
            accelerator.backward(outputs["loss"] if loss_scale == 1 else outputs["loss"] * loss_scale)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
                if norm is not None:  # DeepSpeed reports a Python float: on the device, beside the losses
                    outputs["grad_norm"] = torch.as_tensor(unshard(norm), dtype=torch.float32,
                                                           device=accelerator.device)
                self.applied = optimizer_step(accelerator, self.model, self.optimizer, outputs.get("grad_norm"),
                                              self.on_device)
                self.optimizer.zero_grad(set_to_none=True)
        self.meter.add(outputs)
        return outputs


class Trainer:
    """Trains a `Run` under an accelerator. Whole once constructed: the model prepared (`prepare_model`), the run
    resumed or begun, the outputs open, the data stream at the step; then `train` (the step loop), and inside it
    `step`, `log`, `save`, `evaluate`; `finish` writes the summary."""

    def __init__(self, run: Run, accelerator: Accelerator, settings, out_dir: Path, advice: DivergenceAdvice,
                 begin: Beginning, evaluation: PeriodicEvaluation | None = None):
        """settings: the trainer config (trainer.*); advice: what to say if the run diverges; evaluation: the
        periodic evaluation (trainer.eval_every), or None."""
        self.run, self.accelerator, self.settings, self.out_dir = run, accelerator, settings, out_dir
        self.evaluation, self.advice = evaluation, advice
        self.compile_start = compile_seconds() if settings.compile else 0.0
        self.model, self.optimizer, self.compiled_blocks = prepare_model(accelerator, run.objective, run.optimizer,
                                                                         begin.preparation)
        if accelerator.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(accelerator.device)  # this run's peak in summary.json
        self.objective = accelerator.unwrap_model(self.model)
        check_dtypes(self.objective, parameter_dtype(accelerator, settings.precision))
        self.state = TrainState()
        accelerator.register_for_checkpointing(self.state)
        self.outputs = RunOutputs(accelerator, out_dir, settings.trackers)
        self.end_step = min(settings.max_steps, settings.stop_at_step or settings.max_steps)
        self.meter = Meter()
        self.stopped_by: str | None = None
        self.stopped_now: str | None = None
        self.saved_step: int | None = None
        self._begin(begin)
        self.run_start = self.interval_start = time.perf_counter()  # train() starts the clocks again
        self.interval_step = self.state.step
        # NaFlex batches vary in size: images and valid patches counted (all ranks', every step the same shape)
        self.varying = False  # whether the batches vary in images and tokens (the view builder's batch_counts)
        self.interval_images = self.interval_tokens = self.run_images = 0

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def _begin(self, begin: Beginning) -> None:
        """Resume from trainer.resume (or start), open the outputs, and start the data stream at the step."""
        accelerator, settings = self.accelerator, self.settings
        config, seed, data, describe, threads = begin.config, begin.seed, begin.data, begin.describe, begin.threads
        resume_dir = resolve_resume(settings.resume, self.out_dir)
        if resume_dir is not None:
            fused = [group.get("fused") for group in self.optimizer.param_groups]
            load_checkpoint(accelerator, resume_dir, self.model, settings.allow_inexact_resume,
                            (config.get("model") or {}).get("name"), settings.trust_pickle)
            for group, value in zip(self.optimizer.param_groups, fused, strict=True):  # this device's choice,
                group["fused"] = value  # not the one saved with the checkpoint (load_state_dict restores it)
        else:
            set_seed(seed + accelerator.process_index)  # from here on, ranks draw different masks / dropout
        removed = remove_stale_temps(self.out_dir) if self.is_main else []
        # a tracker that cannot start fails on the main process alone: every rank must stop with it
        dropped = on_main_process(accelerator, self.outputs.open, self.state.step, config, _flat_hparams(config))
        world = accelerator.num_processes
        self.threads, self.start_step = threads, self.state.step
        self.workers = loader_workers(data, accelerator.device.type,
                                      int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
        if self.is_main:
            log.info("%s, %d encoder parameters, %d process(es) x %d thread(s) + %d loader worker(s), global batch "
                     "%d; data: %s; %s%s", describe, count_parameters(self.objective.encoder), world, threads,
                     self.workers, self.run.global_batch, describe_dataset(self.run.dataset),
                     f"resumed from {resume_dir} at step {self.state.step}" if resume_dir else "new run",
                     f" ({dropped} metrics rows past it, {len(removed)} unfinished checkpoint(s) removed)"
                     if dropped or removed else "")
        self.loader = make_loader(
            self.run.dataset, self.run.views, data.batch_size, rank=accelerator.process_index, world_size=world,
            seed=seed, start=self.state.step * settings.grad_accum_steps, num_workers=self.workers,
            pin_memory=accelerator.device.type == "cuda", repeats=self.run.repeats)
        if resume_dir is not None and hasattr(self.loader, "load_state_dict"):  # a stream: its position was saved
            position = read_data_position(resume_dir, accelerator.process_index, world, self.workers,
                                          settings.allow_inexact_resume)
            if position is not None:
                self.loader.load_state_dict(position)
        self.batches = iter(self.loader)
        self.bad_seen, self.skip_log = set(self.state.bad_indices), SkipLog(log, "sample")
        self.new_stream_skips, self.new_bad = 0, []  # this rank's since the last merge (_merge_skipped)
        self.sample_keys = (SampleKeys(self.out_dir, accelerator.process_index, self.state.step)
                            if settings.record_sample_keys else None)
        self.guard = UpdateGuard(self.model.parameters(), settings.max_param_norm_growth,
                                 partial(parameter_norm, accelerator))
        self.skips_on_device = skips_on_device(accelerator, self.optimizer)
        self.unsettled: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, applied, loss finite)

    def train(self) -> dict:
        """Step to the end (or trainer.stop_at_step); the summary, also on a failure (then re-raised)."""
        progress = progress_bar(total=self.end_step, initial=self.state.step, desc="pretrain", dynamic_ncols=True,
                                enabled=self.is_main and self.settings.progress)
        self.run_start = self.interval_start = time.perf_counter()
        self.interval_step, error = self.state.step, None
        self.interval_images = self.interval_tokens = self.run_images = 0
        try:
            with StopRequests(self.settings.preempt_signals) as requests, \
                    StepWatchdog(self.settings.step_timeout_s) as watchdog:
                while self.state.step < self.end_step:
                    watchdog.started(self.state.step + 1)
                    logged = self.step()
                    watchdog.finished()
                    progress.update(1)
                    if logged:
                        progress.set_postfix(self.log_line)
                        if self.is_main and progress.disable:  # no bar (off, or not a terminal): a log line
                            log.info("step %d/%d: %s", self.state.step, self.end_step,
                                     ", ".join(f"{k} {v}" for k, v in self.log_line.items()))
                    if (logged or self.accelerator.num_processes == 1) and (stop := requests.agreed(self.accelerator)):
                        self.stopped_by = stop
                        if self.saved_step != self.state.step:
                            self.save(self.state.step)
                        break
            # A run resumed from its final checkpoint skips the loop: its encoder file may predate that checkpoint.
            if gather_object([self.outputs.encoder_step() != self.state.step])[0]:  # the main process's answer
                self.save_artifacts(self.state.step)
        except BaseException as err:
            error = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            self.stopped_now = getattr(err, "signal_name", None)  # a second stop signal (StoppedNow)
            raise
        finally:
            progress.close()
            if hasattr(self.batches, "_shutdown_workers"):  # now, not at garbage collection (10 s after a data error)
                self.batches._shutdown_workers()
            summary = self.finish(error)
        return summary

    def step(self) -> bool:
        """One optimizer step, then its checks, log line, checkpoint and evaluation when due; whether it logged."""
        state, settings = self.state, self.settings
        run = self.run
        apply_schedule(self.optimizer, float(run.learning_rates[state.step]), float(run.weight_decays[state.step]),
                       state.step)
        self.objective.begin_step(state.step, settings.max_steps)
        batches = self._micro_batches()
        micro = MicroSteps(self.accelerator, self.model, self.optimizer, self.run.grad_clip, state.step + 1,
                           self.meter, self.skips_on_device, self.run.views.loss_factor(batches))
        self.objective.micro_steps(batches, micro)
        state.step += 1
        if self.compiled_blocks and state.step == self.start_step + 1 and self.is_main:
            log.info("compiled %d transformer blocks: %.1f s compiling in the first step", self.compiled_blocks,
                     compile_seconds() - self.compile_start)
        self._check(micro)
        evaluating = self.evaluation is not None and (state.step % settings.eval_every == 0
                                                      or state.step == self.end_step)
        saving = state.step % settings.checkpoint_every == 0 or state.step == self.end_step
        logged = state.step % settings.log_every == 0 or state.step == self.end_step
        if logged or evaluating or saving or not micro.on_device:
            self._settle()  # the device's verdicts since the last time, read at once
        diverged = state.consecutive_nonfinite >= settings.max_consecutive_nonfinite
        logged = logged or diverged
        if logged or evaluating or saving:
            self._stop_if_ruined()  # before anything reads or keeps the weights
        if logged:
            self.log()
        fault_point("step_done", state.step)
        if diverged:
            raise self.advice.nonfinite_error(state.consecutive_nonfinite, state.step, self.save(state.step))
        if evaluating:
            self.evaluate()
        if saving:
            self.save(state.step)
        return logged

    def _micro_batches(self) -> list[dict]:
        batches, keys = [], []
        for _ in range(self.settings.grad_accum_steps):
            batch = next(self.batches)
            self._count_skipped(batch)
            key = batch.pop("key", [])
            keys.extend(key.tolist() if isinstance(key, torch.Tensor) else key)
            counts = self.run.views.batch_counts(batch)  # still on the host
            if counts is not None:
                self.varying, (images, tokens) = True, counts
                world = self.accelerator.num_processes
                self.interval_images += images * world
                self.run_images += images * world
                self.interval_tokens += tokens  # this rank's: summed at log time
            batches.append(self.run.views.on_device(_to_device(batch, self.accelerator.device)))
        if self.sample_keys is not None:
            self.sample_keys.write(self.state.step + 1, keys)
        return batches

    def _count_skipped(self, batch: dict) -> None:
        """Count (and name, the first time) the bad samples the batch's samples stand in for: map-style data marks
        the bad index of each substitute (counted once however often it comes round), a stream counts its losses
        (each sample read once; its workers name them)."""
        skipped = batch.pop("skipped", None)
        indices, reasons = batch.pop("skip_index", None), batch.pop("skip_reason", None)
        if indices is None:
            self.new_stream_skips += int(skipped.sum()) if skipped is not None else 0
            return
        for index, reason in zip(indices.tolist(), reasons, strict=True):
            if index >= 0 and index not in self.bad_seen:
                self.bad_seen.add(index)
                self.new_bad.append(index)
                self.skip_log(f"{reason} (replaced by the next readable sample)")

    def _merge_skipped(self) -> None:
        """Every rank's bad samples since the last merge into the state, the same on every rank (collective with
        several processes): the streams' counts summed, map-style indices as a union (one bad file two ranks met
        is one sample)."""
        mine = (self.new_stream_skips, self.new_bad)
        every = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        new = sorted({index for _, bad in every for index in bad} - set(self.state.bad_indices))
        self.state.bad_indices.extend(new)
        self.state.skipped_samples += sum(count for count, _ in every) + len(new)
        self.bad_seen.update(new)
        self.new_stream_skips, self.new_bad = 0, []

    def _check(self, micro: MicroSteps) -> None:
        """After the update: judge it (on the device: `_stop_if_ruined` reads the guard), run the objective's updates
        outside the gradient (EMA teachers), and keep whether it was applied for `_settle`. Decided on the host, a
        skipped update runs neither; decided on the device (fused AdamW), both run every step: the guard sees an
        unchanged norm and the teacher an unchanged student."""
        if micro.on_device or bool(micro.applied):
            self.guard.check_update(self.state.step)
            self.objective.after_optimizer_step(self.state.step, self.settings.max_steps)
        self.unsettled.append((self.state.step, micro.applied, micro.loss_finite))

    def _settle(self) -> None:
        """Count the skipped updates since the last call, in order (one read of the device for all of them)."""
        if not self.unsettled:
            return
        state, entries = self.state, self.unsettled
        if entries[0][1].device.type != "cpu":  # decided on the device: one read for every entry
            flags = torch.stack([torch.stack([applied, finite]) for _, applied, finite in entries]).tolist()
        else:  # decided on the host; whether the loss was finite is read only for a skipped update
            flags = [(bool(applied), None) for _, applied, _ in entries]
        for (step, _, finite), (applied, loss_finite) in zip(entries, flags, strict=True):
            if applied:
                state.consecutive_nonfinite = 0
                continue
            state.nonfinite_steps += 1
            state.consecutive_nonfinite += 1
            if self.is_main:
                log.warning("non-finite %s at step %d: update skipped (%d in a row, %d in all)",
                            "gradients" if (bool(finite) if loss_finite is None else loss_finite) else "loss", step,
                            state.consecutive_nonfinite, state.nonfinite_steps)
        self.unsettled = []

    def _stop_if_ruined(self) -> None:
        """Raise, without saving, if an update since the start ruined the weights (UpdateGuard)."""
        ruin = self.guard.verdict()
        if ruin is not None:
            step, before, after = ruin
            raise self.advice.ruined_weights_error(step, (before, after),
                                                   (list_checkpoints(self.out_dir) or [None])[-1], self.state.step)

    def log(self) -> None:
        """The metrics row of the steps since the last one (means over them and over the processes)."""
        state, run, now = self.state, self.run, time.perf_counter()
        self._merge_skipped()
        state.last_record = {
            "step": state.step, **self.meter.summary(self.accelerator),
            "lr": float(run.learning_rates[state.step - 1]), "wd": float(run.weight_decays[state.step - 1]),
            "images_per_s": (self.interval_images if self.varying else run.global_batch * (
                state.step - self.interval_step)) / max(now - self.interval_start, 1e-9),
            "nonfinite_steps": state.nonfinite_steps, "skipped_samples": state.skipped_samples}
        if self.varying:  # valid patches of every rank (their batches share a shape, not their padding)
            tokens = torch.tensor(float(self.interval_tokens), device=self.accelerator.device)
            if self.accelerator.num_processes > 1:
                tokens = self.accelerator.reduce(tokens, reduction="sum")
            state.last_record["tokens_per_s"] = float(tokens) / max(now - self.interval_start, 1e-9)
        self.interval_start, self.interval_step = now, state.step
        self.interval_images = self.interval_tokens = 0
        on_main_process(self.accelerator, self.outputs.log, state.last_record, "train/")

    @property
    def log_line(self) -> dict:
        record = self.state.last_record
        return {"loss": f"{record.get('loss', math.nan):.4f}", "lr": f"{record.get('lr', math.nan):.2e}",
                "img_s": f"{record.get('images_per_s', math.nan):.1f}"}

    def save(self, step: int) -> Path:
        """Checkpoint (collective), then the artifacts; returns the checkpoint directory."""
        position = ({"world_size": self.accelerator.num_processes, "num_workers": self.workers,
                     "loader": self.loader.state_dict()} if hasattr(self.loader, "state_dict") else None)
        self._merge_skipped()  # the main process saves the state: the run's totals
        checkpoint = save_checkpoint(self.accelerator, self.out_dir, step, self.settings.keep_checkpoints, position)
        self.save_artifacts(step)
        self.saved_step = step
        return checkpoint

    def save_artifacts(self, step: int) -> None:
        """encoder.safetensors and heads.safetensors from the gathered weights (collective when sharded)."""
        state = full_state_dict(self.accelerator, self.model, self.objective.fp32_shards())  # None off the main
        on_main_process(self.accelerator, self._write_artifacts, state, step)

    def _write_artifacts(self, state: dict, step: int) -> None:
        for member, (config, files) in self.objective.member_artifacts(state).items():  # first: see outputs.py
            self.outputs.save_encoder(files.encoder, config, step, self.run.preprocess, member=member,
                                      **files.metadata)
            self.outputs.save_heads(files.heads, step, member=member, **files.metadata)
        artifacts = self.objective.artifacts(state)
        self.outputs.save_encoder(artifacts.encoder, self.objective.encoder.config, step, self.run.preprocess,
                                  **artifacts.metadata)
        self.outputs.save_heads(artifacts.heads, step, **artifacts.metadata)

    def evaluate(self) -> None:
        """Periodic evaluation on the main process, of the live encoder, or of a gathered copy when the parameters
        are sharded (a forward pass there is collective)."""
        on_main_process(self.accelerator, self._score, *self._evaluated())

    def _score(self, encoder, model) -> None:
        injected_error("eval_error", self.state.step)
        scores = self.evaluation(encoder, model)
        self.outputs.log({"step": self.state.step, **scores})
        log.info("step %d: %s", self.state.step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    def _evaluated(self) -> tuple[VisionTransformer | None, torch.nn.Module | None]:
        """The main process's (encoder, objective for zeroshot / retrieval or None); collective when sharded."""
        objective, needs_model = self.objective, self.evaluation.needs_model
        if not is_sharded(self.accelerator):
            return (objective.encoder, objective if needs_model else None) if self.is_main else (None, None)
        state = full_state_dict(self.accelerator, self.model)  # collective: every rank gathers
        if not self.is_main:
            return None, None
        # Building draws initial weights: leave every training RNG as it was, and build outside transformers'
        # ZeRO-3 hook (a transformers text tower would build itself under zero.Init, a collective, on this rank).
        with torch.random.fork_rng(devices=rng_devices()), without_transformers_zero3():
            if needs_model:
                copy = objective.evaluation_copy(state).to(self.accelerator.device)
                return copy.encoder, copy
            encoder = VisionTransformer(objective.encoder.config)
        encoder.load_state_dict(objective.artifacts(state).encoder)
        return encoder.to(self.accelerator.device), None

    def finish(self, error: str | None) -> dict:
        """summary.json for this invocation (also after a failure), and the closing log line."""
        accelerator, state, settings = self.accelerator, self.state, self.settings
        elapsed = time.perf_counter() - self.run_start
        # Collective: only when every rank got here normally.
        digests = gather_object([replica_digest(accelerator, self.objective)]) if error is None else []
        if error is None:
            self._merge_skipped()
        # after a failure (no collective): the totals merged so far and this rank's since
        skipped = state.skipped_samples + self.new_stream_skips + len(set(self.new_bad) - set(state.bad_indices))
        checkpoints = list_checkpoints(self.out_dir)
        steps = state.step - self.start_step
        summary = {
            "step": state.step, "max_steps": settings.max_steps, "finished": state.step >= settings.max_steps,
            "error": error, "world_size": accelerator.num_processes, "threads_per_process": self.threads,
            "global_batch": self.run.global_batch, "steps_this_run": steps, "wall_s": elapsed,
            "images_per_s": (self.run_images if self.varying else self.run.global_batch * steps) / elapsed
            if steps > 0 else None,
            "nonfinite_steps": state.nonfinite_steps, "skipped_samples": skipped,  # every rank's
            "strategy": strategy_name(accelerator), "last": state.last_record, "param_digests": digests,
            "replicas_in_sync": None if is_sharded(accelerator) else len(set(digests)) <= 1,
            "checkpoint": str(checkpoints[-1]) if checkpoints else None, "encoder": str(self.outputs.encoder_path),
            "preprocess": asdict(self.run.preprocess),
            "cuda_peak_memory_gib": (torch.cuda.max_memory_allocated(accelerator.device) / 2**30
                                     if accelerator.device.type == "cuda" else None),  # this process
            "stopped_by": self.stopped_by,  # the stop signal's name (SIGINT, SIGTERM, SIGUSR1), or None
            # 75: preempted (requeue); a second signal stopped it at once: its status without the checkpoint
            "exit_status": stop_status(self.stopped_by) if error is None else
            stop_status(self.stopped_now) if self.stopped_now else EXIT_FAILED,
            "compiled_blocks": self.compiled_blocks,
            # this process, recompiles included
            "compile_s": compile_seconds() - self.compile_start if self.compiled_blocks else None,
        }
        try:
            self.outputs.summary(summary)
        except OutputError as write_error:
            log.error("%s", write_error)
        self.outputs.close(summary if error is None else None)
        accelerator.end_training()
        if self.is_main:
            if summary["replicas_in_sync"] is False:
                log.error("model replicas differ across processes after training: %s", digests)
            if summary["finished"] and error is None:
                log.info("done: %d steps, %.1f images/s, %d bad samples skipped; encoder at %s", state.step,
                         summary["images_per_s"] or 0, skipped, summary["encoder"])
            elif error is None:
                status = f", exit status {summary['exit_status']}" if summary["exit_status"] else ""
                log.info("stopped at step %d of %d%s, checkpoint and encoder saved%s; continue with:\n  %s",
                         state.step, settings.max_steps, f" ({self.stopped_by})" if self.stopped_by else "", status,
                         resume_command(self.out_dir))
        return summary


def _to_device(batch: dict, device: torch.device) -> dict:
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, dict):  # a NaFlex batch's image
            return {k: move(v) for k, v in value.items()}
        return [move(v) for v in value] if isinstance(value, list) else value

    return {k: move(v) for k, v in batch.items()}


def _flat_hparams(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_hparams(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, int | float | str | bool) else str(value)
    return flat
