"""The build step: a composed config -> the typed parts of a run (`Run`: the objective with its backbone, the data
and its views, the optimizer and its per-step schedules, the periodic-evaluation sets). Every bad value becomes one
`ConfigError` here, before anything trains. What it knows of the objective is its declared `Requirements`; of the
dataset, its registered `DatasetKind`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import OmegaConf

from ssl_vit.backbone import PRESETS, WINDOW_SETTINGS, VisionTransformer, build_vit, preset_config
from ssl_vit.backbone.init import without_transformers_zero3, writable
from ssl_vit.backbone.windows import resample_rel_pos
from ssl_vit.config import model_kwargs, peak_lr, warmup_steps
from ssl_vit.data import DATASETS, DataError, ViewBuilder, build_dataset, dataset_kind
from ssl_vit.data.augreg import mixes
from ssl_vit.data.naflex import NaFlexSettings, NaFlexViews
from ssl_vit.data.subset import limit_samples
from ssl_vit.geometry import pair
from ssl_vit.interop.sources import SOURCES, Pretrained, load_pretrained
from ssl_vit.objectives import OBJECTIVES, DataInfo, Objective, Requirements, build_objective, objective_class
from ssl_vit.optim import build_optimizer, schedule, weight_decay_schedule
from ssl_vit.partition import full_shape
from ssl_vit.preprocess import Preprocess, resolve_preprocess
from ssl_vit.schema import ConfigError, validate_config
from ssl_vit.untrusted import UntrustedFile

log = logging.getLogger("ssl_vit")

# Model settings that may differ from an `init_from` source's (training-time regularisation, resampling rule).
# ViTDet / SAM windows too: a globally pre-trained encoder is fine-tuned windowed (new relative-position tables start
# at zero).
INIT_FROM_ADJUSTABLE = ("drop_path", "attn_drop", "proj_drop", "pos_embed_interp", "pos_embed_antialias",
                        "weight_init", *WINDOW_SETTINGS)


@dataclass
class Run:
    """What the Trainer trains: built by `build_run` from a config."""

    objective: Objective
    dataset: object
    views: ViewBuilder
    preprocess: Preprocess
    optimizer: torch.optim.Optimizer
    learning_rates: np.ndarray  # at every step
    weight_decays: np.ndarray  # at every step
    global_batch: int
    grad_clip: float | None  # the global gradient norm clipped at (None / 0: measured only)
    repeats: int  # repeated augmentation (augreg), else 1


def requirements(objective_cfg) -> tuple[type[Objective], Requirements]:
    """The objective's class and its declared needs for this config."""
    try:
        cls = objective_class(objective_cfg.name)
        return cls, cls.requirements(objective_cfg)
    except ValueError as err:  # an unknown name, or a bad value the record depends on (LiT's encoder file)
        raise ConfigError(str(err)) from err


@dataclass(frozen=True)
class CheckedConfig:
    """A run's config validated once, with its objective's class and what that objective declares for it: what
    every later step of the run reads (`check_config` makes it; pretrain makes one per run)."""

    cfg: object
    objective_class: type[Objective]
    needs: Requirements


def check_config(cfg) -> CheckedConfig:
    """Validate `cfg` (every group's ranges and choices, the model preset) and read its objective's needs, once;
    ConfigError naming the first bad value."""
    validate_config(cfg)
    if cfg.model.name not in PRESETS:
        raise ConfigError(f"unknown model {cfg.model.name!r}; valid choices: {sorted(PRESETS)}")
    return CheckedConfig(cfg, *requirements(cfg.objective))


def init_source(cfg) -> Pretrained | None:
    """The pre-trained encoder `model.init_from` names (ssl_vit.interop.sources), or None. Load it before building
    the model under zero.Init: a timm / transformers source built there would be partitioned."""
    spec = cfg.model.get("init_from")
    if not spec:
        return None
    try:
        # building the source model must not move the run's seed, nor be partitioned by transformers' ZeRO-3 hook
        with torch.random.fork_rng(devices=[]), without_transformers_zero3():
            return load_pretrained(spec, architecture=lambda: preset_config(cfg.model.name, **model_kwargs(cfg.model)),
                                   heads=bool(cfg.model.get("init_heads")))
    except UntrustedFile as err:  # the spec is right; the file is what is refused
        raise ConfigError(f"model.init_from: {err}") from err
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        raise ConfigError(f"model.init_from: {err} (valid forms: {list(SOURCES)})") from err



