"""The engine: `build` (config -> the typed parts of a run), `trainer` (the Trainer and `pretrain`), `strategy`
(how a model is distributed: the one module that knows DDP, DeepSpeed ZeRO-1/2/3 and FSDP2), `checkpoint` (exact
resume), `outputs` (what a run writes), `evaluation` (periodic evaluation), `guard` (divergence), `memory` (the
planner) and `faults` (fault injection for the tests). It knows no objective: it reads the objective contract
(objectives/base.py) and the dataset registry (ssl_vit.data.registry)."""

from ssl_vit.train.build import build_components
from ssl_vit.train.guard import TrainingDiverged
from ssl_vit.train.outputs import OutputError
from ssl_vit.train.trainer import TrainState, pretrain

__all__ = ["OutputError", "TrainState", "TrainingDiverged", "build_components", "pretrain"]
