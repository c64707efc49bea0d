"""DINOv3 against facebookresearch/dinov3's formulas, each written here from its code: `GramLoss` (img_level,
apply_norm, remove_neg), the DINO loss with `global_ignore_diagonal` and the reweighted local term, the
`linear_warmup_cosine_decay` arrays of the Gram weight and the local weight, the Gram teacher's loads and refreshes in
its train loop, the resizing of the Gram teacher's features to the student's grid, and `DataAugmentationDINO`'s
Gram-teacher crops. Then the objective through the real CLI: a run, its reload, and the high-resolution stage continued
from it. Strategies: tests/test_strategies.py."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, pretrain_in_process
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from ssl_vit.backbone import build_vit
from ssl_vit.cli import register_configs
from ssl_vit.data import make_loader
from ssl_vit.data.multicrop import PARAMETERS, MultiCropViews
from ssl_vit.data.photometric import finish_crops
from ssl_vit.objectives import DataInfo, build_objective, load_trained
from ssl_vit.objectives.dinov3 import DINOv3Config, gram_plan
from ssl_vit.objectives.losses.dino import cross_view_loss, sinkhorn_knopp
from ssl_vit.objectives.losses.gram import gram_loss
from ssl_vit.objectives.patches import resize_patch_features
from ssl_vit.schema import ConfigError, validate_config
from ssl_vit.train import build_components

SMALL = dict(out_dim=64, ibot_out_dim=64, hidden_dim=32, bottleneck_dim=16, local_crops=2)


def _reference_gram_loss(student, teacher, remove_neg=False):
    """dinov3/loss/gram_loss.py at img_level with apply_norm, in float64 numpy."""
    s, t = student.double().numpy(), teacher.double().numpy()
    s = s / np.maximum(np.linalg.norm(s, axis=-1, keepdims=True), 1e-12)
    t = t / np.maximum(np.linalg.norm(t, axis=-1, keepdims=True), 1e-12)
    student_sim, target_sim = s @ s.transpose(0, 2, 1), t @ t.transpose(0, 2, 1)
    if remove_neg:
        target_sim[target_sim < 0] = 0.0
        student_sim[student_sim < 0] = 0.0
    return float(((student_sim - target_sim) ** 2).mean())


@pytest.mark.parametrize("remove_negative", [False, True])
def test_the_gram_loss_and_its_gradient_are_dinov3s(remove_negative):
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 10, 8, requires_grad=True), torch.randn(3, 10, 8)
    loss = gram_loss(student, teacher, remove_negative)
    assert loss.item() == pytest.approx(_reference_gram_loss(student.detach(), teacher, remove_negative), rel=1e-5)
    loss.backward()
    # the reference's gradient: the same formula in float64 torch, its in-place zeroing of negative similarities
    s64 = student.detach().double().requires_grad_()
    s, t = F.normalize(s64, dim=-1), F.normalize(teacher.double(), dim=-1)
    student_sim, target_sim = s @ s.transpose(-1, -2), t @ t.transpose(-1, -2)
    if remove_negative:
        target_sim[target_sim < 0] = 0.0
        student_sim = student_sim.masked_fill(student_sim < 0, 0.0)
    torch.nn.MSELoss()(student_sim, target_sim).backward()
    assert torch.allclose(student.grad.double(), s64.grad, rtol=1e-4, atol=1e-9)
    with pytest.raises(ValueError, match=r"the same patches: student \(3, 10, 8\), teacher \(3, 9, 8\)"):
        gram_loss(student, teacher[:, :9])


def test_the_reweighted_local_term_is_dinov3s_dino_loss():
    """dinov3's DINOLoss (crop-major [crops, B, K] einsums, the diagonal dropped for the global crops) weighted by
    the shares of the pairs, the local term times its weight, against ours on the same logits."""
    torch.manual_seed(1)
    n_global, n_local, batch, k, temp = 2, 4, 5, 16, 0.1
    student = torch.randn((n_global + n_local) * batch, k)
    probs = F.softmax(torch.randn(n_global * batch, k) / 0.07, dim=-1)

    def dino_loss(student_logits, teacher_probs, ignore_diagonal):
        log_p = F.log_softmax(student_logits.double() / temp, dim=-1)
        if not ignore_diagonal:
            return -torch.einsum("sbk,tbk->", log_p, teacher_probs.double()) / (
                batch * student_logits.shape[0] * teacher_probs.shape[0])
        loss = -torch.einsum("sbk,tbk->st", log_p, teacher_probs.double())
        m = min(student_logits.shape[0], teacher_probs.shape[0])
        loss = torch.diagonal_scatter(loss, loss.new_zeros(m))
        return loss.sum() / (batch * student_logits.shape[0] * teacher_probs.shape[0] - batch * m)

    s, q = student.view(n_global + n_local, batch, k), probs.view(n_global, batch, k)
    global_terms, local_terms = n_global * (n_global - 1), n_global * n_local
    for local_weight in (1.0, 0.5):
        reference = (global_terms / (global_terms + local_terms) * dino_loss(s[:n_global], q, True)
                     + local_weight * local_terms / (global_terms + local_terms) * dino_loss(s[n_global:], q, False))
        ours = cross_view_loss(student, probs, temp, n_global, local_weight)
        assert ours.item() == pytest.approx(reference.item(), rel=1e-6)


def _linear_warmup_cosine_decay(start, peak, end, warmup_iterations, total_iterations, cosine_iterations):
    """dinov3/train/cosine_lr_scheduler.py's array."""
    linear = np.linspace(start, peak, warmup_iterations, endpoint=False)
    cosine = (np.cos(np.linspace(0, np.pi, cosine_iterations)) + 1) / 2 * (peak - end) + end
    return np.concatenate([linear, cosine, np.full(total_iterations - cosine_iterations - warmup_iterations, end)])