def build_backbone(cfg, needs: Requirements, source: Pretrained | None):
    """(backbone, image size, recorded preprocessing or None): the objective's fixed backbone, the `init_from`
    source's architecture with its weights, or the `model=` preset."""
    if needs.fixed_backbone is not None and source is not None:
        raise ConfigError(f"model.init_from={cfg.model.init_from} with objective={cfg.objective.name}: "
                          f"{needs.init_from}")
    if needs.fixed_backbone is not None:  # its own pre-trained tower: its architecture, size and normalisation
        encoder_config, recorded = needs.fixed_backbone.config, needs.fixed_backbone.preprocess
        img_size = _single_size(encoder_config.img_size)
        if cfg.data.img_size not in (None, img_size):
            raise ConfigError(f"data.img_size={cfg.data.img_size}: the objective's fixed backbone was trained at "
                              f"{img_size} px (leave data.img_size unset)")
        return VisionTransformer(encoder_config), img_size, recorded
    if source is not None:  # pre-trained weights to start from: the source's architecture at the run's size
        if needs.init_from is not None:
            raise ConfigError(f"model.init_from={cfg.model.init_from} with objective={cfg.objective.name}: "
                              f"{needs.init_from}")
        recorded = source.preprocess
        # as evaluation does: data.img_size, else the size the source's preprocessing gives, else its native size
        img_size = cfg.data.img_size or (recorded.img_size if recorded else
                                         _single_size(source.encoder.config.img_size))
        differ = {k: (getattr(source.encoder.config, k), v) for k, v in needs.defaults_for(cfg.model.name).items()
                  if getattr(source.encoder.config, k) != v}
        if differ:
            log.warning("model.init_from: objective=%s builds its own models with %s; the source has %s (kept)",
                        cfg.objective.name, {k: v[1] for k, v in differ.items()}, {k: v[0] for k, v in differ.items()})
        return _backbone_from(source, cfg, img_size), img_size, recorded
    img_size = cfg.data.img_size or PRESETS[cfg.model.name].get("img_size", 224)
    try:
        return build_vit(cfg.model.name, img_size=img_size, **{**needs.defaults_for(cfg.model.name),
                                                                  **model_kwargs(cfg.model)}), \
            img_size, None
    except ValueError as err:
        raise ConfigError(f"model={cfg.model.name} at data.img_size={img_size}: {err}") from err


def _backbone_from(source: Pretrained, cfg, img_size: int) -> VisionTransformer:
    """A backbone with the source's architecture at `img_size` (position embeddings resampled as the source library
    does), its weights, and the run's regularisation settings."""
    overrides = model_kwargs(cfg.model)
    encoder = source.encoder
    source_values = encoder.config.to_dict()
    # an override that restates the source's own value shapes nothing (a shared recipe may name it)
    conflicts = {k: v for k, v in overrides.items() if k not in INIT_FROM_ADJUSTABLE
                 and _plain(v) != source_values.get(k)}
    if conflicts and not source.architecture_given:  # else they shaped it already
        raise ConfigError(f"model.init_from={cfg.model.init_from}: the architecture is the source's; remove "
                          f"{', '.join(f'model.{k}={v}' for k, v in conflicts.items())} (adjustable: "
                          f"{list(INIT_FROM_ADJUSTABLE)})")
    # The run's init scheme (the preset's unless model.weight_init says otherwise): the objective's heads follow it,
    # so the same weights from any source start the same run.
    overrides.setdefault("weight_init", PRESETS[cfg.model.name].get("weight_init", "timm"))
    try:
        backbone = VisionTransformer(encoder.config.replace(img_size=img_size, **overrides))
    except ValueError as err:
        raise ConfigError(f"model.init_from={cfg.model.init_from} at data.img_size={img_size}: {err}") from err
    source_state = encoder.state_dict()
    if "pos_embed" in source_state and backbone.grid_size != encoder.grid_size:  # the run's way of resampling
        source_state["pos_embed"] = backbone.resample_from(source_state["pos_embed"], encoder.grid_size)
    expected = set(backbone.state_dict())
    # relative-position tables: made for another window, resampled to this one's length (as they are when used at
    # another size); dropped where the run has none; new ones stay at zero (ViTDet's, added to the source)
    tables = {name: full_shape(p)[0] for name, p in backbone.named_parameters() if "rel_pos" in name}
    state = {name: resample_rel_pos(value, tables[name]) if name in tables else value
             for name, value in source_state.items() if name in expected or "rel_pos" not in name}
    fresh = {name for name in expected - set(state) if "rel_pos" in name}
    if fresh:
        log.info("model.init_from: %d relative-position tables start at zero (model.rel_pos=true; the source has "
                 "none)", len(fresh))
    load_module_by_module(backbone, state, may_lack=fresh)
    return backbone


