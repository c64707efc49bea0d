"""DINO and MAE in ssl-vit against the same methods built from lightly's parts, at equal work in one run: images/s
end to end (the data loader included) and the k-NN accuracy each encoder reaches.

    pip install -e '.[bench]'                          # lightly (never a dependency of the product)
    python benchmarks/peer_ssl.py                      # vit_tiny, Fashion-MNIST at 32 px, 150 steps of 64 images
    python benchmarks/peer_ssl.py --methods mae --steps 400 --seeds 0,1,2   # mean and spread over seeds

Both sides: the same backbone geometry and initial weights (ours, loaded into timm's VisionTransformer for lightly),
2 x 32 px global + 6 x 12 px local crops with DINO's augmentation, a 3-layer head of 1,024 prototypes (hidden 512,
bottleneck 128, weight-normalised last layer), student temperature 0.1, teacher 0.04, centre momentum 0.9, teacher
momentum 0.99 -> 1 on a cosine, AdamW with the same per-step lr and weight-decay schedules (no decay on biases and
norms), global gradient clipping at 3.0, the same batch and steps, one loader worker each. Ours is the real
`pretrain` (objective=dino_tiny optim=dino), once per `--photometric` placement (auto, the default, first);
lightly's is its documented loop (DINOTransform, DINOProjectionHead, DINOLoss, update_momentum, cosine_schedule)
with the views of each resolution concatenated into one forward, as DINO's MultiCropWrapper does (the strongest fair
peer: the documented loop forwards one view at a time). k-NN (k=20, T=0.07) on the teachers' class tokens,
Fashion-MNIST train -> test subsets, next to the untrained initial encoder.

MAE: mask ratio 0.75, a decoder of width 128, depth 2, 4 heads, per-patch normalised pixel targets, fixed sin-cos
position embeddings, no augmentation (as objective=mae trains), AdamW with ours's schedules; lightly's side is its
documented loop (MaskedVisionTransformerTIMM, MAEDecoderTIMM, random_token_mask).
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


METHODS = {"dino": ["objective=dino_tiny", "optim=dino"],
           "mae": ["objective=mae", "objective.decoder_dim=128", "objective.decoder_depth=2",
                   "objective.decoder_heads=4"]}


def compose_config(out_dir: Path, args, method: str, photometric: str = "workers", seed: int = 0):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("pretrain", overrides=[
            *METHODS[method], f"seed={seed}", "model=vit_tiny", "data=fashion_mnist", "data.img_size=32",
            f"data.batch_size={args.batch}", "data.num_workers=1", f"trainer.max_steps={args.steps}",
            f"trainer.log_every={max(1, args.steps // 5)}", f"trainer.checkpoint_every={args.steps}",
            "trainer.trackers=[]", "trainer.overwrite=true",
            f"data.multicrop_photometric={photometric}", f"output_dir={out_dir}"])


class LightlyViews(torch.utils.data.Dataset):
    """Fashion-MNIST as PIL images through a transform (lightly's DINOTransform: a list of 8 normalised crops)."""

    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        image = Image.fromarray(self.dataset[index]["image"].permute(1, 2, 0).numpy())
        return self.transform(image)


def train_loop(cfg, run, transform, model: torch.nn.Module, optimizer, loss_of) -> float:
    """The plain loop of lightly's examples: Fashion-MNIST through `transform` from one loader worker, our per-step
    lr / weight-decay schedules, `loss_of(step, batch)`, backward, global clipping, AdamW; the wall seconds."""
    loader = torch.utils.data.DataLoader(LightlyViews(FashionMNIST(), transform), batch_size=cfg.data.batch_size,
                                         shuffle=True, num_workers=1, drop_last=True, persistent_workers=True)
    steps, clip = cfg.trainer.max_steps, cfg.optim.grad_clip
    start, step = time.perf_counter(), 0
    while step < steps:
        for batch in loader:
            if step == steps:
                break
            set_schedule(optimizer, run, step)
            loss_of(step, batch).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
    return time.perf_counter() - start


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
    optimizer = adamw(cfg, student)
    transform = DINOTransform(global_crop_size=32, local_crop_size=12, n_local_views=objective.local_crops,
                              normalize={"mean": list(mean), "std": list(std)})
    steps = cfg.trainer.max_steps

    def batched(network, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """One forward per resolution (the views of each size concatenated), as DINO's MultiCropWrapper."""
        outputs, start = [], 0
        while start < len(views):
            end = start
            while end < len(views) and views[end].shape[-1] == views[start].shape[-1]:
                end += 1
            outputs += list(network(torch.cat(views[start:end])).chunk(end - start))
            start = end
        return outputs

    def loss_of(step: int, views: list[torch.Tensor]) -> torch.Tensor:
        momentum = cosine_schedule(step, steps, objective.teacher_momentum, objective.teacher_momentum_end)
        update_momentum(student, teacher, m=momentum)
        with torch.no_grad():
            teacher_out = batched(teacher, views[:objective.global_crops])
        return criterion(teacher_out, batched(student, views), epoch=step)

    wall = train_loop(cfg, run, transform, student, optimizer, loss_of)
    return teacher[0], wall


def adamw(cfg, network: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with ours's betas, no weight decay on biases, norms, position embeddings and class tokens."""
    decayed = {n for n, p in network.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n}
    groups = [[p for n, p in network.named_parameters() if p.requires_grad and (n in decayed) == wanted]
              for wanted in (True, False)]
    return torch.optim.AdamW([{"params": groups[0]}, {"params": groups[1], "weight_decay": 0.0}],
                             betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)


def set_schedule(optimizer, run, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = float(run.learning_rates[step])
    optimizer.param_groups[0]["weight_decay"] = float(run.weight_decays[step])


def lightly_mae(cfg, initial_backbone: dict, run, mean, std) -> tuple[torch.nn.Module, float]:
    """MAE from lightly's parts (its documented model and loop); returns (trained encoder, wall seconds)."""
    # lightly: the optional `bench` extra, imported only where it is used
    from lightly.models import utils
    from lightly.models.modules import MAEDecoderTIMM, MaskedVisionTransformerTIMM
    from torchvision import transforms as T

    objective = cfg.objective
    vit = timm.models.vision_transformer.VisionTransformer(**timm_model_args(dict(initial_backbone["config"])))
    vit.load_state_dict(initial_backbone["state"])
    backbone = MaskedVisionTransformerTIMM(vit=vit, weight_initialization="skip")  # ours; fixed sin-cos positions
    decoder = MAEDecoderTIMM(num_patches=vit.patch_embed.num_patches, patch_size=vit.patch_embed.patch_size[0],
                             embed_dim=vit.embed_dim, decoder_embed_dim=objective.decoder_dim,
                             decoder_depth=objective.decoder_depth, decoder_num_heads=objective.decoder_heads)
    model = torch.nn.ModuleDict({"backbone": backbone, "decoder": decoder})
    optimizer = adamw(cfg, model)
    transform = T.Compose([T.Resize(32), T.CenterCrop(32), T.ToTensor(), T.Normalize(mean, std)])
    patch, length = vit.patch_embed.patch_size[0], backbone.sequence_length

    def loss_of(step: int, images: torch.Tensor) -> torch.Tensor:
        batch = images.shape[0]
        keep, masked = utils.random_token_mask(size=(batch, length), mask_ratio=objective.mask_ratio)
        tokens = decoder.embed(backbone.encode(images=images, idx_keep=keep))
        full = utils.set_at_index(utils.repeat_token(decoder.mask_token, (batch, length)), keep,
                                  tokens.type_as(decoder.mask_token))
        prediction = decoder.predict(utils.get_at_index(decoder.decode(full), masked))
        target = utils.get_at_index(utils.patchify(images, patch), masked - 1)
        if objective.norm_pix_loss:
            target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
        return torch.nn.functional.mse_loss(prediction, target)

    wall = train_loop(cfg, run, transform, model, optimizer, loss_of)
    return vit, wall


def mae_step_parity(cfg, objective, dataset, views, batch: int = 16) -> dict:
    """Ours and lightly's MAE on the same weights (our decoder's loaded into lightly's), images and mask: the
    losses and the largest relative gradient difference over the encoder and decoder. Equal here means the models
    and losses are the same, so a k-NN gap comes from what differs between the runs (random draws, lightly masking
    one patch more, weight decay on its mask token)."""
    from lightly.models import utils
    from lightly.models.modules import MAEDecoderTIMM, MaskedVisionTransformerTIMM

    from ssl_vit.objectives import mae as ours_mae

    o, ours = cfg.objective, copy.deepcopy(objective).train()
    vit = timm.models.vision_transformer.VisionTransformer(**timm_model_args(ours.backbone.config))
    vit.load_state_dict(ours.backbone.state_dict())
    encoder = MaskedVisionTransformerTIMM(vit=vit, weight_initialization="skip")
    decoder = MAEDecoderTIMM(num_patches=vit.patch_embed.num_patches, patch_size=ours.patch_size,
                             embed_dim=vit.embed_dim, decoder_embed_dim=o.decoder_dim, decoder_depth=o.decoder_depth,
                             decoder_num_heads=o.decoder_heads)
    state = ours.state_dict()
    decoder.load_state_dict({k: (v if k == "decoder_pos_embed" else state[k]) for k, v in decoder.state_dict().items()})
    images = torch.stack([views(dataset[i])["image"] for i in range(batch)])
    length = vit.patch_embed.num_patches
    shuffle = torch.rand(batch, length).argsort(1)
    keep = ours.num_visible(length)
    original = ours_mae.per_sample_shuffle
    ours_mae.per_sample_shuffle = lambda *_, **__: (shuffle, shuffle.argsort(1))
    try:
        loss = ours({"image": images})["loss"]
    finally:
        ours_mae.per_sample_shuffle = original
    loss.backward()
    kept = torch.cat([torch.zeros(batch, 1, dtype=torch.long), shuffle[:, :keep] + 1], 1)
    hidden = shuffle[:, keep:] + 1
    full = utils.set_at_index(utils.repeat_token(decoder.mask_token, (batch, length + 1)), kept,
                              decoder.embed(encoder.encode(images=images, idx_keep=kept)))
    prediction = decoder.predict(utils.get_at_index(decoder.decode(full), hidden))
    target = utils.get_at_index(utils.patchify(images, ours.patch_size), hidden - 1)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    theirs = torch.nn.functional.mse_loss(prediction, target)
    theirs.backward()
    mine = dict(ours.backbone.named_parameters()) | dict(ours.named_parameters())
    worst = max(float((p.grad - mine[n].grad).abs().max() / mine[n].grad.abs().max().clamp_min(1e-12))
                for module in (vit, decoder) for n, p in module.named_parameters()
                if p.grad is not None and n in mine and mine[n].grad is not None)
    return {"loss_ours": float(loss), "loss_lightly": float(theirs), "max_relative_gradient_difference": worst}


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


def compare(method: str, args, work: Path, preprocess: Preprocess, train, test, seed: int) -> dict:
    """One method, one seed (the initial weights, masks and data order): the untrained init, ours (per photometric
    placement for DINO), lightly's; k-NN for each."""
    mean, std = preprocess.mean, preprocess.std
    cfg = compose_config(work / method, args, method, seed=seed)
    set_seed(cfg.seed)  # the initial weights pretrain starts from
    objective, dataset, views, built = build_components(cfg)
    initial = {"config": objective.backbone.config, "state": copy.deepcopy(objective.backbone.state_dict())}
    run = build_run(cfg, objective, dataset, views, built, world=1)
    results = {"untrained init": {"knn": knn_accuracy(lambda x: objective.backbone.forward_features(x)[:, 0],
                                                      preprocess, train, test)}}
    if method == "mae":
        parity = mae_step_parity(cfg, objective, dataset, views)
        print(f"MAE, one step on the same weights, images and mask: loss {parity['loss_ours']:.6f} (ours) vs "
              f"{parity['loss_lightly']:.6f} (lightly), gradients within "
              f"{parity['max_relative_gradient_difference']:.1e} (relative)", flush=True)
        results["step parity"] = parity
    placements = args.photometric.split(",") if method == "dino" else ["workers"]
    for placement in placements:
        AcceleratorState._reset_state(reset_partial_state=True)
        name = f"ssl-vit ({placement})" if method == "dino" else "ssl-vit"
        summary = pretrain(compose_config(work / f"{method}_{placement}", args, method, placement, seed))
        encoder = load_encoder(work / f"{method}_{placement}" / "encoder.safetensors").eval()
        results[name] = {"wall_s": summary["wall_s"], "images_per_s": summary["images_per_s"],
                         "knn": knn_accuracy(lambda x, e=encoder: e.forward_features(x)[:, 0], preprocess, train,
                                             test)}
    torch.manual_seed(cfg.seed)
    trained, wall = (lightly_dino if method == "dino" else lightly_mae)(cfg, initial, run, mean, std)
    trained.eval()
    results["lightly"] = {"wall_s": wall, "images_per_s": args.steps * args.batch / wall,
                          "knn": knn_accuracy(lambda x: trained.forward_features(x)[:, 0], preprocess, train, test)}
    return results


def spread(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "values": values}


def summarise(method: str, args, per_seed: dict[int, dict]) -> dict:
    """The record of one method over its seeds (each row's k-NN and images/s as mean, sd and values), printed."""
    from lightly import __version__ as lightly_version  # the optional `bench` extra

    names = list(next(iter(per_seed.values())))
    rows = {name: {key: spread([runs[name][key] for runs in per_seed.values()])
                   for key in per_seed[next(iter(per_seed))][name]} for name in names}
    record = {"benchmark": "peer_ssl", "method": method, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "steps": args.steps, "batch": args.batch,
              "seeds": list(per_seed), "lightly": lightly_version, "results": rows, "per_seed": per_seed,
              "speed_vs_lightly": {name: row["images_per_s"]["mean"] / rows["lightly"]["images_per_s"]["mean"]
                                   for name, row in rows.items() if name.startswith("ssl-vit")}}
    print(f"\n{method.upper()}, vit_tiny on Fashion-MNIST 32 px, {args.steps} steps x {args.batch} images, 1 loader "
          f"worker each, seeds {list(per_seed)} (mean +- sd)" +
          (" (ours: data.multicrop_photometric, auto being the default: collate at 32 px on a CPU)"
           if method == "dino" else ""))
    print(f"{'':<20}{'img/s':>14}{'k-NN':>18}")
    for name, row in ((name, row) for name, row in rows.items() if "knn" in row):
        speed = (f"{row['images_per_s']['mean']:>7.1f} +- {row['images_per_s']['sd']:<4.1f}"
                 if "images_per_s" in row else f"{'-':>14}")
        print(f"{name:<20}{speed}{row['knn']['mean']:>10.1%} +- {row['knn']['sd']:.1%}")
    for name, ratio in record["speed_vs_lightly"].items():
        print(f"{name} / lightly images/s: {ratio:.2f}x", flush=True)
    return record


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="dino,mae", help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--photometric", default="auto,workers,device",
                        help="DINO, ours, one run each: data.multicrop_photometric (auto: the default; workers, "
                             "collate, device)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (initial weights, masks, data order)")
    parser.add_argument("--knn-train", type=int, default=10000)
    parser.add_argument("--knn-test", type=int, default=2000)
    parser.add_argument("--work-dir", default="/tmp/peer_ssl")
    parser.add_argument("--out-dir", default="benchmarks/results", help="writes peer_ssl_cpu_<method>.json")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown --methods {unknown}; valid choices: {list(METHODS)}")
    register_configs()
    preprocess = Preprocess(32, *dataset_stats("fashion_mnist"))
    train = limit_samples(FashionMNIST(split="train"), args.knn_train, 0)
    test = limit_samples(FashionMNIST(split="test"), args.knn_test, 0)
    records = {}
    for method in methods:
        per_seed = {seed: compare(method, args, Path(args.work_dir) / f"seed{seed}", preprocess, train, test, seed)
                    for seed in (int(s) for s in args.seeds.split(","))}
        records[method] = summarise(method, args, per_seed)
        out = Path(args.out_dir) / f"peer_ssl_cpu_{method}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records[method], indent=2) + "\n")
    return records


if __name__ == "__main__":
    main()
