"""The pre-training loop. accelerate owns devices, processes, mixed precision and gradient accumulation; the loop
knows nothing objective-specific: it asks the objective for a loss dict and steps the optimizer.

Outputs in the run directory (see ssl_vit.train.outputs): `metrics.jsonl`, TensorBoard events under `tb/`,
`checkpoints/step_*` (exact resume), `encoder.safetensors` (the newest checkpoint's encoder) and `summary.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from objectives import OBJECTIVES, DataInfo, build_objective
from ssl_vit.config import (
    ConfigError,
    augment_kind,
    model_kwargs,
    peak_lr,
    to_container,
    validate_config,
    warmup_steps,
)
from ssl_vit.data import DataError, build_dataset, make_loader
from ssl_vit.data.augreg import mixes
from ssl_vit.data.subset import limit_samples
from ssl_vit.init import writable
from ssl_vit.preprocess import resolve_preprocess
from ssl_vit.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    remove_stale_temps,
    resolve_resume,
    save_checkpoint,
)
from ssl_vit.train.faults import fault_point, poisoned
from ssl_vit.train.guard import UpdateGuard, nonfinite_error, ruined_weights_error
from ssl_vit.train.optim import apply_schedule, build_optimizer, schedule, weight_decay_schedule
from ssl_vit.train.outputs import ENCODER_FILE, OutputError, RunOutputs, check_writable
from ssl_vit.train.strategy import (
    check_dtypes,
    construction_context,
    full_state_dict,
    is_sharded,
    make_accelerator,
    parameter_dtype,
    parameter_norm,
    replica_digest,
    step_was_applied,
    strategy_name,
    unshard,
)
from ssl_vit.vit import PRESETS, VisionTransformer, build_vit, count_parameters

log = logging.getLogger("ssl_vit")


@dataclass
class TrainState:
    """The loop's own counters; saved and restored with every checkpoint."""

    step: int = 0
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0
    skipped_samples: int = 0  # bad samples the data stream skipped (corrupt images, missing keys)
    last_record: dict = field(default_factory=dict)  # the newest metrics row, for the summary of a resumed run

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


# Model settings that may differ from an `init_from` source's (training-time regularisation, resampling rule).
INIT_FROM_ADJUSTABLE = ("drop_path", "attn_drop", "proj_drop", "pos_embed_interp", "pos_embed_antialias",
                        "weight_init")


def init_source(cfg):
    """The pre-trained encoder `model.init_from` names (ssl_vit.export.pretrained), or None. Load it before building
    the model under zero.Init: a timm / transformers source built there would be partitioned."""
    spec = cfg.model.get("init_from")
    if not spec:
        return None
    from ssl_vit.export.pretrained import SOURCES, load_pretrained

    try:
        # building the source model must not move the run's seed, nor be partitioned by transformers' ZeRO-3 hook
        with torch.random.fork_rng(devices=[]), _without_hf_zero3():
            return load_pretrained(spec)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        raise ConfigError(f"model.init_from: {err} (valid forms: {list(SOURCES)})") from err


def _backbone_from(source, cfg, img_size: int) -> VisionTransformer:
    """A backbone with the source's architecture at `img_size` (position embeddings resampled as the source library
    does), its weights, and the run's regularisation settings."""
    overrides = model_kwargs(cfg.model)
    conflicts = {k: v for k, v in overrides.items() if k not in INIT_FROM_ADJUSTABLE}
    if conflicts:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: the architecture is the source's; remove "
                          f"{', '.join(f'model.{k}={v}' for k, v in conflicts.items())} (adjustable: "
                          f"{list(INIT_FROM_ADJUSTABLE)})")
    encoder = source.encoder
    for key in ("pos_embed_interp", "pos_embed_antialias"):
        if key in overrides:
            setattr(encoder, key, overrides[key])
            encoder.config[key] = overrides[key]
    if _single_size(encoder.config["img_size"]) != img_size:
        try:
            encoder.set_img_size(img_size)
        except ValueError as err:
            raise ConfigError(f"model.init_from={cfg.model.init_from} at data.img_size={img_size}: {err}") from err
    # The run's init scheme (the preset's unless model.weight_init says otherwise): the objective's heads follow it,
    # so the same weights from any source start the same run.
    overrides.setdefault("weight_init", PRESETS[cfg.model.name].get("weight_init", "timm"))
    backbone = VisionTransformer(**{**encoder.config, **overrides})
    load_module_by_module(backbone, encoder.state_dict())
    return backbone


