"""Dense evaluation (eval=segmentation: DINOv2's linear protocol) and the attentive probe (eval=attentive): masks of
the built-in sources against their generators, the linear head on separable and on random features, the scores on a
hand-made confusion matrix, a folder of image + mask pairs, and the evaluate CLI."""

import numpy as np
import pytest
import torch
from conftest import ROOT
from hydra import compose, initialize_config_dir
from PIL import Image

from ssl_vit.artifacts import save_encoder
from ssl_vit.backbone import build_vit
from ssl_vit.cli import register_configs
from ssl_vit.data.segmentation import ALPHA_THRESHOLD, IGNORE_INDEX, SegmentationFolder, TuxPaintComposites
from ssl_vit.data.synthetic import COLOURS, SHAPES, SIZES, SyntheticShapes
from ssl_vit.eval.attentive import attentive_probe
from ssl_vit.eval.run import evaluate
from ssl_vit.eval.segmentation import extract_dense, linear_segmentation, scores
from ssl_vit.preprocess import Preprocess
from ssl_vit.schema import ConfigError


def test_synthetic_masks_are_the_generators_discs_and_squares():
    """Each disc / square mask counts the pixel centres inside the circle of radius `half` / the square of half-side
    0.85 x half, drawn again from the sample's generator; the masked pixels carry the shape's colour."""
    dataset = SyntheticShapes(num_samples=60, img_size=40, seed=3)
    checked = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        rng = np.random.default_rng([3, index])
        label = int(rng.integers(len(SHAPES)))
        size = list(SIZES)[rng.integers(len(SIZES))]
        colour = np.array(COLOURS[list(COLOURS)[rng.integers(len(COLOURS))]])
        half = rng.uniform(*SIZES[size]) * 40 / 2
        cx, cy = rng.uniform(half, 40 - half, size=2)
        mask = sample["mask"].numpy()
        assert set(np.unique(mask)) <= {0, label + 1} and sample["label"] == label
        y, x = np.mgrid[0:40, 0:40] + 0.5
        if SHAPES[label] == "disc":
            inside = (x - cx) ** 2 + (y - cy) ** 2 <= half ** 2
        elif SHAPES[label] == "square":
            inside = (np.abs(x - cx) <= 0.85 * half) & (np.abs(y - cy) <= 0.85 * half)
        else:
            continue
        assert (mask > 0).sum() == inside.sum() and np.array_equal(mask > 0, inside)
        pixels = sample["image"].permute(1, 2, 0).numpy()[inside].astype(float)
        assert np.abs(pixels.mean(0) - colour).max() < 45  # the colour's jitter (12) + noise (4), clipped
        checked += 1
    assert checked >= 8
    assert SyntheticShapes.segmentation_classes[0] == "background"


def test_tux_paint_masks_are_the_stamps_alpha_at_the_threshold():
    """Inside its box, a composite's mask is the stamp's alpha channel, resized to the box, at >= 128 of 255, of
    the stamp's category (its top-level directory) + 1; outside, background."""
    dataset = TuxPaintComposites(img_size=48, num_samples=12, split="test")
    for index in range(len(dataset)):
        sample = dataset[index]
        path, (top, left, height, width) = sample["meta"]["path"], sample["meta"]["box"]
        stamp = Image.open(dataset.root / path).convert("RGBA")
        if max(stamp.size) > 192:
            stamp.thumbnail((192, 192), Image.BILINEAR)
        alpha = np.asarray(stamp.resize((width, height), Image.BILINEAR))[..., 3]
        category = dataset.segmentation_classes.index(path.split("/")[0])
        mask = sample["mask"].numpy()
        expected = np.zeros_like(mask)
        expected[top:top + height, left:left + width] = (alpha >= ALPHA_THRESHOLD) * category
        assert np.array_equal(mask, expected), path
        assert (mask > 0).sum() == (alpha >= 128).sum() > 0 and sample["label"] == category - 1
    train = TuxPaintComposites(img_size=48, num_samples=4, split="train")
    assert not set(train.stamps) & set(dataset.stamps)  # test composites paste unseen stamps
    assert train.segmentation_classes == dataset.segmentation_classes and len(train.segmentation_classes) == 18


def _grid_masks(classes: torch.Tensor, patch: int) -> torch.Tensor:
    return classes.repeat_interleave(patch, dim=1).repeat_interleave(patch, dim=2)


def test_the_linear_head_segments_separable_tokens_perfectly():
    """Tokens that are one-hot codes of their patch's class (plus noise), masks constant per patch: mIoU 1.0. The
    classes change from one column of patches to the next only (stripes): bilinear upsampling then weighs a
    pixel's own patch at >= 0.625 against its neighbour's 0.375 (with a 2-D layout, three neighbours of one other
    class can outweigh a corner pixel's own patch, 0.39 against 0.61, and no linear head is exact there)."""
    generator = torch.Generator().manual_seed(0)
    classes = torch.randint(0, 5, (60, 1, 6), generator=generator).expand(60, 6, 6)
    features = torch.nn.functional.one_hot(classes, 5).permute(0, 3, 1, 2).float() * 3
    features = torch.cat([features, torch.randn(60, 3, 6, 6, generator=generator) * 0.1], dim=1)
    masks = _grid_masks(classes, 4)
    masks[:, 0, 0] = IGNORE_INDEX  # ignored pixels count nowhere
    result = linear_segmentation(features[:40], masks[:40], features[40:], masks[40:], 5, [1e-4, 1e-2])
    assert result["miou"] == 1.0 and result["pixel_accuracy"] == 1.0 and result["mask_size"] == [24, 24]