@pytest.mark.parametrize("start, warmup", [(0, 0), (0, 5), (7, 1), (7, 6), (20, 0)])
def test_the_gram_and_local_weights_follow_dinov3s_schedule_arrays(start, warmup):
    """Gram weight: start 0, peak 0, end gram_weight, warm-up until gram_start, cosine over gram_warmup_steps (as
    the ViT-7B anchoring config: warm-up 1000 epochs at 0, cosine 1 epoch); the local weight 1 -> 0.5 likewise."""
    total = 30
    plan = gram_plan(DINOv3Config(gram_weight=2.0, gram_start=start, gram_warmup_steps=warmup, local_loss_weight=0.5))
    gram = _linear_warmup_cosine_decay(0, 0, 2.0, start, total, warmup)
    local = _linear_warmup_cosine_decay(1, 1, 0.5, start, total, warmup)
    assert [plan.weight * plan.ramp(k) for k in range(total)] == pytest.approx(gram.tolist(), abs=1e-12)
    assert [1 + (plan.local_weight - 1) * plan.ramp(k) for k in range(total)] == pytest.approx(local.tolist(),
                                                                                                 abs=1e-12)
    hires = gram_plan(DINOv3Config(stage="hires", gram_start=start, gram_warmup_steps=warmup))
    assert {hires.weight * hires.ramp(k) for k in range(total)} == {1.5}  # the high-res config: constant 1.5
    with pytest.raises(ConfigError, match=r"^objective.stage=final is not one of pretrain, hires$"):
        validate_config(OmegaConf.structured(DINOv3Config(stage="final")), "objective.")


def test_the_gram_teacher_is_loaded_and_refreshed_where_dinov3s_train_loop_does():
    """dinov3's loop: gram_load_ema_teacher() before iteration it_load_ema_teacher, update_gram() after iteration
    `it` when it + 1 >= it_first_update, (it + 1) % update_frequency == 0 and fewer than max_updates were done
    (before the next iteration, ours). With it_load_ema_teacher = 40, it_first_update = 60, frequency 20, 3 updates."""
    plan = gram_plan(DINOv3Config(gram_start=40, gram_update_every=20, gram_max_updates=3))
    before, updates = set(), 0
    for it in range(200):
        if it == 40:
            before.add(it)
        if it + 1 >= 60 and (it + 1) % 20 == 0 and updates < 3:
            before.add(it + 1)
            updates += 1
    assert {k for k in range(201) if plan.takes_teacher_at(k)} == before == {40, 60, 80, 100}


