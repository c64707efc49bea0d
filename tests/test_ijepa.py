"""I-JEPA against its reference code (facebookresearch/ijepa): the multi-block masks against a transcription of
src/masks/multiblock.py's MaskCollator, the loss against src/train.py's forward_target / forward_context with
src/models/vision_transformer.py's encoder and predictor forward written out on our weights, the momentum against
its momentum_scheduler."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import pretrain_in_process
from safetensors.torch import load_file
from torch import nn

from ssl_vit.backbone import build_vit
from ssl_vit.objectives import DataInfo, build_objective, load_trained
from ssl_vit.objectives.ijepa import IJEPAConfig, MultiBlockMasks, momentum_at


class ReferenceMaskCollator:
    """MaskCollator's block sampling as the reference writes it (int32 grids, `mask *= region`, 20 tries before a
    region is dropped), with one generator for every draw (the reference draws positions from the global one)."""

    def __init__(self, height, width, enc_scale, pred_scale, aspect, npred, min_keep):
        self.height, self.width = height, width
        self.enc_scale, self.pred_scale, self.aspect, self.npred, self.min_keep = (enc_scale, pred_scale, aspect,
                                                                                   npred, min_keep)

    def sample_block_size(self, g, scale, aspect_ratio_scale):
        _rand = torch.rand(1, generator=g).item()
        max_keep = int(self.height * self.width * (scale[0] + _rand * (scale[1] - scale[0])))
        aspect_ratio = aspect_ratio_scale[0] + _rand * (aspect_ratio_scale[1] - aspect_ratio_scale[0])
        h = int(round(math.sqrt(max_keep * aspect_ratio)))
        w = int(round(math.sqrt(max_keep / aspect_ratio)))
        while h >= self.height:
            h -= 1
        while w >= self.width:
            w -= 1
        return h, w

    def sample_block_mask(self, g, b_size, acceptable_regions=None):
        h, w = b_size
        tries, timeout = 0, 20
        while True:
            top = torch.randint(0, self.height - h, (1,), generator=g)
            left = torch.randint(0, self.width - w, (1,), generator=g)
            mask = torch.zeros((self.height, self.width), dtype=torch.int32)
            mask[top:top + h, left:left + w] = 1
            if acceptable_regions is not None:
                for k in range(max(int(len(acceptable_regions) - tries), 0)):
                    mask *= acceptable_regions[k]
            mask = torch.nonzero(mask.flatten())
            if len(mask) > self.min_keep:
                break
            timeout -= 1
            if timeout == 0:
                tries, timeout = tries + 1, 20
        mask_complement = torch.ones((self.height, self.width), dtype=torch.int32)
        mask_complement[top:top + h, left:left + w] = 0
        return mask.squeeze(), mask_complement

    def __call__(self, batch, g):
        p_size = self.sample_block_size(g, self.pred_scale, self.aspect)
        e_size = self.sample_block_size(g, self.enc_scale, (1.0, 1.0))
        masks_pred, masks_enc = [], []
        min_keep_pred = min_keep_enc = self.height * self.width
        for _ in range(batch):
            masks_p, masks_c = [], []
            for _ in range(self.npred):
                mask, mask_c = self.sample_block_mask(g, p_size)
                masks_p.append(mask)
                masks_c.append(mask_c)
                min_keep_pred = min(min_keep_pred, len(mask))
            masks_pred.append(masks_p)
            mask, _ = self.sample_block_mask(g, e_size, acceptable_regions=masks_c)
            masks_enc.append([mask])
            min_keep_enc = min(min_keep_enc, len(mask))
        masks_pred = torch.utils.data.default_collate([[m[:min_keep_pred] for m in ms] for ms in masks_pred])
        masks_enc = torch.utils.data.default_collate([[m[:min_keep_enc] for m in ms] for ms in masks_enc])
        return masks_enc, masks_pred  # lists (one per block) of (B, K)


@pytest.mark.parametrize("grid, min_keep, seed", [((14, 14), 10, 0), ((14, 14), 10, 1), ((8, 8), 2, 2),
                                                  ((6, 9), 4, 3)])
def test_the_multi_block_masks_are_the_reference_collators(grid, min_keep, seed):
    ours = MultiBlockMasks(grid, 4, (0.15, 0.2), (0.75, 1.5), (0.85, 1.0), min_keep)
    reference = ReferenceMaskCollator(*grid, (0.85, 1.0), (0.15, 0.2), (0.75, 1.5), 4, min_keep)
    for step in range(5):
        context, targets = ours(6, torch.Generator().manual_seed(100 * seed + step))
        masks_enc, masks_pred = reference(6, torch.Generator().manual_seed(100 * seed + step))
        assert torch.equal(context, masks_enc[0]) and len(masks_pred) == 4
        for ours_target, reference_target in zip(targets, masks_pred, strict=True):
            assert torch.equal(ours_target, reference_target)
        assert context.shape[1] > min_keep and targets.shape[-1] > min_keep


def _drawn_sizes(grid, scale, aspect, draws: int = 20_001) -> set[tuple[int, int]]:
    """The block sizes of `draws` evenly spaced draws, as the reference's _sample_block_size computes one."""
    u = torch.linspace(0, 1, draws, dtype=torch.float64)
    area = (grid[0] * grid[1] * (scale[0] + u * (scale[1] - scale[0]))).floor()
    ratio = aspect[0] + u * (aspect[1] - aspect[0])
    h = (area * ratio).sqrt().round().clamp(max=grid[0] - 1)
    w = (area / ratio).sqrt().round().clamp(max=grid[1] - 1)
    return {tuple(size) for size in torch.stack([h, w], dim=1).long().unique(dim=0).tolist()}


