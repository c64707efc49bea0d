"""DINO's head, loss, centring and teacher-temperature schedule against references written here from the paper's
formulas (Caron et al. 2021, Algorithm 1 and section 3.1); DINOv2's Sinkhorn-Knopp centring, KoLeo and iBOT patch
loss (Oquab et al. 2024, section 4) against their defining properties."""

import math

import numpy as np
import pytest
import torch
from helpers.ranks import on_ranks

from ssl_vit.data.token_masks import GlobalCropMasks, block_mask, ibot_masks
from ssl_vit.objectives.dino_head import DINOHead, WeightNormLinear
from ssl_vit.objectives.losses.dino import dino_loss, sinkhorn_knopp, teacher_temperature_schedule, updated_centre
from ssl_vit.objectives.losses.ibot import masked_patch_loss, masked_tokens, masked_tokens_loss
from ssl_vit.objectives.losses.koleo import koleo_loss


def reference_loss(student_crops, teacher_globals, centre, ts, tt):
    """H(Pt(x), Ps(x')) = -sum Pt log Ps, summed over every (global x, any view x' != x), averaged over pairs and
    samples; written per sample and per pair, with explicit exponentials."""
    total, pairs = 0.0, 0
    for i, t in enumerate(teacher_globals):
        for v, s in enumerate(student_crops):
            if v == i:
                continue
            for b in range(t.shape[0]):
                pt = torch.exp((t[b].double() - centre[0].double()) / tt)
                pt = pt / pt.sum()
                ps = torch.exp(s[b].double() / ts)
                ps = ps / ps.sum()
                total += float(-(pt * ps.log()).sum()) / t.shape[0]
            pairs += 1
    return total / pairs


@pytest.mark.parametrize("n_local", [0, 2, 6])
def test_dino_loss_equals_the_papers_formula(n_local):
    torch.manual_seed(n_local)
    batch, k = 3, 17
    crops = [torch.randn(batch, k) * 3 for _ in range(2 + n_local)]
    teacher = [torch.randn(batch, k) * 3 for _ in range(2)]
    centre = torch.randn(1, k) * 0.1
    ours = dino_loss(torch.cat(crops), torch.cat(teacher), centre, student_temp=0.1, teacher_temp=0.04)
    assert float(ours) == pytest.approx(reference_loss(crops, teacher, centre, 0.1, 0.04), abs=1e-6, rel=1e-6)


def test_uniform_logits_give_exactly_ln_k():
    k = 4096
    loss = dino_loss(torch.zeros(8 * 4, k), torch.zeros(2 * 4, k), torch.zeros(1, k), 0.1, 0.04)
    assert float(loss) == pytest.approx(math.log(k), abs=1e-6)


def test_a_student_row_count_that_is_not_crops_times_batch_is_refused():
    with pytest.raises(ValueError, match="not n_crops x batch"):
        dino_loss(torch.zeros(7, 5), torch.zeros(4, 5), torch.zeros(1, 5), 0.1, 0.04)


def test_centre_update_closed_form_and_all_reduce():
    centre, teacher = torch.full((1, 4), 2.0), torch.arange(12.0).reshape(3, 4)
    expected = 0.9 * 2.0 + 0.1 * teacher.mean(dim=0, keepdim=True)
    torch.testing.assert_close(updated_centre(centre, teacher, 0.9), expected)
    # two ranks with the same rows: the all-reduced sum doubles, the global batch too, so the mean is unchanged
    torch.testing.assert_close(updated_centre(centre, teacher, 0.9, all_reduce_sum=lambda t: 2 * t), expected)
    # ranks with different row counts (masked patches): the mean over all rows; with no rows at all, no change
    other = torch.full((5, 4), 7.0)
    other_rank = torch.cat([other.sum(dim=0), torch.tensor([5.0])])  # what the other rank adds: its sum and count
    both = updated_centre(centre, teacher, 0.9, all_reduce_sum=lambda t: t + other_rank)
    torch.testing.assert_close(both, 0.9 * 2.0 + 0.1 * torch.cat([teacher, other]).mean(dim=0, keepdim=True))
    assert torch.equal(updated_centre(centre, torch.zeros(0, 4), 0.9), centre)


def test_teacher_temperature_warms_up_linearly_then_stays():
    np.testing.assert_allclose(teacher_temperature_schedule(0.04, 0.07, 4, 7),
                               [0.04, 0.05, 0.06, 0.07, 0.07, 0.07, 0.07])
    np.testing.assert_allclose(teacher_temperature_schedule(0.04, 0.04, 0, 3), [0.04] * 3)


