"""The schemas of the engine's own config groups (model, optim, trainer, eval) and of the entry points (pretrain,
evaluate, plan_memory), with the helpers that read them. Each data kind's schema lives with its data
(ssl_vit.data), each objective's with its method (objectives/); `ssl_vit.cli.register_configs` puts them all in
Hydra's ConfigStore, so that a misspelt key or a wrong type fails at start-up with OmegaConf's message naming the
key, the bad value and the expected type. Model presets need no files: every name in `ssl_vit.backbone.PRESETS` is a
`model=<name>` option.
"""

from __future__ import annotations

import math
import os
import time
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING

from ssl_vit.backbone import CHECKPOINTING, PRESETS, ViTConfig
from ssl_vit.schema import ConfigError, checked

# Choices of the engine's own string options, stated once (the schemas below check them: ssl_vit.schema.checked)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
EVALUATORS = ("linear", "knn", "fewshot", "finetune", "zeroshot", "retrieval", "segmentation", "attentive")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fsdp2")  # plan_memory's
# ssl-vit benchmark's protocols (ssl_vit.eval.benchmark): the frozen-feature ones, VTAB-1k, dense, image-text
BENCHMARK_PROTOCOLS = ("linear", "knn", "fewshot", "vtab", "segmentation", "zeroshot", "retrieval")
LR_SCALINGS = ("none", "linear", "sqrt")  # optim.lr_scaling: how the lr follows the global batch


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class PreemptSignal(str, Enum):  # trainer.preempt_signals (ssl_vit.train.stop_requests)
    SIGTERM = "SIGTERM"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGHUP = "SIGHUP"
    SIGQUIT = "SIGQUIT"


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


# The model group's overrides are ViTConfig's own fields (ssl_vit.backbone.config, where each is documented), each
# None unless set (None: the preset's value), with the same checks; not overridable: the image size (data.img_size),
# the channels (the data's) and the classes (the objective's).
NOT_OVERRIDABLE = ("img_size", "in_chans", "num_classes")
_LISTS = {tuple[int, ...]: list[int], tuple[int, ...] | None: list[int],
          tuple[int, int] | None: list[int]}  # OmegaConf holds lists, not tuples


def _override_type(hint):
    """The Hydra type of a ViTConfig field's override: Optional of its type (lists for tuples; an int for an
    int-or-pair)."""
    if hint in _LISTS:
        return _LISTS[hint] | None
    args = set(typing.get_args(hint)) - {type(None)}
    if int in args and any(typing.get_origin(a) is tuple for a in args):
        return int | None
    return hint if type(None) in typing.get_args(hint) else hint | None


def _model_config() -> type:
    hints = typing.get_type_hints(ViTConfig)
    overrides = [(spec.name, _override_type(hints[spec.name]), field(default=None, metadata=spec.metadata))
                 for spec in fields(ViTConfig) if spec.name not in NOT_OVERRIDABLE]
    schema = make_dataclass("ModelConfig", [
        ("name", str, field(default=MISSING)),
        ("grad_checkpointing", bool, field(default=False)),  # activation checkpointing per transformer block
        # What a checkpointed block keeps: "full" its input only (recompute all), "selective" also its matmul and
        # attention outputs (recompute the element-wise ops; ssl_vit.backbone.CHECKPOINTING)
        ("checkpoint_policy", str, checked("full", choices=CHECKPOINTING)),
        *overrides,
        # Start from pre-trained weights: an encoder file or run directory, timm:<name or file>, hf:<dir>,
        # open_clip:<dir> (ssl_vit.interop.sources); the architecture is the source's, position embeddings resampled
        # to data.img_size as the source library does it.
        ("init_from", str | None, field(default=None)),
        # With init_from: also the objective's weights beyond the encoder that the source holds (our runs'
        # heads.safetensors; DINO / DINOv2 training checkpoints), so a run continues with the heads, teacher and
        # centres it had. Refused by name where a name or shape does not fit the objective.
        ("init_heads", bool, field(default=False)),
    ])
    schema.__module__, schema.__doc__ = __name__, (
        "A preset from `ssl_vit.backbone.PRESETS`; any ViTConfig field, when set, overrides the preset's value.")
    return schema


