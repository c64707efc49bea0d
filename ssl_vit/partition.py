"""This rank's part of a parameter under each strategy: a ZeRO-3 partition (`ds_tensor`), an FSDP2 DTensor's local
shard, or the whole tensor (one process, DDP, ZeRO-1/2). Shared by the EMA update and the strategy's norms. And a
parameter's full shape and size whatever the strategy (a ZeRO-3 partitioned parameter holds an empty 1-D tensor
whose own shape says nothing; an FSDP2 DTensor's shape is already the full one)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_shard(param: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """This rank's part of `param`. ZeRO-3 pads the last rank's partition to the common size with uninitialised
    memory (once measured as inf in a norm): left out unless `padded` (an update in place may run over it: padding
    is never gathered)."""
    if hasattr(param, "ds_tensor"):
        shard = param.ds_tensor
        if padded:
            return shard
        group = getattr(param, "ds_process_group", None)
        rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        valid = max(0, min(shard.numel(), param.ds_numel - rank * shard.numel()))
        return shard.reshape(-1)[:valid]
    if hasattr(param, "to_local"):
        return param.to_local()
    return param.data


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole parameter's shape (ZeRO-3: `ds_shape`)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def full_numel(param: torch.Tensor) -> int:
    """The whole parameter's element count (ZeRO-3: `ds_numel`)."""
    return int(getattr(param, "ds_numel", param.numel()))
