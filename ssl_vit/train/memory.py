"""Memory per GPU of a training run, before launching it: model states (params, grads, optimizer) per strategy and
activations per block, counted on the meta device so that ViT-22B plans in milliseconds.

Model states, bytes per parameter (P parameters, N GPUs; e = 2 for bf16, 4 for fp32 weights in DeepSpeed's flat
groups; g = 2 for bf16 (DeepSpeed's 16-bit gradients), 0 for fp32; AdamW: fp32 master copy 4 + momentum 4 +
variance 4 = 12):
    ddp            params 4P       grads 4P          optimizer 8P
    zero1          params eP       grads gP + 4P/N   optimizer 12P/N
    zero2          params eP       grads (g+4)P/N    optimizer 12P/N                     = DeepSpeed's estimator
    zero3          params eP/N     grads 4P/N        optimizer 12P/N  buffers 4 x largest layer
    zero2_offload  params eP       (grads and optimizer in CPU memory)                   = DeepSpeed's estimator
    zero3_offload  buffers 4 x largest layer (everything else in CPU memory)            = DeepSpeed's estimator
    fsdp2          params 4P/N     grads 4P/N        optimizer 8P/N
For bf16, zero2 and zero3 equal DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs` (no offload), and the
offload variants its GPU and CPU figures; CPU memory per node is DeepSpeed's figure (zero.Init assumed, its 1.5
buffer factor; for zero1 the stage-2 one). DeepSpeed counts 18 bytes per parameter for both stages (its stage-2
comment: 16-bit grads 2, fp32 grads 4, fp32 params 4, Adam 8); under ZeRO-3 the partitioned 16-bit params take 2
of those 18, which leaves 4 for the gradient partitions.

On top of the model states:
- communication buffers: DDP's gradient buckets 4P; DeepSpeed's reduce bucket, DEEPSPEED_BUCKET elements x e
  (configs/deepspeed/*.json: 5e7);
- gathered parameters, during forward and backward only: ZeRO-3 keeps up to stage3_max_live_parameters (1e9, the
  JSON) gathered, min(that, P) x e; FSDP2 unshards the current and the prefetched block, 2 x the largest block x
  (params + grads) in the compute dtype.

Activations kept for backward per block, micro-batch b, s tokens, width h, MLP width m, a heads, bytes c per
activation element (2 bf16, 4 fp32); fused attention (PyTorch SDPA flash / memory-efficient kernels) stores no
s x s matrix:
    (8h + 2m) * s * b * c      LayerNorm inputs and outputs (4h), q, k, v (3h), attention output (h), MLP hidden
                               before and after GELU (2m); the parallel block (ViT-22B) shares one LayerNorm (6h + 2m)
    + 3h * s * b * c           with QK-norm (q and k copied contiguous and normalised per head)
    + m * s * b * c            the parallel block's separate MLP bias (no QKV bias): the biased hidden is a new tensor
    + a * s * b * 4            the attention kernel's log-sum-exp
    + 2m * s * b * c           a SwiGLU MLP (mlp_kind swiglu / swiglu_packed): gate, value, act(gate), product (4m)
    + 2h * s * b * c           with layer scale (each scale keeps its input, the projection's output)
    + 2h * s * b * c           with RMSNorm (torch's composite rms_norm, the CPU's: each keeps its normalised input;
                               a fused kernel keeps less, so this is an upper bound there)
    + 3h * s * b * c           with RoPE (pos_embed rope / learned_rope): the rotated q and k are new tensors the
                               attention keeps, and so is its output, no longer a view beside q, k, v (measured)
(ViT-22B, both: 9h + 3m; the planner had 6h + 2m for it before these terms were measured), and once per model the
final norm's input (h * s * b * c), a patch norm's (AIMv2's) and a norm's before the blocks (pre_norm: CLIP's, PE's;
2h with RMSNorm each).
With gradient checkpointing (model.checkpoint_policy=full) each block keeps only its input (h * s * b * c) and one
block is recomputed at a time. The selective policy keeps, per block, its input and the outputs of its matmuls and
attention: (7h + m) * s * b * c + a * s * b * 4 (input h, q k v 3h, attention output h, its projection h, MLP fc1 m
and fc2 h; the parallel block's fused input projection m + 3h and two output projections 2h: the same sum), and
recomputes the norms and GELU; one block's other activations are live while it is recomputed.
A hybrid's ResNet (model.stem=resnet) keeps the output of every convolution, GroupNorm(+ReLU) and pooling, counted
by a forward pass on the meta device; with gradient checkpointing (per stage, timm's) the stem's outputs, every
stage's input and one stage's outputs; plus, once per step, a standardised copy of every kernel (weight
standardisation; counted whole with or without checkpointing). Measured against autograd's saved tensors
(tests/test_hybrid.py): per image within 10%, the kernel copies within 5%. Dropout masks, drop-path and the
objective's head and loss are not counted.
Windowed blocks (ViTDet / SAM: window w, the grid's s patches padded to s_p, n windows, p prefix tokens) keep beyond
a global block, per image: the partition's copy h s_p, q, k, v and the output over the padding 4h (s_p - s) (and
a (s_p - s) fp32 statistics); with prefix tokens, which every window sees and which attend to every token, the
windows' longer k, v 2h n p, the prefix's query, output and k, v over all tokens 2h p + 2h (p + s), and 2h s of
copies. Relative positions add, per block, the bias (a x queries x keys), the two per-axis terms (a x queries x
(rows + columns) of a window or the grid) and the two gathered tables. Measured against autograd's saved tensors
(tests/test_plan_memory.py): within 3% without prefix tokens (SAM's and ViTDet's layout), within 10% with a class
token (the CPU attention kernels keep different copies with and without a bias).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from timm.layers import GroupNormAct

from ssl_vit.backbone import ParallelBlock, build_vit
from ssl_vit.backbone.mlp import mlp_hidden_width
from ssl_vit.config import STRATEGIES
from ssl_vit.extras import require
from ssl_vit.schema import ConfigError, not_one_of

GIB = 1024**3
PRECISIONS = ("bf16", "fp32")
DEEPSPEED_BUCKET = 50_000_000  # reduce_bucket_size in configs/deepspeed/*.json
ZERO3_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters in configs/deepspeed/zero3*.json


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, read from a model built on the meta device."""

    name: str
    params: int
    largest_layer: int  # most parameters held directly by one module (DeepSpeed's "largest layer")
    largest_block: int  # most parameters in one transformer block (an FSDP2 sharding unit)
    depth: int
    width: int
    mlp_width: int
    heads: int
    tokens: int
    parallel_block: bool
    qk_norm: bool = False  # q and k normalised per head (ViT-22B)
    mlp_bias: bool = False  # the parallel block's separate fc1 bias (no QKV bias: ViT-22B)
    gated: bool = False  # a SwiGLU MLP (mlp_kind swiglu / swiglu_packed): gate and value, m each
    layer_scale: bool = False  # per-channel residual scales: each keeps its input (the projection's output)
    rms_norm: bool = False  # RMSNorm (composite on the CPU): each also keeps its normalised input
    patch_norm: bool = False  # a norm of the patch embeddings (AIMv2): its input, kept with or without checkpoints
    final_norm: bool = True  # a norm after the last block (token pooling), whose input is kept
    pre_norm: bool = False  # a norm before the blocks (CLIP, Perception Encoder): its input, as the patch norm's
    rope: bool = False  # rotary embeddings in every block's attention
    stem_elements: int = 0  # per image, kept by a hybrid's ResNet for backward
    stem_checkpointed: int = 0  # the same with per-stage gradient checkpointing
    stem_weights: int = 0  # per step: the standardised copy of every kernel (weight standardisation) it keeps
    # ViTDet / SAM (ssl_vit.backbone.windows): the patch grid, each block's window (0: global), relative positions, and
    # the prefix tokens (class, registers) the windows see
    grid: tuple[int, int] = (0, 0)
    windows: tuple[int, ...] = ()
    rel_pos: bool = False
    prefix: int = 0

    @classmethod
    def of(cls, name: str, **overrides) -> ModelShape:
        with torch.device("meta"):
            model = build_vit(name, **overrides)
        block = model.blocks[0]
        parallel = isinstance(block, ParallelBlock)
        return cls(
            name=name,
            params=sum(p.numel() for p in model.parameters()),
            largest_layer=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
            largest_block=max(sum(p.numel() for p in b.parameters()) for b in model.blocks),
            depth=len(model.blocks), width=model.embed_dim,
            mlp_width=block.in_split[0] if parallel else mlp_hidden_width(block.mlp),
            gated=model.config.mlp_kind != "mlp", layer_scale=model.config.layer_scale is not None,
            rms_norm=model.config.norm_layer == "rmsnorm", patch_norm=model.config.patch_norm,
            heads=block.num_heads if parallel else block.attn.num_heads,
            tokens=model.patch_embed.num_patches + model.num_prefix_tokens, parallel_block=parallel,
            qk_norm=not isinstance(block.q_norm if parallel else block.attn.q_norm, torch.nn.Identity),
            mlp_bias=parallel and block.mlp_bias is not None,
            final_norm=not isinstance(model.norm, torch.nn.Identity), pre_norm=model.config.pre_norm,
            rope=model.config.has_rope,
            **dict(zip(("stem_elements", "stem_checkpointed"), stem_activation_elements(model), strict=True)),
            stem_weights=sum(p.numel() for p in getattr(model.patch_embed, "backbone", torch.nn.Module()).parameters()
                             if p.ndim == 4),
            grid=tuple(model.grid_size), prefix=model.num_prefix_tokens,
            windows=tuple(block.attn.window for block in model.blocks) if model.windowed else (),
            rel_pos=model.config.rel_pos)