def load_module_by_module(module: torch.nn.Module, state: dict) -> None:
    """`module.load_state_dict(state)` (strict), one submodule's own parameters at a time: under ZeRO-3 only that
    submodule is gathered, never the whole model."""
    expected = set(module.state_dict())
    if expected != set(state):
        raise ValueError(f"weights do not fit the model: missing {sorted(expected - set(state))[:5]}, unexpected "
                         f"{sorted(set(state) - expected)[:5]}")
    for prefix, submodule in module.named_modules():
        own = dict(submodule.named_parameters(recurse=False))
        if not own:
            continue
        with writable(*own.values()), torch.no_grad():
            for name, param in own.items():
                param.copy_(state[f"{prefix}.{name}" if prefix else name])


def build_components(cfg, source=None):
    """The objective (with its backbone), dataset, view builder and preprocessing a config names; ConfigError on a
    bad value. `source`: the `init_source(cfg)` already loaded (pretrain loads it outside zero.Init)."""
    preset = cfg.model.name
    if preset not in PRESETS:
        raise ConfigError(f"unknown model {preset!r}; valid choices: {sorted(PRESETS)}")
    if cfg.objective.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {cfg.objective.name!r}; valid choices: {sorted(OBJECTIVES)}")
    objective_class = OBJECTIVES[cfg.objective.name]
    try:
        fixed = objective_class.fixed_backbone(cfg.objective)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    source = source if source is not None else init_source(cfg)
    if fixed is not None and source is not None:
        raise ConfigError(f"model.init_from={cfg.model.init_from} and objective={cfg.objective.name} with a locked "
                          "image tower both set the encoder; use one")
    if fixed is not None:  # a pre-trained, locked tower: its architecture, size and normalisation
        encoder_config, recorded = fixed
        img_size = _single_size(encoder_config["img_size"])
        if cfg.data.img_size not in (None, img_size):
            raise ConfigError(f"data.img_size={cfg.data.img_size}: the locked image tower was trained at {img_size} px "
                              "(leave data.img_size unset)")
        backbone = VisionTransformer(**encoder_config)
    elif source is not None:  # pre-trained weights to start from: the source's architecture at the run's size
        recorded = source.preprocess
        # as evaluation does: data.img_size, else the size the source's preprocessing gives, else its native size
        img_size = cfg.data.img_size or (recorded.img_size if recorded else
                                         _single_size(source.encoder.config["img_size"]))
        if getattr(cfg.objective, "fixed_pos_embed", False):
            raise ConfigError(f"model.init_from={cfg.model.init_from} with objective={cfg.objective.name}: its "
                              "fixed sin-cos position embeddings would replace the source's; set "
                              "objective.fixed_pos_embed=false")
        differ = {k: (source.encoder.config.get(k), v) for k, v in objective_class.model_defaults.items()
                  if source.encoder.config.get(k) != v}
        if differ:
            log.warning("model.init_from: objective=%s builds its own models with %s; the source has %s (kept)",
                        cfg.objective.name, {k: v[1] for k, v in differ.items()}, {k: v[0] for k, v in differ.items()})
        backbone = _backbone_from(source, cfg, img_size)
    else:
        recorded = None
        img_size = cfg.data.img_size or PRESETS[preset].get("img_size", 224)
        overrides = {**objective_class.model_defaults, **model_kwargs(cfg.model)}
        try:
            backbone = build_vit(preset, img_size=img_size, **overrides)
        except ValueError as err:
            raise ConfigError(f"model={preset} at data.img_size={img_size}: {err}") from err
    backbone.set_grad_checkpointing(cfg.model.grad_checkpointing)
    if cfg.data.name == "wds" and cfg.data.max_train_samples is not None:
        raise ConfigError("data.max_train_samples does not apply to data=wds (a shard stream has no length); "
                          "list fewer shards in data.urls instead")
    try:
        dataset = limit_samples(build_dataset(cfg.data, img_size), cfg.data.max_train_samples, cfg.seed)
    except (ValueError, FileNotFoundError, DataError) as err:
        raise ConfigError(f"data={cfg.data.name}: {err}") from err
    if "label" in OBJECTIVES[cfg.objective.name].views and not dataset.classes:
        raise ConfigError(f"objective={cfg.objective.name} needs class labels but data={cfg.data.name} declares no "
                          "classes: set data.num_classes")
    preprocess = resolve_preprocess(cfg.data, img_size, recorded)
    info = DataInfo(len(dataset.classes), img_size, preprocess.mean, preprocess.std)
    try:
        objective = build_objective(cfg.objective, backbone, info)
    except ValueError as err:
        raise ConfigError(f"objective={cfg.objective.name}: {err}") from err
    if "text" in objective.views and cfg.data.name in ("folder", "fashion_mnist", "digits"):
        raise ConfigError(f"objective={cfg.objective.name} needs captions but data={cfg.data.name} has none; use "
                          "data=synthetic, data=captions, data=tuxpaint or data=wds with 'txt' in the shards")
    augment = augment_kind(cfg.data)
    if augment == "augreg" and mixes(cfg.data.augreg) and cfg.data.batch_size % 2:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: Mixup / CutMix (data.augment=augreg) pair each "
                          "image with another, so the batch per process must be even")
    try:
        views = preprocess.view_builder(objective.views, augment, cfg.data.crop_scale, objective.multicrop_options(),
                                        objective.text_tokenizer(), augreg=cfg.data.augreg,
                                        num_classes=len(dataset.classes) or None)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return objective, dataset, views, preprocess