ModelConfig = _model_config()
MODEL_OVERRIDE_FIELDS = tuple(spec.name for spec in fields(ViTConfig) if spec.name not in NOT_OVERRIDABLE)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = checked(1e-3, gt=0)
    # How the peak lr follows the global batch (processes x data.batch_size x grad_accum_steps): none (lr is the
    # peak), linear (lr x global / lr_base_batch: DINO, MAE, MoCo v3 per 256, DeiT per 512) or sqrt
    # (lr x sqrt(global / lr_base_batch): DINOv2 / DINOv3 against 1024). Each objective's recipe sets its
    # reference's rule; the start-up line prints the lr before and after.
    lr_scaling: str = checked("none", choices=LR_SCALINGS)
    lr_base_batch: int | None = checked(None, ge=1)  # the global batch optim.lr is for (linear, sqrt; none: unused)
    min_lr: float = checked(1e-5, ge=0)
    warmup_steps: int = checked(30, ge=0)
    warmup_fraction: float | None = checked(None, ge=0, lt=1)  # a value: warmup = this share of trainer.max_steps
    warmup_start: float = checked(0.0, ge=0)  # the lr at the warm-up's first step (I-JEPA: 2e-4; not scaled)
    # true: the warm-up's last step is at the peak (DINO's inclusive linspace); false: step k of W is at
    # lr x k / W and the peak comes at step W (MoCo v3's and MAE's adjust_learning_rate, I-JEPA's scheduler)
    warmup_inclusive: bool = True
    # 1: step k takes the lr and weight decay the schedules give step k + 1 (I-JEPA steps its schedulers before
    # each iteration, so its last step reaches min_lr); 0: step k's own
    schedule_lead: int = checked(0, ge=0, le=1)
    schedule: Schedule = Schedule.cosine
    weight_decay: float = checked(0.05, ge=0)
    # None: constant weight decay; a value: cosine from weight_decay to it over the run (DINO: 0.04 -> 0.4)
    weight_decay_end: float | None = checked(None, ge=0)
    # True: every parameter decays, biases, norms, position embeddings and tokens too (MoCo v3's main_moco.py)
    decay_all: bool = False
    beta1: float = checked(0.9, ge=0, lt=1)
    beta2: float = checked(0.999, ge=0, lt=1)
    eps: float = checked(1e-8, gt=0)
    grad_clip: float | None = checked(1.0, ge=0)  # global gradient-norm clipping; None or 0: off
    layer_decay: float | None = checked(None, gt=0, le=1)  # layer-wise lr decay (fine-tuning, DINOv2); None = off
    patch_embed_lr_scale: float = checked(1.0, gt=0)  # the patch embedding's lr multiplier (DINOv2 / DINOv3: 0.2)


