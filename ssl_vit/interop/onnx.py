"""The encoder as an ONNX graph (`torch.onnx.export`, dynamic batch), checked with onnxruntime after writing.

Input `pixel_values` (batch, channels, height, width) at the encoder's image size, normalised as its preprocessing
says (written beside the graph as preprocess.json); outputs `embedding` (batch, D), the pooled embedding, and
`last_hidden_state` (batch, tokens, D), `forward_features`: every token (prefix tokens first) after the final norm
(average-pooled models normalise after pooling: their tokens are the last block's output).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from torch import nn

from ssl_vit.extras import require

MODEL_FILE = "model.onnx"


def _rms_norm(g, x, normalized_shape, weight, eps):
    """aten::rms_norm (RMSNorm: AIMv2) as ONNX primitives, for the TorchScript exporter, which has no symbolic for
    it below opset 23: x / sqrt(mean(x^2) + eps) * weight over the normalised dimensions."""
    from torch.onnx import symbolic_helper  # the exporter's internals: loaded when a graph is exported

    dims = symbolic_helper._get_const(normalized_shape, "is", "normalized_shape")
    eps = symbolic_helper._maybe_get_const(eps, "f")
    eps = torch.finfo(torch.float32).eps if eps is None or symbolic_helper._is_value(eps) else float(eps)
    axes = g.op("Constant", value_t=torch.tensor(list(range(-len(dims), 0)), dtype=torch.long))
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes, keepdims_i=1)
    scaled = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, g.op("Constant", value_t=torch.tensor(eps)))))
    return scaled if symbolic_helper._is_none(weight) else g.op("Mul", scaled, weight)


class _Outputs(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, pixel_values):
        tokens = self.encoder.forward_features(pixel_values)
        return self.encoder.forward_head(tokens, pre_logits=True), tokens


def export_onnx(encoder, out_dir: str | Path, preprocess=None, opset: int = 18,
                check_batch: int = 3) -> tuple[Path, float]:
    """Write DIR/model.onnx (+ preprocess.json); returns (path, max |onnxruntime - torch|) on a random batch of
    `check_batch` images (a batch size other than the traced one: the batch dimension is dynamic)."""
    require("onnx", "an ONNX export (--to onnx)")  # torch.onnx.export's serialiser
    onnxruntime = require("onnxruntime", "an ONNX export (--to onnx)")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MODEL_FILE
    module = _Outputs(copy.deepcopy(encoder)).eval().float()  # the caller's encoder keeps its mode and dtype
    height, width = encoder.patch_embed.img_size
    example = torch.randn(2, encoder.config.in_chans, height, width)
    torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm, opset)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python-side shape checks
        torch.onnx.export(module, (example,), str(path), input_names=["pixel_values"],
                          output_names=["embedding", "last_hidden_state"], opset_version=opset, dynamo=False,
                          dynamic_axes={"pixel_values": {0: "batch"}, "embedding": {0: "batch"},
                                        "last_hidden_state": {0: "batch"}})
    if preprocess is not None:
        (out_dir / "preprocess.json").write_text(preprocess.to_json() + "\n")
    check = torch.randn(check_batch, *example.shape[1:], generator=torch.Generator().manual_seed(0))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    embedding, tokens = session.run(None, {"pixel_values": check.numpy()})
    with torch.no_grad():
        ref_embedding, ref_tokens = module(check)
    error = max(float((torch.from_numpy(embedding) - ref_embedding).abs().max()),
                float((torch.from_numpy(tokens) - ref_tokens).abs().max()))
    return path, error


