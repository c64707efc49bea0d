"""NaFlex data (data.resolution=naflex): sizes for a sequence, the shape schedule, the step-indexed and shard
loaders (budget, two ranks, exact resume), the objectives that train on it, and the one-line refusals."""

import json
import math
import re

import pytest
import torch
from conftest import TINY
from helpers.builders import synthetic_shards
from helpers.inprocess import pretrain

from ssl_vit.data import ShardStream, SyntheticShapes, build_loader
from ssl_vit.data.naflex import NaFlexSchedule, NaFlexSettings, NaFlexViews, grid_for_seq
from ssl_vit.naflex import batch_grids

SETTINGS = dict(patch_size=4, seq_lens=(32, 48, 64, 96), max_tokens=512, reference_batch=8)
MEAN, STD = (0.5,) * 3, (0.25,) * 3


def _views(augment="crop_flip", **settings):
    return NaFlexViews(("image", "label"), NaFlexSettings(**{**SETTINGS, **settings}), MEAN, STD, augment)


@pytest.mark.parametrize("size", [(32, 32), (23, 45), (45, 23), (10, 300), (300, 7), (64, 48), (5, 5), (224, 171)])
@pytest.mark.parametrize("seq_len", [8, 48, 64, 256, 1024])
def test_grid_for_seq_is_siglip2s_size_for_a_patch_budget(size, seq_len):
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

    height, width = size
    rows, cols = grid_for_seq(height, width, 16, seq_len)
    assert 1 <= rows * cols <= seq_len
    theirs = get_image_size_for_max_num_patches(height, width, 16, seq_len)  # bisection on the scale
    assert (rows, cols) == (theirs[0] // 16, theirs[1] // 16) or rows * cols >= theirs[0] * theirs[1] // 256


def test_the_schedule_is_a_function_of_seed_and_step_within_the_budget():
    settings = NaFlexSettings(**SETTINGS)
    schedule, again = NaFlexSchedule(settings, seed=3, world_size=2), NaFlexSchedule(settings, seed=3, world_size=2)
    shapes = [schedule.at(step) for step in range(3000)]
    assert shapes == [again.at(step) for step in range(3000)]  # the same on every rank
    assert {seq for seq, _ in shapes} == set(SETTINGS["seq_lens"]) and all(b * s <= 512 for s, b in shapes)
    assert shapes != [NaFlexSchedule(settings, seed=4).at(step) for step in range(3000)]
    totals = [0]
    for _, batch in shapes:
        totals.append(totals[-1] + 2 * batch)
    for step in (0, 1, 1023, 1024, 1025, 2999):
        assert NaFlexSchedule(settings, seed=3, world_size=2).samples_before(step) == totals[step]


def _batches(rank, start, count, world=2, num_workers=0):
    dataset = SyntheticShapes(400, 32, seed=0, aspect_ratios=(0.5, 1.0, 2.0))
    loader = build_loader(dataset, _views(), 8, rank=rank, world_size=world, seed=5, start=start,
                          num_workers=num_workers)
    return [batch for _, batch in zip(range(count), loader, strict=False)]


def test_loader_batches_fit_the_budget_share_shapes_across_ranks_and_resume_exactly():
    rank0, rank1 = _batches(0, 0, 12), _batches(1, 0, 12)
    seen = []
    for first, second in zip(rank0, rank1, strict=True):
        image = first["image"]
        batch, seq_len, width = image["patches"].shape
        assert batch * seq_len <= 512 and width == 4 * 4 * 3 and seq_len in SETTINGS["seq_lens"]
        assert second["image"]["patches"].shape == image["patches"].shape  # one shape per step on every rank
        assert not set(first["key"].tolist()) & set(second["key"].tolist())  # samples sharded
        assert all(h * w <= seq_len for h, w in batch_grids(image)) and image["patch_valid"].sum(1).min() > 0
        seen += first["key"].tolist() + second["key"].tolist()
    assert len({len(b["label"]) for b in rank0}) > 1  # the batch size follows the sequence length
    assert len(set(seen)) == len(seen)  # within an epoch no image comes twice, on either rank
    resumed = _batches(0, 7, 5, num_workers=2)  # a run resumed at micro-step 7, with workers this time
    for expected, got in zip(rank0[7:], resumed, strict=True):
        assert torch.equal(expected["key"], got["key"])
        assert all(torch.equal(expected["image"][k], got["image"][k]) for k in expected["image"])


def test_shard_stream_takes_the_schedule_and_resumes_at_its_position(tmp_path, monkeypatch):
    synthetic_shards(tmp_path / "shards", count=60, per_shard=10, img_size=16)
    stream = ShardStream(str(tmp_path / "shards"), resampled=True, shuffle_buffer=4)
    views = _views(augment="none")
    schedule = NaFlexSchedule(views.settings, seed=2, world_size=1)
    whole = stream.loader(views, 8, seed=2, num_workers=2, need_label=True, schedule=schedule)
    expected = [batch for _, batch in zip(range(9), whole, strict=False)]
    assert [len(b["label"]) for b in expected] == [schedule.at(step)[1] for step in range(9)]
    first = stream.loader(views, 8, seed=2, num_workers=2, need_label=True, schedule=schedule)
    taken = [batch for _, batch in zip(range(4), first, strict=False)]
    state = first.state_dict()
    resumed = stream.loader(views, 8, seed=2, start=4, num_workers=2, need_label=True, schedule=schedule)
    resumed.load_state_dict(state)
    got = taken + [batch for _, batch in zip(range(5), resumed, strict=False)]
    for a, b in zip(expected, got, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"]["patches"], b["image"]["patches"])
    for loader in (whole, first, resumed):  # their workers now, not at a garbage collection in a later test
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def test_a_shard_worker_without_shards_is_refused_with_naflex(tmp_path):
    """resampled=false with more workers than shards would idle a worker, and the loader's turns would then put the
    ranks' batch shapes out of step: one line instead."""
    from ssl_vit.data import NoUsableShardsError

    synthetic_shards(tmp_path / "shards", count=10, per_shard=10, img_size=16)  # one shard, two workers
    views = _views(augment="none")
    loader = ShardStream(str(tmp_path / "shards"), resampled=False).loader(
        views, 8, num_workers=0, need_label=True, schedule=NaFlexSchedule(views.settings))
    stream = iter(loader.dataset)  # this process's WorkerStream, made to see itself as the second of two workers
    stream.workers, stream.worker = 2, 1
    with pytest.raises(NoUsableShardsError, match=r"worker 1 of rank 0 has no shard .* set data.resampled=true"):
        next(stream)


def test_loss_scale_factors():
    settings = NaFlexSettings(**{**SETTINGS, "loss_scale": "sqrt"})
    assert settings.loss_factor(32) == pytest.approx(2.0) and settings.loss_factor(8) == 1.0
    assert NaFlexSettings(**{**SETTINGS, "loss_scale": "linear"}).loss_factor(4) == 0.5
    assert NaFlexSettings(**SETTINGS).loss_factor(32) == 1.0


@pytest.mark.parametrize(("settings", "message"), [
    (dict(max_tokens=64), r"max_tokens=64 is smaller than the sequence length 96 of one image"),
    (dict(seq_lens=(32, 50)), r"seq_lens=\[32, 50\]: each must be a positive multiple of 8.*\[32, 56\]"),
    (dict(seq_lens=()), r"^data.naflex.seq_lens=\[\] names no sequence length: give one or more multiples of 8, or "
                        r"leave it unset \(null\) for \[0.5, 0.75, 1.0, 1.5, 2.0\] x the patches of data.img_size$"),
])
def test_bad_naflex_settings_are_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        NaFlexSettings(**{**SETTINGS, **settings})


def test_an_empty_bucket_list_is_refused_and_null_means_the_default():
    from omegaconf import OmegaConf

    from ssl_vit.data.naflex import NaFlexConfig

    with pytest.raises(ValueError, match=r"seq_lens=\[\] names no sequence length"):
        NaFlexSettings.resolve(OmegaConf.structured(NaFlexConfig(seq_lens=[])), 4, 32, 8)
    assert NaFlexSettings.resolve(OmegaConf.structured(NaFlexConfig()), 4, 32, 8).seq_lens == (32, 48, 64, 96, 128)


def test_augreg_and_pixel_views_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"data.augment='augreg' with data.resolution=naflex"):
        _views(augment="augreg")
    with pytest.raises(ValueError, match=r"also reads \['pixels'\]"):
        NaFlexViews(("image", "pixels"), NaFlexSettings(**SETTINGS), MEAN, STD)


NAFLEX = ["data.resolution=naflex", "data.aspect_ratios=[0.5,1,2]", "data.naflex.seq_lens=[8,16]"]


def test_supervised_trains_on_naflex_batches_and_logs_tokens(tmp_path):
    proc = pretrain(*TINY, "objective=supervised", *NAFLEX, "trainer.max_steps=3", "data.naflex.loss_scale=sqrt",
                    f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["tokens_per_s"] > 0 and math.isfinite(row["loss"]) for row in rows if "tokens_per_s" in row)
    assert sum("tokens_per_s" in row for row in rows) == 3


def test_objectives_that_cannot_take_naflex_say_why_in_one_line(tmp_path):
    proc = pretrain(*TINY, "objective=mae", *NAFLEX, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'mae'}")
    assert proc.returncode == 2
    assert re.search(r"objective=mae does not train on NaFlex .* keeps a random 25%.*objectives that do: "
                     r"\['clip', 'distill', 'siglip', 'supervised'\]", proc.stderr), proc.stderr
    proc = pretrain(*TINY, "objective=supervised", "model=vit_tiny_r", *NAFLEX, "trainer.max_steps=1",
                    f"hydra.run.dir={tmp_path / 'hybrid'}")
    assert proc.returncode == 2 and "need the patch stem" in proc.stderr


def test_distill_trains_on_naflex_batches_with_each_teacher_map_resized_to_each_image(tmp_path):
    """The teachers see the same crop box at their own fixed size; their patch maps are resized to each image's grid
    (as the dense path resizes them to the batch's): per image, the targets equal resizing that image's map alone."""
    from ssl_vit.artifacts import save_encoder
    from ssl_vit.backbone import build_vit
    from ssl_vit.naflex import NaFlexLayout, pack
    from ssl_vit.objectives.distill import _resize_per_image
    from ssl_vit.objectives.patches import resize_patch_features
    from ssl_vit.preprocess import Preprocess

    teacher = save_encoder(build_vit("vit_test", img_size=24, patch_size=4), tmp_path / "teacher.safetensors",
                           Preprocess(24, mean=[0.5] * 3, std=[0.25] * 3))
    proc = pretrain(*TINY, "objective=distill_tiny", "objective.adaptor_hidden_dim=16", *NAFLEX,
                    "data.augment=crop_flip", f"objective.teachers=[{{source: '{teacher}', name: t}}]",
                    "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row["t_patch_loss"]) for row in rows if "t_patch_loss" in row)
    images = [torch.randn(3, h, w) for h, w in ((8, 16), (16, 8), (12, 12))]
    layout = NaFlexLayout.of(pack(images, 4, seq_len=16))
    maps = torch.randn(3, 36, 5)  # the teacher's 6 x 6 maps
    targets = _resize_per_image(maps, (6, 6), layout)
    start = 0
    for row, grid in enumerate(layout.grids):
        alone = resize_patch_features(maps[row:row + 1], (6, 6), grid, "bilinear")[0]
        assert torch.equal(targets[start:start + len(alone)], alone)
        start += len(alone)


def test_data_resize_mode_squash_keeps_the_whole_image_and_is_recorded():
    from omegaconf import OmegaConf
    from torchvision.transforms.v2 import functional as TF

    from ssl_vit.preprocess import Preprocess, resolve_preprocess

    data = OmegaConf.create({"name": "synthetic", "mean": None, "std": None, "resize_mode": "squash"})
    preprocess = resolve_preprocess(data, 32)
    assert preprocess.resize_mode == "squash"
    image = torch.randint(0, 256, (3, 16, 64), dtype=torch.uint8)
    squashed = preprocess.view_builder(("image",))({"image": image})["image"]
    expected = (TF.resize(image, [32, 32], antialias=True).float() / 255 - torch.tensor(preprocess.mean)[:, None,
                                                                                                        None])
    assert torch.allclose(squashed, expected / torch.tensor(preprocess.std)[:, None, None], atol=1e-6)
    recorded = Preprocess(32, resize_mode="squash")  # an encoder's record holds unless the data config says otherwise
    assert resolve_preprocess(OmegaConf.merge(data, {"resize_mode": None}), 32, recorded).resize_mode == "squash"
    assert resolve_preprocess(OmegaConf.merge(data, {"resize_mode": "shortest"}), 32, recorded).resize_mode == \
        "shortest"


@pytest.mark.slow
def test_a_killed_naflex_run_resumes_loss_exact(tmp_path):
    """SIGKILLed after step 5 (checkpoint at 4), resumed: steps 5 and 6 take the batch shapes, samples and losses of
    the uninterrupted run (the schedule's position and the loader workers' seeds restored)."""
    from helpers.processes import check_ok, launch, read_metrics

    args = [*TINY, "objective=supervised", *NAFLEX, "data.num_workers=2", "data.augment=crop_flip",
            "trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.record_sample_keys=true"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    check_ok(launch(*args, f"hydra.run.dir={whole}"))
    assert launch(*args, f"hydra.run.dir={parts}", env={"SSL_VIT_FAULT": "step_done@5"}).returncode != 0
    check_ok(launch(*args, f"hydra.run.dir={parts}", "trainer.resume=auto"))

    def losses(run):
        return {row["step"]: row["loss"] for row in read_metrics(run) if "loss" in row}

    assert losses(parts) == losses(whole) and len(losses(whole)) == 6
    def keys(run):  # step -> the sample keys it took (a resumed run's file holds its steps again after the kill)
        lines = (run / "sample_keys" / "rank_0.jsonl").read_text().splitlines()
        return {row["step"]: row["keys"] for row in map(json.loads, lines)}

    assert keys(parts) == keys(whole) and len(keys(whole)) == 6
