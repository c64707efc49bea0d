"""Export a trained model for other libraries.

    python scripts/export.py outputs/<clip run> --to open_clip --out exported/clip
    python scripts/export.py outputs/<run> --to hf --out exported/clip-vision
then, offline:
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:exported/clip")
    tokenizer = open_clip.get_tokenizer("local-dir:exported/clip")
    vision = transformers.CLIPVisionModelWithProjection.from_pretrained("exported/clip-vision")

--to open_clip takes a run directory of objective=clip / siglip (encoder.safetensors + heads.safetensors) and writes
open_clip_config.json (towers, preprocessing) and open_clip_model.safetensors; encode_image and encode_text equal
the trained model's (ssl_vit.export.open_clip). --to hf writes the image tower (any run's encoder; with a CLIP run's
projection as visual_projection) as a transformers CLIPVisionModelWithProjection directory with its image processor
(ssl_vit.export.hf); pooler_output is the encoder's embedding, image_embeds the CLIP image embedding.
"""

import argparse
import sys

TARGETS = ("open_clip", "hf")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a run directory (or its encoder.safetensors)")
    parser.add_argument("--to", required=True, choices=TARGETS, help="the target library's format")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        if args.to == "open_clip":
            from ssl_vit.export.open_clip import export_open_clip

            out = export_open_clip(args.source, args.out)
            print(f"wrote {out}: open_clip.create_model_and_transforms('local-dir:{out}')")
        else:
            out = export_hf(args.source, args.out)
            print(f"wrote {out}: transformers.CLIPVisionModelWithProjection.from_pretrained('{out}')")
    except (ValueError, FileNotFoundError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 2
    return 0


def export_hf(source: str, out: str):
    from pathlib import Path

    from safetensors.torch import load_file

    from ssl_vit.export import load_encoder, read_preprocess
    from ssl_vit.export.hf import export_clip_vision

    path = Path(source)
    encoder_path = path / "encoder.safetensors" if path.is_dir() else path
    if not encoder_path.is_file():
        raise FileNotFoundError(f"{source!r} is not an encoder file or a run directory with encoder.safetensors")
    heads = encoder_path.with_name("heads.safetensors")
    projection = load_file(str(heads)).get("image_proj.weight") if heads.is_file() else None
    return export_clip_vision(load_encoder(encoder_path), out, projection, read_preprocess(encoder_path))


if __name__ == "__main__":
    sys.exit(main())
