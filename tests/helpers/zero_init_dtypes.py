"""Build an objective under ZeRO-3's zero.Init as the trainer does (ssl_vit.train.strategy.zero_init) for each
precision, with DeepSpeed's accelerator answering is_fp16_supported() both ways, on a one-process gloo group; print
one JSON line per case: the dtypes of every parameter and of the buffers that must stay fp32, and how far the
initial weights are from the fp32 build's rounded to the case's dtype (same seed). The backbone has rotary
position embeddings: their periods must stay fp32 too."""

import json
import os

import torch
from deepspeed.accelerator import get_accelerator

from ssl_vit.backbone import build_vit
from ssl_vit.objectives import DataInfo, build_objective
from ssl_vit.objectives.dino import DINOConfig
from ssl_vit.train.strategy import kept_fp32_buffers, zero_init

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
accelerator = get_accelerator()
reference = None
for precision in ("fp32", "bf16"):
    for fp16_supported in (True, False):
        accelerator.is_fp16_supported = lambda answer=fp16_supported: answer
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": precision == "bf16"},
                  "fp16": {"enabled": False}, "zero_optimization": {"stage": 3}}
        cfg = DINOConfig(out_dim=16, hidden_dim=16, bottleneck_dim=8, local_crops=0, ibot_weight=1.0, ibot_out_dim=16)
        torch.manual_seed(0)
        with zero_init(config):
            backbone = build_vit("vit_test", weight_init="jax", pos_embed="rope")
            objective = build_objective(cfg, backbone, DataInfo(0, 16))
        weights = {name: p.ds_tensor.reshape(-1)[:p.ds_numel] for name, p in objective.named_parameters()}
        reference = reference or {name: w.clone() for name, w in weights.items()}  # the first case: fp32
        print(json.dumps({"precision": precision, "fp16_supported": fp16_supported,
                          "parameters": sorted({str(p.dtype) for p in objective.parameters()}),
                          "buffers": {name: str(b.dtype) for name, b in objective.named_buffers()
                                      if name.rsplit(".", 1)[-1] in kept_fp32_buffers(objective)},
                          "max_difference_to_fp32_rounded": max(
                              float((w.float() - reference[name].to(w.dtype).float()).abs().max())
                              for name, w in weights.items())}))
torch.distributed.destroy_process_group()