def _objective(**overrides):
    torch.manual_seed(0)
    cfg = DINOv3Config(**{**SMALL, "gram_size_factor": 2.0, **overrides})
    return build_objective(cfg, build_vit("vit_test", pos_embed="rope", num_registers=2), DataInfo(8, 16))


def test_the_gram_teacher_holds_the_ema_teachers_snapshot_between_refreshes():
    model = _objective(gram_start=2, gram_update_every=2, gram_max_updates=1)
    start = {k: v.clone() for k, v in model.gram_teacher.state_dict().items()}
    assert all(torch.equal(v, model.teacher.backbone.state_dict()[k]) for k, v in start.items())
    assert not model.gram_teacher.training and not model.train().gram_teacher.training
    assert not any(p.requires_grad for p in model.gram_teacher.parameters())
    snapshots = {}
    for step in range(7):
        model.begin_step(step, 10)
        snapshots[step] = {k: v.clone() for k, v in model.gram_teacher.state_dict().items()}
        with torch.no_grad():  # what the optimizer step and the EMA update do to the teacher
            for p in model.teacher.backbone.parameters():
                p.add_(0.01 * torch.randn_like(p))
        teacher = {k: v.clone() for k, v in model.teacher.backbone.state_dict().items()}
        if step in (1, 3):
            snapshots[f"teacher after {step}"] = teacher
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert same(snapshots[0], start) and same(snapshots[1], start)
    assert same(snapshots[2], snapshots["teacher after 1"]) and same(snapshots[3], snapshots[2])
    assert same(snapshots[4], snapshots["teacher after 3"])  # the one refresh allowed
    assert same(snapshots[6], snapshots[4])


def test_the_gram_teachers_features_are_resized_on_the_image_grid():
    """A field linear in the pixel coordinates stays linear under bilinear resizing (align_corners=False): the
    resized tokens must be that field at the new grid's cell centres, rows first (the patch raster order)."""
    def field(rows, cols):
        y = (torch.arange(rows) + 0.5) / rows
        x = (torch.arange(cols) + 0.5) / cols
        return torch.stack([y[:, None].expand(rows, cols), x[None, :].expand(rows, cols)], -1).reshape(1, -1, 2)

    resized = resize_patch_features(field(8, 6), (8, 6), (4, 3), "bilinear")
    assert torch.allclose(resized, field(4, 3), atol=1e-6)
    same = field(4, 3)
    assert resize_patch_features(same, (4, 3), (4, 3), "bicubic") is same  # the student's grid already: untouched


def sinkhorn_probs(model, batch):
    with torch.no_grad():
        logits = model.teacher.head(model.teacher.backbone.pool(model.teacher.backbone.forward_features(
            torch.cat(batch["crops"][:2]))))
    return sinkhorn_knopp(logits, model.teacher_temp(), model.cfg.sinkhorn_iterations)


def test_the_logged_gram_loss_is_the_reference_on_the_gram_teachers_resized_features():
    model = _objective(gram_start=0, gram_warmup_steps=0, gram_weight=2.0).eval()
    torch.manual_seed(3)
    batch = {"crops": [torch.randn(4, 3, 16, 16) for _ in range(2)] + [torch.randn(4, 3, 8, 8) for _ in range(2)],
             "gram_crops": [torch.randn(4, 3, 32, 32) for _ in range(2)]}
    masks = torch.rand(8, 16) < 0.3
    batch.update(global_masks=masks, global_mask_indices=masks.flatten().nonzero().squeeze(1))
    model.begin_step(0, 10)
    out = model(batch)
    prefix = model.backbone.num_prefix_tokens
    with torch.no_grad():
        student = model.backbone.forward_features(torch.cat(batch["crops"][:2]), mask=masks,
                                                  mask_token=model.mask_token)[:, prefix:]
        teacher = model.gram_teacher.forward_features(torch.cat(batch["gram_crops"]))[:, prefix:]
    # the reference's resizing: [B, P, D] -> [B, D, N, N] -> bicubic to the student's N -> [B, P', D]
    maps = F.interpolate(teacher.transpose(-2, -1).unflatten(-1, (8, 8)), size=(4, 4), mode="bicubic",
                         align_corners=False, antialias=False)
    reference = _reference_gram_loss(student, maps.flatten(-2, -1).transpose(-2, -1))
    assert out["gram_loss"].item() == pytest.approx(reference, rel=1e-5)
    parts = out["dino_loss"] + 0.1 * out["koleo_loss"] + out["ibot_loss"] + 2.0 * out["gram_loss"]
    assert out["loss"].item() == pytest.approx(parts.item(), rel=1e-6)
    assert out["gram_weight"].item() == 2.0 and out["local_loss_weight"].item() == 0.5
    # the KL monitor stays KL(teacher || student): the plain cross-entropy, not the reweighted loss, minus entropy
    plain = cross_view_loss(model.head(torch.cat([model.backbone.pool(student_tokens) for student_tokens in (
        model.backbone.forward_features(torch.cat(batch["crops"][:2]), mask=masks, mask_token=model.mask_token),
        model.backbone.forward_features(torch.cat(batch["crops"][2:])))])).detach(), sinkhorn_probs(model, batch),
        model.cfg.student_temp, 2)
    assert out["kl_teacher_student"].item() == pytest.approx((plain - out["teacher_entropy"]).item(), rel=1e-5)
    late = _objective(gram_start=5)
    late.begin_step(4, 10)
    assert "gram_loss" not in late(batch)