@pytest.mark.parametrize("rows", range(4, 17))
def test_every_grid_and_min_keep_draws_masks_or_is_refused_at_start(rows):
    """Grids 4..16 (square, and one column fewer) x min_keep 0..12: refused at construction exactly when some draw
    gives a block of min_keep patches or fewer (found here by sampling the draw densely), else every batch's masks
    are drawn, each keeping more than min_keep patches. Either way nothing loops without a bound."""
    for grid in [(rows, rows), (rows, rows - 1)]:
        probe = MultiBlockMasks(grid, min_keep=0)
        sizes = {kind: _drawn_sizes(grid, scale, aspect)
                 for kind, scale, aspect in (("target", (0.15, 0.2), (0.75, 1.5)), ("context", (0.85, 1.0), (1, 1)))}
        assert sizes["target"] <= probe.block_sizes((0.15, 0.2), (0.75, 1.5))  # the start-up check sees them all
        assert sizes["context"] <= probe.block_sizes((0.85, 1.0), (1.0, 1.0))
        smallest = min(h * w for found in sizes.values() for h, w in found)
        for min_keep in range(13):
            if smallest <= min_keep:
                with pytest.raises(ValueError, match=rf"^objective.min_keep={min_keep}: a (target|context) block can "
                                                     rf"be drawn \d+ x \d+ patches .* of a {grid[0]} x {grid[1]} grid"):
                    MultiBlockMasks(grid, min_keep=min_keep)
                continue
            context, targets = MultiBlockMasks(grid, min_keep=min_keep)(4, torch.Generator().manual_seed(min_keep))
            assert context.shape[1] > min_keep and targets.shape[-1] > min_keep


def test_a_placement_that_cannot_keep_enough_gives_up_naming_min_keep_and_the_block():
    masks = MultiBlockMasks((8, 8), min_keep=2)
    masks.min_keep = 4  # as if the start-up check had let a 2 x 2 block through
    regions = [torch.zeros(8, 8, dtype=torch.bool)]  # nothing allowed: relaxed after `tries` placements, then given up
    with pytest.raises(ValueError, match=r"^objective.min_keep=4: a 2 x 2 block on the 8 x 8 patch grid keeps at "
                                         r"most 4 patches"):
        masks.place((2, 2), torch.Generator().manual_seed(0), regions)
    indices, _ = masks.place((3, 3), torch.Generator().manual_seed(0), regions)  # relaxed: the whole block
    assert len(indices) == 9


def _objective(**overrides):
    torch.manual_seed(0)
    backbone = build_vit("vit_test", img_size=32, pos_embed="sincos", class_token=False, global_pool="avg")
    cfg = IJEPAConfig(**{"predictor_dim": 32, "predictor_depth": 2, "min_keep": 2, **overrides})
    return build_objective(cfg, backbone, DataInfo(0, 32))


