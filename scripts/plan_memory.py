"""Plan the memory of a run: a table per GPU for one strategy, every strategy side by side, and the smallest GPU
count that fits. Nothing is allocated: the model is counted on the meta device.

    python scripts/plan_memory.py model=vit_22b strategy=zero3 gpus=64 batch_per_gpu=4 grad_checkpointing=true
    python scripts/plan_memory.py model=vit_g14 grad_checkpointing=true model.checkpoint_policy=selective
    python scripts/plan_memory.py model=vit_l16 strategy=ddp gpus=8 batch_per_gpu=64 precision=bf16
"""

import hydra

from ssl_vit.backbone import CHECKPOINTING
from ssl_vit.cli import register_configs, run_hydra, run_reporting_errors
from ssl_vit.config import model_kwargs
from ssl_vit.paths import CONFIG_DIR
from ssl_vit.schema import validate_config
from ssl_vit.train.memory import (
    GIB,
    STRATEGIES,
    ModelShape,
    check_choice,
    deepspeed_estimate,
    plan,
    smallest_gpu_count,
)

register_configs()
COLUMNS = ("params", "grads", "optimizer", "buffers", "comm_buffers", "gathered", "activations", "total")


def report(cfg) -> None:
    validate_config(cfg)
    overrides = model_kwargs(cfg.model) | ({"img_size": cfg.img_size} if cfg.img_size else {})
    shape = ModelShape.of(cfg.model.name, **overrides)
    checkpointing = cfg.model.checkpoint_policy if cfg.grad_checkpointing or cfg.model.grad_checkpointing else False
    check_choice("model.checkpoint_policy", cfg.model.checkpoint_policy, CHECKPOINTING)
    options = dict(gpus_per_node=cfg.gpus_per_node, batch_per_gpu=cfg.batch_per_gpu,
                   precision=cfg.precision.value, grad_checkpointing=checkpointing)
    chosen = plan(shape, cfg.strategy, cfg.gpus, **options)
    print(f"{shape.name}: {shape.params:,} parameters, largest layer {shape.largest_layer:,}, {shape.depth} blocks, "
          f"{shape.tokens} tokens; batch {cfg.batch_per_gpu}/GPU, {cfg.precision.value}, "
          f"grad checkpointing {checkpointing or 'off'}, AdamW")
    print(f"\n{cfg.strategy} on {cfg.gpus} GPUs ({cfg.gpus_per_node} per node), GiB per GPU:")
    print("".join(f"{c:>13}" for c in COLUMNS))
    print("".join(f"{getattr(chosen, c) / GIB:>13.2f}" for c in COLUMNS))
    if chosen.cpu_per_node:
        print(f"CPU memory per node: {chosen.cpu_per_node / GIB:.1f} GiB")
    print(f"\nEvery strategy on {cfg.gpus} GPUs (GiB per GPU; fits = total <= {cfg.gpu_memory_gib:g} GiB):")
    print(f"{'strategy':<15}{'model states':>14}{'DeepSpeed':>11}{'total':>10}{'fits':>6}{'fewest GPUs':>13}"
          f"{'CPU GiB/node':>14}")
    for strategy in STRATEGIES:
        p = plan(shape, strategy, cfg.gpus, **options)
        try:
            ds = f"{deepspeed_estimate(shape, strategy, cfg.gpus, cfg.gpus_per_node)[0] / GIB:.2f}"
        except ValueError:
            ds = "-"
        fewest = smallest_gpu_count(shape, strategy, int(cfg.gpu_memory_gib * GIB), **options)
        print(f"{strategy:<15}{p.model_states / GIB:>14.2f}{ds:>11}{p.total / GIB:>10.2f}"
              f"{'yes' if p.total <= cfg.gpu_memory_gib * GIB else 'no':>6}{fewest or 'none':>13}"
              f"{p.cpu_per_node / GIB:>14.1f}")


@hydra.main(config_path=str(CONFIG_DIR), config_name="plan_memory", version_base="1.3")
def main(cfg) -> None:
    run_reporting_errors(report, cfg)


if __name__ == "__main__":
    run_hydra(main, "plan_memory", __doc__)