def test_head_shapes_normalisation_and_weight_norm():
    torch.manual_seed(0)
    head = DINOHead(32, 100, hidden_dim=64, bottleneck_dim=16, nlayers=3)
    assert [m.out_features for m in head.mlp if isinstance(m, torch.nn.Linear)] == [64, 64, 16]
    x = torch.randn(5, 32)
    assert head(x).shape == (5, 100)
    rows = head.last_layer.weight().norm(dim=1)
    torch.testing.assert_close(rows, torch.ones(100))  # norm_last_layer: every prototype has norm 1
    assert [n for n, _ in head.last_layer.named_parameters()] == ["weight_v"]
    free = WeightNormLinear(16, 10, fixed_norm=False)
    assert torch.equal(free.weight_g, torch.ones(10, 1))  # g starts at 1, as DINO's fill_(1)
    free.weight_g.data.mul_(3.0)
    torch.testing.assert_close(free.weight().norm(dim=1), torch.full((10,), 3.0))  # then g is each row's norm
    assert isinstance(DINOHead(32, 10, 64, 16, weight_norm=False).last_layer, torch.nn.Linear)
    with pytest.raises(ValueError, match="nlayers=0 is invalid"):
        DINOHead(32, 10, nlayers=0)


def test_sinkhorn_knopp_balances_prototypes_and_normalises_samples():
    torch.manual_seed(0)
    batch, k = 64, 16
    q = sinkhorn_knopp(torch.randn(batch, k) * 0.05, teacher_temp=0.1)  # scores of std 0.5
    torch.testing.assert_close(q.sum(dim=1), torch.ones(batch), atol=1e-3, rtol=0)  # each sample: an assignment
    torch.testing.assert_close(q.sum(dim=0), torch.full((k,), batch / k), atol=1e-3, rtol=0)  # prototypes: B / K
    # Peaked scores (std 2) are balanced only approximately after DINOv2's 3 iterations, and converge with more.
    peaked = torch.randn(batch, k) * 0.2

    def imbalance(iterations):
        return float((sinkhorn_knopp(peaked, 0.1, iterations).sum(dim=0) - batch / k).abs().max())

    assert imbalance(50) < 1e-3 < imbalance(3)
    assert torch.isfinite(sinkhorn_knopp(torch.full((4, 8), 30.0), teacher_temp=0.04)).all()  # exp(750) would not be


def _sinkhorn_rank(rank, logits, out):
    half = logits.shape[0] // 2
    torch.save(sinkhorn_knopp(logits[rank * half:(rank + 1) * half], teacher_temp=0.1), out / f"rank{rank}.pt")


@pytest.mark.distributed
def test_sinkhorn_knopp_on_two_processes_equals_one_process_on_the_whole_batch(tmp_path):
    torch.manual_seed(1)
    logits = torch.randn(12, 10)
    on_ranks(_sinkhorn_rank, logits, tmp_path, log_dir=tmp_path / "ranks")
    together = torch.cat([torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)])
    torch.testing.assert_close(together, sinkhorn_knopp(logits, teacher_temp=0.1), atol=1e-6, rtol=1e-5)


def test_koleo_is_finite_on_duplicate_rows_and_rewards_spread():
    duplicates = torch.ones(4, 8)
    assert torch.isfinite(koleo_loss(duplicates))
    spread = torch.eye(8)[:4]  # orthogonal rows: nearest distance sqrt(2)
    assert float(koleo_loss(spread)) == pytest.approx(-math.log(math.sqrt(2)), abs=1e-6)
    assert koleo_loss(spread) < koleo_loss(duplicates)


def test_masked_patch_loss_reads_only_masked_patches():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 7), torch.softmax(torch.randn(2, 5, 7), dim=-1)
    mask = torch.tensor([[True, False, True, False, False], [False] * 5])
    loss = masked_patch_loss(student, teacher, mask, 0.1)
    changed = student.clone()
    changed[~mask] = 100.0  # unmasked patches: anything
    assert float(masked_patch_loss(changed, teacher, mask, 0.1)) == pytest.approx(float(loss))
    log_p = torch.log_softmax(student[0] / 0.1, dim=-1)
    by_hand = -(teacher[0, [0, 2]] * log_p[[0, 2]]).sum(dim=-1).mean() / 2  # image 2 has no masked patch: 0
    assert float(loss) == pytest.approx(float(by_hand), rel=1e-6)
    # the objective's form, on the masked tokens only, is the same loss
    assert float(masked_tokens_loss(student[mask], teacher[mask], mask, 0.1)) == pytest.approx(float(loss), rel=1e-6)