def _apply_masks(x, masks):
    return torch.cat([torch.gather(x, 1, m.unsqueeze(-1).repeat(1, 1, x.size(-1))) for m in masks], dim=0)


def _reference_loss(objective, images, masks_enc, masks_pred):
    """train.py's forward_target and forward_context with the reference encoder's and predictor's forward."""
    target, encoder, predictor = objective.target, objective.backbone, objective.predictor
    with torch.no_grad():
        h = _final_norm(target, _run(target, target.patch_embed(images) + target.pos_embed))
        h = F.layer_norm(h, (h.size(-1),))
        h = _apply_masks(h, masks_pred)  # repeat_interleave_batch with one context mask: unchanged
    z = _final_norm(encoder, _run(encoder, _apply_masks(encoder.patch_embed(images) + encoder.pos_embed, masks_enc)))
    batch = len(z)
    x = predictor.embed(z)
    x = x + _apply_masks(predictor.pos_embed.repeat(batch, 1, 1), masks_enc)
    n_ctxt = x.shape[1]
    pos_embs = _apply_masks(predictor.pos_embed.repeat(batch, 1, 1), masks_pred)
    pred_tokens = predictor.mask_token.repeat(pos_embs.size(0), pos_embs.size(1), 1) + pos_embs
    x = torch.cat([x.repeat(len(masks_pred), 1, 1), pred_tokens], dim=1)
    for block in predictor.blocks:
        x = block(x)
    z = predictor.proj(predictor.norm(x)[:, n_ctxt:])
    return F.smooth_l1_loss(z, h)


def _run(vit, x):
    for block in vit.blocks:
        x = block(x)
    return x


