"""DINO in ssl-vit against DINO built from lightly's parts, at equal work in one run: images/s end to end (the data
loader included) and the k-NN accuracy each teacher reaches.

    pip install -e '.[bench]'                          # lightly (never a dependency of the product)
    python benchmarks/peer_ssl.py                      # vit_tiny, Fashion-MNIST at 32 px, 150 steps of 64 images
    python benchmarks/peer_ssl.py --steps 400 --photometric workers

Both sides: the same backbone geometry and initial weights (ours, loaded into timm's VisionTransformer for lightly),
2 x 32 px global + 6 x 12 px local crops with DINO's augmentation, a 3-layer head of 1,024 prototypes (hidden 512,
bottleneck 128, weight-normalised last layer), student temperature 0.1, teacher 0.04, centre momentum 0.9, teacher
momentum 0.99 -> 1 on a cosine, AdamW with the same per-step lr and weight-decay schedules (no decay on biases and
norms), global gradient clipping at 3.0, the same batch and steps, one loader worker each. Ours is the real
`pretrain` (objective=dino_tiny optim=dino); lightly's is its documented loop (DINOTransform, DINOProjectionHead,
DINOLoss, update_momentum, cosine_schedule; one forward per view). k-NN (k=20, T=0.07) on the teachers' class
tokens, Fashion-MNIST train -> test subsets, next to the untrained initial encoder.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import timm
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from hydra import compose, initialize_config_dir
from PIL import Image

from ssl_vit.artifacts import load_encoder
from ssl_vit.cli import register_configs
from ssl_vit.data import FashionMNIST
from ssl_vit.data.subset import limit_samples
from ssl_vit.eval.knn import knn_eval
from ssl_vit.interop.timm import timm_model_args
from ssl_vit.preprocess import Preprocess, dataset_stats
from ssl_vit.train import build_components, pretrain
from ssl_vit.train.build import build_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def compose_config(out_dir: Path, args, photometric: str = "workers"):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[
            "objective=dino_tiny", "optim=dino", "model=vit_tiny", "data=fashion_mnist", "data.img_size=32",
            f"data.batch_size={args.batch}", "data.num_workers=1", f"trainer.max_steps={args.steps}",
            f"trainer.log_every={max(1, args.steps // 5)}", f"trainer.checkpoint_every={args.steps}",
            "trainer.tensorboard=false", f"data.multicrop_photometric={photometric}", f"output_dir={out_dir}"])


class LightlyViews(torch.utils.data.Dataset):
    """Fashion-MNIST as PIL images through lightly's DINOTransform (a list of 8 normalised crops)."""

    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image = Image.fromarray(self.dataset[index]["image"].permute(1, 2, 0).numpy())
        return self.transform(image)


