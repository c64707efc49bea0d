"""MoCo v3 against its reference formulas (facebookresearch/moco-v3: moco/builder.py's MoCo_ViT, main_moco.py's
momentum schedule), written out here with torch's own BatchNorm1d, and across 2 processes against 1."""

import json
import math

import helpers.mocov3_two_ranks as two_ranks
import pytest
import torch
import torch.nn.functional as F
from conftest import pretrain_in_process
from helpers.ranks import on_ranks
from torch import nn

from ssl_vit.backbone import build_vit
from ssl_vit.objectives import DataInfo, build_objective, load_trained
from ssl_vit.objectives.mocov3 import MoCoV3Config, momentum_at
from ssl_vit.optim import param_groups


def _objective(**overrides):
    torch.manual_seed(0)
    return build_objective(MoCoV3Config(dim=16, mlp_dim=32, **overrides), build_vit("vit_test", pos_embed="sincos"),
                           DataInfo(0, 16))


def _reference_mlp(ours: nn.Sequential, layers: int, in_dim: int, hidden: int, out: int) -> nn.Sequential:
    """MoCo v3's _build_mlp with torch's BatchNorm1d (train mode: batch statistics), given our weights."""
    modules = []
    for i in range(layers):
        a, b = in_dim if i == 0 else hidden, out if i == layers - 1 else hidden
        modules.append(nn.Linear(a, b, bias=False))
        if i < layers - 1:
            modules += [nn.BatchNorm1d(b), nn.ReLU(inplace=True)]
        else:
            modules.append(nn.BatchNorm1d(b, affine=False))
    mlp = nn.Sequential(*modules)
    missing, unexpected = mlp.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in missing)
    return mlp.train()


def _reference_loss(objective, x1, x2, temperature):
    """MoCo_ViT.forward on one process: base encoder + projector (+ predictor) per view, momentum encoder keys."""
    width = objective.backbone.embed_dim
    projector = _reference_mlp(objective.projector, 3, width, 32, 16)
    predictor = _reference_mlp(objective.predictor, 2, 16, 32, 16)
    momentum_projector = _reference_mlp(objective.momentum.projector, 3, width, 32, 16)

    def base(x):
        return projector(objective.backbone(x))

    def momentum(x):
        return momentum_projector(objective.momentum.backbone(x))

    def ctr(q, k):
        q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        logits = torch.einsum("nc,mc->nm", q, k) / temperature
        return nn.CrossEntropyLoss()(logits, torch.arange(q.shape[0])) * (2 * temperature)

    q1, q2 = predictor(base(x1)), predictor(base(x2))
    with torch.no_grad():
        k1, k2 = momentum(x1), momentum(x2)
    return ctr(q1, k2) + ctr(q2, k1), {"projector": projector, "predictor": predictor}


def test_the_loss_gradients_momentum_update_and_frozen_patch_projection_are_moco_v3s():
    objective = _objective()
    with torch.no_grad():  # keys from another network than the queries, as after any training
        for p in objective.momentum.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    generator = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(6, 3, 16, 16, generator=generator) for _ in range(2))
    ours = objective({"crops": [x1, x2]})
    ours["loss"].backward()
    ours_grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    objective.zero_grad()
    reference, mlps = _reference_loss(objective, x1, x2, 0.2)
    reference.backward()
    torch.testing.assert_close(ours["loss"], reference, atol=1e-6, rtol=1e-6)
    reference_grads = {**{n: p.grad for n, p in objective.named_parameters() if p.grad is not None},
                       **{f"{m}.{n}": p.grad for m, mlp in mlps.items() for n, p in mlp.named_parameters()}}
    assert set(reference_grads) == set(ours_grads)
    for name, grad in ours_grads.items():  # fp32 rounding, relative to each tensor's largest entry
        assert float((grad - reference_grads[name]).abs().max()) <= 1e-5 * max(1.0, float(grad.abs().max())), name
    assert 0 <= float(ours["contrastive_accuracy"]) <= 1 and float(ours["query_std"]) > 0.1
    # the patch projection is frozen (MoCo v3's stop_grad_conv1): no gradient, in no optimizer group
    frozen = {n for n, p in objective.named_parameters() if not p.requires_grad}
    assert {"backbone.patch_embed.proj.weight", "backbone.patch_embed.proj.bias"} <= frozen
    assert all(n.startswith(("backbone.patch_embed.proj.", "momentum.")) for n in frozen - {"backbone.pos_embed"})
    grouped = {id(p) for g in param_groups(objective, weight_decay=0.1) for p in g["params"]}
    assert not any(id(p) in grouped for n, p in objective.named_parameters() if n in frozen)
    # the momentum update after optimizer step 3 of 10: main_moco.py's adjust_moco_momentum at that iteration
    m = 1.0 - 0.5 * (1.0 + math.cos(math.pi * 3 / 10)) * (1.0 - 0.99)
    assert momentum_at(3, 10, 0.99) == pytest.approx(m, abs=1e-15) and momentum_at(3, 10, 0.99, cosine=False) == 0.99
    student = dict(objective.named_parameters())
    before = {n: p.clone() for n, p in objective.momentum.named_parameters()}
    objective.after_optimizer_step(3, 10)
    for name, value in objective.momentum.named_parameters():
        torch.testing.assert_close(value, before[name] * m + student[name] * (1 - m), atol=1e-6, rtol=0, msg=name)


