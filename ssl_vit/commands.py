"""`ssl-vit <command> [args]`: every entry point of scripts/ under one installed command.

    ssl-vit pretrain objective=masked_patch model=vit_s16            # = python scripts/pretrain.py ...
    ssl-vit evaluate outputs/<run> data=digits eval=knn
    ssl-vit export outputs/<run> --to timm --out exported/timm
    accelerate launch -m ssl_vit pretrain objective=dinov2           # a distributed run (torchrun -m ssl_vit too)
    ssl-vit launch --config_file ddp_gpu8 pretrain objective=dinov2  # the same, exiting with the run's status

A command runs its script module (ssl_vit.scripts.<name>, the repository's scripts/<name>.py) as `__main__`, so its
arguments, Hydra overrides, one-line errors and exit statuses are the script's own. Nothing heavy is imported before
the command is known: `ssl-vit --help` answers at once (0.2 s here).
"""

from __future__ import annotations

import difflib
import runpy
import sys

from ssl_vit._version import __version__

COMMANDS = {  # command: (script module, what it does)
    "pretrain": ("pretrain", "pre-train a ViT with one objective (Hydra overrides: objective=, model=, data=, ...)"),
    "evaluate": ("evaluate", "k-NN, linear, few-shot, fine-tuning, segmentation, zero-shot of an encoder"),
    "benchmark": ("benchmark", "encoders x data sets x protocols: one table (Markdown, CSV, JSON) and PNGs"),
    "linear-probe": ("linear_probe", "the evaluate command under its old name"),
    "export": ("export", "an encoder for transformers, timm, ONNX or open_clip, with a model card"),
    "consolidate": ("consolidate", "whole files from a sharded checkpoint (ZeRO, FSDP2), on CPU"),
    "analyze": ("analyze", "a trained ViT inspected as in the paper: four PNGs"),
    "visualize-mae": ("visualize_mae", "a PNG of MAE reconstructions from a run"),
    "plan-memory": ("plan_memory", "the memory of a run per GPU, per strategy"),
    "make-shards": ("make_shards", "WebDataset shards (.tar) from an image source"),
    "launch": ("", "accelerate launch that exits with the run's own status (75 after a preemption signal)"),
}
LAUNCH = "launch"  # ssl_vit.launch: accelerate's launcher; its script may be a command (ssl-vit launch ... pretrain)
PROGRAM = "ssl-vit"


def usage() -> str:
    lines = [f"usage: {PROGRAM} <command> [args]   ({PROGRAM} <command> --help: its arguments)", "", "commands:"]
    lines += [f"  {name:<14} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", f"{PROGRAM} --version: the installed release ({__version__})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        print(f"{PROGRAM} {__version__}")
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        print(f"{PROGRAM}: error: unknown command {name!r}{hint} (valid: {', '.join(COMMANDS)})",
              file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"{PROGRAM} {name}", *rest]
    module = "ssl_vit.launch" if name == LAUNCH else f"ssl_vit.scripts.{COMMANDS[name][0]}"
    runpy.run_module(module, run_name="__main__")