def lightly_dino(cfg, initial_backbone: dict, run, mean, std) -> tuple[torch.nn.Module, float]:
    """DINO from lightly's parts (its documented training loop); returns (teacher backbone, wall seconds)."""
    # lightly: the optional `bench` extra, imported only where it is used
    from lightly.loss import DINOLoss
    from lightly.models.modules import DINOProjectionHead
    from lightly.models.utils import update_momentum
    from lightly.transforms import DINOTransform
    from lightly.utils.scheduler import cosine_schedule

    objective = cfg.objective

    def network():
        backbone = timm.models.vision_transformer.VisionTransformer(
            **timm_model_args(dict(initial_backbone["config"])), dynamic_img_size=True)
        backbone.load_state_dict(initial_backbone["state"])
        return torch.nn.Sequential(backbone, DINOProjectionHead(backbone.embed_dim, objective.hidden_dim,
                                                                objective.bottleneck_dim, objective.out_dim))

    student, teacher = network(), network()  # (the weight-normalised head cannot be deep-copied in this torch)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    criterion = DINOLoss(objective.out_dim, objective.warmup_teacher_temp, objective.teacher_temp,
                         warmup_teacher_temp_epochs=1, student_temp=objective.student_temp,
                         center_momentum=objective.centre_momentum)
    decay = [p for n, p in student.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n]
    no_decay = [p for n, p in student.named_parameters() if not (p.ndim > 1 and "pos_embed" not in n
                                                                  and "cls_token" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    transform = DINOTransform(global_crop_size=32, local_crop_size=12, n_local_views=objective.local_crops,
                              normalize={"mean": list(mean), "std": list(std)})
    loader = torch.utils.data.DataLoader(LightlyViews(FashionMNIST(), transform), batch_size=cfg.data.batch_size,
                                         shuffle=True, num_workers=1, drop_last=True, persistent_workers=True)
    steps, clip = cfg.trainer.max_steps, cfg.optim.grad_clip
    start, step = time.perf_counter(), 0
    while step < steps:
        for views in loader:
            if step == steps:
                break
            optimizer.param_groups[0]["lr"] = optimizer.param_groups[1]["lr"] = float(run.learning_rates[step])
            optimizer.param_groups[0]["weight_decay"] = float(run.weight_decays[step])
            momentum = cosine_schedule(step, steps, objective.teacher_momentum, objective.teacher_momentum_end)
            update_momentum(student, teacher, m=momentum)
            teacher_out = [teacher(view) for view in views[:objective.global_crops]]
            student_out = [student(view) for view in views]
            loss = criterion(teacher_out, student_out, epoch=step)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
    return teacher[0], time.perf_counter() - start


def knn_accuracy(embed, preprocess: Preprocess, train, test) -> float:
    """Weighted k-NN (k=20, T=0.07) on `embed(images)` features, `train` -> `test`."""
    views = preprocess.view_builder(("image", "label"))

    def features(dataset):
        xs, ys = [], []
        with torch.no_grad():
            for start in range(0, len(dataset), 256):
                samples = [views(dataset[i]) for i in range(start, min(start + 256, len(dataset)))]
                xs.append(embed(torch.stack([s["image"] for s in samples])))
                ys.append(torch.tensor([s["label"] for s in samples]))
        return torch.cat(xs), torch.cat(ys)

    return knn_eval(*features(train), *features(test))["accuracy"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--photometric", default="workers,device",
                        help="ours, one run each: data.multicrop_photometric (workers, device)")
    parser.add_argument("--knn-train", type=int, default=10000)
    parser.add_argument("--knn-test", type=int, default=2000)
    parser.add_argument("--work-dir", default="/tmp/peer_ssl")
    parser.add_argument("--out", default="benchmarks/results/peer_ssl_cpu.json")
    args = parser.parse_args(argv)
    register_configs()
    work = Path(args.work_dir)
    placements = args.photometric.split(",")
    cfg = compose_config(work / "ours", args)
    mean, std = dataset_stats("fashion_mnist")
    preprocess = Preprocess(32, mean, std)
    train = limit_samples(FashionMNIST(split="train"), args.knn_train, 0)
    test = limit_samples(FashionMNIST(split="test"), args.knn_test, 0)

    set_seed(cfg.seed)  # the initial weights pretrain starts from
    objective, dataset, views, built = build_components(cfg)
    initial = {"config": objective.backbone.config, "state": copy.deepcopy(objective.backbone.state_dict())}
    run = build_run(cfg, objective, dataset, views, built, world=1)
    results = {"untrained init": {"knn": knn_accuracy(lambda x: objective.backbone.forward_features(x)[:, 0],
                                                      preprocess, train, test)}}

    for placement in placements:
        AcceleratorState._reset_state(reset_partial_state=True)
        summary = pretrain(compose_config(work / f"ours_{placement}", args, placement))
        encoder = load_encoder(work / f"ours_{placement}" / "encoder.safetensors").eval()
        results[f"ssl-vit ({placement})"] = {
            "wall_s": summary["wall_s"], "images_per_s": summary["images_per_s"],
            "knn": knn_accuracy(lambda x, e=encoder: e.forward_features(x)[:, 0], preprocess, train, test)}

    torch.manual_seed(cfg.seed)
    teacher, wall = lightly_dino(cfg, initial, run, mean, std)
    teacher.eval()
    results["lightly"] = {"wall_s": wall, "images_per_s": args.steps * args.batch / wall,
                          "knn": knn_accuracy(lambda x: teacher.forward_features(x)[:, 0], preprocess, train, test)}
    from lightly import __version__ as lightly_version  # the optional `bench` extra

    record = {"benchmark": "peer_ssl", "method": "dino", "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "steps": args.steps, "batch": args.batch,
              "lightly": lightly_version, "results": results,
              "speed_vs_lightly": {p: results[f"ssl-vit ({p})"]["images_per_s"] / results["lightly"]["images_per_s"]
                                   for p in placements}}
    print(f"\nDINO, vit_tiny on Fashion-MNIST 32 px, {args.steps} steps x {args.batch} images, 1 loader worker each "
          "(ours: the photometric augmentation in the loader's workers, or batched on the device)")
    print(f"{'':<20}{'img/s':>8}{'wall s':>9}{'k-NN':>8}")
    for name, row in results.items():
        speed = f"{row['images_per_s']:>8.1f}{row['wall_s']:>9.0f}" if "wall_s" in row else f"{'-':>8}{'-':>9}"
        print(f"{name:<20}{speed}{row['knn']:>8.1%}")
    for placement, ratio in record["speed_vs_lightly"].items():
        print(f"ssl-vit ({placement}) / lightly images/s: {ratio:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