def test_the_gram_crops_are_the_global_crops_boxes_without_distortion():
    """dinov3's DataAugmentationDINO with gram_teacher_no_distortions: one box cut at the larger size (and flipped
    for both, when flips are on), resized for the student and for the Gram teacher. With the photometric part on
    the device the workers' uint8 crops show it: the student's crop is the Gram crop resized; the Gram crops get
    no photometric parameter set, the student's global crops no flip of their own."""
    views = MultiCropViews(16, 8, [0.5] * 3, [0.25] * 3, n_global=2, n_local=2, photometric_on="device",
                           gram_size=32)
    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8)
    crops, parameters = views(image)
    assert [tuple(c.shape[-2:]) for c in crops] == [(16, 16)] * 2 + [(8, 8)] * 2 + [(32, 32)] * 2
    for student, gram in zip(crops[:2], crops[4:], strict=True):
        from_gram = F.interpolate(gram[None].float(), size=(16, 16), mode="bicubic", antialias=True)[0]
        assert (from_gram.round().clamp(0, 255) - student.float()).abs().max() <= 1
    flags = [PARAMETERS.index(name) for name in ("flip", "jitter", "grey", "blur", "solarize")]
    assert all(p[flags].abs().sum() == 0 for p in parameters[4:]) and all(p[0] == 0 for p in parameters[:2])
    finished = finish_crops(views, [c[None] for c in crops], [p[None] for p in parameters])
    assert torch.allclose(finished[4][0], (crops[4].float() / 255 - 0.5) / 0.25)
    no_flips = MultiCropViews(16, 8, [0.5] * 3, [0.25] * 3, n_local=2, photometric_on="device", flip=False)
    assert all(no_flips(image)[1][k][0] == 0 for k in range(4) for _ in range(5))
    with pytest.raises(ValueError, match="gram_size=0 is invalid"):
        MultiCropViews(16, 8, [0.5] * 3, [0.25] * 3, gram_size=0)


def test_the_hires_stage_crops_at_twice_the_size_with_the_gram_teacher_at_1_5x():
    model = _objective(stage="hires")
    options = model.multicrop_options()
    assert (options["global_size"], options["gram_size"], options["local_size"]) == (32, 48, 12)
    assert options["global_masks"]["grid"] == (8, 8) and options["flip"] is False
    with pytest.raises(ConfigError, match=r"^objective.gram_resize=area is not one of bicubic, bilinear, nearest$"):
        validate_config(OmegaConf.structured(DINOv3Config(gram_resize="area")), "objective.")


