"""Run under `accelerate launch --config_file configs/accelerate/zero3_cpu2.yaml`: build a preset the way the trainer
does under ZeRO-3 (zero.Init), and write each rank's view of its parameters to JSON: full and local sizes and the
statistics of the local shard (tests/test_strategies.py checks them against the intended init), one file per rank
and init scheme (argv: preset, comma-separated schemes, output directory)."""

import json
import sys

from accelerate.utils import set_seed
from omegaconf import OmegaConf

from ssl_vit.backbone import build_vit
from ssl_vit.train.strategy import StrategySettings, construction_context, make_accelerator

preset, schemes, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
cfg = OmegaConf.create({"trainer": {"precision": "fp32", "grad_accum_steps": 1, "tensorboard": False},
                        "data": {"batch_size": 2}, "optim": {"grad_clip": 1.0}})
accelerator = make_accelerator(StrategySettings.from_config(cfg), out)
for weight_init in schemes:
    set_seed(0)
    with construction_context(accelerator):
        model = build_vit(preset, weight_init=weight_init)
    report = {name: {"numel": int(p.ds_numel), "local": int(p.ds_tensor.numel()), "visible": int(p.numel()),
                     "std": float(p.ds_tensor.float().std()) if p.ds_tensor.numel() > 1 else None,
                     "max_abs": float(p.ds_tensor.abs().max()) if p.ds_tensor.numel() else None}
              for name, p in model.named_parameters()}
    with open(f"{out}/rank{accelerator.process_index}_{weight_init}.json", "w") as f:
        json.dump(report, f)
    del model
