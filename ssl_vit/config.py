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
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ssl_vit.vit import PRESETS

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class ConfigError(ValueError):
    """A bad configuration value, reported at start-up with the valid choices."""


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
    num_registers: int | None = None
    no_embed_class: bool | None = None
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


MODEL_OVERRIDE_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.name not in ("name", "grad_checkpointing"))


@dataclass
class DataConfig:
    name: str = MISSING
    img_size: int | None = None  # None: the model preset's native size
    batch_size: int = 64  # per process and micro-step; the global batch is this x processes x grad_accum_steps
    num_workers: int = 0
    augment: bool = False  # random resized crop + horizontal flip
    crop_scale: list[float] = field(default_factory=lambda: [0.35, 1.0])
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_samples: int = 4096
    seed: int = 0


@dataclass
class FolderDataConfig(DataConfig):
    name: str = "folder"
    root: str = MISSING
    test_root: str | None = None  # held-out images in the same layout, for evaluation
    augment: bool = True


@dataclass
class FashionMNISTDataConfig(DataConfig):
    name: str = "fashion_mnist"
    root: str = "/usr/share/datasets/fashion-mnist"
    split: str = "train"
    mean: list[float] = field(default_factory=lambda: [0.286] * 3)
    std: list[float] = field(default_factory=lambda: [0.353] * 3)


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    split: str = "train"
    mean: list[float] = field(default_factory=lambda: [0.3] * 3)
    std: list[float] = field(default_factory=lambda: [0.4] * 3)


@dataclass
class ShardDataConfig(DataConfig):
    name: str = "wds"
    urls: Any = MISSING  # a brace pattern ("/data/shard-{000000..000099}.tar"), or a list of them
    num_classes: int | None = None  # needed by objectives that use labels (shards carry no class list)
    resampled: bool = True  # draw shards with replacement (step-based training, as open_clip)
    shuffle_buffer: int = 1000


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 30
    schedule: Schedule = Schedule.cosine
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    layer_decay: float | None = None  # layer-wise lr decay (fine-tuning); None = off


@dataclass
class TrainerConfig:
    max_steps: int = 300
    grad_accum_steps: int = 1
    precision: Precision = Precision.fp32
    log_every: int = 10
    checkpoint_every: int = 100  # also at the end of the run
    keep_checkpoints: int = 2
    resume: str | None = None  # "auto": the newest checkpoint in the output dir; or a checkpoint directory
    stop_at_step: int | None = None  # end this invocation early (e.g. a job time limit); resume continues it
    max_consecutive_nonfinite: int = 5
    cpu_threads: int | None = None  # None: the machine's cores divided among the local processes
    eval_every: int = 0  # > 0: frozen-feature evaluation of the encoder every N steps (main process), logged
    eval_evaluators: list[str] = field(default_factory=lambda: ["knn"])
    eval_max_samples: int = 2000  # per split, the first N samples of the data's train / test sets
    progress: bool = True
    tensorboard: bool = True


@dataclass
class EvalConfig:
    """Which evaluators run on the frozen features, and their settings."""

    evaluators: list[str] = field(default_factory=lambda: ["linear", "knn", "fewshot"])
    features: str = "cls_avg"  # cls | avg | cls_avg | last_k | pooled (ssl_vit.eval.features)
    last_k: int = 4
    batch_size: int = 256
    l2_values: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    val_fraction: float = 0.2
    knn_k: int = 20
    knn_temperature: float = 0.07
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    fewshot_draws: int = 5
    fewshot_l2: float = 1.0
    finetune_steps: int = 300
    finetune_batch_size: int = 64
    finetune_lr: float = 1e-3
    finetune_layer_decay: float | None = 0.75
    finetune_img_size: int | None = None  # None: the encoder's own; larger resamples the position embeddings
    finetune_augment: bool = False  # random resized crops + flips: for long runs; slows short ones


@dataclass
class ProbeConfig:
    checkpoint: str = MISSING  # encoder.safetensors, a run directory, or timm:<model name> (random init)
    data: Any = MISSING
    eval: EvalConfig = MISSING
    cache_dir: str | None = "outputs/feature_cache"
    seed: int = 0
    output_dir: str = MISSING


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
    store.store(group="schema/eval", name="eval", node=EvalConfig)
    # Schemas live in their own groups (schema/<group>/<option>) so that Hydra's list of valid options for a
    # group shows only the real options; each option file pulls its schema in with `/schema/...@_here_`.
    store.store(group="schema/optim", name="adamw", node=OptimConfig)
    store.store(group="schema/trainer", name="default", node=TrainerConfig)
    store.store(group="schema/data", name="synthetic", node=SyntheticDataConfig)
    store.store(group="schema/data", name="folder", node=FolderDataConfig)
    store.store(group="schema/data", name="fashion_mnist", node=FashionMNISTDataConfig)
    store.store(group="schema/data", name="digits", node=DigitsDataConfig)
    store.store(group="schema/data", name="wds", node=ShardDataConfig)
    for name, objective in OBJECTIVES.items():
        store.store(group="schema/objective", name=name, node=objective.config_class)
    for name in PRESETS:
        store.store(group="model", name=name, node=ModelConfig(name=name))


def model_kwargs(model_cfg) -> dict:
    """The VisionTransformer overrides set in a model config (fields left at None keep the preset's value)."""
    return {k: model_cfg[k] for k in MODEL_OVERRIDE_FIELDS if model_cfg.get(k) is not None}


def to_container(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
