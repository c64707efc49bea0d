"""Bad data is skipped and counted, never silently lost or mis-scaled; data that cannot be used at all is a clear
error. Real files throughout: encoded PNG / JPEG / BMP / TIFF bytes, tar files on disk, the real loaders."""

import ast
import io
import json
import logging
import shlex
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from braceexpand import braceexpand
from conftest import write_tar
from PIL import Image

from ssl_vit.data import (
    BadSampleError,
    DataError,
    FolderDataset,
    NoUsableSamplesError,
    NoUsableShardsError,
    ShardStream,
    ViewBuilder,
    build_loader,
    decode_rgb,
)
from ssl_vit.data.shards import SIZES_FILE, expand_urls, read_shard, write_shards

ROOT = Path(__file__).resolve().parents[1]


def _identity(sample):
    return sample


def _first_batch(loader):
    """next(iter(loader)), shutting worker processes down at once even when it raises (left to the garbage
    collector, a DataLoader whose workers raised takes 10 s to shut down)."""
    batches = iter(loader)
    try:
        return next(batches)
    finally:
        getattr(batches, "_shutdown_workers", lambda: None)()


# ----- item 6: one decoder, 8-bit RGB from every format and mode -----
def _png16(array: np.ndarray) -> bytes:
    """A 16-bit PNG (grey for (H, W), RGB for (H, W, 3)) written by hand: PIL cannot write 16-bit RGB."""
    height, width = array.shape[:2]
    rows = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, 0 if array.ndim == 2 else 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _encode(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


GREY16 = np.array([[0, 65535, 32768], [1000, 40000, 257]], dtype=np.uint16)
RGB16 = np.stack([GREY16, 65535 - GREY16, np.full_like(GREY16, 40000)], axis=-1)
RGB8 = (np.arange(2 * 3 * 3).reshape(2, 3, 3) * 13 + 7).astype(np.uint8)  # every pixel and channel differs


def _grey(array):
    return np.repeat(array[None], 3, axis=0)


def _palette_image():
    image = Image.new("P", (3, 2), 1)
    image.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    image.putpixel((0, 0), 0)
    return image


CASES = {  # name -> (encoded bytes, expected uint8 (3, H, W), tolerance)
    "png16_grey": (_png16(GREY16), _grey(GREY16 >> 8), 0),
    "png16_rgb": (_png16(RGB16), (RGB16 >> 8).transpose(2, 0, 1), 0),
    "png_palette": (_encode(_palette_image(), "PNG"), np.array([[[0, 10, 10], [10, 10, 10]],
                                                                [[0, 20, 20], [20, 20, 20]],
                                                                [[0, 30, 30], [30, 30, 30]]]), 0),
    "png_grey_alpha": (_encode(Image.new("LA", (3, 2), (77, 10)), "PNG"), np.full((3, 2, 3), 77), 0),
    "png_rgba": (_encode(Image.new("RGBA", (3, 2), (1, 2, 3, 0)), "PNG"),
                 np.broadcast_to(np.array([1, 2, 3])[:, None, None], (3, 2, 3)), 0),
    "jpeg_cmyk": (_encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95),
                  np.broadcast_to(np.array([255, 0, 0])[:, None, None], (3, 8, 8)), 3),
    "png_1x1": (_encode(Image.new("RGB", (1, 1), (5, 6, 7)), "PNG"), np.array([5, 6, 7]).reshape(3, 1, 1), 0),
    "png_grey8": (_encode(Image.fromarray(RGB8[..., 0]), "PNG"), _grey(RGB8[..., 0]), 0),
    "bmp": (_encode(Image.fromarray(RGB8), "BMP"), RGB8.transpose(2, 0, 1), 0),
    "tiff": (_encode(Image.fromarray(RGB8), "TIFF"), RGB8.transpose(2, 0, 1), 0),
    "ppm": (_encode(Image.fromarray(RGB8), "PPM"), RGB8.transpose(2, 0, 1), 0),
    "tiff16_grey": (_encode(Image.fromarray(GREY16), "TIFF"), _grey(GREY16 >> 8), 0),  # PIL I;16, not clipped
    "tiff32_int": (_encode(Image.fromarray(GREY16.astype(np.int32)), "TIFF"), _grey(GREY16 >> 8), 0),  # PIL I
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_format_and_mode_decodes_to_8bit_rgb_with_the_right_values(name, tmp_path):
    data, expected, tolerance = CASES[name]
    path = tmp_path / f"image.{name.split('_')[0][:4]}"
    path.write_bytes(data)
    for source in (data, path):  # bytes (shards) and paths (folders) go through the same function
        image = decode_rgb(source)
        assert image.dtype == torch.uint8 and image.shape == expected.shape and image.is_contiguous()
        difference = (image.int() - torch.from_numpy(np.ascontiguousarray(expected)).int()).abs().max().item()
        assert difference <= tolerance, (name, image.tolist(), expected.tolist())


def test_undecodable_data_is_a_bad_sample_naming_file_and_reason(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(BadSampleError, match=r"empty.png: empty file \(0 bytes\)"):
        decode_rgb(tmp_path / "empty.png")
    with pytest.raises(BadSampleError, match=r"junk.jpg: cannot decode the image \(.+\)"):
        decode_rgb(tmp_path / "junk.jpg")
    with pytest.raises(BadSampleError, match="cannot read the file"):
        decode_rgb(tmp_path / "vanished.png")
    assert issubclass(BadSampleError, DataError) and issubclass(DataError, RuntimeError)


def test_a_16bit_png_is_scaled_alike_in_folders_and_shards(tmp_path):
    """Before: uint16 pixels reached the views and were divided by 255 (values up to 257)."""
    (tmp_path / "folder" / "a").mkdir(parents=True)
    (tmp_path / "folder" / "a" / "x.png").write_bytes(_png16(RGB16))
    write_tar(tmp_path / "s-000000.tar", [("x", {"png": _png16(RGB16), "cls": b"0"})])
    from_folder = FolderDataset(tmp_path / "folder")[0]["image"]
    pipeline, _ = ShardStream(str(tmp_path / "s-000000.tar"), resampled=False, shuffle_buffer=0).pipeline(
        _identity, batch_size=None, epochs=1)
    from_shard = next(iter(pipeline))["image"]
    assert torch.equal(from_folder, from_shard) and torch.equal(from_folder, torch.from_numpy(
        (RGB16 >> 8).transpose(2, 0, 1).astype(np.uint8)))
    pixels = ViewBuilder(("pixels",), 3, [0.5] * 3, [0.5] * 3)({"image": from_folder})["pixels"]
    assert 0.9 < pixels.max() <= 1.0


# ----- item 7: image folders skip, count and name bad files; batches stay full and deterministic -----
def _bad_folder(root: Path, good_per_class: int = 5) -> Path:
    for index, colour in enumerate(((220, 30, 30), (30, 30, 220))):
        folder = root / f"class_{index}"
        folder.mkdir(parents=True)
        for i in range(good_per_class):
            Image.new("RGB", (20 + i, 16), colour).save(folder / f"{i}.png")
    good_jpeg = _encode(Image.new("RGB", (32, 32), (9, 9, 9)), "JPEG")
    (root / "class_0" / "corrupt.jpg").write_bytes(good_jpeg[: len(good_jpeg) // 2])
    (root / "class_1" / "empty.png").write_bytes(b"")
    return root


def test_folder_with_a_corrupt_jpeg_and_an_empty_png_gives_full_counted_batches(tmp_path, caplog):
    data = FolderDataset(_bad_folder(tmp_path / "images"))
    assert len(data) == 12
    views = ViewBuilder(("image", "label"), 16, [0.5] * 3, [0.5] * 3)
    with caplog.at_level(logging.WARNING):
        loader = build_loader(data, views, 4, seed=5, num_workers=0)
        batches = [b for _, b in zip(range(6), loader, strict=False)]  # 3 batches per epoch: two epochs
    assert all(b["image"].shape == (4, 3, 16, 16) and b["label"].shape == (4,) for b in batches)
    assert sum(int(b["skipped"].sum()) for b in batches) == 4  # each bad file once per epoch
    # each substitute names the bad sample it stands in for; the loader itself says nothing (the trainer counts
    # and names each bad sample once: test_training_on_a_folder_with_bad_files_counts_them)
    stood_in = {(int(i), r) for b in batches for i, r in zip(b["skip_index"], b["skip_reason"], strict=True) if i >= 0}
    assert len(stood_in) == 2 and all(int(b["skipped"].sum()) == int((b["skip_index"] >= 0).sum()) for b in batches)
    reasons = " ".join(reason for _, reason in stood_in)
    assert "corrupt.jpg" in reasons and "empty.png: empty file (0 bytes)" in reasons and caplog.text == ""
    # exactly resumable, and the same with worker processes
    resumed = [b for _, b in zip(range(3), build_loader(data, views, 4, seed=5, start=3), strict=False)]
    workers = [b for _, b in zip(range(6), build_loader(data, views, 4, seed=5, num_workers=2), strict=False)]
    for expected, got in zip(batches[3:], resumed, strict=True):
        assert torch.equal(expected["image"], got["image"]) and torch.equal(expected["skipped"], got["skipped"])
    for expected, got in zip(batches, workers, strict=True):
        assert torch.equal(expected["image"], got["image"]) and torch.equal(expected["label"], got["label"])


def test_training_on_a_folder_with_bad_files_counts_them(tmp_path, caplog):
    from accelerate.state import AcceleratorState
    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs
    from ssl_vit.train import pretrain

    _bad_folder(tmp_path / "images")
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=[
            "model=vit_test", "data=folder", f"data.root={tmp_path / 'images'}", "data.num_workers=0",
            "data.batch_size=4", "trainer.max_steps=6", "trainer.log_every=3", "trainer.progress=false",
            "trainer.trackers=[]", f"output_dir={tmp_path / 'run'}"])
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with caplog.at_level(logging.INFO, logger="ssl_vit"):
            summary = pretrain(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    # 6 steps x 4 = two epochs of 12 files: each of the 2 bad ones is replaced twice, counted and named once
    assert summary["finished"] and summary["skipped_samples"] == 2
    assert "done: 6 steps" in caplog.text and ", 2 bad samples skipped; encoder at" in caplog.text
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped bad sample")]
    assert len(named) == 2 and len(set(named)) == 2, named


def test_a_folder_without_a_readable_image_is_a_clear_error(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(b"")
    (tmp_path / "a" / "y.jpg").write_bytes(b"\xff\xd8\xff junk")
    views = ViewBuilder(("image",), 8, [0.5] * 3, [0.5] * 3)
    loader = build_loader(FolderDataset(tmp_path), views, 2, num_workers=2)
    with pytest.raises(NoUsableSamplesError, match=r"image folder .* no sample of it is readable; first error: .*x"):
        _first_batch(loader)


def test_feature_extraction_drops_unreadable_samples_with_their_labels(tmp_path, caplog):
    from ssl_vit.backbone import VisionTransformer
    from ssl_vit.eval.features import extract_features

    data = FolderDataset(_bad_folder(tmp_path / "images", good_per_class=2))  # labels 0 0 0 | 1 1 1, 2 bad
    encoder = VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    views = ViewBuilder(("image", "label"), 16, [0.5] * 3, [0.5] * 3)
    with caplog.at_level(logging.WARNING):
        features, labels = extract_features(encoder, data, views, batch_size=2, progress=False)
    assert features.shape == (4, 32) and labels.tolist() == [0, 0, 1, 1]
    assert "corrupt.jpg" in caplog.text and "empty.png" in caplog.text and "dropped 2 of 6 samples" in caplog.text


# ----- item 8: shards -----
def _png(colour=(10, 200, 30), size=8):
    return _encode(Image.new("RGB", (size, size), colour), "PNG")


def _shards(out_dir, count=16, per_shard=8):
    samples = ({"image": torch.full((3, 8, 8), i, dtype=torch.uint8), "label": i % 2} for i in range(count))
    return write_shards(samples, out_dir, source="test", samples_per_shard=per_shard)


def _member_offsets(path):
    with tarfile.open(path) as tar:
        return [(member.offset, member.offset_data, member.size) for member in tar.getmembers()]


def _break(path, how):
    """Damage a shard of 8 samples x 3 files (cls, json, png) after its second sample (member 6)."""
    data = path.read_bytes()
    header, body, size = _member_offsets(path)[6]
    if how == "truncated_member":
        data = data[: body + size // 2]
    elif how == "corrupt_header":  # Python's tarfile ends the archive quietly here
        data = data[:header] + b"\x07" * 512 + data[header + 512:]
    elif how == "cut_between_members":  # no end-of-archive marker
        data = data[:header]
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["truncated_member", "corrupt_header", "cut_between_members"])
@pytest.mark.parametrize("with_sizes", [True, False])
def test_samples_lost_in_a_broken_tar_are_counted_and_the_shard_named(tmp_path, caplog, how, with_sizes):
    summary = _shards(tmp_path)
    assert summary["sizes"] == {"shard-000000.tar": 8, "shard-000001.tar": 8}
    if not with_sizes:
        (tmp_path / SIZES_FILE).unlink()
    _break(tmp_path / "shard-000001.tar", how)
    stream = ShardStream(str(tmp_path), resampled=False, shuffle_buffer=4)
    with caplog.at_level(logging.WARNING):
        pipeline, decode = stream.pipeline(_identity, batch_size=None, need_label=True, epochs=1)
        samples = list(pipeline)
    lost = 6 if with_sizes else 1  # expected - delivered, else at least 1 per broken shard
    assert len(samples) == 10 and decode.skipped == lost
    assert sum(s["skipped"] for s in samples) + decode.trailing == lost
    assert "shard-000001.tar" in caplog.text and f"{lost} sample(s) lost" in caplog.text


def test_trailing_data_after_the_end_of_archive_is_reported_without_losing_the_last_sample(tmp_path):
    _shards(tmp_path, count=8)
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(path.read_bytes() * 2)  # a concatenated archive: tarfile reads the first one only
    *samples, end = read_shard(str(path), expected=16)
    assert len(samples) == 8 and end["lost"] == 8 and "after the end-of-archive marker" in end["error"]


def test_lost_counts_reach_the_batches_through_worker_processes(tmp_path):
    _shards(tmp_path, count=24)  # 3 shards of 8
    _break(tmp_path / "shard-000001.tar", "corrupt_header")  # delivers 2, loses 6
    stream = ShardStream(str(tmp_path), resampled=False, shuffle_buffer=0)
    loader = stream.loader(_identity, 4, num_workers=1, need_label=True)
    batches = [b for _, b in zip(range(5), loader, strict=False)]  # 20 samples: one epoch (18) + 2
    assert all(len(b["label"]) == 4 for b in batches)
    assert sum(int(b["skipped"].sum()) for b in batches) == 6  # this epoch's loss, carried by the next good sample


def _garbage_shards(tmp_path, count=2):
    for index in range(count):
        (tmp_path / f"bad-{index:06d}.tar").write_bytes(b"this is not a tar file " * 40)
    return str(tmp_path)


@pytest.mark.parametrize("resampled", [True, False])
def test_no_usable_shard_is_an_error_not_a_hang_even_from_worker_processes(tmp_path, resampled):
    stream = ShardStream(_garbage_shards(tmp_path), resampled=resampled, shuffle_buffer=8)
    loader = stream.loader(_identity, 4, num_workers=2)
    with pytest.raises(NoUsableShardsError, match=r"bad-00000[01].tar: ReadError: invalid header") as caught:
        _first_batch(loader)
    assert "none of the" in str(caught.value)


def test_shards_whose_every_sample_is_unusable_are_an_error(tmp_path):
    write_tar(tmp_path / "s-000000.tar", [(f"{i:03d}", {"png": _png(), "txt": b"no label"}) for i in range(10)])
    stream = ShardStream(str(tmp_path), resampled=True, shuffle_buffer=0, max_consecutive_bad=30)
    pipeline, _ = stream.pipeline(_identity, 4, need_label=True)
    with pytest.raises(NoUsableShardsError, match=r"the last 30 samples .* all unusable .* has no 'cls'"):
        next(iter(pipeline))


def test_unresampled_streams_are_endless_and_reshuffle_each_epoch(tmp_path):
    _shards(tmp_path, count=48, per_shard=4)  # 12 shards of 4
    stream = ShardStream(str(tmp_path), resampled=False, shuffle_buffer=0)
    pipeline, _ = stream.pipeline(_identity, batch_size=4, seed=2)
    batches = [b for _, b in zip(range(36), pipeline, strict=False)]  # three epochs, no StopIteration
    epochs = [[int(k) for b in batches[12 * e: 12 * (e + 1)] for k in b["key"]] for e in range(3)]
    assert all(sorted(keys) == list(range(48)) for keys in epochs)  # every sample once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # a new shard order each epoch


def test_fewer_shards_than_ranks_names_the_counts_and_the_fix(tmp_path, monkeypatch):
    _shards(tmp_path, count=8)  # one shard
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    pipeline, _ = ShardStream(str(tmp_path), resampled=False).pipeline(_identity, batch_size=4)
    with pytest.raises(NoUsableShardsError, match=r"splits the 1 shard\(s\) over 2 ranks.*set data.resampled=true"):
        next(iter(pipeline))


def test_a_zero_byte_shard_is_left_out_with_a_warning(tmp_path, caplog):
    _shards(tmp_path, count=8)
    (tmp_path / "shard-000001.tar").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        stream = ShardStream(str(tmp_path), resampled=False, shuffle_buffer=0)
    assert stream.urls == [str(tmp_path / "shard-000000.tar")]
    assert "shard-000001.tar" in caplog.text and "empty (0 bytes)" in caplog.text
    pipeline, decode = stream.pipeline(_identity, batch_size=None, epochs=1)
    assert len(list(pipeline)) == 8 and decode.skipped == 0
    (tmp_path / "shard-000000.tar").write_bytes(b"")
    with pytest.raises(NoUsableShardsError, match="every shard of data.urls is empty"):
        ShardStream(str(tmp_path))


# ----- item 9: the documented data.urls examples work as written -----
def _url_overrides(lines) -> list[str]:
    """The `data.urls=...` arguments of the pretraining commands in these lines (and of the make_shards hint line),
    split as a POSIX shell splits them; trailing `  # comments` dropped."""
    found = []
    for line in lines:
        start = line.find("scripts/pretrain.py") if "scripts/pretrain.py" in line else line.find("or name these shards")
        if start >= 0 and "data.urls=" in line:
            found += [word for word in shlex.split(line[start:].split("  #")[0]) if word.startswith("data.urls=")]
    return found


def test_documented_url_overrides_parse_in_hydra_and_expand(tmp_path, monkeypatch, capsys):
    """Every data.urls example in the wds config's comments, the README and docs/, make_shards' docstring and what
    make_shards prints, run through Hydra's override parser as written, then expanded to the shards."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    from ssl_vit.cli import register_configs

    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("make_shards", ROOT / "scripts" / "make_shards.py")
    make_shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_shards)
    assert make_shards.main(["synthetic", "--out", "data/shapes", "--num-samples", "20", "--img-size", "8",
                             "--samples-per-shard", "1"]) == 0
    printed = _url_overrides(capsys.readouterr().out.splitlines())
    assert printed == ["data.urls=data/shapes", 'data.urls="data/shapes/shard-{000000..000019}.tar"']
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    documented = _url_overrides((ROOT / "configs" / "data" / "wds.yaml").read_text().splitlines()
                                + [line for page in pages for line in page.read_text().splitlines()]
                                + ast.get_docstring(ast.parse((ROOT / "scripts" / "make_shards.py").read_text()))
                                .splitlines())
    assert len(documented) >= 4 and any("{" in o for o in documented) and any("*" in o for o in documented)
    every = [f"data/shapes/shard-{index:06d}.tar" for index in range(20)]
    assert json.loads(Path("data/shapes/sizes.json").read_text()) == {Path(url).name: 1 for url in every}
    register_configs()
    for override in sorted(set(documented + printed)):
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("pretrain", overrides=["data=wds", override])
        if "data/shapes" not in override:  # another machine's shards (docs' cluster examples): the pattern alone
            assert len(list(braceexpand(str(cfg.data.urls)))) > 1, override
            continue
        urls = expand_urls(cfg.data.urls)
        if "shard-0000" in override:  # a list of two shards
            assert urls == every[:2], override
        else:  # the directory, the glob and the brace pattern name them all
            assert urls == every, override


@pytest.mark.slow
def test_training_on_unreadable_shards_stops_with_one_line_and_a_summary(tmp_path):
    from conftest import pretrain_in_process

    shards = tmp_path / "shards"
    shards.mkdir()
    proc = pretrain_in_process("model=vit_test", "objective=mae", "data=wds", f"data.urls={_garbage_shards(shards)}",
                               "data.num_workers=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert len(errors) == 1 and "none of the" in errors[0] and "bad-00000" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 0 and "none of the" in summary["error"]


def test_images_linking_outside_the_root_are_named_once_and_left_out_on_request(tmp_path, caplog):
    """A folder of links into a shared store is read as ImageFolder reads it, with one line naming the links that
    leave data.root; data.follow_symlinks=false leaves them out. Links inside the root are not named."""
    outside = tmp_path / "store"
    outside.mkdir()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(outside / "far.png")
    root = tmp_path / "root"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        Image.new("RGB", (8, 8), (9, 9, 9)).save(root / label / "own.png")
    (root / "a" / "far.png").symlink_to(outside / "far.png")
    (root / "b" / "near.png").symlink_to(root / "a" / "own.png")
    (root / "b" / "linked_dir").symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="ssl_vit"):
        followed = FolderDataset(root, labels=False)
    assert len(followed) == 5  # own x 2, near, far, linked_dir/far
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"data.root={root}: 2 image(s) are symbolic links to files outside it (e.g. ")
    assert said.endswith("they are read (data.follow_symlinks=false leaves them out)")
    kept = FolderDataset(root, labels=True, follow_symlinks=False)
    assert sorted(Path(path).name for path, _ in kept.samples) == ["near.png", "own.png", "own.png"]
    assert kept.targets == [label for _, label in kept.samples]


@pytest.mark.distributed
def test_bad_samples_are_counted_once_over_the_ranks_and_across_a_resume(tmp_path):
    """2 DDP processes on a folder with 2 bad files of 12: each bad file is counted once however many ranks and
    epochs meet it, and a run stopped at step 3 and resumed (the state the main process saved holds the run's
    totals) ends with the same count as the uninterrupted run."""
    from helpers.ranks import pretrain_ranks

    _bad_folder(tmp_path / "images")
    args = ["model=vit_test", "data=folder", f"data.root={tmp_path / 'images'}", "data.num_workers=0",
            "data.batch_size=2", "trainer.max_steps=6", "trainer.log_every=1", "trainer.checkpoint_every=3",
            "trainer.trackers=[]"]
    summaries = {}
    for name, extra in (("whole", [[]]), ("resumed", [["trainer.stop_at_step=3"], ["trainer.resume=auto"]])):
        for more in extra:
            proc = pretrain_ranks(*args, *more, f"hydra.run.dir={tmp_path / name}", config="ddp_cpu2",
                                  log_dir=tmp_path / f"{name}.logs")
            assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert summaries["whole"]["skipped_samples"] == summaries["resumed"]["skipped_samples"] == 2
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped_samples"] for row in rows if "loss" in row][-1] == 2