def stem_activation_elements(model) -> tuple[int, int]:
    """Activation elements per image a hybrid's ResNet keeps for backward: (without, with per-stage gradient
    checkpointing); (0, 0) for pixel patches. Counted by a forward pass on the meta device."""
    backbone = getattr(model.patch_embed, "backbone", None)
    if backbone is None:
        return 0, 0
    outputs: dict[str, int] = {}
    stage_inputs: list[int] = []

    def count(name):
        def hook(module, args, output):
            outputs[name] = output.numel()
        return hook

    kept = (torch.nn.Conv2d, torch.nn.GroupNorm, GroupNormAct, torch.nn.MaxPool2d)
    handles = [m.register_forward_hook(count(n)) for n, m in backbone.named_modules()
               if isinstance(m, kept) or type(m).__name__.startswith("MaxPool")]
    stages = list(getattr(backbone, "stages", []))
    handles += [s.register_forward_pre_hook(lambda module, args: stage_inputs.append(args[0].numel())) for s in stages]
    height, width = model.patch_embed.img_size
    backbone(torch.zeros(1, model.patch_embed.in_chans, height, width, device="meta"))
    for handle in handles:
        handle.remove()
    per_stage = [sum(v for k, v in outputs.items() if k.startswith(f"stages.{i}.")) for i in range(len(stages))]
    stem = sum(outputs.values()) - sum(per_stage)
    # checkpointed: the stem's outputs (the first stage's input among them), later stages' inputs, one stage's
    return sum(outputs.values()), stem + sum(stage_inputs[1:]) + max(per_stage, default=0)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU (and, with offload, CPU bytes per node)."""

    strategy: str
    gpus: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    comm_buffers: int
    gathered: int
    activations: int
    cpu_per_node: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def total(self) -> int:
        return self.model_states + self.comm_buffers + self.gathered + self.activations

    def as_dict(self) -> dict:
        return {**asdict(self), "model_states": self.model_states, "total": self.total}


def check_choice(name: str, value, choices) -> None:
    """For Python callers of `plan` (the CLI's values: PlanConfig's schema)."""
    if value not in choices:
        raise ConfigError(not_one_of(name, value, choices))


def spatial_terms(shape: ModelShape, window: int) -> tuple[int, int]:
    """(elements of c bytes, fp32 elements) one image's windowed / relative-position block keeps beyond a global
    block (module docstring), `window` 0 for a global block with relative positions."""
    (height, width), h, a, prefix = shape.grid, shape.width, shape.heads, shape.prefix
    tokens = height * width
    elements = stats = 0
    if window:
        padded = math.ceil(height / window) * math.ceil(width / window) * window * window
        count = padded // (window * window)
        elements += h * padded + 4 * h * (padded - tokens)  # the partition's copy; q, k, v, output over padding
        stats += a * (padded - tokens)
        if prefix:  # each window's k, v gain the prefix's; the prefix's q, output and k, v over every token
            elements += 2 * h * count * prefix + 2 * h * prefix + 2 * h * (prefix + tokens) + 2 * h * tokens
            stats += a * prefix
        queries, keys, side = count * window * window, prefix + window * window, (window, window)
    else:
        queries, keys, side = prefix + tokens, prefix + tokens, (height, width)
    if shape.rel_pos:  # the bias (queries x keys per head), the two per-axis terms, the gathered tables
        rows = queries if window else tokens
        elements += a * queries * keys + a * rows * (side[0] + side[1]) + 2 * (h // a) * side[0] * side[1]
    return elements, stats


def activation_terms(shape: ModelShape, batch: int, precision: str, grad_checkpointing: bool | str
                     ) -> tuple[int, int]:
    """(bytes kept from forward to backward, bytes live only while a checkpointed block is recomputed) on one GPU
    (formulas in the module docstring); `grad_checkpointing`: False, True / "full", or "selective"."""
    c = 2 if precision == "bf16" else 4
    tokens = shape.tokens * batch
    h, m = shape.width, shape.mlp_width
    mlp = 4 * m if shape.gated else 2 * m  # GELU: its input and output; SwiGLU: gate, value, act(gate), product
    norms = 1 if shape.parallel_block else 2
    per_element = ((6 * h if shape.parallel_block else 8 * h) + mlp + 3 * h * shape.qk_norm + m * shape.mlp_bias
                   + 2 * h * shape.layer_scale + norms * h * shape.rms_norm + 3 * h * shape.rope)
    attention_stats = shape.heads * tokens * 4
    block = per_element * tokens * c + attention_stats
    one_norm = h * tokens * c * (1 + shape.rms_norm)
    final_norm = one_norm * (shape.final_norm + shape.patch_norm + shape.pre_norm)  # (+ those before the blocks)
    if grad_checkpointing == "selective":
        kept = (7 * h + (2 * m if shape.gated else m)) * tokens * c + attention_stats  # SwiGLU: both input matmuls
        stem = (shape.stem_checkpointed * batch + shape.stem_weights) * c
        terms = shape.depth * kept + final_norm + stem, block - kept
    elif grad_checkpointing:
        stem = (shape.stem_checkpointed * batch + shape.stem_weights) * c
        terms = shape.depth * h * tokens * c + final_norm + stem, block
    else:
        terms = shape.depth * block + final_norm + (shape.stem_elements * batch + shape.stem_weights) * c, 0
    return _with_spatial_terms(shape, batch, c, grad_checkpointing, terms)


def _with_spatial_terms(shape: ModelShape, batch: int, c: int, grad_checkpointing, terms: tuple[int, int]
                        ) -> tuple[int, int]:
    """`terms` (kept, live while recomputing) plus what windowed / relative-position blocks keep beyond a global
    block (`spatial_terms`): all of it without checkpointing or with the selective policy (its matmul and attention
    outputs are among them), the largest block's while it is recomputed under a checkpoint."""
    extras = [(elements * c + stats * 4) * batch for elements, stats in
              (spatial_terms(shape, window) for window in shape.windows)]
    if not extras:
        return terms
    kept, live = terms
    if grad_checkpointing == "selective":
        return kept + sum(extras), live + max(extras)
    if grad_checkpointing:
        return kept, live + max(extras)
    return kept + sum(extras), live


