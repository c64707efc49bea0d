"""MoCo v3 on 2 gloo processes against 1 process on the whole batch: each rank takes its half of an 8-image batch of
2 views, runs the objective (global BatchNorm, keys gathered, labels offset by rank) and backpropagates; the mean of
the two ranks' losses and gradients (what DDP applies) must equal the one-process loss and gradients on all 8.
Prints one JSON line: the largest differences."""

import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

from objectives import DataInfo, build_objective
from objectives.mocov3 import MoCoV3Config
from ssl_vit.vit import build_vit


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


def rank_main(rank, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29541"))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    loss, grads = run(build(), {"crops": [c[rank * 4:(rank + 1) * 4] for c in crops()]})
    torch.save({"loss": loss, "grads": grads}, f"{path}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as path:
        mp.spawn(rank_main, args=(path,), nprocs=2)
        ranks = [torch.load(f"{path}/rank{r}.pt") for r in range(2)]
    loss, grads = run(build(), {"crops": crops()})
    mean_loss = sum(r["loss"] for r in ranks) / 2
    if set(grads) != set(ranks[0]["grads"]):
        sys.exit(f"gradients differ in names: {sorted(set(grads) ^ set(ranks[0]['grads']))}")
    difference = max(float((grads[n] - (ranks[0]["grads"][n] + ranks[1]["grads"][n]) / 2).abs().max()) for n in grads)
    print(json.dumps({"loss": loss, "mean_rank_loss": mean_loss, "grad_difference": difference,
                      "grad_scale": max(float(g.abs().max()) for g in grads.values()), "parameters": sorted(grads)}))
