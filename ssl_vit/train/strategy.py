"""How the model is distributed: the one module that knows the strategy (one process, DDP, DeepSpeed ZeRO-1/2/3,
FSDP2). A strategy is chosen by the accelerate config file the user launches with (configs/accelerate/); the loop
and the objectives call the verbs here and never branch on the strategy themselves.

Facts this module encodes (measured on this stack; docs/architecture.md and docs/scaling.md):
- On CPU, accelerate's workers only join one process group with ACCELERATE_USE_CPU=1, and DeepSpeed needs the gloo
  backend passed explicitly: both are set here, so a config file alone picks the strategy.
- accelerate 1.15 only enables FSDP for GPU-like process groups; on CPU its FSDP2 code (fully_shard per block, DCP
  checkpoints, gathered state dicts) runs unchanged once the shared state says FSDP: `_enable_fsdp_on_cpu`.
- Under DeepSpeed the engine steps inside `accelerator.backward` (accumulation, global clipping from its JSON, the
  optimizer step, skipping a step whose gradient norm is not finite); our per-step schedules still write the
  wrapped optimizer's param groups. The JSON's "auto" values are filled from our config here.
- ZeRO-3 partitions every parameter (`p.numel() == 0` outside forward): reading full weights needs a collective
  gather; norms are summed over the local shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    broadcast_object_list,
)

from ssl_vit.backbone import TransformerBlock
from ssl_vit.backbone.init import fp32_random_init
from ssl_vit.config import Precision
from ssl_vit.extras import require
from ssl_vit.partition import local_shard
from ssl_vit.schema import ConfigError

log = logging.getLogger("ssl_vit")


@dataclass(frozen=True)
class StrategySettings:
    """What the strategy takes from a run's config. `ema_teacher`: the objective updates a teacher shard by shard
    (its declared need), so ZeRO-3 must keep no parameter whole on every rank."""

    precision: Precision
    micro_batch: int
    grad_accum_steps: int = 1
    grad_clip: float | None = None
    ema_teacher: bool = False
    tf32: bool = True
    collective_timeout_s: int = 1800

    @classmethod
    def from_config(cls, cfg, ema_teacher: bool = False) -> StrategySettings:
        return cls(Precision(cfg.trainer.precision), cfg.data.batch_size, cfg.trainer.grad_accum_steps,
                   cfg.optim.grad_clip, ema_teacher, cfg.trainer.get("tf32", True),
                   cfg.trainer.get("collective_timeout_s", 1800))


def make_accelerator(settings: StrategySettings, out_dir) -> Accelerator:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if deepspeed:
        require("deepspeed", "a DeepSpeed ZeRO launch (this accelerate config)")
    backend = None
    if distributed and not torch.cuda.is_available():
        if deepspeed:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            backend = "gloo"  # else accelerate miscounts the processes
        else:  # DDP, and FSDP before `_enable_fsdp_on_cpu`
            os.environ.setdefault("ACCELERATE_USE_CPU", "1")  # else accelerate's CPU workers never form one group
    accelerator = Accelerator(
        # Under DeepSpeed both come from its JSON, which `configure_deepspeed` fills from our config.
        mixed_precision=None if deepspeed else ("bf16" if settings.precision == Precision.bf16 else "no"),
        gradient_accumulation_steps=settings.grad_accum_steps,
        project_dir=str(out_dir),
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend,
                                                timeout=timedelta(seconds=settings.collective_timeout_s))],
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes but they did not join one process group (each sees "
            f"{accelerator.num_processes}); launch with a config from configs/accelerate/, e.g. "
            "accelerate launch --config_file configs/accelerate/ddp_cpu2.yaml scripts/pretrain.py"
            + ("" if torch.cuda.is_available() else "; on CPU the workers join only with ACCELERATE_USE_CPU=1, "
               f"which the trainer sets unless the environment says otherwise (here: "
               f"{os.environ.get('ACCELERATE_USE_CPU')!r})"))
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines drown the progress bar
    if distributed and fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU:
        _enable_fsdp_on_cpu(accelerator)
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError(f"fsdp_version={accelerator.state.fsdp_plugin.fsdp_version} is not supported (parameters "
                          "must be DTensors): set fsdp_version: 2 in the accelerate config, as in "
                          "configs/accelerate/fsdp2_cpu2.yaml")
    if accelerator.distributed_type == DistributedType.FSDP and settings.precision == Precision.bf16:
        accelerator.state.fsdp_plugin.mixed_precision_policy = fsdp2_mixed_precision()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        configure_deepspeed(accelerator, settings)
    if settings.tf32:
        enable_tf32(accelerator.device)
    return accelerator


def fsdp2_mixed_precision():
    """FSDP2's policy for bf16 training: bf16 compute copies of the fp32 parameters, gradients reduced in fp32, and
    no cast of the output (the loss dict: accelerate's default policy reduces in bf16 and rounds the loss to bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # only under FSDP2 (imports the FSDP package)

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None)


