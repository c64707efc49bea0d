"""Pre-train a ViT with one objective.

    python scripts/pretrain.py                                 # supervised, vit_tiny, synthetic shapes
    python scripts/pretrain.py objective=supervised model=vit_s16 data=folder data.root=/data/train
    accelerate launch --config_file configs/accelerate/zero3_cpu2.yaml scripts/pretrain.py objective=mae  # "Scaling up"

Hydra overrides select and change everything in configs/; see configs/pretrain.yaml. A bad value ends in one line,
`ssl-vit: error: ...`, with exit status 2; a run that stops (divergence, unusable data, a full disk) with 1.
Ctrl-C stops after the current step with a checkpoint and the encoder, prints the command that resumes, and exits
130; a preemption signal (trainer.preempt_signals: SIGTERM, SIGUSR1) does the same and exits 75, for a job script to
requeue on. A second Ctrl-C (the same signal again) stops at once.
"""

import hydra

from ssl_vit.cli import exit_without_teardown, register_configs, run_hydra, run_reporting_errors, stopped_status
from ssl_vit.paths import CONFIG_DIR
from ssl_vit.train import pretrain

register_configs()


@hydra.main(config_path=str(CONFIG_DIR), config_name="pretrain", version_base="1.3")
def main(cfg) -> None:
    status = stopped_status(run_reporting_errors(pretrain, cfg))
    if status:  # Ctrl-C / a preemption signal: saved, then 130 / 75
        exit_without_teardown(status)


if __name__ == "__main__":
    run_hydra(main, "pretrain", __doc__)
    exit_without_teardown()  # a finished distributed run: see ssl_vit.cli