def _single_size(size) -> int:
    return int(size if isinstance(size, int) else size[0])


def periodic_eval_sets(cfg, img_size: int):
    """The (train, test) sets that `trainer.eval_every` evaluates on: stratified subsets of eval_max_samples."""
    from ssl_vit.eval.run import EVALUATORS, eval_datasets  # lazily: the evaluators import the engine's optim

    text_model = hasattr(OBJECTIVES[cfg.objective.name], "encode_text")
    valid = ["linear", "knn", "fewshot"] + (["zeroshot", "retrieval"] if text_model else [])
    unknown = [e for e in cfg.trainer.eval_evaluators if e not in valid]
    if unknown:
        raise ConfigError(f"unknown trainer.eval_evaluators {unknown} for objective={cfg.objective.name}; valid "
                          f"choices: {valid}" + ("" if text_model or not set(unknown) & set(EVALUATORS) else
                                                 " (zeroshot and retrieval need an image-text objective)"))
    try:
        train, test = eval_datasets(cfg.data, img_size, cfg.seed)
    except ConfigError as err:
        raise ConfigError(f"trainer.eval_every needs labelled train/test data: {err}") from err
    if not test.classes and any(e != "retrieval" for e in cfg.trainer.eval_evaluators):
        raise ConfigError(f"data={cfg.data.name} has captions but no class labels: trainer.eval_evaluators can only "
                          f"be [retrieval] here, got {list(cfg.trainer.eval_evaluators)}")
    return tuple(limit_samples(d, cfg.trainer.eval_max_samples, cfg.seed) for d in (train, test))


def periodic_eval(encoder, eval_sets, cfg, preprocess, model=None) -> dict[str, float]:
    """Scores of trainer.eval_evaluators; zeroshot / retrieval use `model` (an image-text objective)."""
    from ssl_vit.config import EvalConfig
    from ssl_vit.eval.run import run_evaluators

    ecfg = EvalConfig(evaluators=list(cfg.trainer.eval_evaluators), fewshot_shots=[5], fewshot_draws=2)
    was_training = encoder.training
    results, _, _ = run_evaluators(encoder, *eval_sets, ecfg, preprocess, progress=False, model=model,
                                   data_name=cfg.data.name)
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
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
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