def enable_tf32(device: torch.device) -> None:
    """fp32 matmuls on CUDA in TF32 (PyTorch's default is full fp32, several times slower on tensor-core GPUs;
    trainer.tf32=false keeps it); nothing changes on other devices."""
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")


def _enable_fsdp_on_cpu(accelerator) -> None:
    """Switch accelerate's state from plain multi-CPU to FSDP, with the plugin the launcher's config describes (the
    state accelerate would have built on GPUs). Both shared states must agree: accelerate re-reads PartialState's."""
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` sets
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)  # make_accelerator then sets ours
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def strategy_name(accelerator) -> str:
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return f"fsdp{accelerator.state.fsdp_plugin.fsdp_version}"
    return "ddp" if accelerator.num_processes > 1 else "single"


def configure_deepspeed(accelerator, settings: StrategySettings) -> None:
    """Fill the DeepSpeed JSON from our config: micro-batch, accumulation, clipping (optim.grad_clip; DeepSpeed's
    own default would clip at 1.0 silently), precision, and the consolidated ZeRO-3 save."""
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    ours = {"train_micro_batch_size_per_gpu": settings.micro_batch,
            "gradient_accumulation_steps": settings.grad_accum_steps,
            "gradient_clipping": float(settings.grad_clip or 0.0)}
    for key, value in ours.items():
        if ds.get(key, "auto") not in ("auto", value):
            log.warning("DeepSpeed JSON sets %s=%s; the run uses %s from the training config", key, ds[key], value)
        ds[key] = value
    ds["train_batch_size"] = settings.micro_batch * settings.grad_accum_steps * accelerator.num_processes
    bf16 = settings.precision == Precision.bf16
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16, "check_grad_overflow": True}
    ds["fp16"] = {"enabled": False}
    if bf16:  # DeepSpeed accumulates gradients in the model's dtype unless told (a JSON setting is kept)
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    zero = ds.setdefault("zero_optimization", {})
    if plugin.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # encoder.safetensors is the full encoder
        if settings.ema_teacher:
            # The EMA updates each rank's partition (ssl_vit.ema): a parameter persisted whole on every rank
            # (below the threshold) would keep its stale full copy (measured: 0.18 off at step 2).
            zero["stage3_param_persistence_threshold"] = 0
    accelerator.gradient_accumulation_steps = settings.grad_accum_steps


# The strategies per-block compilation works under (DeepSpeed's ZeRO-3 gathers and
# releases parameters in hooks around every module's forward, and its engine has its own compile path).
COMPILE_STRATEGIES = ("single", "ddp", "fsdp2")
# The user's own inductor / triton caches, as the process started (inductor writes its default into the
# environment when it first compiles, which must not read as a user's choice for the next run in this process).
_USER_CACHES = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
# Compiled blocks share one code object (Module._call_impl), so every variant (grad / no-grad, train / eval, each
# shape kind, a teacher, a decoder) takes an entry of torch's recompile limit (8), past which blocks silently run
# eager: raised to this.
RECOMPILE_LIMIT = 64


def check_compile(accelerator) -> None:
    """ConfigError unless the strategy takes per-block compilation (the mode: trainer.compile_mode's schema)."""
    name = strategy_name(accelerator) if accelerator is not None else "single"
    if name not in COMPILE_STRATEGIES:
        raise ConfigError(f"trainer.compile=true is not supported under {name} (DeepSpeed); it works under "
                          f"{list(COMPILE_STRATEGIES)}: launch with configs/accelerate/ddp_*.yaml or fsdp2_*.yaml, "
                          "or set trainer.compile=false")


def compile_blocks(model: torch.nn.Module, accelerator=None, mode: str | None = None, dynamic: bool | None = None,
                   cache_dir: str | os.PathLike | None = None, backend: str = "inductor") -> int:
    """torch.compile every transformer block of `model` in place (`nn.Module.compile`: names, state dicts and
    hooks are unchanged), returning how many. The order is the anchors' (DINOv3's ac_compile_parallelize,
    torchtitan): activation checkpointing is already set inside each block, the blocks are compiled here, then
    `accelerator.prepare` shards them (FSDP2) or wraps the model (DDP). A block is one graph reused by every block
    of its shape; a second input shape (DINO's local crops, evaluation's last batch) recompiles once with dynamic
    sizes unless `dynamic` says otherwise. `cache_dir`: inductor's on-disk cache (`compile_cache_dir` resolves the
    run's), so that a resumed run loads its kernels instead of compiling them again; None leaves the environment's.
    `accelerator`: the strategy to check (None: a model outside training, e.g. a benchmark);
    `backend`: torch.compile's (inductor; "aot_eager" traces the same graphs without generating kernels)."""
    check_compile(accelerator)
    if cache_dir is not None:  # read when inductor next needs its cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        os.environ["TRITON_CACHE_DIR"] = _USER_CACHES["TRITON_CACHE_DIR"] or str(Path(cache_dir) / "triton")
    import torch._dynamo  # the compiler: only when compiling

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    blocks = [module for module in model.modules() if isinstance(module, TransformerBlock)]
    for block in blocks:
        block.compile(backend=backend, mode=mode, dynamic=dynamic)
    return len(blocks)


def compile_cache_dir(configured: str | None, out_dir) -> Path:
    """Where inductor caches a run's kernels: trainer.compile_cache_dir, else the user's TORCHINDUCTOR_CACHE_DIR,
    else <run>/compile_cache."""
    return Path(configured or _USER_CACHES["TORCHINDUCTOR_CACHE_DIR"] or Path(out_dir) / "compile_cache")


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo + inductor: every forward graph with whatever
    backward it compiled at once, and the backward graphs compiled on their first call); take differences."""
    from torch._dynamo.utils import compilation_time_metrics  # dynamo's own timers (imported once compiling)

    return sum(sum(compilation_time_metrics.get(name, ())) for name in
               ("_compile.compile_inner", "backward._backward_impl"))


@dataclass(frozen=True)
class Preparation:
    """How the model is made ready to train (model.grad_checkpointing / checkpoint_policy, trainer.compile*)."""

    checkpointing: bool | str = False  # False, or ssl_vit.backbone.CHECKPOINTING's "full" / "selective"
    compile: bool = False
    compile_mode: str | None = None
    compile_dynamic: bool | None = None
    compile_cache_dir: Path | None = None

    @classmethod
    def from_config(cls, cfg, out_dir) -> Preparation:
        trainer = cfg.trainer
        return cls(cfg.model.checkpoint_policy if cfg.model.grad_checkpointing else False, trainer.compile,
                   trainer.compile_mode, trainer.compile_dynamic,
                   compile_cache_dir(trainer.compile_cache_dir, out_dir) if trainer.compile else None)


def prepare_model(accelerator, objective, optimizer, preparation: Preparation):
    """The objective and its optimizer made ready to train, in the anchors' order (DINOv3's
    `ac_compile_parallelize`, torchtitan's `parallelize_*`): activation checkpointing in the trained backbone's
    blocks, then each transformer block compiled, then `accelerator.prepare` (FSDP2 shards the blocks, DDP wraps
    the model, DeepSpeed builds its engine). Returns (model, optimizer, the number of compiled blocks)."""
    objective.backbone.set_grad_checkpointing(preparation.checkpointing)
    compiled = compile_blocks(objective, accelerator, preparation.compile_mode, preparation.compile_dynamic,
                              preparation.compile_cache_dir) if preparation.compile else 0
    model, optimizer = accelerator.prepare(objective, optimizer)
    return model, optimizer, compiled


def fused_optimizer(accelerator) -> bool:
    """Fused AdamW where it is the fastest and ours steps: on CUDA, outside DeepSpeed (whose engine steps its own
    flat partitions, with CPU offload on the host)."""
    return accelerator.device.type == "cuda" and accelerator.distributed_type != DistributedType.DEEPSPEED


def construction_context(accelerator):
    """Build the model under DeepSpeed's zero.Init when the config asks for it (ZeRO-3 with zero3_init_flag): every
    module's parameters are partitioned as its constructor returns, so a large preset never exists whole on one
    rank. Layers initialise themselves in their constructors (ssl_vit.backbone.init), so the init survives."""
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    if plugin is None or plugin.zero_stage != 3 or not plugin.zero3_init_flag:
        return contextlib.nullcontext()
    return zero_init(plugin.deepspeed_config)


@contextlib.contextmanager
def zero_init(deepspeed_config: dict):
    """DeepSpeed's zero.Init building parameters in the dtype the config's precision means (bf16.enabled: bf16, else
    fp32), initialised in fp32 either way (`ssl_vit.backbone.init.fp32_random_init`: a bf16 run starts from the fp32
    run's weights, rounded). The dtype comes from the config (`dtype=None`): DeepSpeed 0.19.8 reads an explicit one as
    `(dtype or fp16) if is_fp16_supported() else (bf16 if is_bf16_supported else fp32)`, the last test a bound
    method and always true, so an explicit fp32 became bf16 on a CPU without fp16 support (and bf16 fp32 on GPUs)."""
    import deepspeed  # heavy: only for ZeRO-3 runs

    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config, dtype=None), fp32_random_init():
        yield


def parameter_dtype(accelerator, precision: Precision) -> torch.dtype:
    """The dtype the model's parameters have once prepared: DeepSpeed holds 16-bit copies in the module (fp32
    masters in its optimizer); DDP and FSDP2 keep fp32 parameters and compute in bf16 under autocast / their
    mixed-precision policy."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED and precision == Precision.bf16:
        return torch.bfloat16
    return torch.float32


def kept_fp32_buffers(model: torch.nn.Module) -> set[str]:
    """The buffer names any module of `model` keeps in fp32 (`_keep_in_fp32_modules_strict`: DeepSpeed's zero.Init
    and `check_dtypes` read it; an objective's `fp32_buffers`, RoPE's periods)."""
    return {name for module in model.modules() for name in getattr(module, "_keep_in_fp32_modules_strict", ())}


def check_dtypes(model: torch.nn.Module, expected: torch.dtype, fp32_buffers=None) -> None:
    """Refuse to train when parameters are not in `expected` or a buffer that must stay fp32 is not (a strategy that
    built them otherwise would silently train another model: 2x the memory, or bf16 rounding in an fp32 run).
    `fp32_buffers`: buffer names that must be fp32 (default: those the model's modules declare)."""
    fp32_buffers = kept_fp32_buffers(model) if fp32_buffers is None else set(fp32_buffers)
    wrong = [f"{name} {p.dtype}" for name, p in model.named_parameters() if p.dtype != expected]
    wrong += [f"{name} {b.dtype}" for name, b in model.named_buffers()
              if name.rsplit(".", 1)[-1] in fp32_buffers and b.dtype != torch.float32]
    if wrong:
        raise RuntimeError(f"parameters should be {expected} (and {sorted(fp32_buffers)} fp32) for this precision and "
                           f"strategy, but {len(wrong)} are not: {wrong[:4]}")


def unshard(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from an FSDP2 DTensor result (e.g. the gradient norm, a replicated DTensor)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def is_sharded(accelerator) -> bool:
    """Whether parameters are split across ranks (ZeRO-3, FSDP2): full weights then need a collective gather."""
    return strategy_name(accelerator) in ("zero3", "fsdp2")


def parameter_norm(accelerator, parameters) -> torch.Tensor:
    """The global L2 norm of the parameters as a 0-d fp32 tensor on the device, summed over shards when they are
    sharded (collective then; never read back to the host here)."""
    shards = [local_shard(p).detach() for p in parameters]
    norms = torch._foreach_norm([s for s in shards if s.numel()])
    squares = (torch.stack([n.float() for n in norms]).square().sum() if norms else
               torch.zeros((), device=accelerator.device))
    if is_sharded(accelerator):
        squares = accelerator.reduce(squares.to(accelerator.device), reduction="sum")
    return squares.sqrt()


def skips_on_device(accelerator, optimizer) -> bool:
    """Whether a non-finite update can be skipped on the device, so that the loop never waits to learn whether a
    step was applied: fused AdamW takes `found_inf` (as under torch.amp.GradScaler) and then leaves the weights,
    its moments and its step count as they were. Not DeepSpeed, whose engine decides inside `backward`."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    return (accelerator.distributed_type != DistributedType.DEEPSPEED
            and all(group.get("fused") for group in inner.param_groups))


def optimizer_step(accelerator, model, optimizer, grad_norm: torch.Tensor | None, on_device: bool) -> torch.Tensor:
    """Take the optimizer step if its gradients are usable (a finite global norm); returns whether it was applied,
    a 0-d bool tensor. `on_device` (skips_on_device): the step is always called and skips itself on the device,
    and the answer stays there; otherwise it is decided on the host (DeepSpeed: its engine has already stepped or
    skipped inside `backward`)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return torch.tensor(bool(model.was_step_applied()))
    usable = (torch.isfinite(grad_norm) if grad_norm is not None else
              torch.ones((), dtype=torch.bool, device=accelerator.device))
    if on_device:
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.found_inf = (~usable).float()
        try:
            optimizer.step()
        finally:
            inner.found_inf = None
        return usable
    usable = usable.cpu()  # the host decides
    if usable:
        optimizer.step()
    return usable


def replica_digest(accelerator, module: torch.nn.Module) -> str | None:
    """sha256 of every parameter's bytes in name order (equal digests: bitwise-equal replicas); None when the
    parameters are sharded, where ranks hold different shards by design."""
    if is_sharded(accelerator):
        return None
    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def full_state_dict(accelerator, model, fp32_shards: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on the main process (None elsewhere), in fp32 whatever the training precision;
    collective when sharded. `fp32_shards`: fp32 values of parameters the optimizer holds no master of (this rank's
    shards by name: `Objective.fp32_shards()`, an EMA teacher's averages)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED and any(
            p.dtype != torch.float32 for p in model.module.parameters()):
        return _deepspeed_fp32_state_dict(accelerator, model, fp32_shards or {})
    if not is_sharded(accelerator):
        state = accelerator.unwrap_model(model).state_dict() if accelerator.is_main_process else None
    else:
        state = accelerator.get_state_dict(model)
    return state if accelerator.is_main_process else None


def _deepspeed_fp32_state_dict(accelerator, engine, fp32_shards: dict) -> dict[str, torch.Tensor] | None:
    """Under DeepSpeed bf16 the module holds bf16 copies and the fp32 master weights live in the optimizer: gather
    those, one parameter at a time (collective under ZeRO-3), onto the main process's CPU. Frozen parameters have no
    master: their fp32 values come from `fp32_shards` when given there, else from the module."""
    import deepspeed  # heavy: only under DeepSpeed

    main = accelerator.is_main_process
    state = {}
    for name, param in engine.module.named_parameters():
        full = (deepspeed.utils.safe_get_full_fp32_param(param) if param.requires_grad else
                _whole(param, fp32_shards.get(name)))
        if full is None:
            with deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") else contextlib.nullcontext():
                full = param.detach().float().clone()
        if main:
            state[name] = full.detach().float().cpu()
    if not main:
        return None
    for prefix, module in engine.module.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu()
    return state


def _whole(param: torch.Tensor, shard: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a parameter from this rank's `shard` of it: gathered from every rank's ZeRO-3 partition
    (collective there, padding included), or the shard itself when parameters are whole; None without a shard."""
    if shard is None or not hasattr(param, "ds_id"):
        return shard
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard.contiguous())
    return torch.cat(parts)[: param.ds_numel].view(param.ds_shape)


class MainProcessFailed(RuntimeError):
    """Raised on the other ranks when work that only the main process does (evaluation, writing outputs) failed."""


def on_main_process(accelerator, work, *args):
    """`work(*args)` on the main process only; a failure there is raised on every rank, which would otherwise wait
    in their next collective until the timeout (collective with several processes). Returns the main process's
    result (None elsewhere)."""
    result, failure = None, None
    if accelerator.is_main_process:
        try:
            result = work(*args)
        except Exception as err:  # every kind: the other ranks must hear of it
            failure = err
    if accelerator.num_processes > 1:
        said = broadcast_object_list([f"{type(failure).__name__}: {failure}" if failure else None], from_process=0)
        if said[0] is not None and failure is None:
            raise MainProcessFailed(f"the main process stopped ({said[0]})")
    if failure is not None:
        raise failure
    return result
