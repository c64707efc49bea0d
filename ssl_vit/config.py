"""Structured (dataclass) schemas for the Hydra configs under configs/, registered in Hydra's ConfigStore.

Each group option file under configs/ extends its schema (`defaults: [/schema/<group>/<option>@_here_, _self_]`),
so a misspelt key or a wrong type fails at start-up with OmegaConf's message naming the key, the bad value and the
expected type. Model
presets need no files: every name in `ssl_vit.vit.PRESETS` is a `model=<name>` option, so the list of valid names
Hydra prints on a typo is the preset table itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from ssl_vit.preprocess import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401 (re-exported)
from ssl_vit.vit import PRESETS


class ConfigError(ValueError):
    """A bad configuration value, reported at start-up with the valid choices."""


def checked(default: Any = MISSING, *, factory=None, ge=None, gt=None, le=None, lt=None, length=None,
            example: str | None = None):
    """A dataclass field with range rules that `validate_config` enforces: bounds apply to a number or to every
    item of a list, `length` to a list; None always passes (optional fields). `example` completes the message when a
    mandatory value is missing."""
    rules = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, length=length, example=example).items()
             if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=rules)
    return field(default=default, metadata=rules)


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def _rule_violation(value, rules: dict) -> str | None:
    """What `value` breaks of `rules` ("must be >= 1", "must have 3 values"), or None."""
    if value is None:
        return None
    allowed = " and ".join(f"{symbol} {rules[key]}" for key, (symbol, _) in _BOUNDS.items() if key in rules)
    if isinstance(value, list | tuple | ListConfig):
        if "length" in rules and len(value) != rules["length"]:
            return f"must have {rules['length']} values, got {len(value)}"
        bad = [v for v in value if not all(test(v, rules[k]) for k, (_, test) in _BOUNDS.items() if k in rules)]
        return f"every value must be {allowed}" if bad else None
    if not all(test(value, rules[key]) for key, (_, test) in _BOUNDS.items() if key in rules):
        return f"must be {allowed}"
    return None


def validate_config(cfg) -> None:
    """One pass over a composed config: every mandatory value is set, every `checked` rule holds. Raises ConfigError
    naming the key, the value and what is allowed."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        example = _field_rules(cfg, key).get("example")
        raise ConfigError(f"{key} is not set" + (f" (data={cfg.data.name})" if key.startswith("data.") else "")
                          + f"; give it on the command line, e.g. {example or key + '=...'}")
    _check_node(cfg, "")


def _field_rules(cfg, dotted_key: str) -> dict:
    parent_key, _, name = dotted_key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    if schema is not None and is_dataclass(schema):
        return dict(next((f.metadata for f in fields(schema) if f.name == name), {}))
    return {}


def _check_node(node: DictConfig, prefix: str) -> None:
    schema = OmegaConf.get_type(node)
    rules = {f.name: f.metadata for f in fields(schema)} if schema is not None and is_dataclass(schema) else {}
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _check_node(child, f"{prefix}{key}.")
            continue
        if rules.get(key):
            value = node[key]
            problem = _rule_violation(value, rules[key])
            if problem:
                shown = list(value) if isinstance(value, ListConfig) else value
                raise ConfigError(f"{prefix}{key}={shown} is invalid: {problem}")


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class ModelConfig:
    """A preset from `ssl_vit.vit.PRESETS`; any other field, when set, overrides the preset's value."""

    name: str = MISSING
    grad_checkpointing: bool = False
    global_pool: str | None = None
    class_token: bool | None = None
    dist_token: bool | None = None  # DeiT's distillation token (objective=deit turns it on)
    num_registers: int | None = None
    no_embed_class: bool | None = None
    pos_embed_interp: str | None = None  # "bicubic" | "bilinear", for resampling to another grid
    pos_embed_antialias: bool | None = None  # timm antialiases (default); DINOv2 / HF transformers do not
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    norm_bias: bool | None = None
    pre_norm: bool | None = None
    parallel_block: bool | None = None
    layer_scale: float | None = None
    drop_path: float | None = None
    attn_drop: float | None = None
    proj_drop: float | None = None
    patch_size: int | None = None
    embed_dim: int | None = None
    depth: int | None = None
    num_heads: int | None = None
    mlp_ratio: float | None = None
    mlp_dim: int | None = None
    weight_init: str | None = None  # timm | jax | torch (ssl_vit.init); None: the preset's
    act_layer: str | None = None  # gelu | gelu_tanh | quick_gelu (ssl_vit.vit.ACTIVATIONS); None: gelu
    # Hybrid (ssl_vit.stem): stem=resnet takes tokens from a ResNet-v2 feature map, 1x1 patches unless patch_size
    # says otherwise; stem_layers = blocks per stage (R50 hybrid: [3, 4, 9], stride 16), stem_channels = stage
    # widths (None: ResNet's 256, 512, ...), stem_width = the 7x7 stem conv's width.
    stem: str | None = None  # patch | resnet
    stem_layers: list[int] | None = checked(None, ge=1)
    stem_channels: list[int] | None = checked(None, ge=1)
    stem_width: int | None = checked(None, ge=1)
    # Start from pre-trained weights: an encoder file or run directory, timm:<name or file>, hf:<dir>,
    # open_clip:<dir> (ssl_vit.export.pretrained); the architecture is the source's, position embeddings resampled
    # to data.img_size as the source library does it.
    init_from: str | None = None


