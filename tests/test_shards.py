import io
import json
import tarfile

import numpy as np
import pytest
import torch
from conftest import ROOT, check_ok, read_metrics, write_tar
from helpers.builders import synthetic_shards, write_idx
from helpers.inprocess import run_script
from helpers.ranks import pretrain_ranks
from PIL import Image
from torch.utils.data import DataLoader

from ssl_vit.data import Digits, FashionMNIST, NoUsableShardsError, ShardStream, SyntheticShapes, ViewBuilder
from ssl_vit.data.real import read_idx
from ssl_vit.data.shards import expand_urls


def _identity(sample):
    return sample


def test_round_trip_is_pixel_exact_in_a_shuffled_order(tmp_path):
    summary = synthetic_shards(tmp_path)
    assert summary["samples"] == 40 and len(summary["shards"]) == 3 and summary["formats"] == {"png": 40}
    stream = ShardStream(str(tmp_path), resampled=False, shuffle_buffer=10)
    pipeline, decode = stream.pipeline(_identity, batch_size=None, seed=1, need_label=True, need_text=True, epochs=1)
    samples = list(pipeline)
    source = SyntheticShapes(40, 16, seed=3)
    keys = [int(s["key"]) for s in samples]
    assert sorted(keys) == list(range(40)) and keys != list(range(40))
    for sample in samples:
        original = source[int(sample["key"])]
        assert torch.equal(sample["image"], original["image"])
        assert sample["label"] == original["label"] and sample["text"] == original["text"]
    assert decode.skipped == 0 and all(s["skipped"] == 0 for s in samples)


def test_shard_metadata_json_names_the_source_and_class(tmp_path):
    synthetic_shards(tmp_path, count=4)
    with tarfile.open(tmp_path / "shard-000000.tar") as tar:
        meta = json.loads(tar.extractfile("000000002.json").read())
    assert meta["source"] == "synthetic" and meta["index"] == 2 and meta["class_name"] in SyntheticShapes.classes


def _keys(batch):
    return tuple(batch["key"])


def test_resampled_streams_differ_between_workers_and_ranks(tmp_path, monkeypatch):
    synthetic_shards(tmp_path, count=64)
    stream = ShardStream(str(tmp_path), resampled=True, shuffle_buffer=8)
    pipeline, _ = stream.pipeline(_identity, batch_size=8, seed=0)
    loader = DataLoader(pipeline, batch_size=None, num_workers=2)
    batches = [b for _, b in zip(range(6), loader, strict=False)]  # workers take turns: 0, 1, 0, 1, ...
    worker0, worker1 = [_keys(b) for b in batches[0::2]], [_keys(b) for b in batches[1::2]]
    assert worker0 != worker1
    streams = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        pipeline, _ = stream.pipeline(_identity, batch_size=8, seed=0)
        streams[rank] = [_keys(b) for _, b in zip(range(3), pipeline, strict=False)]
    assert streams[0] != streams[1]
    pipeline, _ = stream.pipeline(_identity, batch_size=8, seed=0)
    assert [_keys(b) for _, b in zip(range(3), pipeline, strict=False)] == streams[1]  # deterministic per seed


@pytest.mark.slow
@pytest.mark.parametrize("resampled", [True, False])
def test_a_resumed_stream_continues_exactly_on_2_ranks_x_2_workers(tmp_path, monkeypatch, resampled):
    """Stopped inside a shard with a part-full shuffle buffer, then resumed from the saved loader state (through a
    file, as a checkpoint holds it): each rank's batches, their keys and their random augmentation equal the
    uninterrupted stream's."""
    synthetic_shards(tmp_path / "shards", count=70, per_shard=9)  # 8 shards, the last one short
    stream = ShardStream(str(tmp_path / "shards"), resampled=resampled, shuffle_buffer=6)
    views = ViewBuilder(("image", "label"), 16, mean=(0.5,) * 3, std=(0.5,) * 3, augment=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        whole = stream.loader(views, 5, seed=4, num_workers=2, need_label=True)
        expected = [batch for _, batch in zip(range(11), whole, strict=False)]  # over an epoch (resampled=False)
        first = stream.loader(views, 5, seed=4, num_workers=2, need_label=True)
        taken = [batch for _, batch in zip(range(5), first, strict=False)]  # worker 0 is ahead: 3 batches vs 2
        torch.save(first.state_dict(), tmp_path / f"position_{rank}.pt")
        resumed = stream.loader(views, 5, seed=4, start=5, num_workers=2, need_label=True)  # as the trainer makes it
        resumed.load_state_dict(torch.load(tmp_path / f"position_{rank}.pt", weights_only=True))
        got = taken + [batch for _, batch in zip(range(6), resumed, strict=False)]
        assert [batch["key"] for batch in got] == [batch["key"] for batch in expected]
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(got, expected, strict=True))
        if rank == 0:  # a position of other shards is refused, naming both
            other = ShardStream(str(tmp_path / "shards" / "shard-00000[0-6].tar"), resampled=resampled,
                                shuffle_buffer=6).loader(views, 5, seed=4, num_workers=2, need_label=True)
            state = torch.load(tmp_path / f"position_{rank}.pt", weights_only=True)
            with pytest.raises(ValueError, match=r"of another stream: 8 shards .* this one has 7"):
                other.load_state_dict({**state})
                next(iter(other))
        positions = list(_stream_positions(first.state_dict()))
        assert len(positions) == 2 and all(p["offset"] > 0 and len(p["buffer"]) == 5 for p in positions), positions
        for loader in (whole, first, resumed):  # their workers now, not at a garbage collection in a later test
            _shut_down(loader)