def activation_bytes(shape: ModelShape, batch: int, precision: str, grad_checkpointing: bool | str) -> int:
    """Activations for backward on one GPU at their peak: kept ones plus one block's recomputation."""
    return sum(activation_terms(shape, batch, precision, grad_checkpointing))


def plan(shape: ModelShape, strategy: str, gpus: int, *, gpus_per_node: int = 8, batch_per_gpu: int = 1,
         precision: str = "bf16", grad_checkpointing: bool | str = False) -> MemoryPlan:
    """Memory per GPU for `shape` trained with AdamW under `strategy` on `gpus` GPUs (the module docstring)."""
    check_choice("strategy", strategy, STRATEGIES)
    check_choice("precision", precision, PRECISIONS)
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError(f"gpus={gpus} and gpus_per_node={gpus_per_node} must be >= 1")
    p, n = shape.params, gpus
    e, g = (2, 2) if precision == "bf16" else (4, 0)
    per_node = min(gpus, gpus_per_node)
    nodes = math.ceil(gpus / per_node)
    activations = activation_bytes(shape, batch_per_gpu, precision, grad_checkpointing)
    def shard(bytes_per_param):  # rounded as DeepSpeed's estimators round
        return int(bytes_per_param * p / n)

    states = {  # params, grads, optimizer, buffers, CPU bytes per node
        "ddp": (4 * p, 4 * p, 8 * p, 0, 0),
        "zero1": (e * p, g * p + shard(4), shard(12), 0, int(p * 4 * per_node * 1.5)),
        "zero2": (e * p, shard(g + 16) - shard(12), shard(12), 0, int(p * 4 * per_node * 1.5)),
        "zero3": (shard(e), shard(e + 16) - shard(e) - shard(12), shard(12), 4 * shape.largest_layer,
                  int(shape.largest_layer * 4 * per_node * 1.5)),
        "zero2_offload": (e * p, 0, 0, 0, int(p * max(4 * gpus, 16) * 1.5)),
        "zero3_offload": (0, 0, 0, 4 * shape.largest_layer, int(p * 18 / nodes * 1.5)),
        "fsdp2": (shard(4), shard(4), shard(8), 0, 0),
    }[strategy]
    comm = {"ddp": 4 * p, "fsdp2": 0}.get(strategy, DEEPSPEED_BUCKET * e)
    gathered = {"zero3": min(ZERO3_MAX_LIVE, p) * e, "zero3_offload": min(ZERO3_MAX_LIVE, p) * e,
                "fsdp2": 2 * shape.largest_block * 2 * e}.get(strategy, 0)
    return MemoryPlan(strategy, gpus, *states[:4], comm_buffers=comm, gathered=gathered, activations=activations,
                      cpu_per_node=states[4])


