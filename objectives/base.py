"""The objective contract: everything the engine (ssl_vit/train/) knows about a method is on this page.

An objective is an `nn.Module` that owns its backbone, its heads and any teacher, and turns a batch into a loss.
The engine meets it at these points, and only these:

    needs = Objective.requirements(cfg)      # declared as data: views, EMA teacher, image-text, fixed backbone, ...
    objective = Objective(backbone, cfg, data)   # built under the strategy's construction context (zero.Init)
    data               text_tokenizer(), multicrop_options(), teacher_inputs() (the `text`, `crops`,
                       `teacher_images` views)
    optimizer groups   no_weight_decay(), frozen_parameters()
    every step         begin_step(step, total); micro_steps(batches, engine); after_optimizer_step(step, total)
    saving             artifacts(full_state) -> encoder / heads / metadata; fp32_shards() (16-bit runs)
    evaluation         encoder (what is evaluated and exported); evaluation_copy(full_state)
    reloading          rebuild_config(cfg), state_from_artifacts(encoder, heads) (ssl_vit.objectives.load_trained)
    strategies         fp32_buffers (kept fp32 under 16-bit training), _no_split_modules (FSDP2's units)

`forward(batch) -> {"loss": scalar, **scalar metrics}` is the one method an objective must write. The smallest
complete objective, a linear classifier on the pooled embedding:

    @dataclass
    class LinearConfig(ObjectiveConfig):
        name: str = "linear"

    class Linear(Objective):
        config_class = LinearConfig
        needs = Requirements(views=("image", "label"))
        saved_heads = ("head.",)

        def __init__(self, backbone, cfg, data):
            super().__init__(backbone, cfg, data)
            self.head = nn.Linear(backbone.embed_dim, data.num_classes)

        def forward(self, batch):
            logits = self.head(self.backbone.pool(self.backbone.forward_features(batch["image"])))
            return {"loss": F.cross_entropy(logits.float(), batch["label"])}

Register it in objectives/__init__.py with a config under configs/objective/, or, outside this package, name it
`module:Class` in the objective config (`name: my_package.linear:Linear`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ssl_vit.artifacts import load_encoder, load_heads, read_metadata, read_preprocess, run_files
from ssl_vit.backbone import Block, ParallelBlock, VisionTransformer, ViTConfig
from ssl_vit.schema import to_container, validate_config


@dataclass
class ObjectiveConfig:
    name: str = "???"


@dataclass
class DataInfo:
    """What an objective may need to know about its data."""

    num_classes: int
    img_size: int
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class FixedBackbone:
    """A pre-trained backbone an objective brings itself (LiT's locked image tower): built instead of `model=`."""

    config: ViTConfig
    preprocess: object = None  # its recorded ssl_vit.preprocess.Preprocess, or None


@dataclass(frozen=True)
class Requirements:
    """What an objective needs from the run, declared as data; the build step and the strategy read only this.

    views: the batch entries it reads (ssl_vit.data.views.VIEW_KINDS; "label" needs class labels, "text" captions).
    naflex: its `image` may be a NaFlex batch (patches, coordinates, valid mask) instead of an image tensor.
    drops_patches: its encoder runs on a subset of each image's patch tokens (MAE's visible 25%, I-JEPA's context
      block), so windowed attention and relative positions, which need the whole grid, are refused at start-up.
    ema_teacher: it holds a teacher updated shard by shard after each step (DeepSpeed then keeps no parameter whole
      on every rank). image_text: it embeds images and texts (`encode_image`, `encode_text`, `text_tokenizer`), so
      zero-shot and retrieval evaluate it. fixed_backbone: its own backbone, replacing `model=`. init_from: why
      `model.init_from` cannot start it (None: it can). model_defaults: backbone options the method uses where the
      model config leaves them unset (CLIP: pre_norm). preset_defaults: {preset: options} the method's reference
      gives one `model=` preset, on top of model_defaults (MoCo v3's ViT-S: 12 heads)."""

    views: tuple[str, ...] = ("image",)
    naflex: bool = False  # it trains on NaFlex batches (data.resolution=naflex; ssl_vit.naflex)
    drops_patches: bool = False
    ema_teacher: bool = False
    image_text: bool = False
    fixed_backbone: FixedBackbone | None = None
    init_from: str | None = None
    model_defaults: dict = field(default_factory=dict)
    preset_defaults: dict = field(default_factory=dict)

    def defaults_for(self, preset: str) -> dict:
        """The backbone options the method sets for `model=preset` where the model config leaves them unset."""
        return {**self.model_defaults, **self.preset_defaults.get(preset, {})}


@dataclass
class Artifacts:
    """What a run saves of an objective: the encoder's state dict (encoder.safetensors), the heads' (heads.safetensors,
    by their names in the objective) and metadata that rebuilds the objective (`load_trained`): its name,
    its config and its `DataInfo`, as JSON."""

    encoder: dict[str, torch.Tensor]
    heads: dict[str, torch.Tensor]
    metadata: dict[str, str]


class Engine(Protocol):
    """What `Objective.micro_steps` drives (the Trainer gives it): `forward(batch)` runs the distributed model on a
    batch without a backward pass; `step(batch, loss_scale)` runs one micro-step: forward, backward of loss x
    loss_scale, and, after the last micro-batch of the optimizer step, clipping and the optimizer step."""

    forward: Callable[[dict], dict]
    step: Callable[..., dict]


class Objective(nn.Module, ABC):
    """Built from (backbone, objective config, data info); see the module docstring for the whole contract."""

    config_class: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    needs: ClassVar[Requirements] = Requirements()
    # why it does not train on NaFlex batches (needs.naflex False), said in one line at start-up
    naflex_refusal: ClassVar[str] = "its views and losses are built for fixed-size images"
    # State-dict prefixes of the heads saved beside the encoder (heads.safetensors), to continue training from them.
    saved_heads: ClassVar[tuple[str, ...]] = ()
    # Buffers that stay fp32 whatever the training precision (DINO's centres); zero.Init keeps them so too.
    fp32_buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, backbone: VisionTransformer, cfg, data: DataInfo):
        super().__init__()
        self.backbone = backbone
        self.cfg = cfg
        self.data = data

    @abstractmethod
    def forward(self, batch: dict) -> dict[str, torch.Tensor]: ...

    # ----- declared needs -----
    @classmethod
    def requirements(cls, cfg) -> Requirements:
        """The record for this config (ValueError naming a bad value); `needs` unless an option changes it."""
        return cls.needs

    # ----- data and optimizer hooks -----
    def text_tokenizer(self):
        """For objectives that read `text`: str -> token ids, run in the data workers."""
        return None

    def multicrop_options(self) -> dict | None:
        """For objectives that read the `crops` view: the multi-crop settings (`MultiCropViews` keywords, and
        `global_masks`: `GlobalCropMasks` settings for token masks the collate draws, batch keys `global_masks`
        and `global_mask_indices`)."""
        return None

    def teacher_inputs(self) -> list | None:
        """For objectives that read the `teacher_images` view: each frozen teacher's input recipe
        (ssl_vit.preprocess.Preprocess: size, interpolation, normalisation); the data layer cuts every teacher's view
        from the student's crop box."""
        return None

    def frozen_parameters(self) -> dict[str, int]:
        """Parameter-name prefixes -> how many first steps they are held at learning rate 0 (a zero-lr optimizer
        group: unlike dropping gradients, this also works under DeepSpeed)."""
        return {}

    def lr_scales(self) -> dict[str, float]:
        """Parameter-name prefixes -> learning-rate multipliers: each prefix's parameters get optimizer groups of
        their own (distill's extra students)."""
        return {}

    # ----- the step -----
    def check_start(self, total_steps: int, from_trained: bool) -> None:
        """Refuse (ValueError naming the value) a run this objective would train wrongly: `total_steps` long, its
        backbone starting from trained weights (`model.init_from`) or not."""

    def begin_step(self, step: int, total_steps: int) -> None:
        """Called before optimizer step `step` (0-based) of `total_steps`: for schedules the forward reads."""

    def micro_steps(self, micro_batches: list[dict], engine: Engine) -> None:
        """One optimizer step over its micro-batches (gradient accumulation): one `engine.step` per micro-batch.
        Contrastive objectives override it (CLIP: every micro-batch embedded first, each then scored against all)."""
        for batch in micro_batches:
            engine.step(batch)

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        """After optimizer step `step` (1-based): updates outside the gradient (EMA teachers, monitors)."""

    # ----- saving and evaluation -----
    @property
    def encoder(self) -> VisionTransformer:
        """The network that is evaluated and exported (DINO: the teacher's backbone)."""
        return self.backbone

    def artifacts(self, state: dict[str, torch.Tensor]) -> Artifacts:
        """This objective's artifacts from its full (gathered) state dict."""
        prefix = self._encoder_prefix
        return Artifacts(encoder={k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                         heads={k: v for k, v in state.items() if k.startswith(self.saved_heads)},
                         metadata={"objective": self.cfg.name, "objective_config": json.dumps(to_container(self.cfg)),
                                   "data_info": json.dumps(asdict(self.data))})

    def member_artifacts(self, state: dict[str, torch.Tensor]) -> dict[str, tuple[ViTConfig, Artifacts]]:
        """Further encoders the run saves, each as a run directory of its own under the run's
        (`<run>/<key>/encoder.safetensors` and heads.safetensors): key -> (its encoder config, its artifacts) from
        the full state dict. Distill's extra students are saved so."""
        return {}

    def state_from_artifacts(self, encoder: dict[str, torch.Tensor], heads: dict[str, torch.Tensor]) -> dict:
        """The inverse of `artifacts`: state-dict entries (all the artifacts hold) for `load_state_dict`."""
        return {**{self._encoder_prefix + k: v for k, v in encoder.items()}, **heads}

    @property
    def _encoder_prefix(self) -> str:
        return next(name for name, module in self.named_modules() if module is self.encoder) + "."

    @classmethod
    def rebuild_config(cls, cfg):
        """The config that rebuilds this objective from its artifacts alone (without the files it was first built
        from: LiT's locked image tower is in encoder.safetensors)."""
        return cfg

    def fp32_shards(self) -> dict[str, torch.Tensor]:
        """Parameters the optimizer holds no fp32 master of, whose fp32 values live elsewhere (an EMA teacher's
        averages when its tensors are 16-bit): name -> this rank's fp32 shard, for saving at full precision."""
        return {}

    def evaluation_copy(self, state: dict[str, torch.Tensor]) -> Objective:
        """An unsharded copy holding the gathered `state` (for evaluating a sharded run on one process)."""
        copy = type(self)(VisionTransformer(self.backbone.config), self.rebuild_config(self.cfg), self.data)
        copy.load_state_dict(state)
        return copy

    # ----- what the strategies read -----
    @property
    def _no_split_modules(self) -> list[str]:
        """The transformer-block classes in this model (backbone, decoders, heads): FSDP2's auto-wrap shards each
        block as one unit (accelerate reads this when the accelerate config names no layer class)."""
        return sorted({type(m).__name__ for m in self.modules() if isinstance(m, (Block, ParallelBlock))})

    @property
    def _keep_in_fp32_modules_strict(self) -> list[str]:
        """DeepSpeed's zero.Init turns every float tensor made during construction into the training dtype except
        the buffers this names (its keep_in_fp32 rule, after transformers' attribute)."""
        return list(self.fp32_buffers)


def typed_config(cls: type[Objective], cfg):
    """`cfg` on the objective's schema: a key it lacks or a wrong type fails, its range rules are checked. A config
    typed already (by Hydra from the registered schema, or built from it) is taken as it is; an untyped one (an
    objective named module:Class, a config read back from a run's metadata) is typed here."""
    if is_dataclass(cfg) or (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is cls.config_class):
        return cfg
    typed = OmegaConf.merge(OmegaConf.structured(cls.config_class), cfg)
    validate_config(typed, prefix="objective.")
    return typed


def recorded_objective(encoder_path: Path) -> dict[str, str]:
    """The objective's name and config that a run without heads.safetensors recorded: in encoder.safetensors (every
    run since encoder files record the config), else the name there and the config Hydra saved beside it
    (`.hydra/config.yaml`: masked_patch and MAE runs wrote no heads file before they saved their heads); ValueError
    naming what is missing."""
    meta = read_metadata(encoder_path)
    hydra = encoder_path.parent / ".hydra" / "config.yaml"
    if "objective_config" not in meta and "objective" in meta and hydra.is_file():
        meta["objective_config"] = json.dumps(OmegaConf.to_container(OmegaConf.load(hydra).objective, resolve=True))
    if "objective_config" not in meta:
        raise ValueError(f"{encoder_path.parent} has no heads.safetensors, and neither its encoder.safetensors nor "
                         "a .hydra/config.yaml beside it records the objective's config: copy the run's "
                         "heads.safetensors (or .hydra/) into it")
    return meta


def load_run(run, objective_class: Callable[[str], type[Objective]], image_text: bool = False,
             weights: bool = True) -> Objective:
    """The objective a run trained, rebuilt from its encoder.safetensors and heads.safetensors (which record the
    objective's name and config; `objective_class` maps that name to its class), in eval mode; ValueError naming
    what is missing. `image_text`: refuse, before building anything, a run whose objective is not an image-text
    model. `weights=False`: the objective as built, holding the encoder's weights only (to fill from a checkpoint)."""
    encoder_path, heads_path = run_files(run)
    if not encoder_path.is_file():
        raise ValueError(f"{str(run)!r} is not a run directory with encoder.safetensors")
    heads, meta = load_heads(heads_path) if heads_path.is_file() else ({}, recorded_objective(encoder_path))
    cls = objective_class(meta.get("objective", ""))
    cfg = cls.rebuild_config(typed_config(cls, json.loads(meta["objective_config"])))
    if image_text and not cls.requirements(cfg).image_text:
        raise ValueError(f"{str(run)!r} was trained with objective={cfg.name}; this needs an image-text model "
                         "(objective=clip or siglip, or a distill run with an image-text teacher)")
    backbone, preprocess = load_encoder(encoder_path), read_preprocess(encoder_path)
    if "data_info" in meta:
        data = DataInfo(**json.loads(meta["data_info"]))
    else:  # written before it was recorded: image-text runs, which need no class count
        data = DataInfo(0, backbone.patch_embed.img_size[0], *((preprocess.mean, preprocess.std) if preprocess else
                                                              ([], [])))
    model = cls(backbone, cfg, data)
    if not weights:
        return model
    # copies: `backbone` is also the objective's own backbone, which heads.safetensors may overwrite (DINO's student,
    # I-JEPA's context encoder) before the encoder's values reach the teacher / target encoder
    encoder = {name: value.clone() for name, value in backbone.state_dict().items()}
    missing, unexpected = model.load_state_dict(model.state_from_artifacts(encoder, heads), strict=False)
    if missing and not heads_path.is_file():
        raise ValueError(f"{str(run)!r} has no heads.safetensors: the weights of objective={cfg.name} beyond its "
                         f"encoder are not in the run directory (missing {missing[:3]})")
    if missing or unexpected:
        raise ValueError(f"{heads_path} does not fit its objective config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    return model.eval()