def _plain(value):
    """A config value as ViTConfig.to_dict writes it (tuples as lists)."""
    return list(value) if isinstance(value, (tuple, list)) else value


def load_module_by_module(module: torch.nn.Module, state: dict, may_lack: set[str] = frozenset()) -> None:
    """`module.load_state_dict(state)` (strict but for the names in `may_lack`, which keep their initial values),
    one submodule's own parameters at a time: under ZeRO-3 only that submodule is gathered, never the whole
    model."""
    expected = set(module.state_dict()) - set(may_lack)
    if expected != set(state):
        raise ValueError(f"weights do not fit the model: missing {sorted(expected - set(state))[:5]}, unexpected "
                         f"{sorted(set(state) - expected)[:5]}")
    load_entries(module, state)


def load_entries(module: torch.nn.Module, state: dict) -> None:
    """Copy the entries of `state` (state-dict names of `module`, all of which exist) into its parameters and
    buffers, one submodule's own parameters at a time (gathered under ZeRO-3)."""
    for prefix, submodule in module.named_modules():
        def key(name: str, prefix: str = prefix) -> str:
            return f"{prefix}.{name}" if prefix else name

        own = {name: p for name, p in submodule.named_parameters(recurse=False) if key(name) in state}
        with writable(*own.values()), torch.no_grad():
            for name, param in own.items():
                param.copy_(state[key(name)])
        with torch.no_grad():
            for name, buffer in submodule.named_buffers(recurse=False):
                if buffer is not None and key(name) in state:
                    buffer.copy_(state[key(name)])


def _resample_backbone_pos_embed(objective: Objective, state: dict, source_size: Sequence[int]) -> None:
    """The run's backbones were built at data.img_size (`_backbone_from`); the position tables among the source's heads
    (DINO's student and teacher, distill's further students) were made at the source's image size `source_size`:
    each is resampled to the grid of the backbone it belongs to, the way that backbone resamples."""
    for key, value in state.items():
        owner_name, _, leaf = key.rpartition(".")
        try:
            owner = objective.get_submodule(owner_name) if owner_name else objective
        except AttributeError:  # not a name of this objective: refused by name in load_source_heads
            continue
        if leaf != "pos_embed" or not isinstance(owner, VisionTransformer) or owner.pos_embed is None:
            continue
        if tuple(value.shape) != full_shape(owner.pos_embed):
            try:
                state[key] = owner.resample_from(value, owner.patch_embed.grid_for(*source_size))
            except ValueError:  # the source's size does not tile into this backbone's patches: refused by shape
                continue


def load_source_heads(objective: Objective, source: Pretrained | None, spec: str | None) -> None:
    """model.init_heads: the source's weights beyond the encoder (its heads, and for DINO its student and centres)
    into the built objective, with the source's encoder where the objective keeps it (`state_from_artifacts`:
    DINO's teacher). Every name must be the objective's and every shape fit; the objective's other weights keep
    their initialisation (logged)."""
    if source is None:
        raise ConfigError("model.init_heads=true needs model.init_from (the run or checkpoint to take them from)")
    if source.heads is None:
        raise ConfigError(f"model.init_heads: model.init_from={spec} is an encoder without heads; heads come from "
                          f"our run directories (heads.safetensors) and DINO / DINOv2 training checkpoints (valid "
                          f"forms: {list(SOURCES)})")
    heads, trained_by = source.heads
    state = objective.state_from_artifacts(source.encoder.state_dict(), heads)
    _resample_backbone_pos_embed(objective, state, pair(source.encoder.config.img_size))
    shapes = {name: full_shape(t) for name, t in (*objective.named_parameters(), *objective.named_buffers())}
    problems = [f"{k} is not in objective={objective.cfg.name}" for k in state if k not in shapes]
    problems += [f"{k} is {tuple(v.shape)} there, {shapes[k]} here" for k, v in state.items()
                 if k in shapes and tuple(v.shape) != shapes[k]]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ConfigError(f"model.init_heads: the weights of {spec} (objective={trained_by}) do not fit "
                          f"objective={objective.cfg.name}: {'; '.join(problems[:4])}{more}")
    load_entries(objective, state)
    fresh = [name for name in shapes if name not in state]
    log.info("model.init_heads: %d tensors from %s (objective=%s)%s", len(state), spec, trained_by,
             f"; {len(fresh)} keep their initialisation: {', '.join(fresh[:4])}{' ...' if len(fresh) > 4 else ''}"
             if fresh else "")


