"""Evaluate an encoder: linear probe, k-NN, few-shot and fine-tuning on a labelled dataset; zero-shot
classification and image-text retrieval for an image-text model (objective=clip / siglip).

    python scripts/evaluate.py checkpoint=outputs/run/encoder.safetensors data=fashion_mnist eval=all
    python scripts/evaluate.py checkpoint=outputs/run data=digits eval=knn eval.knn_k=10
    python scripts/evaluate.py checkpoint=timm:vit_small_patch16_224 data=digits   # random-init baseline
    python scripts/evaluate.py checkpoint=outputs/clip-run data=synthetic eval=zeroshot
    python scripts/evaluate.py checkpoint=outputs/clip-run data=tuxpaint eval=retrieval

The encoder's recorded preprocessing (image size, mean, std, resize rule) is the default; data.img_size,
data.mean and data.std override it. Writes results.json to the run directory and prints one table. Features are
cached under cache_dir.
"""

import hydra

from ssl_vit.cli import register_configs, run_hydra, run_reporting_errors
from ssl_vit.eval.run import evaluate, print_table, write_report
from ssl_vit.paths import CONFIG_DIR

register_configs()


@hydra.main(config_path=str(CONFIG_DIR), config_name="evaluate", version_base="1.3")
def main(cfg) -> None:
    report = run_reporting_errors(evaluate, cfg)
    print_table(report)
    print(f"-> {write_report(report, cfg.output_dir)}")


if __name__ == "__main__":
    run_hydra(main, "evaluate", __doc__)