@dataclass
class TrainerConfig:
    max_steps: int = checked(300, ge=1)
    grad_accum_steps: int = checked(1, ge=1)
    precision: Precision = Precision.fp32
    tf32: bool = True  # fp32 matmuls in TF32 on CUDA (false: full fp32, e.g. for parity checks)
    # torch.compile each transformer block (ssl_vit.train.strategy.compile_blocks): single process, DDP, FSDP2
    compile: bool = False
    compile_mode: str | None = checked(None, choices=COMPILE_MODES)  # torch.compile's mode; None: its default
    compile_dynamic: bool | None = None  # None: torch decides (a second input shape recompiles with dynamic sizes)
    compile_cache_dir: str | None = None  # inductor's cache (TORCHINDUCTOR_CACHE_DIR); None: <run>/compile_cache
    log_every: int = checked(10, ge=1)
    checkpoint_every: int = checked(100, ge=1)  # also at the end of the run
    keep_checkpoints: int = checked(2, ge=0)  # 0: keep all
    resume: str | None = None  # "auto": the newest checkpoint in the output dir; or a checkpoint directory
    overwrite: bool = False  # a new run where an earlier one left outputs: clear them (else refused)
    # Resuming needs every rank's RNG state for an exact continuation; true accepts a checkpoint without them (e.g.
    # written by a different number of processes) with a warning that the run no longer reproduces.
    allow_inexact_resume: bool = False
    # A checkpoint's pickled files (accelerate's, DeepSpeed's, DCP's) are read as weights only before they load: one
    # holding other Python objects is refused, since unpickling it would run their code. true: load it unchecked.
    trust_pickle: bool = False
    record_sample_keys: bool = False  # sample_keys/rank_<r>.jsonl: the samples each step trained on, per rank
    stop_at_step: int | None = checked(None, ge=1)  # end this invocation early (a job time limit); resume continues
    # Signals that stop the run after the step with a checkpoint and exit 75 (requeue); Ctrl-C always stops (130).
    preempt_signals: list[PreemptSignal] = field(default_factory=lambda: [PreemptSignal.SIGTERM,
                                                                          PreemptSignal.SIGUSR1])
    max_consecutive_nonfinite: int = checked(5, ge=1)
    # Stop when one update multiplies the parameter norm by more than this (the weights are then ruined).
    max_param_norm_growth: float = checked(2.0, gt=1)
    # A step (its evaluation and checkpoint included) that runs longer stops the run: one line, every thread's stack
    # on every rank, exit status 1 (ssl_vit/train/watchdog.py). None: no limit.
    step_timeout_s: float | None = checked(None, gt=0)
    # How long a process waits in a collective (gradient reduction, barrier) before the run stops with an error.
    collective_timeout_s: int = checked(1800, ge=1)
    cpu_threads: int | None = checked(None, ge=1)  # None: the machine's cores divided among the local processes
    eval_every: int = checked(0, ge=0)  # > 0: frozen-feature evaluation every N steps (main process), logged
    eval_evaluators: list[str] = field(default_factory=lambda: ["knn"])
    eval_max_samples: int = checked(2000, ge=1)  # per split, a stratified subset of the train / test sets
    progress: bool = True
    # accelerate's trackers: tensorboard (into <run>/tb), mlflow, wandb, comet_ml, aim, clearml, dvclive, ...; []: none
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])