def _pretrain(out, *overrides):
    proc = pretrain_in_process("objective=dinov3_tiny", "model=vit_test", "objective.out_dim=64",
                               "objective.ibot_out_dim=64", "objective.hidden_dim=32", "objective.bottleneck_dim=16",
                               "objective.local_crops=2", "data.batch_size=8", "data.num_samples=32",
                               "trainer.log_every=1", *overrides, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


@pytest.mark.slow
def test_the_config_trains_reloads_and_continues_at_high_resolution(tmp_path):
    """Through the CLI's entry (in this process): DINOv3's backbone defaults, the Gram loss from gram_start with its
    ramp, a reload that holds the Gram teacher; then stage=hires from that run (its heads too): constant weights, a
    Gram teacher that stays the starting teacher (the first run's encoder) for the whole stage."""
    run = tmp_path / "run"
    logged = _pretrain(run, "trainer.max_steps=4", "objective.gram_start=1", "objective.gram_warmup_steps=2",
                       "objective.gram_update_every=2")
    assert "gram_loss" not in logged[0] and all("gram_loss" in m for m in logged[1:])
    assert [m["gram_weight"] for m in logged] == pytest.approx([0, 0, 2.0, 2.0])
    assert [m["local_loss_weight"] for m in logged] == pytest.approx([1, 1, 0.5, 0.5])
    model = load_trained(run)
    assert model.backbone.pos_embed_kind == "rope" and model.backbone.num_prefix_tokens == 5
    heads = load_file(run / "heads.safetensors")
    for name, value in model.gram_teacher.state_dict().items():
        assert torch.equal(value, heads[f"gram_teacher.{name}"]), name
    assert not torch.equal(heads["gram_teacher.blocks.0.attn.qkv.weight"],
                           load_file(run / "encoder.safetensors")["blocks.0.attn.qkv.weight"])

    hires = tmp_path / "hires"
    logged = _pretrain(hires, "trainer.max_steps=3", "objective.stage=hires", f"model.init_from={run}",
                       "model.init_heads=true")
    assert [m["gram_weight"] for m in logged] == [1.5] * 3 and [m["local_loss_weight"] for m in logged] == [0.5] * 3
    assert all(math.isfinite(m["gram_loss"]) for m in logged)
    start = load_file(run / "encoder.safetensors")
    heads = load_file(hires / "heads.safetensors")
    assert all(torch.equal(heads[f"gram_teacher.{name}"], value) for name, value in start.items())


@pytest.mark.parametrize("placement", ["workers", "device"])
def test_the_loader_gives_the_gram_crops_apart_wherever_the_photometric_part_runs(placement):
    """Through the config and the real loader: `crops` holds the student's crops, `gram_crops` the Gram teacher's
    (normalised; on the device path after `on_device`), at 2x the global size."""
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["objective=dinov3_tiny", "objective.local_crops=2", "model=vit_test",
                                             f"data.multicrop_photometric={placement}", "data.num_samples=8",
                                             "output_dir=x"])
    model, dataset, views, _ = build_components(cfg)
    batch = views.on_device(next(iter(make_loader(dataset, views, batch_size=4))))
    assert [tuple(c.shape) for c in batch["crops"]] == [(4, 3, 16, 16)] * 2 + [(4, 3, 8, 8)] * 2
    assert [tuple(c.shape) for c in batch["gram_crops"]] == [(4, 3, 32, 32)] * 2
    assert all(c.dtype == torch.float32 for c in batch["gram_crops"]) and "crop_parameters" not in batch
    assert torch.isfinite(model(batch)["loss"])