def _shut_down(loader) -> None:
    """End a StatefulDataLoader's worker processes. Left to the garbage collector, which may find them in a later
    test, the workers of an unfinished iterator each cost that test 5 s (MP_STATUS_CHECK_INTERVAL) here."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def _stream_positions(state):
    """The WorkerStream states inside a StatefulDataLoader state."""
    if isinstance(state, dict):
        if "offset" in state and "buffer" in state:
            yield state
        for value in state.values():
            yield from _stream_positions(value)


def _png(colour=(10, 200, 30), size=8):
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_bad_samples_are_skipped_and_counted_exactly(tmp_path):
    good = _png()
    write_tar(tmp_path / "bad-000000.tar", [
        ("a", {"png": good, "cls": b"1"}),
        ("b", {"png": good[: len(good) // 2], "cls": b"2"}),  # truncated image
        ("c", {"png": b"this is not an image", "cls": b"3"}),  # non-image payload
        ("d", {"png": good}),  # missing cls
        ("e", {"png": _png((255, 0, 0)), "cls": b"4"}),
        ("f", {"cls": b"5"}),  # no image at all
        ("g", {"jpg": b"\xff\xd8\xff\xe0 broken", "cls": b"6"}),  # corrupt jpeg, last in the shard
    ])
    stream = ShardStream(str(tmp_path / "bad-000000.tar"), resampled=False, shuffle_buffer=0)
    pipeline, decode = stream.pipeline(_identity, batch_size=None, need_label=True, epochs=1)
    samples = list(pipeline)
    assert [s["key"] for s in samples] == ["a", "e"] and [s["label"] for s in samples] == [1, 4]
    assert decode.skipped == 5
    assert sum(s["skipped"] for s in samples) + decode.trailing == 5  # carried counts + the tail
    # without labels needed, the sample missing cls is fine
    pipeline, decode = stream.pipeline(_identity, batch_size=None, need_label=False, epochs=1)
    assert [s["key"] for s in pipeline] == ["a", "d", "e"] and decode.skipped == 4


def test_missing_or_empty_shards_fail_at_start_up(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        expand_urls(str(tmp_path / "shard-{000000..000002}.tar"))
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(NoUsableShardsError, match=r"every shard of data.urls is empty \(0 bytes\).*empty.tar"):
        expand_urls([str(tmp_path / "empty.tar")])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards in directory"):
        expand_urls(str(tmp_path / "nothing"))


@pytest.mark.distributed
def test_a_killed_shard_run_resumes_with_the_samples_of_an_uninterrupted_one(tmp_path):
    """2 processes x 2 loader workers on shards read once per epoch: killed after step 5 (checkpoint at 4, inside
    the epoch), resumed: every rank's per-step sample keys and the losses equal the uninterrupted run's."""
    synthetic_shards(tmp_path / "shards", count=70, per_shard=9, img_size=16)
    args = ["objective=supervised", "model=vit_test", "data=wds", f"data.urls={tmp_path / 'shards'}",
            "data.resampled=false", "data.shuffle_buffer=6", "data.num_classes=8", "data.num_workers=2",
            "data.batch_size=4", "trainer.max_steps=6", "trainer.log_every=1", "trainer.checkpoint_every=2",
            "trainer.record_sample_keys=true", "trainer.cpu_threads=1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"

    def launch(*overrides, env=None):  # 2 processes forked as `accelerate launch` would start them (helpers.ranks)
        return pretrain_ranks(*args, *overrides, config="ddp_cpu2", log_dir=tmp_path / "logs", env=env)

    check_ok(launch(f"hydra.run.dir={whole}"))
    killed = launch(f"hydra.run.dir={parts}", env={"SSL_VIT_FAULT": "step_done@5"})
    assert killed.returncode != 0 and (parts / "checkpoints" / "step_00000004").is_dir()
    resumed = check_ok(launch(f"hydra.run.dir={parts}", "trainer.resume=auto"))
    assert "at step 4" in resumed.stdout + resumed.stderr
    for rank in (0, 1):
        rows, expected = ([json.loads(line) for line in (run / "sample_keys" / f"rank_{rank}.jsonl").open()]
                          for run in (parts, whole))
        assert [row["step"] for row in rows] == list(range(1, 7)) and all(len(row["keys"]) == 4 for row in rows)
        assert rows == expected
    assert (parts / "sample_keys" / "rank_0.jsonl").read_text() != (parts / "sample_keys" / "rank_1.jsonl").read_text()
    losses = {run: [m["loss"] for m in read_metrics(run)] for run in (whole, parts)}
    assert losses[parts] == pytest.approx(losses[whole], abs=1e-6) and len(losses[whole]) == 6
    assert read_metrics(parts)[-1]["skipped_samples"] == 0
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.schema import ConfigError
    from ssl_vit.train.build import build_components

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["objective=supervised", "model=vit_test", "data=wds",
                                             f"data.urls={tmp_path / 'shards'}", "output_dir=x"])
    with pytest.raises(ConfigError, match="set data.num_classes"):
        build_components(cfg)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reader_on_a_tiny_idx_file(tmp_path, gz):
    images = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    suffix = ".gz" if gz else ""
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", images, gz)
    write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", np.array([9, 0, 4]), gz)
    data = FashionMNIST(tmp_path, split="test")
    assert len(data) == 3 and data[0]["label"] == 9 and data.classes[9] == "Ankle boot"
    assert data[1]["image"].shape == (3, 28, 28) and torch.equal(data[1]["image"][2], torch.from_numpy(
        images[1].astype(np.uint8)))
    np.testing.assert_array_equal(read_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}"), [9, 0, 4])


def test_fashion_mnist_missing_names_the_install_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        FashionMNIST(tmp_path, split="train")
    (tmp_path / "x-idx1-ubyte").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "x-idx1-ubyte")


def test_the_installed_fashion_mnist_package():
    """.ci/run installs Debian's dataset-fashion-mnist (scripts/get_data.sh), so this reads the real files."""
    test = FashionMNIST(split="test")
    assert len(test) == 10_000 and np.bincount(test.labels).tolist() == [1000] * 10
    assert test[0]["image"].shape == (3, 28, 28) and test[0]["image"].dtype == torch.uint8