MODEL_OVERRIDE_FIELDS = tuple(f.name for f in fields(ModelConfig)
                              if f.name not in ("name", "grad_checkpointing", "init_from"))


AUGMENTS = ("none", "crop_flip", "augreg")


@dataclass
class AugRegConfig:
    """`data.augreg.*`, used with `data.augment=augreg` (ssl_vit.data.augreg: timm's data tools). Defaults are DeiT's
    ImageNet recipe; the crop scale is data.crop_scale (DeiT: 0.08 at 224 px; the default 0.35 suits small images)."""

    rand_augment: str = "rand-m9-mstd0.5-inc1"  # timm's RandAugment policy string; "" turns it off
    random_erasing: float = checked(0.25, ge=0, le=1)  # probability per image (timm's RandomErasing, 'pixel' mode)
    mixup: float = checked(0.8, ge=0)  # Mixup's Beta(alpha, alpha); 0 turns it off
    cutmix: float = checked(1.0, ge=0)  # CutMix's Beta(alpha, alpha); 0 turns it off
    mix_prob: float = checked(1.0, ge=0, le=1)  # probability that a batch is mixed at all
    switch_prob: float = checked(0.5, ge=0, le=1)  # with both on: CutMix instead of Mixup for a mixed batch
    label_smoothing: float = checked(0.1, ge=0, lt=1)  # in Mixup's soft targets (Mixup off: objective.label_smoothing)
    repeats: int = checked(3, ge=1)  # repeated augmentation (map-style data): each image this often per epoch
    interpolation: str = "bicubic"


@dataclass
class DataConfig:
    name: str = MISSING
    img_size: int | None = checked(None, ge=1)  # None: the model preset's (or, evaluating, the encoder's) size
    batch_size: int = checked(64, ge=1)  # per process and micro-step; global = this x processes x grad_accum_steps
    num_workers: int = checked(0, ge=0)
    # none | crop_flip (random resized crop + horizontal flip; true / false still mean crop_flip / none) | augreg
    # (DeiT / AugReg: timm's RandAugment, random erasing, Mixup / CutMix, repeated augmentation; data.augreg.*)
    augment: str = "none"
    augreg: AugRegConfig = field(default_factory=AugRegConfig)
    crop_scale: list[float] = checked(factory=lambda: [0.35, 1.0], gt=0, le=1, length=2)
    # Normalisation per colour channel. None: the encoder's own when evaluating one that records it, else the
    # dataset's statistics (ImageNet's for natural images).
    mean: list[float] | None = checked(None, length=3)
    std: list[float] | None = checked(None, gt=0, length=3)
    max_train_samples: int | None = checked(None, ge=1)  # a stratified subset of the training set
    max_test_samples: int | None = checked(None, ge=1)  # a stratified subset of the test set (evaluation)


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_samples: int = checked(4096, ge=1)
    seed: int = 0