@dataclass
class EvalConfig:
    """Which evaluators run on the frozen features, and their settings."""

    evaluators: list[str] = checked(factory=lambda: ["linear", "knn", "fewshot"], choices=EVALUATORS)
    # ssl_vit.eval.features.FEATURE_KINDS, or the name of a distilled student's adaptor (not a fixed set: checked
    # by the evaluation against the run it reads)
    features: str = "cls_avg"
    last_k: int = checked(4, ge=1)
    batch_size: int = checked(256, ge=1)
    l2_values: list[float] = checked(factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1], gt=0)
    val_fraction: float = checked(0.2, gt=0, lt=1)
    knn_k: int = checked(20, ge=1)
    knn_temperature: float = checked(0.07, gt=0)
    fewshot_shots: list[int] = checked(factory=lambda: [1, 5, 10, 25], ge=1)
    fewshot_draws: int = checked(5, ge=1)
    fewshot_l2: float = checked(1.0, gt=0)
    finetune_steps: int = checked(300, ge=1)
    finetune_batch_size: int = checked(64, ge=1)
    finetune_lr: float = checked(1e-3, gt=0)
    finetune_layer_decay: float | None = checked(0.75, gt=0, le=1)
    finetune_img_size: int | None = checked(None, ge=1)  # None: the encoder's own; larger resamples pos. embeddings
    finetune_augment: bool = False  # random resized crops + flips: for long runs; slows short ones
    zeroshot_templates: list[str] = field(default_factory=list)  # prompts with {} for the class; empty: the data's
    retrieval_ks: list[int] = checked(factory=lambda: [1, 5, 10], ge=1)
    segmentation_blocks: int = checked(1, ge=1)  # the last k blocks' patch tokens, concatenated (DINOv2's +ms: 4)
    attentive_lr_values: list[float] = checked(factory=lambda: [1e-3, 3e-3], gt=0)
    attentive_weight_decays: list[float] = checked(factory=lambda: [0.01, 0.1], ge=0)
    attentive_epochs: int = checked(20, ge=1)
    attentive_batch_size: int = checked(256, ge=1)
    attentive_heads: int | None = checked(None, ge=1)  # None: the encoder's head count
    # ViTDet / SAM: run a ViT of ours windowed (data.img_size: the resolution), window_size x window_size squares in
    # every block but global_attn_indexes (SAM ViT-B: 14, [2, 5, 8, 11]); 0: as it was built
    window_size: int = checked(0, ge=0)
    global_attn_indexes: list[int] = checked(factory=list, ge=0)
    # segmentation on a level of ViTDet's simple feature pyramid over the last feature map (ssl_vit.backbone.pyramid:
    # stride patch/4 .. 2 x patch; seeded, untrained: the frozen-feature protocol fits only the linear head); None:
    # the tokens
    pyramid_stride: int | None = checked(None, ge=1)
    # fixed: every image resized and cropped to data.img_size | naflex: each whole image at its own aspect ratio,
    # resized to fit eval.seq_len patches (ssl_vit.data.naflex), for linear, knn, fewshot, zeroshot, retrieval
    resolution: str = checked("fixed", choices=("fixed", "naflex"))
    seq_len: int | None = checked(None, ge=1)  # None: the encoder's patches at data.img_size


@dataclass
class ProbeConfig:
    # encoder.safetensors, a run directory, or timm:<model name> (random init)
    checkpoint: str = checked(MISSING, example="checkpoint=outputs/<run>/encoder.safetensors (or a run directory, "
                                               "or timm:<model name>)")
    data: Any = MISSING
    eval: EvalConfig = MISSING
    # extracted features, reused by later evaluations; None: <run>/eval/feature_cache for a run of ours,
    # $SSL_VIT_CACHE/features (default ~/.cache/ssl_vit/features) for an import; never the current directory
    cache_dir: str | None = None
    cache_features: bool = True
    # timm: / hf: / open_clip: sources that are not ViTs (a ResNet, ConvNeXt, Swin) are evaluated as their library
    # runs them (ssl_vit.interop.native); true: ViTs too, instead of converting them into ours
    native: bool = False
    seed: int = 0
    threads: int | None = checked(None, ge=1)  # torch CPU threads; None: torch's default (all cores)
    output_dir: str = MISSING


@dataclass
class BenchmarkSuite:
    """A suite of data sets (configs/benchmark/<name>.yaml): each a data config, by its name in the tables."""

    name: str = MISSING
    datasets: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchmarkConfig:
    """scripts/benchmark.py: encoders x data sets x protocols (ssl_vit.eval.benchmark)."""

    # a list of specs (a run, encoder.safetensors, timm:, hf:, open_clip:), labelled by their names; or {label: spec}
    encoders: Any = checked(MISSING, example="encoders=[outputs/<run>,timm:resnet18]")
    benchmark: BenchmarkSuite = MISSING
    # auto: each protocol where it applies; named ones must apply to every data set and encoder
    protocols: list[str] = checked(factory=lambda: ["auto"], choices=("auto", *BENCHMARK_PROTOCOLS))
    datasets: list[str] | None = None  # a subset of the suite's data sets, by name; None: all of them
    img_size: int | None = checked(None, ge=1)  # every encoder at this size (a data set's own img_size wins)
    eval: EvalConfig = MISSING  # the evaluators' settings (eval.knn_k, eval.fewshot_shots, ...); not which run
    vtab_train: int = checked(1000, ge=2)  # VTAB-1k: training images per task ...
    vtab_val: int = checked(200, ge=1)  # ... of which these choose the hyper-parameters
    native: bool = False  # as evaluate's: ViTs of timm: / hf: / open_clip: run by their library too
    cache_dir: str | None = None  # frozen features; None: <out>/feature_cache
    plots: bool = True  # the PNGs (heat map, few-shot curves)
    seed: int = 0
    threads: int | None = checked(None, ge=1)
    out: str = MISSING