def test_block_masks_are_rectangles_up_to_the_target_count():
    generator = torch.Generator().manual_seed(0)
    for target in (1, 4, 20, 50, 98):  # a block has 4 patches or more, unless fewer are left: at most the target
        mask = block_mask((14, 14), target, generator)
        assert (0.75 * target if target >= 20 else 0) <= int(mask.sum()) <= target, (target, int(mask.sum()))
        if target >= 20:  # blocks, not scattered patches: almost every masked patch has a masked neighbour
            padded = torch.nn.functional.pad(mask.float()[None, None], (1, 1, 1, 1))[0, 0]
            neighbours = padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
            assert float((neighbours[mask] > 0).float().mean()) > 0.95


def _dinov2_masking_generator(rows, cols, num_masking, rng, min_num_patches=4, min_aspect=0.3):
    """DINOv2's `MaskingGenerator` (dinov2/data/masking.py, max_num_patches half the grid as its train.py sets),
    written here from its code with a numpy generator."""
    def uniform(a, b):  # Python's random.uniform, which DINOv2 calls: reversed bounds are allowed
        return a + (b - a) * rng.random()

    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    mask = np.zeros((rows, cols), dtype=bool)
    count = 0
    while count < num_masking:
        max_mask_patches = min(num_masking - count, 0.5 * rows * cols)
        delta = 0
        for _ in range(10):
            target_area = uniform(min_num_patches, max_mask_patches)
            aspect = math.exp(uniform(*log_aspect))
            h, w = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
            if w < cols and h < rows:
                top, left = rng.integers(0, rows - h + 1), rng.integers(0, cols - w + 1)
                fresh = h * w - mask[top:top + h, left:left + w].sum()
                if 0 < fresh <= max_mask_patches:
                    delta = int(fresh)
                    mask[top:top + h, left:left + w] = True
                    break
        if delta == 0:
            break
        count += delta
    return mask


def _block_statistics(masks):
    """Mean masked patches, connected blocks (4-neighbour) and bounding-box area per block, over masked images."""
    from scipy import ndimage

    counts, blocks, boxes = [], [], []
    for mask in masks:
        labels, n = ndimage.label(mask)
        counts.append(mask.sum())
        blocks.append(n)
        boxes += [(s[0].stop - s[0].start) * (s[1].stop - s[1].start) for s in ndimage.find_objects(labels)]
    return np.mean(counts), np.mean(blocks), np.mean(boxes)


@pytest.mark.slow
def test_block_masks_have_the_statistics_of_dinov2s_masking_generator():
    """On DINOv2's 14x14 grid with its per-image counts (int(196 * r), r spread over 0.1-0.5), 2,000 images each:
    masked patches, connected blocks per image and block sizes agree with DINOv2's generator."""
    rng, generator = np.random.default_rng(0), torch.Generator().manual_seed(0)
    targets = [int(196 * r) for r in np.linspace(0.1, 0.5, 2000)]
    ours = _block_statistics([block_mask((14, 14), t, generator).numpy() for t in targets])
    reference = _block_statistics([_dinov2_masking_generator(14, 14, t, rng) for t in targets])
    np.testing.assert_allclose(ours, reference, rtol=0.03)


def test_ibot_masks_half_the_images_with_ratios_in_range():
    masks = ibot_masks(16, (8, 8), ratio=(0.1, 0.5), probability=0.5, generator=torch.Generator().manual_seed(0))
    counts = masks.sum(dim=1)
    assert masks.shape == (16, 64) and int((counts > 0).sum()) == 8
    assert int(counts.max()) <= 0.5 * 64 and int(counts[counts > 0].min()) >= 0.75 * 0.1 * 64 - 1
    again = ibot_masks(16, (8, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(masks, again)  # a pure function of the generator


def test_collate_masks_pick_the_same_tokens_and_loss_by_their_indices():
    """GlobalCropMasks (drawn in the collate) gives the masks with their flat indices; index_select on those picks
    tokens[mask], and the loss computed through them is the boolean-indexed one."""
    draw = GlobalCropMasks(grid=(4, 4), n_global=2, ratio=(0.1, 0.5), probability=0.5)
    drawn = draw.draw(6, torch.Generator().manual_seed(3))
    masks, indices = drawn["global_masks"], drawn["global_mask_indices"]
    assert masks.shape == (12, 16) and int((masks.sum(dim=1) > 0).sum()) == 6  # 2 crops x 6 images, half masked
    torch.manual_seed(0)
    tokens, teacher = torch.randn(12, 16, 5), torch.softmax(torch.randn(int(masks.sum()), 5), dim=-1)
    assert torch.equal(masked_tokens(tokens, masks, indices), tokens[masks])
    student = masked_tokens(tokens, masks, indices)
    assert float(masked_tokens_loss(student, teacher, masks, 0.1, indices)) == pytest.approx(
        float(masked_tokens_loss(student, teacher, masks, 0.1)), rel=1e-6)