@dataclass
class FolderDataConfig(DataConfig):
    name: str = "folder"
    root: str = checked(MISSING, example="data.root=/path/to/images (class subfolders of images)")
    test_root: str | None = None  # held-out images in the same layout, for evaluation
    augment: str = "crop_flip"


@dataclass
class CaptionDataConfig(DataConfig):
    """Images with same-named .txt captions (ssl_vit.data.captions), split by a stable hash of the path."""

    name: str = "captions"
    root: str = checked(MISSING, example="data.root=/path/to/pairs (images with same-named .txt captions)")
    split: str = "train"  # train | test | all
    test_fraction: float = checked(0.1, ge=0, lt=1)


@dataclass
class TuxPaintDataConfig(CaptionDataConfig):
    name: str = "tuxpaint"
    root: str = "/usr/share/tuxpaint/stamps"


@dataclass
class FashionMNISTDataConfig(DataConfig):
    name: str = "fashion_mnist"
    root: str = "/usr/share/datasets/fashion-mnist"
    split: str = "train"


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    split: str = "train"


@dataclass
class ShardDataConfig(DataConfig):
    name: str = "wds"
    urls: Any = checked(MISSING, example="data.urls=data/shapes (a directory of .tar shards)")
    num_classes: int | None = checked(None, ge=2)  # for objectives that use labels (shards carry no class list)
    resampled: bool = True  # draw shards with replacement (step-based training, as open_clip)
    shuffle_buffer: int = checked(1000, ge=0)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = checked(1e-3, gt=0)
    # None: lr is the peak learning rate; a batch size: lr is per that many images and scales linearly with the
    # global batch (DeiT: 5e-4 per 512, i.e. lr x global_batch / lr_base_batch)
    lr_base_batch: int | None = checked(None, ge=1)
    min_lr: float = checked(1e-5, ge=0)
    warmup_steps: int = checked(30, ge=0)
    warmup_fraction: float | None = checked(None, ge=0, lt=1)  # a value: warmup = this share of trainer.max_steps
    schedule: Schedule = Schedule.cosine
    weight_decay: float = checked(0.05, ge=0)
    # None: constant weight decay; a value: cosine from weight_decay to it over the run (DINO: 0.04 -> 0.4)
    weight_decay_end: float | None = checked(None, ge=0)
    beta1: float = checked(0.9, ge=0, lt=1)
    beta2: float = checked(0.999, ge=0, lt=1)
    eps: float = checked(1e-8, gt=0)
    grad_clip: float | None = checked(1.0, ge=0)  # global gradient-norm clipping; None or 0: off
    layer_decay: float | None = checked(None, gt=0, le=1)  # layer-wise lr decay (fine-tuning); None = off


@dataclass
class TrainerConfig:
    max_steps: int = checked(300, ge=1)
    grad_accum_steps: int = checked(1, ge=1)
    precision: Precision = Precision.fp32
    log_every: int = checked(10, ge=1)
    checkpoint_every: int = checked(100, ge=1)  # also at the end of the run
    keep_checkpoints: int = checked(2, ge=0)  # 0: keep all
    resume: str | None = None  # "auto": the newest checkpoint in the output dir; or a checkpoint directory
    # Resuming needs every rank's RNG state for an exact continuation; true accepts a checkpoint without them (e.g.
    # written by a different number of processes) with a warning that the run no longer reproduces.
    allow_inexact_resume: bool = False
    stop_at_step: int | None = checked(None, ge=1)  # end this invocation early (a job time limit); resume continues
    max_consecutive_nonfinite: int = checked(5, ge=1)
    # Stop when one update multiplies the parameter norm by more than this (the weights are then ruined).
    max_param_norm_growth: float = checked(2.0, gt=1)
    cpu_threads: int | None = checked(None, ge=1)  # None: the machine's cores divided among the local processes
    eval_every: int = checked(0, ge=0)  # > 0: frozen-feature evaluation every N steps (main process), logged
    eval_evaluators: list[str] = field(default_factory=lambda: ["knn"])
    eval_max_samples: int = checked(2000, ge=1)  # per split, a stratified subset of the train / test sets
    progress: bool = True
    tensorboard: bool = True