@dataclass
class PlanConfig:
    """scripts/plan_memory.py: memory per GPU of a run (ssl_vit.train.memory)."""

    model: ModelConfig = MISSING
    strategy: str = checked("zero3", choices=STRATEGIES)
    gpus: int = checked(8, ge=1)
    gpus_per_node: int = checked(8, ge=1)
    batch_per_gpu: int = checked(1, ge=1)
    img_size: int | None = checked(None, ge=1)  # None: the preset's
    precision: Precision = Precision.bf16
    grad_checkpointing: bool = False
    gpu_memory_gib: float = checked(80.0, gt=0)  # for "the smallest GPU count that fits"


@dataclass
class PretrainConfig:
    model: ModelConfig = MISSING
    objective: Any = MISSING
    data: Any = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    seed: int = 0
    out: str | None = None  # the run directory (short for hydra.run.dir); None: outputs/<group>/<time>
    output_dir: str = MISSING


def launch_time(fmt: str = "%Y-%m-%d_%H-%M-%S") -> str:
    """A timestamp that every process of one launch agrees on, for the shared output directory.

    Under a multi-process launcher (torchrun / accelerate launch) all local ranks are children of one agent, so the
    agent's start time is the same for each of them; a single process uses the current time.
    """
    stamp = time.time()
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        try:
            with open(f"/proc/{os.getppid()}/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
            stamp = boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, StopIteration):
            pass
    return time.strftime(fmt, time.localtime(stamp))


def peak_lr(optim_cfg, global_batch: int) -> float:
    """The peak learning rate for `global_batch` images a step: optim.lr scaled as optim.lr_scaling says."""
    rule, base = optim_cfg.get("lr_scaling", "none"), optim_cfg.get("lr_base_batch")
    if rule == "none":
        return optim_cfg.lr
    if not base:
        raise ConfigError(f"optim.lr_scaling={rule} needs optim.lr_base_batch, the global batch optim.lr is given "
                          "for (DINO, MAE, MoCo v3: 256; DINOv2 / DINOv3: 1024)")
    ratio = global_batch / base
    return optim_cfg.lr * (ratio if rule == "linear" else math.sqrt(ratio))


def warmup_steps(optim_cfg, max_steps: int) -> int:
    """optim.warmup_steps, or optim.warmup_fraction of the run when set."""
    if optim_cfg.get("warmup_fraction") is not None:
        return round(optim_cfg.warmup_fraction * max_steps)
    return optim_cfg.warmup_steps


def model_kwargs(model_cfg) -> dict:
    """The VisionTransformer overrides set in a model config (fields left at None keep the preset's value).

    `stem=resnet` on a plain preset means 1x1 patches of the ResNet map (the paper's hybrid) unless patch_size is set.
    """
    kwargs = {k: model_cfg[k] for k in MODEL_OVERRIDE_FIELDS if model_cfg.get(k) is not None}
    for key in ("stem_layers", "stem_channels", "global_attn_indexes"):
        if key in kwargs:
            kwargs[key] = list(kwargs[key])
    preset = PRESETS.get(model_cfg.get("name"), {})
    if kwargs.get("stem") == "resnet" and preset.get("stem") != "resnet" and "patch_size" not in kwargs:
        kwargs["patch_size"] = 1
    return kwargs