def test_gram_anchoring_starts_late_by_default_and_never_from_an_untrained_network(tmp_path):
    """dinov3_vit7b16_gram_anchor.yaml: the Gram weight 0 until iteration 1M of 1.2M, then a cosine to 2.0 over
    1000 iterations; the Gram teacher is the trained EMA teacher of that moment. Unset, gram_start is that fraction
    of the run; a start at step 0 from scratch anchors to the untrained network and is refused in one line."""
    from helpers.builders import pretrain_config

    tiny = ("objective=dinov3_tiny", "model=vit_test", "objective.out_dim=64", "objective.ibot_out_dim=64",
            "objective.hidden_dim=32", "objective.bottleneck_dim=16", "data.num_samples=8")
    cfg = pretrain_config(tmp_path, *tiny, "objective.gram_start=null", "objective.gram_warmup_steps=1000",
                          "trainer.max_steps=12000")
    model = build_components(cfg)[0]
    model.begin_step(0, 12000)
    assert model.gram.start == 10000 and model.plan.start is None  # fixed once the run's length is known
    weights = []
    for step in (9999, 10000, 10500, 10999, 11999):
        model.begin_step(step, 12000)
        weights.append(model.gram_weight())
    reference = [0.0, 0.0, 2.0 * (1 - math.cos(math.pi * 500 / 999)) / 2, 2.0, 2.0]  # inclusive cosine
    assert weights == pytest.approx(reference, abs=1e-12)
    assert DINOv3Config().gram_start is None and DINOv3Config().gram_start_fraction == pytest.approx(1 / 1.2)

    message = ("objective=dinov3: objective.gram_start=0 anchors the patch features to the untrained network "
               "from step 0 (dinov3 anchors late, to a trained teacher); leave objective.gram_start unset "
               "(objective.gram_start_fraction of the run), start from a trained run (model.init_from=...), give "
               "objective.gram_teacher=..., or set objective.gram_untrained=true")
    with pytest.raises(ConfigError) as refused:
        build_components(pretrain_config(tmp_path, *tiny, "objective.gram_start=0"))
    assert str(refused.value) == message
    with pytest.raises(ConfigError, match=r"objective.stage=hires anchors the patch features to the untrained"):
        build_components(pretrain_config(tmp_path, *tiny, "objective.stage=hires"))
    build_components(pretrain_config(tmp_path, *tiny, "objective.gram_start=0", "objective.gram_untrained=true"))
    build_components(pretrain_config(tmp_path, *tiny, "objective.gram_start=0", "objective.gram_weight=0"))


def test_a_given_gram_teacher_holds_from_the_start_and_is_refreshed_from_the_ema_teacher_after(tmp_path):
    """objective.gram_teacher: dinov3's gram.ckpt (the Gram teacher loaded from a checkpoint), then its rep_update
    from the EMA teacher every update_frequency iterations; an encoder of another architecture is one line."""
    from helpers.builders import pretrain_config

    from ssl_vit.artifacts import save_encoder

    torch.manual_seed(1)
    anchor = build_vit("vit_test", pos_embed="rope", rope_rescale=2.0, num_registers=4)
    save_encoder(anchor, tmp_path / "anchor.safetensors")
    tiny = ("objective=dinov3_tiny", "model=vit_test", "objective.out_dim=64", "objective.ibot_out_dim=64",
            "objective.hidden_dim=32", "objective.bottleneck_dim=16", "data.num_samples=8")
    cfg = pretrain_config(tmp_path, *tiny, "objective.gram_start=0", "objective.gram_update_every=3",
                          f"objective.gram_teacher={tmp_path / 'anchor.safetensors'}")
    model = build_components(cfg)[0]
    expected = anchor.state_dict()
    for step in range(3):
        model.begin_step(step, 10)
        assert all(torch.equal(v, expected[k]) for k, v in model.gram_teacher.state_dict().items())
    with torch.no_grad():
        model.teacher.backbone.blocks[0].attn.qkv.weight.add_(1.0)  # as EMA updates would move it
    model.begin_step(3, 10)
    assert torch.equal(model.gram_teacher.blocks[0].attn.qkv.weight, model.teacher.backbone.blocks[0].attn.qkv.weight)

    save_encoder(build_vit("vit_test"), tmp_path / "other.safetensors")
    with pytest.raises(ConfigError, match=r"objective.gram_teacher=.*other.safetensors: its architecture is not the "
                                          r"backbone's \(\d+ tensors differ, e.g. "):
        build_components(pretrain_config(tmp_path, *tiny, f"objective.gram_teacher={tmp_path / 'other.safetensors'}"))


def test_the_hires_stage_holds_the_teacher_temperature_and_momentum_constant():
    """dinov3_vit7b16_high_res_adapt.yaml: teacher_temp 0.07 and momentum 0.999 from start to end (the pre-training
    schedules' warm-up and cosine are not continued)."""
    hires, pretraining = _objective(stage="hires"), _objective()
    temps, momenta = [], []
    for step in (0, 5, 9):
        for model in (hires, pretraining):
            model.begin_step(step, 10)
        temps.append((hires.teacher_temp(), pretraining.teacher_temp()))
        momenta.append((hires.teacher_momentum(step + 1, 10), pretraining.teacher_momentum(step + 1, 10)))
    assert [t for t, _ in temps] == [0.07] * 3 and [m for m, _ in momenta] == [0.999] * 3
    assert temps[0][1] == pytest.approx(0.04) and momenta[0][1] == pretraining.cfg.teacher_momentum  # pre-training's