@dataclass
class EvalConfig:
    """Which evaluators run on the frozen features, and their settings."""

    evaluators: list[str] = field(default_factory=lambda: ["linear", "knn", "fewshot"])
    features: str = "cls_avg"  # cls | avg | cls_avg | last_k | pooled (ssl_vit.eval.features)
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


@dataclass
class ProbeConfig:
    # encoder.safetensors, a run directory, or timm:<model name> (random init)
    checkpoint: str = checked(MISSING, example="checkpoint=outputs/<run>/encoder.safetensors (or a run directory, "
                                               "or timm:<model name>)")
    data: Any = MISSING
    eval: EvalConfig = MISSING
    cache_dir: str | None = "outputs/feature_cache"
    seed: int = 0
    threads: int | None = checked(None, ge=1)  # torch CPU threads; None: torch's default (all cores)
    output_dir: str = MISSING


@dataclass
class PlanConfig:
    """scripts/plan_memory.py: memory per GPU of a run (ssl_vit.train.memory)."""

    model: ModelConfig = MISSING
    strategy: str = "zero3"  # ddp | zero1 | zero2 | zero3 | zero2_offload | zero3_offload | fsdp2
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


def register_configs() -> None:
    """Register the schemas, the model presets and the `launch_time` resolver (idempotent)."""
    from objectives import OBJECTIVES

    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)
    store = ConfigStore.instance()
    store.store(name="pretrain_schema", node=PretrainConfig)
    store.store(name="probe_schema", node=ProbeConfig)
    store.store(name="plan_schema", node=PlanConfig)
    store.store(group="schema/eval", name="eval", node=EvalConfig)
    # Schemas live in their own groups (schema/<group>/<option>) so that Hydra's list of valid options for a
    # group shows only the real options; each option file pulls its schema in with `/schema/...@_here_`.
    store.store(group="schema/optim", name="adamw", node=OptimConfig)
    store.store(group="schema/trainer", name="default", node=TrainerConfig)
    store.store(group="schema/data", name="synthetic", node=SyntheticDataConfig)
    store.store(group="schema/data", name="folder", node=FolderDataConfig)
    store.store(group="schema/data", name="captions", node=CaptionDataConfig)
    store.store(group="schema/data", name="tuxpaint", node=TuxPaintDataConfig)
    store.store(group="schema/data", name="fashion_mnist", node=FashionMNISTDataConfig)
    store.store(group="schema/data", name="digits", node=DigitsDataConfig)
    store.store(group="schema/data", name="wds", node=ShardDataConfig)
    for name, objective in OBJECTIVES.items():
        store.store(group="schema/objective", name=name, node=objective.config_class)
    for name in PRESETS:
        store.store(group="model", name=name, node=ModelConfig(name=name))


def augment_kind(data_cfg) -> str:
    """data.augment as one of AUGMENTS (true / false, as before the recipe existed: crop_flip / none)."""
    value = str(data_cfg.get("augment", "none")).lower()
    value = {"true": "crop_flip", "false": "none"}.get(value, value)
    if value not in AUGMENTS:
        raise ConfigError(f"data.augment={data_cfg.get('augment')!r} is not one of {list(AUGMENTS)}")
    return value


def peak_lr(optim_cfg, global_batch: int) -> float:
    """optim.lr, or scaled linearly by the global batch when optim.lr_base_batch is set."""
    if optim_cfg.get("lr_base_batch"):
        return optim_cfg.lr * global_batch / optim_cfg.lr_base_batch
    return optim_cfg.lr


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
    for key in ("stem_layers", "stem_channels"):
        if key in kwargs:
            kwargs[key] = list(kwargs[key])
    preset = PRESETS.get(model_cfg.get("name"), {})
    if kwargs.get("stem") == "resnet" and preset.get("stem") != "resnet" and "patch_size" not in kwargs:
        kwargs["patch_size"] = 1
    return kwargs


def to_container(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
