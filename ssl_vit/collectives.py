"""Collectives that also work in one process (no process group: the tensor itself)."""

from __future__ import annotations

import torch


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) over ranks in place when a process group is up; the tensor itself on one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
        torch.distributed.all_reduce(tensor, op=ops[op])
    return tensor
