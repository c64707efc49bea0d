import numpy as np
import pytest
import torch
from PIL import Image

from ssl_vit.data import FolderDataset, StepBatchSampler, SyntheticShapes, ViewBuilder, build_loader
from ssl_vit.data.synthetic import COLOURS, SHAPES


def test_synthetic_is_deterministic_and_varied():
    a, b = SyntheticShapes(64, 32, seed=1), SyntheticShapes(64, 32, seed=1)
    assert torch.equal(a[5]["image"], b[5]["image"]) and a[5]["text"] == b[5]["text"]
    assert not torch.equal(a[5]["image"], SyntheticShapes(64, 32, seed=2)[5]["image"])
    samples = [a[i] for i in range(64)]
    assert samples[0]["image"].shape == (3, 32, 32) and samples[0]["image"].dtype == torch.uint8
    assert len({s["label"] for s in samples}) == len(SHAPES)
    assert len({s["text"] for s in samples}) > 50


def test_synthetic_caption_names_the_label_colour_size_and_place():
    sample = SyntheticShapes(16, 48, seed=0)[3]
    words = sample["text"]
    assert words.startswith("a ") and SHAPES[sample["label"]] in words
    assert any(f" {c} " in words for c in COLOURS)
    assert any(s in words for s in ("small", "medium", "large"))
    assert any(p in words for p in ("top", "bottom", "left", "right", "centre"))


def test_shape_colour_is_painted_where_the_caption_says():
    """A large shape in the centre: the central pixel has the named colour (within the jitter)."""
    data = SyntheticShapes(400, 64, seed=0)
    sample = next(data[i] for i in range(400) if "large" in data[i]["text"] and "centre" in data[i]["text"]
                  and data[i]["label"] in (SHAPES.index("disc"), SHAPES.index("square")))
    colour = next(c for c in COLOURS if f" {c} " in sample["text"])
    centre = sample["image"][:, 32, 32].float().numpy()
    assert np.abs(centre - np.array(COLOURS[colour])).max() < 60


def test_views_normalise_image_and_keep_raw_pixels():
    sample = {"image": torch.full((3, 8, 8), 51, dtype=torch.uint8), "label": 2, "text": "x"}
    views = ViewBuilder(("image", "pixels", "label"), 8, mean=[0.1, 0.2, 0.3], std=[0.5, 0.5, 0.5])
    out = views(sample)
    assert set(out) == {"image", "pixels", "label"}
    torch.testing.assert_close(out["pixels"], torch.full((3, 8, 8), 0.2))
    torch.testing.assert_close(out["image"][:, 0, 0], torch.tensor([0.2, 0.0, -0.2]))
    with pytest.raises(ValueError, match=r"unknown view\(s\) \['depth'\].*valid choices"):
        ViewBuilder(("depth",), 8, [0.5] * 3, [0.5] * 3)
    with pytest.raises(ValueError, match="the crops view needs multi-crop settings"):
        ViewBuilder(("crops",), 8, [0.5] * 3, [0.5] * 3)


def test_sampler_shards_ranks_and_resumes_mid_stream():
    full = StepBatchSampler(100, 8, rank=0, world_size=1, seed=3)
    stream = [b for _, b in zip(range(30), full, strict=False)]  # 12 batches per epoch: crosses 2 epochs
    ranks = [StepBatchSampler(100, 4, rank=r, world_size=2, seed=3) for r in range(2)]
    first = [next(iter(s)) for s in ranks]
    assert [i for i, _ in first[0] + first[1]] == [i for i, _ in stream[0]]  # ranks split one global batch
    resumed = StepBatchSampler(100, 8, seed=3, start=17)
    assert [b for _, b in zip(range(13), resumed, strict=False)] == stream[17:]
    epoch0 = [i for b in stream[:12] for i, _ in b]
    assert len(set(epoch0)) == 96  # no repeats within an epoch


def test_sampler_rejects_a_dataset_smaller_than_one_global_batch():
    with pytest.raises(ValueError, match="fewer than one global batch of 64"):
        StepBatchSampler(40, 32, world_size=2)


def test_augmentation_depends_only_on_the_sample_not_on_workers():
    data = SyntheticShapes(32, 32)
    views = ViewBuilder(("image",), 24, [0.5] * 3, [0.5] * 3, augment=True)
    batches = [next(iter(build_loader(data, views, 8, seed=1, num_workers=w)))["image"] for w in (0, 2)]
    torch.testing.assert_close(batches[0], batches[1], atol=0, rtol=0)


def test_folder_dataset_reads_class_subfolders(tmp_path):
    for cls, colour in (("cats", (200, 0, 0)), ("dogs", (0, 0, 200))):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.new("RGB", (20, 12), colour).save(tmp_path / cls / f"{i}.png")
    data = FolderDataset(tmp_path)
    assert data.classes == ["cats", "dogs"] and len(data) == 6
    sample = data[4]
    assert sample["label"] == 1 and sample["image"].shape == (3, 12, 20)
    assert sample["image"][:, 0, 0].tolist() == [0, 0, 200]
    out = ViewBuilder(("image", "label"), 8, [0.5] * 3, [0.5] * 3)(sample)
    assert out["image"].shape == (3, 8, 8)


def test_folder_dataset_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FolderDataset(tmp_path / "nope")


def test_loader_workers_default_to_the_cores_on_a_gpu_and_the_kinds_choice_on_cpu(monkeypatch):
    """data.num_workers=null: every core of this process's share but one on a GPU (at most 16); on CPU 0 for
    in-memory data and 2 for files to decode; a number given is kept."""
    from types import SimpleNamespace

    from ssl_vit.data import loader_workers

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(96)))
    auto = SimpleNamespace(name="folder", num_workers=None)
    assert loader_workers(auto, "cuda", processes_on_node=8) == 11  # 96 cores / 8 GPUs, one left to the trainer
    assert loader_workers(auto, "cuda", processes_on_node=1) == 16
    assert loader_workers(auto, "cpu") == 2 and loader_workers(SimpleNamespace(name="synthetic", num_workers=None),
                                                                "cpu") == 0
    assert loader_workers(SimpleNamespace(name="folder", num_workers=3), "cuda", 8) == 3