def train_step(model, optimizer, batches, accelerator, state, meter, cfg) -> tuple[bool, bool]:
    """One optimizer step over grad_accum_steps micro-batches. Returns (applied, loss finite on this rank); the
    update is skipped when the global gradient norm is non-finite (any rank's non-finite loss makes it so).

    For objectives that cache features (contrastive losses), every micro-batch is first embedded without gradients;
    each micro-step's loss is then the whole accumulated batch's, and its backward yields only that micro-batch's
    share of the gradient: it is not averaged over the micro-steps (accelerate divides by their number)."""
    accum = cfg.trainer.grad_accum_steps
    micro_batches = []
    for _ in range(accum):
        batch = next(batches)
        if "skipped" in batch:
            state.skipped_samples += int(batch.pop("skipped").sum())
        micro_batches.append(_to_device(batch, accelerator.device))
    cached = None
    if accum > 1 and accelerator.unwrap_model(model).caches_features:
        with torch.no_grad():
            cached = [model(batch, embed_only=True) for batch in micro_batches]
    local_finite = torch.ones((), dtype=torch.bool, device=accelerator.device)
    for index, batch in enumerate(micro_batches):
        with accelerator.accumulate(model):
            outputs = model(batch) if cached is None else model(batch, cached=cached, index=index)
            outputs["loss"] = poisoned(outputs["loss"], state.step + 1)
            local_finite &= torch.isfinite(outputs["loss"].detach())
            accelerator.backward(outputs["loss"] if cached is None else outputs["loss"] * accum)
            if accelerator.sync_gradients:
                # max_norm=inf measures without clipping: the norm decides whether the update is usable. Under
                # DeepSpeed the engine already stepped (or skipped) inside backward; this reports its norm.
                norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
                if norm is not None:
                    outputs["grad_norm"] = torch.as_tensor(unshard(norm), dtype=torch.float32)
                applied = step_was_applied(accelerator, model, outputs.get("grad_norm"))
                if applied:
                    optimizer.step()  # a no-op under DeepSpeed
                optimizer.zero_grad(set_to_none=True)
        meter.add(outputs)
    return applied, bool(local_finite)


