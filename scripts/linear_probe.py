"""Benchmark a frozen encoder: linear probe, k-NN and few-shot accuracy on a labelled dataset.

    python scripts/linear_probe.py checkpoint=outputs/run/encoder.safetensors data=fashion_mnist eval=all
    python scripts/linear_probe.py checkpoint=outputs/run data=digits eval=knn eval.knn_k=10
    python scripts/linear_probe.py checkpoint=timm:vit_small_patch16_224 data=digits   # random-init baseline

The encoder's recorded preprocessing (image size, mean, std, resize rule) is the default; data.img_size,
data.mean and data.std override it. Writes results.json to the run directory and prints one table. Features are
cached under cache_dir.
"""

import hydra

from ssl_vit.cli import run_reporting_errors
from ssl_vit.config import register_configs
from ssl_vit.eval.run import evaluate, print_table, write_report

register_configs()


@hydra.main(config_path="../configs", config_name="linear_probe", version_base="1.3")
def main(cfg) -> None:
    report = run_reporting_errors(evaluate, cfg)
    print_table(report)
    print(f"-> {write_report(report, cfg.output_dir)}")


if __name__ == "__main__":
    main()
