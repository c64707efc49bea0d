import math

import pytest
import torch
from conftest import ROOT
from helpers.inprocess import run_script
from PIL import Image

from ssl_vit.analysis.inspect import (
    attention_rollout,
    class_token_rollout_maps,
    mean_attention_distance,
    patch_distances,
    patch_embedding_components,
    pos_embed_similarity,
)
from ssl_vit.analysis.plots import (
    plot_attention_distance,
    plot_filter_components,
    plot_pos_embed_similarity,
    plot_rollout,
)
from ssl_vit.artifacts import save_encoder
from ssl_vit.backbone import build_vit


def _with_prefix(patch_attention: torch.Tensor) -> torch.Tensor:
    """(N, N) patch attention -> (1, 1, N+1, N+1) with a class token that attends to itself only."""
    n = patch_attention.shape[0]
    full = torch.zeros(n + 1, n + 1)
    full[0, 0] = 1
    full[1:, 1:] = patch_attention
    return full[None, None]


def test_patch_distances_in_pixels():
    distances = patch_distances((2, 2), patch_size=4)
    assert distances[0].tolist() == pytest.approx([0, 4, 4, 4 * math.sqrt(2)])


@pytest.mark.parametrize("pattern, expected", [
    (torch.full((4, 4), 0.25), (0 + 4 + 4 + 4 * math.sqrt(2)) / 4),  # uniform over a 2x2 grid of 4-px patches
    (torch.eye(4), 0.0),  # every patch attends to itself
    (torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], dtype=torch.float), 4.0),  # neighbour
])
def test_mean_attention_distance_on_hand_made_patterns(pattern, expected):
    distance = mean_attention_distance([_with_prefix(pattern)] * 2, grid=(2, 2), patch_size=4)
    assert distance.shape == (2, 1) and distance[0, 0].item() == pytest.approx(expected)


def test_attention_to_the_class_token_is_excluded_and_renormalised():
    attention = _with_prefix(torch.full((4, 4), 0.125))
    attention[0, 0, 1:, 0] = 0.5  # half of every query's mass on the class token
    assert mean_attention_distance([attention], (2, 2), 4)[0, 0].item() == pytest.approx((8 + 4 * math.sqrt(2)) / 4)


def test_rollout_of_uniform_attention_is_uniform_over_patches():
    n = 1 + 9
    uniform = torch.full((2, 3, n, n), 1 / n)
    maps = class_token_rollout_maps([uniform] * 4, grid=(3, 3))
    assert maps.shape == (2, 3, 3)
    torch.testing.assert_close(maps, torch.full_like(maps, maps[0, 0, 0].item()))
    rollout = attention_rollout([uniform] * 4)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, n))  # rows stay distributions


def test_rollout_of_identity_attention_keeps_all_mass_on_the_class_token():
    identity = torch.eye(10).expand(2, 3, 10, 10)
    rollout = attention_rollout([identity] * 3)
    assert torch.equal(rollout[:, 0, 0], torch.ones(2))
    assert torch.equal(class_token_rollout_maps([identity] * 3, (3, 3)), torch.zeros(2, 3, 3))


def test_pos_embed_similarity_and_filter_components():
    encoder = build_vit("vit_test")
    similarity = pos_embed_similarity(encoder)
    assert similarity.shape == (4, 4, 4, 4)
    torch.testing.assert_close(similarity.reshape(16, 16).diagonal(), torch.ones(16))
    with torch.no_grad():  # filters on one direction: the first component explains everything
        direction = torch.randn(3, 4, 4)
        encoder.patch_embed.proj.weight.copy_(torch.randn(32, 1, 1, 1) * direction)
    components, variance = patch_embedding_components(encoder, num_components=5)
    assert components.shape == (5, 3, 4, 4) and variance[0] == pytest.approx(1.0, abs=1e-5)
    cosine = torch.nn.functional.cosine_similarity(components[0].flatten(), direction.flatten(), dim=0)
    assert abs(cosine.item()) == pytest.approx(1.0, abs=1e-5)


def test_the_four_plots_are_pngs_of_what_they_draw(tmp_path):
    """The plotting functions alone (analyze.py's slow test draws them from a trained run): each writes a PNG that
    decodes; the position-similarity figure has one panel per patch position, so it grows with the grid."""
    small = plot_pos_embed_similarity(pos_embed_similarity(build_vit("vit_test")), tmp_path / "a" / "sim.png")
    large = plot_pos_embed_similarity(torch.rand(6, 6, 6, 6) * 2 - 1, tmp_path / "sim6.png")
    paths = [small, large,
             plot_attention_distance(torch.rand(3, 4) * 16, tmp_path / "distance.png", image_size=16),
             plot_rollout(torch.rand(2, 3, 16, 16), torch.rand(2, 4, 4), tmp_path / "rollout.png"),
             plot_filter_components(torch.randn(9, 3, 4, 4), torch.linspace(0.5, 0.01, 9), tmp_path / "pca.png")]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            image.verify()
    with Image.open(small) as a, Image.open(large) as b:
        assert b.size[0] > a.size[0] and b.size[1] > a.size[1]


@pytest.mark.slow
@pytest.mark.parametrize("pos_embed", ["learned", "rope"])
def test_analyze_script_writes_the_four_pngs(tmp_path, pos_embed):
    """Four plots; three for a RoPE encoder, which has no position table to compare (said, not a crash)."""
    torch.manual_seed(0)
    checkpoint = save_encoder(build_vit("vit_test", img_size=32, pos_embed=pos_embed),
                              tmp_path / "encoder.safetensors")
    proc = run_script(ROOT / "scripts" / "analyze.py", checkpoint, "--num-images", "2", "--out", tmp_path / "figs")
    assert proc.returncode == 0, proc.stderr
    names = ["attention_distance", "attention_rollout", "patch_filters_pca"]
    names += ["pos_embed_similarity"] if pos_embed == "learned" else []
    assert sorted(p.stem for p in (tmp_path / "figs").glob("*.png")) == sorted(names)
    for name in names:
        with Image.open(tmp_path / "figs" / f"{name}.png") as image:
            assert image.size[0] > 100 and image.size[1] > 100