def pretrain(cfg) -> dict:
    """Run (or resume) pre-training as `cfg` says; returns the run summary (also written to summary.json)."""
    validate_config(cfg)
    tcfg = cfg.trainer
    out_dir = Path(cfg.output_dir)
    accelerator = make_accelerator(cfg, out_dir)
    is_main = accelerator.is_main_process
    if is_main:
        check_writable(out_dir)
    threads = configure_threads(tcfg.cpu_threads, accelerator)
    set_seed(cfg.seed)  # identical initialisation on every rank
    source = init_source(cfg)
    with construction_context(accelerator):
        objective, dataset, views, preprocess = build_components(cfg, source)
    optimizer = build_optimizer(objective, cfg.optim, num_layers=len(objective.encoder.blocks))
    global_batch = cfg.data.batch_size * accelerator.num_processes * tcfg.grad_accum_steps
    peak = peak_lr(cfg.optim, global_batch)
    if cfg.optim.min_lr > peak:
        log.warning("optim.min_lr=%g is above the peak lr %g (optim.lr scaled to global batch %d): the schedule "
                    "stays at the peak instead of rising", cfg.optim.min_lr, peak, global_batch)
    lrs = schedule(peak, min(cfg.optim.min_lr, peak), tcfg.max_steps, warmup_steps(cfg.optim, tcfg.max_steps),
                   cfg.optim.schedule)
    wds = weight_decay_schedule(cfg.optim, tcfg.max_steps)
    eval_sets = periodic_eval_sets(cfg, preprocess.img_size) if tcfg.eval_every > 0 else None

    model, optimizer = accelerator.prepare(objective, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    check_dtypes(unwrapped, parameter_dtype(accelerator, tcfg.precision), unwrapped.fp32_buffers)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    resume_dir = resolve_resume(tcfg.resume, out_dir)
    if resume_dir is not None:
        load_checkpoint(accelerator, resume_dir, model, tcfg.allow_inexact_resume)
    else:
        set_seed(cfg.seed + accelerator.process_index)  # from here on, ranks draw different masks / dropout
    world = accelerator.num_processes
    outputs = RunOutputs(accelerator, out_dir, tcfg.tensorboard)
    removed = remove_stale_temps(out_dir) if is_main else []
    dropped = outputs.open(state.step, cfg, _flat_hparams(to_container(cfg)))
    if is_main:
        log.info("%s on %s: %s, %d encoder parameters, %d process(es) x %d thread(s), global batch %d; %s%s",
                 cfg.objective.name, cfg.data.name, cfg.model.name, count_parameters(unwrapped.encoder), world,
                 threads, global_batch, f"resumed from {resume_dir} at step {state.step}" if resume_dir else "new run",
                 f" ({dropped} metrics rows past it, {len(removed)} unfinished checkpoint(s) removed)"
                 if dropped or removed else "")

    batches = iter(make_loader(dataset, views, cfg.data.batch_size, rank=accelerator.process_index,
                               world_size=world, seed=cfg.seed, start=state.step * tcfg.grad_accum_steps,
                               num_workers=cfg.data.num_workers, pin_memory=accelerator.device.type == "cuda",
                               repeats=cfg.data.augreg.repeats if augment_kind(cfg.data) == "augreg" else 1))
    end_step = min(tcfg.max_steps, tcfg.stop_at_step or tcfg.max_steps)
    guard = UpdateGuard(model.parameters(), tcfg.max_param_norm_growth, partial(parameter_norm, accelerator))
    progress = tqdm(total=end_step, initial=state.step, disable=not (is_main and tcfg.progress),
                    desc="pretrain", dynamic_ncols=True)
    meter = Meter()
    run_start = interval_start = time.perf_counter()
    start_step = interval_step = state.step
    error = None

    def encoder_state(with_heads: bool = False):  # collective when the model is sharded: every rank calls it
        model_state, prefix = full_state_dict(accelerator, model), encoder_prefix(unwrapped)
        if model_state is None:
            return (None, None) if with_heads else None
        encoder = {k[len(prefix):]: v for k, v in model_state.items() if k.startswith(prefix)}
        heads = {k: v for k, v in model_state.items() if k.startswith(unwrapped.saved_heads)}
        return (encoder, heads) if with_heads else encoder

    def save_encoder(step: int) -> None:  # collective when the model is sharded
        encoder, heads = encoder_state(with_heads=True)
        outputs.save_encoder(encoder, unwrapped.encoder.config, step, objective=cfg.objective.name,
                             preprocess=preprocess)
        if unwrapped.saved_heads:
            outputs.save_heads(heads, step, objective=cfg.objective.name,
                               objective_config=json.dumps(to_container(cfg.objective)))

    text_eval = any(e in ("zeroshot", "retrieval") for e in tcfg.eval_evaluators)

    def evaluated_model() -> tuple[VisionTransformer | None, torch.nn.Module | None]:  # collective when sharded
        """The main process's (encoder, objective) for periodic evaluation (the objective only for zeroshot and
        retrieval): the live ones, or, when the parameters are sharded (a forward pass there is collective), full
        copies from the gathered weights."""
        if not is_sharded(accelerator):
            return (unwrapped.encoder, unwrapped if text_eval else None) if is_main else (None, None)
        if text_eval:
            state = full_state_dict(accelerator, model)  # collective: every rank gathers
            if not is_main:
                return None, None
            copy = evaluation_copy(unwrapped, state, cfg)
            return copy.encoder, copy
        weights = encoder_state()
        if not is_main:
            return None, None
        encoder = VisionTransformer(**unwrapped.encoder.config)
        encoder.load_state_dict(weights)
        return encoder.to(accelerator.device), None

    def save(step: int) -> Path:
        checkpoint = save_checkpoint(accelerator, out_dir, step, tcfg.keep_checkpoints)
        save_encoder(step)
        return checkpoint

    try:
        while state.step < end_step:
            apply_schedule(optimizer, float(lrs[state.step]), float(wds[state.step]), state.step)
            unwrapped.begin_step(state.step, tcfg.max_steps)
            applied, loss_finite = train_step(model, optimizer, batches, accelerator, state, meter, cfg)
            state.step += 1
            if applied:
                state.consecutive_nonfinite = 0
                growth = guard.check_update()
                if growth is not None:
                    raise ruined_weights_error(state.step, growth, cfg, (list_checkpoints(out_dir) or [None])[-1])
                unwrapped.after_optimizer_step(state.step, tcfg.max_steps)
            else:
                state.nonfinite_steps += 1
                state.consecutive_nonfinite += 1
                if is_main:
                    log.warning("non-finite %s at step %d: update skipped (%d in a row, %d in all)",
                                "gradients" if loss_finite else "loss", state.step, state.consecutive_nonfinite,
                                state.nonfinite_steps)
            diverged = state.consecutive_nonfinite >= tcfg.max_consecutive_nonfinite
            if state.step % tcfg.log_every == 0 or state.step == end_step or diverged:
                now = time.perf_counter()
                state.last_record = {
                    "step": state.step, **meter.summary(accelerator), "lr": float(lrs[state.step - 1]),
                    "wd": float(wds[state.step - 1]),
                    "images_per_s": global_batch * (state.step - interval_step) / max(now - interval_start, 1e-9),
                    "nonfinite_steps": state.nonfinite_steps, "skipped_samples": state.skipped_samples}
                interval_start, interval_step = now, state.step
                outputs.log(state.last_record, tensorboard_prefix="train/")
                progress.set_postfix(loss=f"{state.last_record.get('loss', math.nan):.4f}",
                                     lr=f"{state.last_record['lr']:.2e}",
                                     img_s=f"{state.last_record['images_per_s']:.1f}")
            progress.update(1)
            fault_point("step_done", state.step)
            if diverged:
                raise nonfinite_error(state.consecutive_nonfinite, state.step, cfg, save(state.step))
            if eval_sets is not None and (state.step % tcfg.eval_every == 0 or state.step == end_step):
                encoder, evaluated = evaluated_model()
                if is_main:
                    scores = periodic_eval(encoder, eval_sets, cfg, preprocess, evaluated)
                    outputs.log({"step": state.step, **scores})
                    log.info("step %d: %s", state.step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
                accelerator.wait_for_everyone()
            if state.step % tcfg.checkpoint_every == 0 or state.step == end_step:
                save(state.step)
        # A run resumed from its final checkpoint skips the loop: its encoder file may predate that checkpoint.
        if gather_object([outputs.encoder_step() != state.step])[0]:  # the main process's answer, for all
            save_encoder(state.step)
    except BaseException as err:
        error = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise
    finally:
        progress.close()
        if hasattr(batches, "_shutdown_workers"):  # now, not at garbage collection (10 s after a data error)
            batches._shutdown_workers()
        elapsed = time.perf_counter() - run_start
        # Collective: only when every rank got here normally.
        digests = gather_object([replica_digest(accelerator, unwrapped)]) if error is None else []
        checkpoints = list_checkpoints(out_dir)
        summary = {
            "step": state.step, "max_steps": tcfg.max_steps, "finished": state.step >= tcfg.max_steps,
            "error": error, "world_size": world, "threads_per_process": threads, "global_batch": global_batch,
            "steps_this_run": state.step - start_step, "wall_s": elapsed,
            "images_per_s": global_batch * (state.step - start_step) / elapsed if state.step > start_step else None,
            "nonfinite_steps": state.nonfinite_steps, "skipped_samples": state.skipped_samples,
            "strategy": strategy_name(accelerator), "last": state.last_record, "param_digests": digests,
            "replicas_in_sync": None if is_sharded(accelerator) else len(set(digests)) <= 1,
            "checkpoint": str(checkpoints[-1]) if checkpoints else None, "encoder": str(out_dir / ENCODER_FILE),
            "preprocess": asdict(preprocess),
        }
        try:
            outputs.summary(summary)
        except OutputError as write_error:
            log.error("%s", write_error)
        accelerator.end_training()

    if is_main:
        if summary["replicas_in_sync"] is False:
            log.error("model replicas differ across processes after training: %s", digests)
        log.info("done: %d steps, %s images/s; encoder at %s" if summary["finished"] else
                 "stopped at step %d of %d; continue with trainer.resume=auto hydra.run.dir=%s",
                 *((state.step, f"{summary['images_per_s'] or 0:.1f}", summary["encoder"]) if summary["finished"]
                   else (state.step, tcfg.max_steps, out_dir)))
    return summary


@contextlib.contextmanager
def _without_hf_zero3():
    """transformers builds models under deepspeed.zero.Init while a ZeRO-3 config is registered with it."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def evaluation_copy(objective, state: dict, cfg):
    """An unsharded copy of `objective` holding the gathered `state` (its weights are all in `state`: a locked
    image tower is not read again from its file)."""
    from omegaconf import OmegaConf

    settings = OmegaConf.merge(cfg.objective, {"lock_image": False, "image_encoder": None}) \
        if "lock_image" in cfg.objective else cfg.objective
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    # Building draws initial weights: leave every training RNG as it was. Under ZeRO-3 accelerate has told
    # transformers so, and a transformers text tower would build itself under zero.Init (collective) on this one
    # rank: switch that off for the copy.
    with torch.random.fork_rng(devices=devices), _without_hf_zero3():
        copy = type(objective)(VisionTransformer(**objective.encoder.config), settings, objective.data)
    copy.load_state_dict(state)
    return copy.to(next(objective.parameters()).device)


def encoder_prefix(objective) -> str:
    """The state-dict prefix of the objective's encoder ("backbone." for most; a teacher's for DINO)."""
    return next(name for name, module in objective.named_modules() if module is objective.encoder) + "."
