"""DINO's head, loss, centring and teacher-temperature schedule against references written here from the paper's
formulas (Caron et al. 2021, Algorithm 1 and section 3.1)."""

import math

import numpy as np
import pytest
import torch

from objectives.distillation import (
    DINOHead,
    WeightNormLinear,
    dino_loss,
    teacher_temperature_schedule,
    updated_centre,
)


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
    torch.testing.assert_close(updated_centre(centre, teacher, 0.9, all_reduce_sum=lambda t: 2 * t, world_size=2),
                               expected)


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
    plain = torch.nn.functional.linear(torch.ones(2, 16), free.weight_v)
    torch.testing.assert_close(free(torch.ones(2, 16)), plain)  # g starts at ||v||: the plain layer
    assert isinstance(DINOHead(32, 10, 64, 16, weight_norm=False).last_layer, torch.nn.Linear)
    with pytest.raises(ValueError, match="nlayers=0 is invalid"):
        DINOHead(32, 10, nlayers=0)