def test_the_hires_stage_mixes_dinov3s_crop_pairs_one_pair_per_step_as_its_config_gives_them():
    """dinov3_vit7b16_high_res_adapt.yaml for its 256 px model: global_crops_size [512, 768, 768, 768, 768],
    local_crops_size [112, 112, 168, 224, 336], gram_teacher_crops_size [768, 1152, ...], ratios 0.3 / 0.3 / 0.3 /
    0.05 / 0.05. Ours (configs/objective/dinov3.yaml, as multiples of the model's size) gives those sizes at 256 px
    and patch 16; a step's pair is a function of the step alone (every rank, every resume), drawn with the shares."""
    from ssl_vit.objectives.dinov3 import CropPairs

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["objective=dinov3", "output_dir=x"])
    pairs = CropPairs.from_config(cfg.objective.hires_crop_pairs, 256, cfg.objective.hires_gram_size_factor, 16)
    # 168 px is 10.5 patches: dinov3's strided patch convolution reads 10 (160 px); ours cuts the 160 px it reads
    assert [list(size) for size in zip(*pairs.sizes, strict=True)] == [
        [512, 768, 768, 768, 768], [112, 112, 160, 224, 336], [768, 1152, 1152, 1152, 1152]]
    assert pairs.shares == (0.3, 0.3, 0.3, 0.05, 0.05) and pairs.largest == (768, 336, 1152)
    drawn = [pairs.pick(step) for step in range(20000)]
    assert drawn[:50] == [pairs.pick(step) for step in range(50)]  # the step's alone
    shares = [sum(d == size for d in drawn) / len(drawn) for size in pairs.sizes]
    assert shares == pytest.approx([0.3, 0.3, 0.3, 0.05, 0.05], abs=0.015)
    with pytest.raises(ValueError, match=r"objective.hires_crop_pairs=\[\[2, 0.5\]\]: give \[global, local, share\]"):
        CropPairs.from_config([[2, 0.5]], 256, 1.5, 16)


def test_a_hires_step_trains_at_its_pairs_sizes_from_crops_cut_at_the_largest():
    """The loader cuts at the largest sizes; a step whose pair is smaller resizes them (bicubic, antialiased) and
    draws iBOT's masks for its own grid."""
    model = _objective(stage="hires", hires_crop_pairs=[[2.0, 0.5, 0.5], [3.0, 0.75, 0.5]], ibot_mask_probability=1.0)
    options = model.multicrop_options()
    assert (options["global_size"], options["local_size"], options["gram_size"]) == (48, 12, 72)
    assert options["global_masks"]["grid"] == (12, 12)
    small = next(step for step in range(100) if model.pairs.pick(step) == (32, 8, 48))
    large = next(step for step in range(100) if model.pairs.pick(step) == (48, 12, 72))
    torch.manual_seed(0)
    batch = {"crops": [torch.randn(2, 3, 48, 48)] * 2 + [torch.randn(2, 3, 12, 12)] * 2,
             "gram_crops": [torch.randn(2, 3, 72, 72)] * 2,
             "global_masks": torch.zeros(4, 144, dtype=torch.bool), "global_mask_indices": torch.zeros(0).long()}
    resized = model.pairs.resized(batch, small, 2)
    assert [tuple(c.shape[-2:]) for c in resized["crops"]] == [(32, 32)] * 2 + [(8, 8)] * 2
    assert [tuple(c.shape[-2:]) for c in resized["gram_crops"]] == [(48, 48)] * 2 and "global_masks" not in resized
    expected = F.interpolate(batch["crops"][0], size=(32, 32), mode="bicubic", antialias=True, align_corners=False)
    assert torch.equal(resized["crops"][0], expected)
    kept = model.pairs.resized(batch, large, 2)
    assert kept["crops"][0] is batch["crops"][0] and "global_masks" in kept
    for step in (small, large):
        model.begin_step(step, 100)
        out = model(batch)
        assert torch.isfinite(out["loss"]) and "gram_loss" in out
