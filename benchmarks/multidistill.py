"""One teacher, many students (objective=distill with objective.students) against one distill run per student.

    python benchmarks/multidistill.py                      # ~15 minutes on 2 cores
    python benchmarks/multidistill.py --teacher-steps 20 --steps 10 --knn-train 256 --knn-test 128   # a smoke run
    python benchmarks/multidistill.py --reuse-teacher      # the students again, from the teacher trained before

On the built-in synthetic shapes at 32 px (batch 64): a teacher (a supervised ViT, 192 wide, 6 blocks, 4 px patches)
is trained first; then three students of it (vit_tiny; vit_tiny 32 wide; vit_tiny with 8 px patches) train for the
same steps twice: once together (one run, `objective.students`), once as three separate distill runs. Measured:
the teacher's forwards per optimizer step (counted by a forward hook on the teachers during the real runs), the
wall time and the student-images per second (images each student trains on / wall time of all of them), and each
student's k-NN (weighted, k 20, held-out shapes; its backbone's features) after equal steps, with the teacher's and
a random encoder's for scale.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir

from ssl_vit.artifacts import load_encoder, read_preprocess
from ssl_vit.cli import register_configs
from ssl_vit.config import EvalConfig
from ssl_vit.data import SyntheticShapes
from ssl_vit.eval.run import run_evaluators
from ssl_vit.objectives.feature_teacher import FeatureTeacher
from ssl_vit.train import build_components, pretrain

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
COMMON = ["data=synthetic", "data.img_size=32", "data.num_samples=8192", "data.batch_size=64",
          "trainer.log_every=50", "trainer.checkpoint_every=1000000", "trainer.trackers=[]", "trainer.progress=false"]
TEACHER = ["objective=supervised", "model=vit_tiny", "model.embed_dim=192", "model.depth=6", "model.num_heads=3"]
# name -> (preset, its model options): the first is the run's model= student
STUDENTS = {"tiny": ("vit_tiny", {}), "narrow": ("vit_tiny", {"embed_dim": 32, "num_heads": 2}),
            "coarse": ("vit_tiny", {"patch_size": 8})}


def _config(out_dir: Path, *overrides: str):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[*COMMON, f"output_dir={out_dir}", *overrides])


def _options(name: str) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in STUDENTS[name][1].items()) + "}"


def counted_run(cfg) -> tuple[dict, int]:
    """pretrain(cfg) in this process: (its summary, how many batches the teachers ran on)."""
    forwards = [0]

    def count(module, args, output):
        if isinstance(module, FeatureTeacher):
            forwards[0] += 1

    AcceleratorState._reset_state(reset_partial_state=True)
    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        summary = pretrain(cfg)
    finally:
        hook.remove()
    return summary, forwards[0]


def knn(encoder, preprocess, train_samples: int, test_samples: int) -> float:
    """Weighted k-NN (k 20) of `encoder` on held-out synthetic shapes."""
    train, test = SyntheticShapes(train_samples, 32, seed=0), SyntheticShapes(test_samples, 32, seed=1)
    results, _, _ = run_evaluators(encoder, train, test, EvalConfig(evaluators=["knn"]), preprocess, progress=False)
    return results["knn"]["accuracy"]


def file_knn(encoder_file: Path, train_samples: int, test_samples: int) -> float:
    return knn(load_encoder(encoder_file), read_preprocess(encoder_file), train_samples, test_samples)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of every student")
    parser.add_argument("--knn-train", type=int, default=4096)
    parser.add_argument("--knn-test", type=int, default=1024)
    parser.add_argument("--work-dir", default="outputs/bench_multidistill")
    parser.add_argument("--out", default="benchmarks/results/multidistill.json")
    parser.add_argument("--reuse-teacher", action="store_true",
                        help="take the teacher a previous run left in --work-dir instead of training it again")
    args = parser.parse_args(argv)
    register_configs()
    work, started = Path(args.work_dir), time.perf_counter()
    if args.reuse_teacher and (work / "teacher" / "summary.json").is_file():
        pretrain_teacher = json.loads((work / "teacher" / "summary.json").read_text())
    else:
        pretrain_teacher, _ = counted_run(_config(work / "teacher", *TEACHER,
                                                  f"trainer.max_steps={args.teacher_steps}"))
    teacher = f"objective.teachers=[{{source: '{work / 'teacher'}', name: teacher}}]"
    names = list(STUDENTS)
    first, *others = names
    distill = ["objective=distill_tiny", teacher, f"trainer.max_steps={args.steps}", "data.augment=crop_flip"]
    students = "objective.students=[" + ", ".join(
        f"{{name: {name}, model: {STUDENTS[name][0]}, options: {_options(name)}}}" for name in others) + "]"
    together, together_forwards = counted_run(_config(work / "together", *distill, f"model={STUDENTS[first][0]}",
                                                      students))
    separate = {}
    for name in names:
        preset, options = STUDENTS[name]
        separate[name] = counted_run(_config(work / f"alone_{name}", *distill, f"model={preset}",
                                             *(f"model.{k}={v}" for k, v in options.items())))
    files = {name: work / "together" / ("" if name == first else f"students/{name}") / "encoder.safetensors"
             for name in names}
    rows = {name: {"together_knn": file_knn(files[name], args.knn_train, args.knn_test),
                   "alone_knn": file_knn(work / f"alone_{name}" / "encoder.safetensors", args.knn_train,
                                         args.knn_test),
                   "alone_wall_s": separate[name][0]["wall_s"]} for name in names}
    torch.manual_seed(0)
    random_model, _, _, random_preprocess = build_components(_config(work / "random", *distill, "model=vit_tiny"))
    scale = {"teacher_knn": file_knn(work / "teacher" / "encoder.safetensors", args.knn_train, args.knn_test),
             "random_knn": knn(random_model.encoder, random_preprocess, args.knn_train, args.knn_test)}
    steps, batch = args.steps, 64
    alone_wall = sum(summary["wall_s"] for summary, _ in separate.values())
    report = {
        "benchmark": "multidistill", "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "common": COMMON, "teacher": TEACHER, "presets": STUDENTS,
        "steps": steps, "teacher_steps": args.teacher_steps, "teacher_final_loss": pretrain_teacher["last"].get("loss"),
        "teacher_forwards_per_step": {"together": together_forwards / steps,
                                      "separate": sum(f for _, f in separate.values()) / steps},
        "wall_s": {"together": together["wall_s"], "separate": alone_wall},
        "student_images_per_s": {"together": len(names) * steps * batch / together["wall_s"],
                                 "separate": len(names) * steps * batch / alone_wall},
        "students": rows, "scale": scale, "total_minutes": (time.perf_counter() - started) / 60,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"One teacher, {len(names)} students, {steps} steps at batch {batch}, 32 px synthetic shapes "
          f"({report['threads']} threads, fp32, {report['total_minutes']:.0f} min in all)")
    print(f"{'':<26}{'together':>10}{'separate':>10}")
    print(f"{'teacher forwards / step':<26}{report['teacher_forwards_per_step']['together']:>10.2f}"
          f"{report['teacher_forwards_per_step']['separate']:>10.2f}")
    print(f"{'wall s':<26}{together['wall_s']:>10.1f}{alone_wall:>10.1f}")
    print(f"{'student-images / s':<26}{report['student_images_per_s']['together']:>10.1f}"
          f"{report['student_images_per_s']['separate']:>10.1f}")
    for name, row in rows.items():
        print(f"{'k-NN ' + name:<26}{100 * row['together_knn']:>9.1f}%{100 * row['alone_knn']:>9.1f}%")
    print(f"k-NN of the teacher {100 * scale['teacher_knn']:.1f}%, of a random vit_tiny "
          f"{100 * scale['random_knn']:.1f}%; JSON: {out}")
    return report


if __name__ == "__main__":
    main()
