"""Write WebDataset shards (.tar) from an image source, and print a summary.

    python scripts/make_shards.py synthetic --out data/shapes --num-samples 20000 --img-size 64
    python scripts/make_shards.py folder --root /data/train --out data/train-shards --samples-per-shard 5000
    python scripts/make_shards.py captions --root /data/pairs --out data/pairs-train         # image + .txt pairs
    python scripts/make_shards.py tuxpaint --split train --out data/tuxpaint-train           # 90% of the stamps
    python scripts/make_shards.py tuxpaint --split test --out data/tuxpaint-test             # the held-out 10%
    python scripts/make_shards.py fashion_mnist --split train --out data/fmnist-train
    python scripts/make_shards.py digits --out data/digits

Each sample holds the image (png for images up to 64 px, jpg above; --format to choose), `cls` when labelled,
`txt` when captioned, and a `json` with its source metadata; `sizes.json` beside the shards counts each shard's
samples (so a reader can count what a broken shard lost). Unreadable source images are left out, named in the log
(the first few) and counted in the summary. Then train on them (a directory, a quoted glob, or a brace pattern
quoted twice: once for the shell, once for Hydra, whose parser reads bare braces as a dict):
    python scripts/pretrain.py data=wds data.urls=data/shapes
    python scripts/pretrain.py data=wds 'data.urls=data/shapes/*.tar'
    python scripts/pretrain.py data=wds 'data.urls="data/shapes/shard-{000000..000019}.tar"'
"""

import argparse
import json
import logging
import sys

from ssl_vit.data.shards import FORMATS, write_shards
from ssl_vit.data.sources import SOURCES, open_source


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=SOURCES)
    parser.add_argument("--out", required=True, help="output directory for the .tar shards")
    parser.add_argument("--root", help="input directory (folder, captions) or idx directory (fashion_mnist)")
    parser.add_argument("--split", default=None,
                        help="fashion_mnist, digits: train (default) or test; captions, tuxpaint: all (default), "
                             "train or test (90%% / 10%% by a stable hash of the path)")
    parser.add_argument("--num-samples", type=int, default=10000, help="synthetic: how many images")
    parser.add_argument("--img-size", type=int, default=64, help="synthetic: image size in pixels")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: seed")
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument("--format", default="auto", choices=FORMATS)
    parser.add_argument("--prefix", default="shard")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="make_shards: %(levelname)s: %(message)s")
    try:
        split = args.split or ("all" if args.source in ("captions", "tuxpaint") else "train")
        samples, classes = open_source(args.source, root=args.root, split=split, num_samples=args.num_samples,
                                       img_size=args.img_size, seed=args.seed)
        summary = write_shards(samples, args.out, source=args.source, prefix=args.prefix,
                               samples_per_shard=args.samples_per_shard, image_format=args.format, classes=classes)
    except (FileNotFoundError, ValueError) as err:
        print(f"make_shards: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {summary['samples']} samples from {args.source} into {len(summary['shards'])} shard(s), "
          f"{summary['bytes'] / 1e6:.1f} MB, formats {summary['formats']}")
    if getattr(samples, "skipped", 0):
        print(f"left out {samples.skipped} unreadable image(s) (the first ones are named above)")
    if summary["classes"]:
        print(f"classes: {len(summary['classes'])} ({json.dumps(summary['classes'])})")
    print(f"train on them: python scripts/pretrain.py data=wds data.urls={summary['out_dir']}"
          + (f" data.num_classes={len(classes)}" if classes else ""))
    if summary["pattern"]:
        print(f"  or name these shards (quoted for the shell, then for Hydra): 'data.urls=\"{summary['pattern']}\"'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
