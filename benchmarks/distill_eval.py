"""Multi-teacher distillation against its teachers and against single objectives at the same total budget.

    python benchmarks/distill_eval.py --budget-minutes 5    # ~55 minutes on 2 cores in all
    python benchmarks/distill_eval.py --budget-minutes 1    # a quick look (the ranking is not settled there)

On the built-in synthetic shapes (32 px, 8,192 training images with captions and masks; vit_tiny everywhere):
- clip teacher: objective=clip_tiny for B minutes (B = --budget-minutes; steps from a measured rate);
- dinov2 teacher: objective=dinov2_tiny for B minutes;
- student: objective=distill_tiny from both teachers for B minutes: the whole pipeline costs 3B;
- clip / dinov2 from scratch for 3B minutes each: the single objectives at the student pipeline's total budget;
- the random encoder (the student's initialisation).
Metrics on held-out shapes (seed 1): weighted k-NN (k 20, 4,096 train / 1,024 test images; the encoder's class
token + patch average, or the student's DINO adaptor), zero-shot top-1 (8 shape names in the dataset's templates,
1,024 images, chance 12.5%), image->text retrieval R@1 (1,024 held-out image-caption pairs; identical captions
count), linear segmentation mIoU (DINOv2's protocol, 1,024 train / 512 test masks, 9 classes). The student is
measured through its adaptors (k-NN and segmentation through the DINO adaptor, zero-shot and retrieval through the
CLIP adaptor and the CLIP teacher's text tower) and through its backbone alone. Encoders without a text tower get
chance on the text metrics in the average. Also measured: the teachers' share of a distillation step (their
forwards against the student's forward + backward, batch 64, median of 5).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir

from ssl_vit.artifacts import load_encoder, read_preprocess
from ssl_vit.cli import register_configs
from ssl_vit.config import EvalConfig
from ssl_vit.data import SyntheticShapes
from ssl_vit.eval.run import adaptor_features, run_evaluators
from ssl_vit.objectives import load_trained
from ssl_vit.objectives.distill import Distill
from ssl_vit.preprocess import Preprocess
from ssl_vit.train import build_components, pretrain

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
COMMON = ["model=vit_tiny", "data=synthetic", "data.img_size=32", "data.num_samples=8192", "data.batch_size=64",
          "trainer.log_every=50", "trainer.checkpoint_every=1000000", "trainer.trackers=[]"]
CLIP = ["objective=clip_tiny", "optim.lr=2e-3"]
DINOV2 = ["objective=dinov2_tiny"]
CHANCE = {"zeroshot": 1 / 8}
METRICS = ("knn", "zeroshot", "retrieval_R@1", "segmentation_miou")


def _config(out_dir, *overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[*COMMON, "trainer.progress=true", f"output_dir={out_dir}", *overrides])


def _pretrain(cfg) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    return pretrain(cfg)


def train_for(name: str, overrides: list[str], minutes: float, out_root: Path) -> dict:
    """Measure the rate over 12 steps, then train for `minutes` (batch 64)."""
    probe = _pretrain(_config(out_root / f"{name}-rate", *overrides, "trainer.max_steps=12"))
    steps = max(20, int(minutes * 60 * probe["images_per_s"] / 64))
    start = time.perf_counter()
    summary = _pretrain(_config(out_root / name, *overrides, f"trainer.max_steps={steps}",
                                f"optim.warmup_steps={max(10, steps // 20)}"))
    return {"steps": summary["step"], "images_per_s": summary["images_per_s"], "minutes": minutes,
            "wall_s": time.perf_counter() - start, "final_loss": summary["last"].get("loss")}


def _datasets():
    train, test = SyntheticShapes(4096, 32, seed=0), SyntheticShapes(1024, 32, seed=1)
    return train, test, SyntheticShapes(1024, 32, seed=2), SyntheticShapes(512, 32, seed=3)


def evaluate(encoder, preprocess: Preprocess, model=None, embed=None, dense=None, text: bool = False) -> dict:
    """knn, zero-shot and retrieval (when `text`: `model` embeds text), segmentation mIoU; `embed` / `dense`:
    an adaptor's summary / patch features instead of the encoder's."""
    train, test, seg_train, seg_test = _datasets()
    row, seconds = {}, 0.0
    knn, timings, _ = run_evaluators(encoder, train, test, EvalConfig(evaluators=["knn"]), preprocess, model=model,
                                     embed=embed, progress=False)
    row["knn"], seconds = knn["knn"]["accuracy"], seconds + sum(timings.values())
    segmentation, timings, _ = run_evaluators(encoder, seg_train, seg_test, EvalConfig(evaluators=["segmentation"]),
                                              preprocess, dense=dense, progress=False)
    row["segmentation_miou"], seconds = segmentation["segmentation"]["miou"], seconds + sum(timings.values())
    if text:
        results, timings, _ = run_evaluators(encoder, None, test, EvalConfig(evaluators=["zeroshot", "retrieval"],
                                                                             retrieval_ks=[1, 5]),
                                             preprocess, model=model, data_name="synthetic", progress=False)
        row["zeroshot"] = results["zeroshot"]["accuracy"]
        row["retrieval_R@1"] = results["retrieval"]["accuracy"]["image_to_text_R@1"]
        seconds += sum(timings.values())
    row["eval_s"] = seconds
    return row


def average(row: dict) -> float:
    """The mean of the four metrics, chance where the encoder has no text side (retrieval: 1 / 1,024 pairs)."""
    chance = {**CHANCE, "retrieval_R@1": 1 / 1024}
    return statistics.mean(row.get(metric, chance.get(metric)) for metric in METRICS)


def teacher_cost(student_run: Path, repeats: int = 5) -> dict:
    """Milliseconds per step (batch 64) of the teachers' forwards and of the student's forward + backward."""
    student = load_trained(student_run)
    cfg = student.cfg.copy()
    cfg.load_teachers = True
    live = Distill(load_encoder(student_run / "encoder.safetensors"), cfg, student.data).train()
    generator = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(64, 3, 32, 32, generator=generator),
             "teacher_images": [torch.randn(64, 3, t.preprocess.img_size, t.preprocess.img_size, generator=generator)
                                for t in live.teachers]}

    def timed(fn):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    teachers = timed(lambda: live.teacher_features(batch["teacher_images"]))
    whole = timed(lambda: live(batch)["loss"].backward())
    return {"teachers_ms": teachers, "step_ms": whole, "student_ms": whole - teachers,
            "teacher_share": teachers / whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=5.0)
    parser.add_argument("--work-dir", default="outputs/bench_distill")
    parser.add_argument("--out", default="benchmarks/results/distill_eval.json")
    args = parser.parse_args()
    register_configs()
    work, budget = Path(args.work_dir), args.budget_minutes
    started = time.perf_counter()
    training, rows = {}, {}
    torch.manual_seed(0)
    random_model, _, _, preprocess = build_components(_config(work / "random", *DINOV2))
    rows["random encoder"] = evaluate(random_model.encoder, preprocess)

    training["clip teacher"] = train_for("clip_teacher", CLIP, budget, work)
    training["dinov2 teacher"] = train_for("dinov2_teacher", DINOV2, budget, work)
    teachers = (f"objective.teachers=[{{source: '{work / 'clip_teacher'}', name: clip}}, "
                f"{{source: '{work / 'dinov2_teacher'}', name: dino}}]")
    training["student"] = train_for("student", ["objective=distill_tiny", teachers, "data.augment=crop_flip"],
                                    budget, work)
    training["clip from scratch"] = train_for("clip_scratch", CLIP, 3 * budget, work)
    training["dinov2 from scratch"] = train_for("dinov2_scratch", DINOV2, 3 * budget, work)

    for name, run, text in (("clip teacher", "clip_teacher", True), ("dinov2 teacher", "dinov2_teacher", False),
                            ("clip from scratch", "clip_scratch", True),
                            ("dinov2 from scratch", "dinov2_scratch", False)):
        model = load_trained(work / run) if text else None
        encoder = model.encoder if text else load_encoder(work / run / "encoder.safetensors")
        rows[name] = evaluate(encoder, read_preprocess(work / run / "encoder.safetensors"), model, text=text)
    student = load_trained(work / "student", image_text=True)
    student_preprocess = read_preprocess(work / "student" / "encoder.safetensors")

    rows["student (adaptors)"] = evaluate(student.encoder, student_preprocess, student,
                                          *adaptor_features(student, "dino"), text=True)
    rows["student (backbone)"] = evaluate(student.encoder, student_preprocess)
    for row in rows.values():
        row["average"] = average(row)
    cost = teacher_cost(work / "student")
    student_row = rows["student (adaptors)"]
    goals = {"student / clip teacher zero-shot": student_row["zeroshot"] / rows["clip teacher"]["zeroshot"],
             "student / clip teacher retrieval": student_row["retrieval_R@1"] / rows["clip teacher"]["retrieval_R@1"],
             "student / dinov2 teacher k-NN": student_row["knn"] / rows["dinov2 teacher"]["knn"],
             "student average - best single objective": student_row["average"] - max(
                 rows["clip from scratch"]["average"], rows["dinov2 from scratch"]["average"])}
    report = {"benchmark": "distill_eval", "budget_minutes": budget, "common": COMMON,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "training": training, "results": rows, "teacher_cost": cost, "goals": goals,
              "total_minutes": (time.perf_counter() - started) / 60}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    print(f"Multi-teacher distillation, vit_tiny at 32 px on synthetic shapes, B = {budget:g} min of training "
          f"(2 CPU cores, fp32; {report['total_minutes']:.0f} min in all)")
    print(f"{'encoder':<22}{'minutes':>8}{'steps':>7}{'k-NN':>8}{'zero-shot':>11}{'R@1 i2t':>9}{'mIoU':>8}"
          f"{'average':>9}")
    for name, row in rows.items():
        info = training.get(name.split(" (")[0], {})
        minutes = f"{info['minutes']:g}" if info else "-"
        steps = f"{info['steps']}" if info else "-"
        cells = [f"{100 * row[m]:>7.1f}%" if m in row else f"{'-':>8}" for m in METRICS]
        cells[1] = f"{cells[1]:>11}"
        print(f"{name:<22}{minutes:>8}{steps:>7}{cells[0]:>8}{cells[1]}{cells[2]:>9}{cells[3]:>8}"
              f"{100 * row['average']:>8.1f}%")
    print(f"teachers: {cost['teachers_ms']:.0f} ms of a {cost['step_ms']:.0f} ms step at batch 64 "
          f"({100 * cost['teacher_share']:.0f}%; the student's forward + backward {cost['student_ms']:.0f} ms)")
    for goal, value in goals.items():
        print(f"{goal}: {value:.3f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
