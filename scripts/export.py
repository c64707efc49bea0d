"""Export an encoder (or a CLIP / SigLIP model) for other libraries.

    python scripts/export.py outputs/<run> --to hf --out exported/hf     # --hf-arch vit|dinov2|clip|siglip|dinov3
    python scripts/export.py outputs/<run> --to timm --out exported/timm   # --timm-arch naflexvit: timm's NaFlex ViT
    python scripts/export.py outputs/<run> --to onnx --out exported/onnx
    python scripts/export.py outputs/<clip run> --to open_clip --out exported/clip
    python scripts/export.py outputs/<mae run> --to detectron2 --out exported/vitdet   # ViTDet's backbone
    python scripts/export.py hf:<transformers dir> --to safetensors --out exported/ours   # any import, as ours
then, offline:
    transformers.AutoModel.from_pretrained("exported/hf"); AutoImageProcessor.from_pretrained("exported/hf")
    timm.create_model("local-dir:exported/timm", pretrained=True)
    onnxruntime.InferenceSession("exported/onnx/model.onnx")
    open_clip.create_model_and_transforms("local-dir:exported/clip")

The source is a run directory, an encoder.safetensors, or any import form (timm:, hf:, open_clip:; see
ssl_vit/interop/sources.py). --to hf writes a transformers directory (default --hf-arch: dinov3 for RoPE models, clip
for pre-norm models, dinov2 with layer scale or registers, siglip without a class token, vit otherwise; a CLIP run's
projection becomes visual_projection) with its image processor; --to timm a model.safetensors + timm config.json
(timm's DINOv3 port for RoPE models); --to onnx model.onnx (dynamic batch, checked with onnxruntime); --to
open_clip a CLIP / SigLIP run's image and text towers; --to safetensors of a distilled student (objective=distill)
writes its adaptor heads beside the encoder. Every target gets a README.md model card beside the
weights (ssl_vit/model_card.py) with the Hub's front matter (library_name, --license, tags, pipeline_tag).
"""

import argparse
import sys

from ssl_vit.interop.export import TARGETS, TIMM_ARCHS, export
from ssl_vit.interop.hf import HF_ARCHS
from ssl_vit.run_dirs import resolve_run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a run directory, an encoder.safetensors, timm:..., hf:<dir>, open_clip:...")
    parser.add_argument("--to", required=True, choices=TARGETS, help="the target library's format")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--hf-arch", choices=HF_ARCHS, default=None, help="--to hf: the transformers model class")
    parser.add_argument("--timm-arch", choices=TIMM_ARCHS, default="vit",
                        help="--to timm: timm's classic VisionTransformer, or NaFlexVit (images at their own sizes)")
    parser.add_argument("--license", default="other",
                        help="the model card's Hub license id (e.g. apache-2.0, cc-by-nc-4.0; default: other): the "
                             "weights' terms follow the data they were trained on")
    args = parser.parse_args(argv)
    args.source = resolve_run(args.source.removeprefix("checkpoint="))  # as evaluate.py; a group: its newest run
    try:
        print(export(args.source, args.to, args.out, args.hf_arch, args.license, args.timm_arch))
    except (ValueError, FileNotFoundError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
