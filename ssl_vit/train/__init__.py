from ssl_vit.train.loop import NonFiniteLossError, TrainState, build_components, pretrain

__all__ = ["NonFiniteLossError", "TrainState", "build_components", "pretrain"]