@pytest.mark.distributed
def test_two_processes_give_the_one_process_loss_and_gradients_of_the_whole_batch(tmp_path):
    """BatchNorm over the global batch, every rank's keys as negatives and labels offset by rank make the mean of
    2 ranks' losses and gradients (what DDP applies) those of 1 process on the whole batch."""
    on_ranks(two_ranks.rank_main, tmp_path, log_dir=tmp_path / "ranks")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    loss, grads = two_ranks.run(two_ranks.build(), {"crops": two_ranks.crops()})
    assert set(grads) == set(ranks[0]["grads"])
    assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(loss, abs=1e-6)
    difference = max(float((grads[n] - (ranks[0]["grads"][n] + ranks[1]["grads"][n]) / 2).abs().max()) for n in grads)
    assert difference < 5e-6 * max(1.0, max(float(g.abs().max()) for g in grads.values()))
    assert "projector.1.weight" in grads and "backbone.blocks.0.attn.qkv.weight" in grads


@pytest.mark.slow
def test_the_config_trains_saves_and_reloads_and_bad_views_are_named(tmp_path):
    """Through the real CLI on one process (in this one): the recipe's optimiser, fixed sin-cos positions, logged
    health metrics, and the run reloads with its projector, predictor and momentum encoder."""
    out = tmp_path / "run"
    proc = pretrain_in_process("objective=mocov3_tiny", "model=vit_test", "objective.dim=16", "objective.mlp_dim=32",
                               "data.batch_size=8", "data.num_samples=32", "trainer.max_steps=3", "trainer.log_every=1",
                               f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optim=mocov3 (lr 0.0006 per 256 images (linear) -> 1.875e-05 at global batch 8, weight decay 0.1" \
        in proc.stdout + proc.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "loss" in m]
    assert len(logged) == 3 and all({"contrastive_accuracy", "query_std"} <= set(m) for m in logged)
    model = load_trained(out)
    assert model.backbone.pos_embed_kind == "sincos" and model.cfg.dim == 16
    assert not torch.equal(model.momentum.backbone.blocks[0].attn.qkv.weight, model.backbone.blocks[0].attn.qkv.weight)
    with pytest.raises(ValueError, match="MoCo v3 compares 2 views of each image; the batch has 3 crops"):
        model({"crops": [torch.zeros(2, 3, 16, 16)] * 3})


def test_objective_mocov3_builds_vit_s_with_the_references_12_heads_and_says_so(tmp_path):
    """vits.py's vit_small has 12 heads of 32 (DeiT's and timm's: 6 of 64); model.num_heads still wins."""
    from helpers.builders import pretrain_config

    from ssl_vit.train.build import build_backbone, check_config
    from ssl_vit.train.trainer import describe_run

    def heads(*overrides):
        cfg = pretrain_config(tmp_path, *overrides, "model=vit_s16", "data.img_size=32")
        needs = check_config(cfg).needs
        backbone, _, _ = build_backbone(cfg, needs, None)
        return backbone.blocks[0].attn.num_heads, describe_run(cfg, 64, needs)

    count, line = heads("objective=mocov3")
    assert count == 12 and "model=vit_s16 (objective=mocov3's reference: num_heads=12)" in line
    count, line = heads("objective=mocov3", "model.num_heads=6")
    assert count == 6 and "reference" not in line
    assert heads("objective=dino")[0] == 6
    assert heads("objective=mocov3", "model=vit_b16")[0] == 12