@pytest.mark.slow
def test_the_linear_head_on_random_tokens_sits_at_the_class_frequency_floor():
    """Random tokens carry nothing: the head predicts the most frequent class (background) everywhere, so pixel
    accuracy is its frequency and mIoU its frequency over the classes present."""
    dataset = SyntheticShapes(num_samples=300, img_size=32)
    masks = torch.stack([dataset[i]["mask"] for i in range(300)]).long()
    features = torch.randn(300, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    result = linear_segmentation(features[:200], masks[:200], features[200:], masks[200:], 9, [1e-2, 1e-1, 1.0])
    background = float((masks[200:] == 0).float().mean())
    present = len(torch.unique(masks[200:]))
    assert result["pixel_accuracy"] == pytest.approx(background, abs=0.02)
    assert result["miou"] == pytest.approx(background / present, abs=0.02)


def test_scores_are_mmsegmentations_on_a_hand_made_confusion_matrix():
    confusion = torch.tensor([[50, 10, 0], [5, 20, 0], [0, 0, 0]])  # class 2 absent: not counted
    result = scores(confusion, ["bg", "a", "b"])
    assert result["iou"] == pytest.approx({"bg": 50 / 65, "a": 20 / 35})
    assert result["miou"] == pytest.approx((50 / 65 + 20 / 35) / 2) and result["pixel_accuracy"] == 70 / 85


def test_a_segmentation_folder_reads_pairs_and_skips_bad_masks(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    (tmp_path / "classes.txt").write_text("background\nleft\nright\n")
    rng = np.random.default_rng(0)
    for index in range(6):
        Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(tmp_path / "images" / f"{index}.png")
        mask = np.zeros((20, 30), dtype=np.uint8)
        mask[:, :15], mask[0] = 1, IGNORE_INDEX
        mask[:, 15:] = 2 if index != 4 else 7  # 7: beyond the classes
        Image.fromarray(mask).save(tmp_path / "masks" / f"{index}.png")
    Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8)).save(tmp_path / "masks" / "5.png")  # RGB: not a mask
    dataset = SegmentationFolder(tmp_path)
    assert dataset.segmentation_classes == ("background", "left", "right") and len(dataset) == 6
    encoder = build_vit("vit_test")
    features, masks = extract_dense(encoder, dataset, Preprocess(16, mean=[0.5] * 3, std=[0.5] * 3), progress=False)
    assert features.shape == (4, 32, 4, 4) and masks.shape == (4, 16, 16)  # 2 bad masks skipped
    assert set(torch.unique(masks).tolist()) == {1, 2, IGNORE_INDEX}  # resized by the shorter side, centre-cropped
    (tmp_path / "classes.txt").unlink()
    with pytest.raises(ValueError, match="name the classes in classes.txt"):
        SegmentationFolder(tmp_path)
    assert SegmentationFolder(tmp_path, classes=["a", "b", "c"]).segmentation_classes == ("a", "b", "c")


def test_the_attentive_probe_finds_the_one_informative_token():
    """Seven noise tokens and one whose direction is the class, at a random position: the learned query finds it."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (600,), generator=generator)
    tokens = torch.randn(600, 8, 16, generator=generator)
    position = torch.randint(0, 8, (600,), generator=generator)
    tokens[torch.arange(600), position, :4] += 4 * torch.nn.functional.one_hot(labels, 4)
    tokens[torch.arange(600), position, 4] = 5.0  # a marker the query can attend to
    result = attentive_probe(tokens[:400], labels[:400], tokens[400:], labels[400:], [3e-3], [0.01], epochs=30,
                             batch_size=64, num_heads=2)
    assert result["accuracy"] > 0.9 and result["tokens"] == 8


def _evaluate(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return evaluate(compose("evaluate", overrides=["cache_dir=null", *overrides]), progress=False)


@pytest.mark.slow
def test_evaluate_runs_segmentation_and_the_attentive_probe_and_names_what_has_no_masks(tmp_path):
    torch.manual_seed(0)
    encoder = save_encoder(build_vit("vit_test"), tmp_path / "run" / "encoder.safetensors",
                           Preprocess(16, mean=[0.5] * 3, std=[0.25] * 3))
    common = [f"checkpoint={encoder.parent}", f"output_dir={tmp_path}", "data.max_train_samples=120",
              "data.max_test_samples=60"]
    report = _evaluate(*common, "data=synthetic", "eval=segmentation", "eval.segmentation_blocks=2")
    result = report["results"]["segmentation"]
    assert result["grid"] == [4, 4] and result["mask_size"] == [16, 16] and result["blocks"] == 2
    assert result["num_classes"] == 9 and 0 < result["miou"] <= 1 and result["num_test"] == 60
    attentive = _evaluate(*common, "data=digits", "eval=attentive", "eval.attentive_epochs=2")["results"]
    assert 0.1 < attentive["attentive"]["accuracy"] <= 1 and attentive["attentive"]["tokens"] == 17
    with pytest.raises(ConfigError, match="eval=segmentation needs masks; data=digits has none"):
        _evaluate(*common, "data=digits", "eval=segmentation")