def build_data(cfg, needs: Requirements, img_size: int):
    """The training set, checked against what the objective reads (labels, captions)."""
    try:
        kind = dataset_kind(cfg.data.name)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if kind.stream and cfg.data.max_train_samples is not None:
        raise ConfigError(f"data.max_train_samples does not apply to data={cfg.data.name} (a stream has no length); "
                          "give it less data instead (e.g. fewer shards in data.urls)")
    if "text" in needs.views and not kind.captioned:
        captioned = [name for name, other in DATASETS.items() if other.captioned]
        raise ConfigError(f"objective={cfg.objective.name} needs captions but data={cfg.data.name} has none; use "
                          f"data= one of {captioned} (shards: with a 'txt' per sample)")
    data_cfg = cfg.data
    if "labels" in data_cfg and data_cfg.labels is None:  # labels only where the objective reads them: resolved
        data_cfg = OmegaConf.merge(data_cfg, {"labels": "label" in needs.views})  # in a copy, the config as given
    try:
        dataset = limit_samples(build_dataset(data_cfg, img_size), cfg.data.max_train_samples, cfg.seed)
    except (ValueError, FileNotFoundError, DataError) as err:
        raise ConfigError(f"data={cfg.data.name}: {err}") from err
    if "label" in needs.views and not dataset.classes:
        how = ("images in class subfolders, root/<class>/<image>, with data.labels=true (or unset)"
               if "labels" in cfg.data else "set data.num_classes")
        raise ConfigError(f"objective={cfg.objective.name} needs class labels but data={cfg.data.name} declares no "
                          f"classes: {how}")
    return dataset


def build_components(cfg, source: Pretrained | None = None, device_type: str = "cpu",
                     checked: CheckedConfig | None = None):
    """(objective with its backbone, dataset, view builder, preprocessing) of a config; ConfigError on a bad value.
    `source`: the `init_source(cfg)` already loaded (pretrain loads it outside zero.Init); `device_type`: where it
    trains ("cuda", "cpu": what data.multicrop_photometric=auto chooses by); `checked`: `check_config(cfg)` where
    the caller made it already (pretrain), else made here."""
    checked = checked if checked is not None else check_config(cfg)
    needs = checked.needs
    source = source if source is not None else init_source(cfg)
    backbone, img_size, recorded = build_backbone(cfg, needs, source)
    if needs.drops_patches and backbone.windowed:
        given = {key: str(value).lower() if isinstance(value, bool) else value
                 for key in ("window_size", "rel_pos") if (value := getattr(backbone.config, key))}
        raise ConfigError(f"objective={cfg.objective.name} with {', '.join(f'model.{k}={v}' for k, v in given.items())}"
                          ": its encoder sees a subset of each image's patches, and windowed attention and relative "
                          "positions need them all; pre-train without them (as ViTDet does: fine-tune the result "
                          "windowed at a higher resolution with model.init_from=<this run> model.window_size=...)")
    dataset = build_data(cfg, needs, img_size)
    preprocess = resolve_preprocess(cfg.data, img_size, recorded)
    info = DataInfo(len(dataset.classes), img_size, preprocess.mean, preprocess.std)
    try:
        objective = build_objective(cfg.objective, backbone, info)
        objective.check_start(cfg.trainer.max_steps, from_trained=source is not None)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"objective={cfg.objective.name}: {err}") from err
    if cfg.model.get("init_heads"):
        load_source_heads(objective, source, cfg.model.init_from)
    augment = cfg.data.augment  # one of AUGMENTS (its schema checks it)
    if augment == "augreg" and mixes(cfg.data.augreg) and cfg.data.batch_size % 2:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: Mixup / CutMix (data.augment=augreg) pair each "
                          "image with another, so the batch per process must be even")
    multicrop = objective.multicrop_options()
    placement = photometric_on(cfg.data, device_type, (multicrop or {}).get("global_size", img_size))
    if multicrop is not None:
        multicrop = dict(multicrop, photometric_on=placement)
    if cfg.data.get("resolution", "fixed") == "naflex":
        return objective, dataset, naflex_views(cfg, objective, needs, preprocess, img_size), preprocess
    try:
        views = preprocess.view_builder(needs.views, augment, cfg.data.crop_scale, multicrop,
                                        objective.text_tokenizer() if "text" in needs.views else None,
                                        augreg=cfg.data.augreg,
                                        num_classes=len(dataset.classes) or None,
                                        teacher_inputs=objective.teacher_inputs())
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return objective, dataset, views, preprocess


