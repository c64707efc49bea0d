"""Export a trained model for other libraries.

    python scripts/export.py outputs/<clip run> --to open_clip --out exported/clip
then, anywhere with open_clip installed (offline):
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:exported/clip")
    tokenizer = open_clip.get_tokenizer("local-dir:exported/clip")

--to open_clip takes a run directory of objective=clip / siglip (encoder.safetensors + heads.safetensors) and writes
open_clip_config.json (towers, preprocessing) and open_clip_model.safetensors; encode_image and encode_text equal
the trained model's (ssl_vit.export.open_clip).
"""

import argparse
import sys

TARGETS = ("open_clip",)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a run directory (or its encoder.safetensors)")
    parser.add_argument("--to", required=True, choices=TARGETS, help="the target library's format")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    from ssl_vit.export.open_clip import export_open_clip

    try:
        out = export_open_clip(args.source, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}: open_clip.create_model_and_transforms('local-dir:{out}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
