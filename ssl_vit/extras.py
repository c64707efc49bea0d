"""Optional features and the extra that installs each (pyproject.toml's [project.optional-dependencies]): using one
without its package ends in one line naming the extra, `pip install 'ssl-vit[deepspeed]'`, not an ImportError deep
inside a run."""

from __future__ import annotations

import importlib
from types import ModuleType

from ssl_vit.schema import ConfigError

EXTRA_OF = {"deepspeed": "deepspeed", "transformers": "hf", "onnx": "onnx", "onnxruntime": "onnx",
            "mlflow": "trackers", "wandb": "trackers"}


class MissingExtra(ConfigError):
    """An optional feature was asked for and its package is not installed (exit status 2, as a bad config)."""


def require(module: str, feature: str) -> ModuleType:
    """`module` imported; MissingExtra naming `feature` and the extra when its package is not installed (an
    ImportError from inside an installed package is its own failure and propagates)."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != top:
            raise
        extra = EXTRA_OF.get(top)
        how = f"pip install 'ssl-vit[{extra}]'" if extra else f"pip install {top}"
        raise MissingExtra(f"{feature} needs {top}, which is not installed here: {how}") from err