# On a CPU the batched photometric stage in the workers' collate beats torchvision per crop up to global crops of
def naflex_views(cfg, objective: Objective, needs: Requirements, preprocess: Preprocess, img_size: int) -> NaFlexViews:
    """The NaFlex view builder (data.resolution=naflex); ConfigError where the objective or backbone cannot take
    NaFlex batches, or a data.naflex setting does not fit."""
    if not needs.naflex:
        takes = sorted(name for name, cls in OBJECTIVES.items() if cls.needs.naflex)
        raise ConfigError(f"objective={cfg.objective.name} does not train on NaFlex batches (data.resolution=naflex): "
                          f"{objective.naflex_refusal}; objectives that do: {takes}")
    refusal = objective.backbone.naflex_refusal()
    if refusal:
        raise ConfigError(f"data.resolution=naflex: {refusal}")
    patch = objective.backbone.patch_embed.patch_size
    if patch[0] != patch[1]:
        raise ConfigError(f"data.resolution=naflex takes square patches, model.patch_size={list(patch)}")
    try:
        settings = NaFlexSettings.resolve(cfg.data.naflex, patch[0], img_size, cfg.data.batch_size)
        return NaFlexViews(needs.views, settings, preprocess.mean, preprocess.std, cfg.data.augment,
                           cfg.data.crop_scale, preprocess.interpolation,
                           objective.text_tokenizer() if "text" in needs.views else None, objective.teacher_inputs())
    except ValueError as err:
        raise ConfigError(str(err)) from err


# about 80 px (per image, 2 + 6 crops: 2.5x at 32 px, 1.23x at 64, 1.03x at 80, 0.88x at 96, 0.81x at 224;
# docs/benchmarks.md, "Where DINO's photometric augmentation runs").
COLLATE_BELOW_PX = 80


def photometric_on(data_cfg, device_type: str, global_size: int) -> str:
    """data.multicrop_photometric as "workers", "collate" or "device"; auto: the device on a GPU, on a CPU the
    workers' collate for global crops under COLLATE_BELOW_PX, else torchvision per crop in the workers."""
    value = str(data_cfg.get("multicrop_photometric", "auto"))
    if value == "auto":
        if device_type == "cuda":
            return "device"
        return "collate" if global_size < COLLATE_BELOW_PX else "workers"
    return value  # one of PHOTOMETRIC_ON (its schema checks it)


def build_run(cfg, objective: Objective, dataset, views: ViewBuilder, preprocess: Preprocess, world: int,
              fused: bool = False) -> Run:
    """The run around built components: the optimizer (`fused`: fused AdamW) and the per-step schedules for
    `world` processes."""
    optimizer = build_optimizer(objective, cfg.optim, num_layers=len(objective.encoder.blocks), fused=fused)
    global_batch = cfg.data.batch_size * world * cfg.trainer.grad_accum_steps
    peak = peak_lr(cfg.optim, global_batch)
    if cfg.optim.min_lr > peak:
        log.warning("optim.min_lr=%g is above the peak lr %g (optim.lr scaled to global batch %d): the schedule "
                    "stays at the peak instead of rising", cfg.optim.min_lr, peak, global_batch)
    steps = cfg.trainer.max_steps
    learning_rates = schedule(peak, min(cfg.optim.min_lr, peak), steps, warmup_steps(cfg.optim, steps),
                              cfg.optim.schedule, warmup_start=cfg.optim.warmup_start,
                              warmup_inclusive=cfg.optim.warmup_inclusive, lead=cfg.optim.schedule_lead)
    repeats = cfg.data.augreg.repeats if cfg.data.augment == "augreg" else 1
    return Run(objective, dataset, views, preprocess, optimizer, learning_rates,
               weight_decay_schedule(cfg.optim, steps), global_batch, cfg.optim.grad_clip, repeats)


def _single_size(size) -> int:
    return int(size if isinstance(size, int) else size[0])
