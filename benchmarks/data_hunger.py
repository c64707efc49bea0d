"""The paper's central finding in one command: ViTs trail CNNs when data is small and catch up as it grows (ViT
paper, figures 3 and 4), and what DeiT's recipe and distillation change about that.

    bash scripts/get_data.sh                # Fashion-MNIST from Debian
    python benchmarks/data_hunger.py        # 1k / 5k / 60k training images, 300 steps each: ~1 hour on 2 cores

For each training-set size (a stratified subset of Fashion-MNIST's 60k, at 32 px) and the same step budget (steps x
batch images seen, whatever the size), from scratch:
  cnn         timm's resnet10t (4.9M parameters), cross-entropy, random resized crop + flip, AdamW (our loop below)
  vit         ViT-Ti/4 (D=192, 12 blocks, 4x4 patches: 64 tokens; 5.4M), objective=supervised, head=linear, the same
              augmentation and optimiser settings as the CNN
  vit_augreg  the same ViT with optim=augreg data.augment=augreg (RandAugment, random erasing, Mixup / CutMix, label
              smoothing, repeated augmentation, stochastic depth 0.1, no clipping), at the plain runs' peak lr
  deit        vit_augreg + objective=deit: a distillation token learning from that size's trained CNN (hard)
Test accuracy on the 10k test images (ViTs: their heads; DeiT: both heads averaged). Writes a JSON with every
number and the wall / CPU seconds of every run, a PNG (accuracy vs training-set size per model), and prints a table.
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

from ssl_vit.cli import register_configs
from ssl_vit.data import build_dataset, build_loader
from ssl_vit.data.subset import limit_samples
from ssl_vit.objectives.teacher import load_teacher
from ssl_vit.optim import schedule
from ssl_vit.preprocess import resolve_preprocess
from ssl_vit.train import pretrain

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODELS = ("cnn", "vit", "vit_augreg", "deit")
CNN = "resnet10t"
# The plain settings shared by the CNN and the plain ViT (AdamW, cosine, crop + flip).
PLAIN = dict(lr=1e-3, weight_decay=0.05, warmup_fraction=0.05, min_lr=1e-5)
VIT_RUNS = {
    "vit": ["objective=supervised", "objective.head=linear", "data.augment=crop_flip", f"optim.lr={PLAIN['lr']}",
            f"optim.weight_decay={PLAIN['weight_decay']}", f"optim.warmup_fraction={PLAIN['warmup_fraction']}"],
    "vit_augreg": ["objective=supervised", "objective.head=linear", "optim=augreg", "data.augment=augreg"],
    "deit": ["objective=deit", "optim=augreg", "data.augment=augreg"],
}
# The recipe runs keep the plain runs' peak lr and warmup: DeiT's 5e-4 per 512 images is 6e-5 at batch 64, set for
# 300 epochs, not a few hundred steps; what differs is the augmentation and regularisation.
SAME_LR = [f"optim.lr={PLAIN['lr']}", "optim.lr_scaling=none", f"optim.warmup_fraction={PLAIN['warmup_fraction']}"]
for _name in ("vit_augreg", "deit"):
    VIT_RUNS[_name] += SAME_LR


def _compose(args, out_dir: Path, size: int, *overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[
            *args.model, f"data={args.data}", f"data.img_size={args.img_size}", f"data.batch_size={args.batch_size}",
            f"data.max_train_samples={size}", f"trainer.max_steps={args.steps}", "trainer.log_every=50",
            "trainer.checkpoint_every=1000000", "trainer.progress=true", f"output_dir={out_dir}", *overrides])


def _timed(run) -> tuple[object, dict]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def train_cnn(args, size: int, out_dir: Path) -> Path:
    """timm's CNN on the same data pipeline, batches and schedule shape as the plain ViT; saved for DeiT."""
    import timm
    from safetensors.torch import save_file

    cfg = _compose(args, out_dir, size, "objective=supervised")
    train = limit_samples(build_dataset(cfg.data, args.img_size), size, cfg.seed)
    preprocess = resolve_preprocess(cfg.data, args.img_size)
    views = preprocess.view_builder(("image", "label"), "crop_flip", cfg.data.crop_scale)
    torch.manual_seed(0)
    model = timm.create_model(CNN, pretrained=False, num_classes=len(train.classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=PLAIN["lr"], weight_decay=PLAIN["weight_decay"])
    lrs = schedule(PLAIN["lr"], PLAIN["min_lr"], args.steps, round(PLAIN["warmup_fraction"] * args.steps))
    batches = iter(build_loader(train, views, args.batch_size, seed=0))
    model.train()
    for step in range(args.steps):
        batch = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = float(lrs[step])
        loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  {CNN} on {size}: step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{CNN}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_set(args, cfg):
    """The test split (a stratified subset of --test-samples) and its eval transform (resize + centre crop, the data's
    normalisation)."""
    test_cfg = cfg.data.copy()
    test_cfg.split = "test"
    test = limit_samples(build_dataset(test_cfg, args.img_size), args.test_samples, 0)
    return test, resolve_preprocess(cfg.data, args.img_size).view_builder(("image", "label"))


@torch.no_grad()
def test_accuracy(classifier, test, views) -> float:
    """Top-1 on the test set."""
    classifier.eval()
    correct = 0
    for start in range(0, len(test), 500):
        batch = torch.utils.data.default_collate([views(test[i]) for i in range(start, min(start + 500, len(test)))])
        correct += int((classifier(batch["image"]).argmax(-1) == batch["label"]).sum())
    return correct / len(test)


def plot(results: dict, sizes: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    labels = {"cnn": f"CNN ({CNN})", "vit": "ViT-Ti/4", "vit_augreg": "ViT-Ti/4 + recipe",
              "deit": "ViT-Ti/4 + recipe + distillation (DeiT)"}
    for model in results:
        ax.plot(sizes, [100 * results[model][str(s)]["test_acc"] for s in sizes], marker="o", label=labels[model])
    ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
    ax.set_xlabel("training images")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,5000,60000", help="training-set sizes (stratified subsets)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run, the same for every size")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data", default="fashion_mnist", choices=("fashion_mnist", "digits"))
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--model", default="model=vit_ti16,model.patch_size=4",
                        help="the ViT's Hydra overrides, comma-separated (default: ViT-Ti/4)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--test-samples", type=int, default=10000)
    parser.add_argument("--work-dir", default="outputs/bench_data_hunger")
    parser.add_argument("--out", default="benchmarks/results/data_hunger.json")
    args = parser.parse_args(argv)
    args.model = args.model.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; valid choices: {list(MODELS)}")
    if "deit" in models and "cnn" not in models:
        parser.error("deit distils from the CNN trained on the same subset: include cnn in --models")
    register_configs()
    work = Path(args.work_dir)
    results = {m: {} for m in models}
    test, test_views = test_set(args, _compose(args, work, sizes[0], "objective=supervised"))
    num_classes = len(test.classes)
    start = time.perf_counter()
    for size in sizes:
        teacher = None
        if "cnn" in models:
            path, cost = _timed(lambda: train_cnn(args, size, work / f"cnn-{size}"))  # noqa: B023 (called at once)
            teacher = f"timm:{CNN}:{path}"
            acc = test_accuracy(load_teacher(teacher, num_classes), test, test_views)
            results["cnn"][str(size)] = {"test_acc": acc, **cost}
            print(f"cnn on {size}: test accuracy {100 * acc:.2f}%", flush=True)
        for model in (m for m in models if m != "cnn"):
            out = work / f"{model}-{size}"
            extra = [f"objective.teacher={teacher}"] if model == "deit" else []
            cfg = _compose(args, out, size, *VIT_RUNS[model], *extra)
            AcceleratorState._reset_state(reset_partial_state=True)
            summary, cost = _timed(lambda: pretrain(cfg))  # noqa: B023 (called at once)
            acc = test_accuracy(load_teacher(str(out), num_classes), test, test_views)
            results[model][str(size)] = {"test_acc": acc, "final_loss": summary["last"].get("loss"),
                                         "images_per_s": summary["images_per_s"], **cost}
            print(f"{model} on {size}: test accuracy {100 * acc:.2f}%", flush=True)
    total = time.perf_counter() - start

    title = (f"{args.data}, {args.img_size} px, {args.steps} steps x {args.batch_size} images per size "
             f"({torch.get_num_threads()} CPU threads, {total / 60:.0f} min)")
    out = Path(args.out)
    plot(results, sizes, out.with_suffix(".png"), title)
    report = {"benchmark": "data_hunger", "data": args.data, "img_size": args.img_size, "steps": args.steps,
              "batch_size": args.batch_size, "sizes": sizes, "vit": args.model, "cnn": CNN,
              "test_samples": args.test_samples, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "total_wall_s": total, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(title)
    print(f"{'model':<12}" + "".join(f"{s:>10,}" for s in sizes) + f"{'wall s':>10}{'cpu s':>10}")
    for model, row in results.items():
        wall, cpu = sum(r["wall_s"] for r in row.values()), sum(r["cpu_s"] for r in row.values())
        print(f"{model:<12}" + "".join(f"{100 * row[str(s)]['test_acc']:>9.2f}%" for s in sizes)
              + f"{wall:>10.0f}{cpu:>10.0f}")
    print(f"-> {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
