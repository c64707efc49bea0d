"""Image-text data: caption folders (pairs, splits, transparency on white, unpaired files counted), the text view
tokenised in the loaders with samples without text skipped and counted, shards with captions, Tux Paint's stamps."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT
from helpers.inprocess import run_script
from PIL import Image

from ssl_vit.data import CaptionFolder, ShardStream, SyntheticShapes, TuxPaintStamps, build_loader
from ssl_vit.data.captions import TUXPAINT_DIR
from ssl_vit.data.shards import write_shards
from ssl_vit.objectives.clip import TextTokenizer
from ssl_vit.preprocess import Preprocess

TOKENIZER = TextTokenizer(context_length=16)
START, END = 49406, 49407  # open_clip's BPE start / end of text


@pytest.fixture
def pairs(tmp_path):
    root = tmp_path / "pairs"
    (root / "sub").mkdir(parents=True)
    drawing = np.zeros((8, 8, 4), dtype=np.uint8)
    drawing[2:6, 2:6] = (200, 0, 0, 255)  # an opaque red square on a transparent background
    Image.fromarray(drawing, "RGBA").save(root / "drawing.png")
    (root / "drawing.txt").write_text("a red square\nfr.utf8=un carré rouge\n")
    Image.new("RGB", (10, 8), (0, 0, 255)).save(root / "sub" / "photo.jpg")
    (root / "sub" / "photo.txt").write_text("a blue photo")
    (root / "vector.svg").write_text("<svg/>")  # a caption without a raster image: not a sample, counted
    (root / "vector.txt").write_text("a vector drawing")
    Image.new("RGB", (8, 8)).save(root / "lonely.png")  # an image without a caption: not a sample, counted
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 0, 90, 0] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.save(root / "palette.png", transparency=0)  # a palette PNG whose index 0 is transparent (tRNS)
    (root / "palette.txt").write_text("a green field")
    Image.new("RGB", (8, 8), (0, 255, 0)).save(root / "silent.png")
    (root / "silent.txt").write_text("   \n")  # an empty caption: a sample without text
    return root


def test_a_caption_folder_pairs_images_with_captions_and_counts_the_rest(pairs):
    data = CaptionFolder(pairs)
    assert [s["meta"]["path"] for s in (data[i] for i in range(len(data)))] == [
        "drawing.png", "palette.png", "silent.png", "sub/photo.jpg"]
    assert data.unpaired == {"captions without a raster image": 1, "images without a caption": 1}
    drawing = data[0]
    assert drawing["text"] == "a red square\nfr.utf8=un carré rouge" and "text" not in data[2]
    assert drawing["image"][:, 0, 0].tolist() == [255, 255, 255]  # transparent -> white
    assert drawing["image"][:, 3, 3].tolist() == [200, 0, 0]
    palette = data[1]["image"]  # palette colours, not indices; the transparent index on white
    assert palette[:, 0, 0].tolist() == [255, 255, 255] and palette[:, 4, 4].tolist() == [0, 90, 0]


def test_splits_are_disjoint_stable_and_cover_every_pair(tmp_path):
    for i in range(40):
        Image.new("RGB", (4, 4)).save(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text(f"image {i}")
    train, test = CaptionFolder(tmp_path, "train", 0.25), CaptionFolder(tmp_path, "test", 0.25)
    names = [{p.name for p, _ in d.pairs} for d in (train, test)]
    assert not names[0] & names[1] and len(names[0] | names[1]) == 40 and 4 <= len(names[1]) <= 16
    Image.new("RGB", (4, 4)).save(tmp_path / "new.png")
    (tmp_path / "new.txt").write_text("a new pair")
    assert {p.name for p, _ in CaptionFolder(tmp_path, "test", 0.25).pairs} - {"new.png"} == names[1]
    with pytest.raises(ValueError, match="unknown split 'val'; valid choices: \\['train', 'test', 'all'\\]"):
        CaptionFolder(tmp_path, "val")


def test_the_text_view_is_tokenised_and_a_sample_without_text_is_skipped_and_counted(pairs):
    views = Preprocess(8).view_builder(("image", "text"), tokenizer=TOKENIZER)
    loader = iter(build_loader(CaptionFolder(pairs), views, batch_size=4))
    batch = next(loader)
    assert batch["text"].shape == (4, 16) and batch["text"].dtype == torch.int64
    assert int(batch["skipped"].sum()) == 1  # "silent" has no caption: replaced by the next readable sample
    assert (batch["text"][:, 0] == START).all() and (batch["text"] == END).any(dim=1).all()
    assert (batch["text"] == TOKENIZER("a red square\nfr.utf8=un carré rouge")).all(dim=1).any()


def test_shards_with_captions_feed_the_text_view(tmp_path):
    write_shards(iter(SyntheticShapes(12, 16)), tmp_path, source="synthetic", samples_per_shard=6)
    views = Preprocess(16).view_builder(("image", "text"), tokenizer=TOKENIZER)
    batch = next(iter(ShardStream(str(tmp_path), resampled=False, shuffle_buffer=0).loader(
        views, 4, need_text=True)))
    captions = {SyntheticShapes(12, 16)[i]["text"] for i in range(12)}
    assert batch["text"].shape == (4, 16)
    assert {tuple(TOKENIZER(c).tolist()) for c in captions} >= {tuple(t.tolist()) for t in batch["text"]}


tuxpaint = pytest.mark.skipif(not Path(TUXPAINT_DIR).is_dir(), reason="bash scripts/get_data.sh installs Tux Paint")


@tuxpaint
def test_tux_paint_stamps_give_785_captioned_drawings_on_white():
    everything = TuxPaintStamps()
    assert len(everything) == 785 and everything.unpaired["captions without a raster image"] >= 165
    assert len(TuxPaintStamps(split="train")) + len(TuxPaintStamps(split="test")) == 785
    frog = next(i for i, (path, _) in enumerate(everything.pairs) if path.name == "frog.png")
    sample = everything[frog]
    assert sample["text"] == "A frog." and sample["image"][:, 0, 0].tolist() == [255, 255, 255]


@pytest.mark.slow
@tuxpaint
def test_make_shards_writes_the_held_out_tux_paint_pairs(tmp_path):
    proc = run_script(ROOT / "scripts/make_shards.py", "tuxpaint", "--split", "test", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(TuxPaintStamps(split='test'))} samples from tuxpaint" in proc.stdout
