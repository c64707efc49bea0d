from ssl_vit.train.guard import TrainingDiverged
from ssl_vit.train.loop import TrainState, build_components, pretrain
from ssl_vit.train.outputs import OutputError

__all__ = ["OutputError", "TrainState", "TrainingDiverged", "build_components", "pretrain"]
