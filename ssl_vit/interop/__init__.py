"""Our ViT and the other libraries' models, both directions, one module per library, each driven by one name table:
`timm`, `hf` (transformers), `open_clip`, `onnx` (export only); `sources` reads every import form (a spec string:
ours, timm:, hf:, open_clip:) into an encoder with its preprocessing."""