def _final_norm(vit, x):
    """The reference encoder's `self.norm` on every token: the one LayerNorm our average-pooled ViT has."""
    norms = [m for m in (vit.norm, vit.fc_norm) if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 1
    return F.layer_norm(x, norms[0].normalized_shape, norms[0].weight, norms[0].bias, norms[0].eps)


def test_the_loss_and_its_gradients_are_the_reference_forwards():
    objective = _objective()
    with torch.no_grad():  # a target encoder that has moved away from the context encoder
        for p in objective.target.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    context, targets = objective.masks(4, torch.Generator().manual_seed(2))
    ours = objective.loss_for(images, context, targets)
    ours["loss"].backward()
    ours_grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    objective.zero_grad()
    reference = _reference_loss(objective, images, [context], list(targets))
    reference.backward()
    torch.testing.assert_close(ours["loss"], reference, atol=1e-6, rtol=1e-6)
    # every trained parameter gets a gradient (DDP's reducer needs them all), the target none
    assert set(ours_grads) == {n for n, p in objective.named_parameters() if p.requires_grad}
    assert {n.split(".")[0] for n in ours_grads} == {"backbone", "predictor"}
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, dict(objective.named_parameters())[name].grad, atol=1e-6, rtol=1e-5,
                                   msg=name)
    assert float(ours["prediction_std"]) > 0 and float(ours["context_patches"]) == context.shape[1]
    # the momentum: train.py's momentum_scheduler, consumed once per step (ipe 10 x 3 epochs; ipe_scale 1.0 as its
    # released configs, and 1.25, init_opt's default)
    ema, ipe, epochs = (0.996, 1.0), 10, 3
    schedulers = {scale: [ema[0] + i * (ema[1] - ema[0]) / (ipe * epochs * scale)
                          for i in range(int(ipe * epochs * scale) + 1)] for scale in (1.0, 1.25)}
    for scale, scheduler in schedulers.items():
        ours_momenta = [momentum_at(s, 30, 0.996, 1.0, scale) for s in range(1, 31)]
        assert ours_momenta == pytest.approx(scheduler[:30], abs=1e-15)
    before = {n: p.clone() for n, p in objective.target.named_parameters()}
    objective.after_optimizer_step(7, 30)
    student = dict(objective.backbone.named_parameters())
    m = schedulers[1.0][6]
    for name, value in objective.target.named_parameters():
        torch.testing.assert_close(value, before[name] * m + student[name] * (1 - m), atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_the_config_trains_saves_and_reloads_and_an_impossible_min_keep_is_named(tmp_path):
    """Through the CLI's entry (in this process): the recipe's optimiser, the method's backbone defaults, logged
    health metrics, and a run that reloads with its context encoder and predictor; the evaluated encoder is the
    target encoder."""
    out = tmp_path / "run"
    proc = pretrain_in_process("objective=ijepa_tiny", "model=vit_test", "data.img_size=32",
                               "objective.predictor_dim=32", "objective.predictor_depth=1", "data.batch_size=8",
                               "data.num_samples=32", "trainer.max_steps=3", "trainer.log_every=1",
                               f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optim=ijepa (lr 0.001, weight decay 0.04 -> 0.4" in proc.stdout + proc.stderr
    logged = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert len(logged) == 3 and all({"prediction_std", "context_patches", "target_patches"} <= set(m) for m in logged)
    model = load_trained(out)
    assert model.encoder is model.target and model.backbone.cls_token is None
    assert model.backbone.global_pool == "avg" and model.backbone.pos_embed_kind == "sincos"
    assert not torch.equal(model.target.blocks[0].attn.qkv.weight, model.backbone.blocks[0].attn.qkv.weight)
    # each network holds its own file's values (the target was once overwritten by the context encoder there)
    heads = load_file(out / "heads.safetensors")
    for name, value in load_file(out / "encoder.safetensors").items():
        assert torch.equal(model.target.state_dict()[name], value), name
        assert torch.equal(model.backbone.state_dict()[name], heads[f"backbone.{name}"]), name
    with pytest.raises(ValueError, match=r"objective.min_keep=10: a target block can be drawn 3 x 3 patches"):
        _objective(min_keep=10)
    # the case: on vit_test's 4 x 4 grid a draw of u = 0.25 gives a 1 x 1 target (u = 0 gives 2 x 1), on
    # which the placement once retried for ever; now one line before anything trains
    proc = pretrain_in_process("objective=ijepa", "model=vit_test", "objective.min_keep=1", "trainer.max_steps=2",
                               f"output_dir={tmp_path / 'refused'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "ssl-vit: error: objective=ijepa: objective.min_keep=1: a target block can be drawn 1 x 1 patches (scale "
        "[0.15, 0.2], aspect [0.75, 1.5] of a 4 x 4 grid), which can never keep more; lower objective.min_keep or "
        "raise data.img_size"]


def test_objective_ijepa_trains_on_its_references_crop_only_view(tmp_path):
    """make_transforms as I-JEPA's configs set it: RandomResizedCrop(scale (0.3, 1)), no flip, no colour
    distortion; merged over the data kind's default (a folder's crop_flip), while data.augment=... still wins."""
    from helpers.builders import pretrain_config
    from torchvision.transforms import v2

    from ssl_vit.train.build import build_components

    cfg = pretrain_config(tmp_path, "objective=ijepa_tiny", "data.img_size=32", "data.num_samples=4")
    assert cfg.data.augment == "crop" and list(cfg.data.crop_scale) == [0.3, 1.0]
    folder = pretrain_config(tmp_path, "objective=ijepa", "data=folder", "data.root=/nowhere")
    assert folder.data.augment == "crop"
    assert pretrain_config(tmp_path, "objective=dino", "data=folder", "data.root=/x").data.augment == "crop_flip"
    assert pretrain_config(tmp_path, "objective=ijepa", "data.augment=crop_flip").data.augment == "crop_flip"

    _, dataset, views, preprocess = build_components(cfg)
    image = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8)
    reference = v2.RandomResizedCrop(32, scale=(0.3, 1.0), interpolation=v2.InterpolationMode.BILINEAR,
                                     antialias=True)
    mean, std = torch.tensor(preprocess.mean).view(3, 1, 1), torch.tensor(preprocess.std).view(3, 1, 1)
    for seed in range(8):  # a flip would show in half of them
        torch.manual_seed(seed)
        ours = views({"image": image})["image"]
        torch.manual_seed(seed)
        expected = (reference(image).float() / 255 - mean) / std
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