def deepspeed_estimate(shape: ModelShape, strategy: str, gpus: int, gpus_per_node: int = 8) -> tuple[int, int]:
    """(GPU bytes, CPU bytes) of model states from DeepSpeed's own estimator functions, for the DeepSpeed
    strategies it covers (zero2, zero3 and their offload variants), given counts from the meta device."""
    require("deepspeed", "the comparison with DeepSpeed's own estimators")
    # heavy (deepspeed): only for the comparison with DeepSpeed's own estimators
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs  # (the same)

    per_node = min(gpus, gpus_per_node)
    nodes = max(1, math.ceil(gpus / per_node))
    if strategy in ("zero2", "zero2_offload"):
        cpu, gpu = estimate_zero2_model_states_mem_needs(shape.params, per_node, nodes,
                                                         cpu_offload=strategy.endswith("offload"))
        return gpu, cpu
    if strategy in ("zero3", "zero3_offload"):
        offload = strategy.endswith("offload")
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(shape.params, shape.largest_layer, per_node, nodes,
                                                            cpu_offload=offload, cpu_offload_params=offload)
        return gpu, cpu
    raise ConfigError(f"DeepSpeed has no estimator for strategy={strategy!r}; it has one for "
                     "['zero2', 'zero2_offload', 'zero3', 'zero3_offload']")


def smallest_gpu_count(shape: ModelShape, strategy: str, memory_bytes: int, *, max_gpus: int = 65536,
                       **kwargs) -> int | None:
    """The fewest GPUs (1, 2, 4, ... then multiples of gpus_per_node) on which the plan fits `memory_bytes`."""
    per_node = kwargs.get("gpus_per_node", 8)
    candidates = [g for g in (1, 2, 4) if g < per_node] + list(range(per_node, max_gpus + 1, per_node))
    return next((g for g in candidates if plan(shape, strategy, g, **kwargs).total <= memory_bytes), None)
