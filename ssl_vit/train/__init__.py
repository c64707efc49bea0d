"""The engine: `build` (config -> the typed parts of a run), `trainer` (the Trainer and `pretrain`), `strategy`
(how a model is distributed: the one module that knows DDP, DeepSpeed ZeRO-1/2/3 and FSDP2), `checkpoint` (exact
resume), `outputs` (what a run writes), `evaluation` (periodic evaluation), `guard` (divergence), `memory` (the
planner) and `faults` (fault injection for the tests). It knows no objective: it reads the objective contract
(objectives/base.py) and the dataset registry (ssl_vit.data.registry)."""

import os

import torch

# DeepSpeed (imported by accelerate wherever it is installed, e.g. in unwrap_model) warns "Setting accelerator to
# CPU" on every import without a GPU; naming the accelerator it would pick anyway keeps CPU runs quiet. Set here,
# before the engine's modules import accelerate.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"

from ssl_vit.train.build import build_components  # noqa: E402
from ssl_vit.train.guard import TrainingDiverged  # noqa: E402
from ssl_vit.train.outputs import OutputError  # noqa: E402
from ssl_vit.train.trainer import TrainState, pretrain  # noqa: E402

__all__ = ["OutputError", "TrainState", "TrainingDiverged", "build_components", "pretrain"]
