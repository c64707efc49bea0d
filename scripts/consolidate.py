"""Turn a sharded checkpoint into whole files, on CPU, in one process (no GPU, no process group of its size).

    python scripts/consolidate.py runs/big/checkpoints/step_00010000 --out consolidated/big
    python scripts/consolidate.py runs/big --out consolidated/big        # a run directory: its newest checkpoint

DeepSpeed ZeRO-1/2/3 checkpoints are read by DeepSpeed's zero_to_fp32, FSDP2's by torch.distributed.checkpoint's
format utilities, DDP / single-process ones as they are. Writes encoder.safetensors and heads.safetensors (as a
run does: evaluate.py, export.py, objectives' load_trained take the directory) and training_state.pt (the full model
state dict, the whole optimizer state where the format has one (FSDP2, DDP), step and counters); see
ssl_vit/train/consolidate.py. Every pickled file is read as weights only first (zero_to_fp32 and DCP's conversion
then unpickle in full): one holding other Python objects is refused in one line unless --trust-pickle. Exit status 2
with one line for a directory that is not a checkpoint or a file that is refused.
"""

import argparse
import sys
from pathlib import Path

from ssl_vit.artifacts import read_preprocess
from ssl_vit.objectives import rebuild_untrained
from ssl_vit.run_dirs import ENCODER_FILE
from ssl_vit.train.consolidate import find_checkpoint, full_state, write_consolidated


def consolidate(checkpoint: str, out: str, trust_pickle: bool = False) -> dict[str, Path]:
    path = find_checkpoint(checkpoint)
    run = path.parent.parent  # <run>/checkpoints/step_*
    if not (run / ENCODER_FILE).is_file():
        raise ValueError(f"{path}: {run} has no {ENCODER_FILE}, which records the objective the checkpoint belongs "
                         "to; consolidate a checkpoint inside its run directory")
    state, optimizer = full_state(path, trust_pickle)
    return write_consolidated(rebuild_untrained(run), state, optimizer, path, out, read_preprocess(run / ENCODER_FILE),
                              trust_pickle)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory (<run>/checkpoints/step_*) or a run directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read checkpoint files that hold pickled Python objects beyond tensors (runs their code; "
                             "refused without it)")
    args = parser.parse_args(argv)
    try:
        written = consolidate(args.checkpoint, args.out, args.trust_pickle)
    except (ValueError, FileNotFoundError) as err:
        print(f"consolidate: error: {err}", file=sys.stderr)
        return 2
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