def test_digits_splits_and_scaling():
    train, test = Digits("train"), Digits("test")
    assert (len(train), len(test)) == (1438, 359) and set(train.labels) == set(range(10))
    from sklearn.datasets import load_digits
    image = train[0]["image"]
    assert image.shape == (3, 8, 8) and torch.equal(image[0], image[2]) and train.images.max() == 255
    expected = np.round(load_digits().images[0] * 255 / 16).astype(np.uint8)  # sample 0 is in the train split
    assert torch.equal(image[0], torch.from_numpy(expected))


def _make_shards(*args):
    return run_script(ROOT / "scripts" / "make_shards.py", *map(str, args))


def test_make_shards_from_image_caption_pairs_and_class_folders(tmp_path):
    pairs = tmp_path / "pairs"
    (pairs / "sub").mkdir(parents=True)
    for name, colour, caption in (("a", (255, 0, 0), "a red square"), ("sub/b", (0, 0, 255), "a blue square")):
        Image.new("RGB", (12, 10), colour).save(pairs / f"{name}.png")
        (pairs / f"{name}.txt").write_text(caption + "\n")
    Image.new("RGB", (12, 10)).save(pairs / "no_caption.png")  # skipped: no .txt beside it
    (pairs / "broken.png").write_bytes(b"\x89PNG broken")  # unreadable: left out, named, counted
    (pairs / "broken.txt").write_text("never seen")
    proc = _make_shards("captions", "--root", pairs, "--out", tmp_path / "cap")
    assert proc.returncode == 0, proc.stderr
    assert "wrote 2 samples from captions into 1 shard(s)" in proc.stdout
    assert "left out 1 unreadable image(s)" in proc.stdout and "broken.png: cannot decode" in proc.stderr
    pipeline, _ = ShardStream(str(tmp_path / "cap"), resampled=False, shuffle_buffer=0).pipeline(
        _identity, batch_size=None, need_text=True, epochs=1)
    samples = list(pipeline)
    assert [s["text"] for s in samples] == ["a red square", "a blue square"]
    assert samples[1]["image"][:, 0, 0].tolist() == [0, 0, 255] and "label" not in samples[0]

    folder = tmp_path / "folder"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
        Image.new("RGB", (80, 80), (9, 9, 9)).save(folder / cls / "x.png")
    (folder / "dog" / "empty.jpg").write_bytes(b"")
    proc = _make_shards("folder", "--root", folder, "--out", tmp_path / "fol", "--samples-per-shard", 1)
    assert proc.returncode == 0, proc.stderr
    assert "left out 1 unreadable image(s)" in proc.stdout and "empty.jpg: empty file (0 bytes)" in proc.stderr
    assert "into 2 shard(s)" in proc.stdout and "formats {'jpg': 2}" in proc.stdout  # 80 px > 64: jpg
    assert "data.num_classes=2" in proc.stdout
    proc = _make_shards("folder", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "needs --root" in proc.stderr
