"""The exponential moving average of one set of parameters into another (an EMA teacher), shard by shard, with
the average kept in fp32. The one place that knows how a teacher is updated under each strategy:

- one process, DDP, ZeRO-1/2: whole tensors, `t <- t + (1 - m) (s - t)` (a foreach lerp);
- FSDP2: the same on each DTensor's local shard (student and teacher are sharded alike, so the shards line up);
- ZeRO-3: on each parameter's partition (`ds_tensor`); the student's side is its fp32 master partition from the
  optimizer. The teacher must not be persisted whole on every rank (DeepSpeed's
  `stage3_param_persistence_threshold`: set to 0 when a model has a teacher), or its small parameters go stale.

Nothing is ever gathered. When the teacher's own tensors are 16-bit (DeepSpeed's bf16 mode casts the whole module),
the average lives in fp32 copies of the local shards and is written into the teacher after each update: a bf16
EMA at m = 0.996 stalls, because (1 - m)(s - t) is below bf16's resolution of t. `fp32_shards()` hands those
averages over by name, for saving the teacher at full precision. A resumed run restarts the fp32 average from the
(bf16) teacher in the checkpoint.
"""

from __future__ import annotations

import torch

from ssl_vit.backbone import VisionTransformer
from ssl_vit.partition import local_shard


def teacher_backbone(backbone: VisionTransformer) -> VisionTransformer:
    """The backbone built again for an EMA teacher: the same config, without stochastic depth or dropout (its outputs
    are targets, as in DINO's, MoCo v3's and I-JEPA's code). Built like the student, so zero.Init partitions it the
    same way; `EMA.following` gives it the student's values."""
    return VisionTransformer(backbone.config.replace(drop_path=0.0, attn_drop=0.0, proj_drop=0.0))


def _student_local_fp32(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a student parameter at full precision: ZeRO-3's fp32 master partition when the module
    holds 16-bit copies, else the local shard itself."""
    local = local_shard(param, padded=True)
    if local.dtype == torch.float32 or not param.requires_grad:  # frozen: no master copy (DeepSpeed gives None)
        return local.float()
    if hasattr(param, "ds_tensor") and getattr(param, "_z3_optimizer", None) is not None:
        from deepspeed.utils import safe_get_local_fp32_param  # heavy: only under ZeRO-3

        return safe_get_local_fp32_param(param)
    return local.float()  # ZeRO-1/2 bf16: the module's bf16 copy, averaged into an fp32 EMA


def _named(modules) -> dict[str, torch.Tensor]:
    """Parameters by name from a module, or from a {name: module or None} dict (parts of a larger module)."""
    if isinstance(modules, torch.nn.Module):
        return dict(modules.named_parameters())
    return {f"{key}.{name}": p for key, module in modules.items() if module is not None
            for name, p in module.named_parameters()}


def _pairs(student, teacher):
    s, t = _named(student), _named(teacher)
    if s.keys() != t.keys():
        raise ValueError(f"student and teacher differ in parameters: {sorted(s.keys() ^ t.keys())[:5]}")
    return [(s[name], t[name]) for name in s]


@torch.no_grad()
def copy_parameters(teacher, student) -> None:
    """teacher <- student, local shard by local shard (at construction: under zero.Init both are partitioned)."""
    for s, t in _pairs(student, teacher):
        local_shard(t, padded=True).copy_(local_shard(s, padded=True))


class EMA:
    """`update(m)`: teacher <- m teacher + (1 - m) student for every parameter, on local shards, in fp32."""

    def __init__(self, student, teacher):
        """student, teacher: modules, or {name: module} dicts, whose parameters match by name."""
        self.student, self.teacher = student, teacher
        self._fp32: list[torch.Tensor] | None = None  # fp32 averages when the teacher's tensors are 16-bit

    @classmethod
    def following(cls, student, teacher: torch.nn.Module) -> EMA:
        """Start a teacher: it takes the student's values and is frozen (updated only by the returned EMA)."""
        copy_parameters(teacher, student)
        teacher.requires_grad_(False)
        return cls(student, teacher)

    @torch.no_grad()
    def update(self, momentum: float) -> None:
        pairs = _pairs(self.student, self.teacher)
        students = [_student_local_fp32(s) for s, _ in pairs]
        teachers = [local_shard(t, padded=True) for _, t in pairs]
        if all(t.dtype == torch.float32 for t in teachers):
            torch._foreach_lerp_(teachers, students, 1.0 - momentum)
            return
        if self._fp32 is None:  # first update (or after a resume): start from the teacher's current values
            self._fp32 = [t.float().clone() for t in teachers]
        torch._foreach_lerp_(self._fp32, [s.to(a.device) for s, a in zip(students, self._fp32, strict=True)],
                             1.0 - momentum)
        for average, t in zip(self._fp32, teachers, strict=True):
            t.copy_(average)

    def fp32_shards(self) -> dict[str, torch.Tensor]:
        """The teacher's fp32 averages by parameter name (this rank's shards, ZeRO-3's padding included), when its
        tensors are 16-bit and it has been updated; else {} (its own tensors are the average)."""
        if self._fp32 is None:
            return {}
        return dict(zip(_named(self.student), self._fp32, strict=True))  # the order of _pairs
