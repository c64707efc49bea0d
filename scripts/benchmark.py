"""Benchmark encoders: a list of encoders x the data sets of a suite x protocols (linear, k-NN, few-shot, VTAB-1k,
segmentation, zero-shot, retrieval), one table and PNGs.

    ssl-vit benchmark encoders=[outputs/<run>,timm:resnet18,timm:swin_tiny_patch4_window7_224] img_size=64
    ssl-vit benchmark encoders=[outputs/<run>] datasets=[digits,synthetic] protocols=[linear,fewshot]
    ssl-vit benchmark encoders=[outputs/<run>] benchmark=folders benchmark.datasets.classes.root=/data/train \\
        benchmark.datasets.classes.test_root=/data/val benchmark.datasets.masks.root=/data/seg

Writes benchmark.md (printed), benchmark.csv, benchmark.json, heatmap.png and fewshot.png to `out` (default
outputs/benchmark/<suite>); each cell is stored as it is computed, so the same command again (after a kill, or with
one more encoder) computes only the cells that are missing.
"""

import hydra

from ssl_vit.cli import register_configs, run_hydra, run_reporting_errors
from ssl_vit.eval.benchmark import run_benchmark
from ssl_vit.eval.benchmark_report import markdown_table, write_report
from ssl_vit.paths import CONFIG_DIR

register_configs()


@hydra.main(config_path=str(CONFIG_DIR), config_name="benchmark", version_base="1.3")
def main(cfg) -> None:
    report = run_reporting_errors(run_benchmark, cfg)
    paths = run_reporting_errors(write_report, report, cfg.out, cfg.plots)
    print(markdown_table(report))
    print(f"{report['computed']} cells computed, {report['read_back']} read back; -> "
          + ", ".join(str(path) for path in paths.values()))


if __name__ == "__main__":
    run_hydra(main, "benchmark", __doc__)
