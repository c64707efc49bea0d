"""MoCo v3 on 2 gloo processes against 1 process on the whole batch (tests/test_mocov3.py): each rank takes its half
of an 8-image batch of 2 views, runs the objective (global BatchNorm, keys gathered, labels offset by rank) and
backpropagates; the mean of the two ranks' losses and gradients (what DDP applies) must equal the one-process loss
and gradients on all 8."""

import torch

from ssl_vit.backbone import build_vit
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.mocov3 import MoCoV3Config


def build():
    torch.manual_seed(0)
    objective = build_objective(MoCoV3Config(dim=16, mlp_dim=32), build_vit("vit_test", pos_embed="sincos"),
                                DataInfo(0, 16))
    objective.momentum.backbone.blocks[0].attn.qkv.weight.data.mul_(0.9)  # keys from another network than queries
    return objective


def crops():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 16, 16, generator=generator) for _ in range(2)]


def run(objective, batch):
    out = objective(batch)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    return float(out["loss"]), grads


def rank_main(rank, out):
    """One rank's half of the batch (helpers.ranks.on_ranks has joined the process group)."""
    loss, grads = run(build(), {"crops": [c[rank * 4:(rank + 1) * 4] for c in crops()]})
    torch.save({"loss": loss, "grads": grads}, out / f"rank{rank}.pt")
