"""Each operation of duplexkit.models.minicpmo45.sampling on hand-made logits; the expected values
are computed independently with numpy (or written out by hand), never recorded from the code."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from duplexkit.models.minicpmo45 import sampling as S  # noqa: E402

NEG = -np.inf


def _np_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _t(a):
    return torch.tensor(np.asarray(a, dtype=np.float32))


def test_sign_aware_scale_divides_positive_multiplies_negative():
    x = np.array([2.0, -2.0, 0.0, -0.5, 3.0], dtype=np.float32)
    got = S.sign_aware_scale(_t(x), 1.25).numpy()
    np.testing.assert_allclose(got, [1.6, -2.5, 0.0, -0.625, 2.4], rtol=1e-6)


def test_repetition_penalty_hf_on_the_seen_set_only():
    x = np.array([2.0, -2.0, 1.0, -1.0], dtype=np.float32)
    seen = S.seen_mask_rows([[0, 1, 1]], 4)[0]  # repeats count once
    got = S.repetition_penalty_hf(_t(x), seen, 2.0).numpy()
    np.testing.assert_array_equal(got, [1.0, -4.0, 1.0, -1.0])


def test_repetition_penalty_divide_whatever_the_sign():
    x = np.array([2.0, -2.0, 1.0, -1.0], dtype=np.float32)
    seen = S.seen_mask_rows([[0, 1]], 4)[0]
    got = S.repetition_penalty_divide(_t(x), seen, 2.0).numpy()
    np.testing.assert_array_equal(got, [1.0, -1.0, 1.0, -1.0])  # -2 / 2 = -1: a negative logit moves up


def test_repetition_penalty_counted_powers_by_occurrence_and_per_row():
    x = np.array([[2.0, -2.0, 1.0, -1.0], [2.0, -2.0, 1.0, -1.0]], dtype=np.float32)
    window = torch.tensor([[0, 0, 1, 4, 4], [3, 3, 3, 4, 2]])  # 4 == V: padding
    pen = np.array([[1.5], [2.0]], dtype=np.float32)
    counts = np.array([[2, 1, 0, 0], [0, 0, 1, 3]])
    alpha = pen.astype(np.float64) ** counts
    want = np.where(x > 0, x / alpha, x * alpha)
    got = S.repetition_penalty_counted(_t(x), window, torch.from_numpy(pen)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    one = S.repetition_penalty_counted(_t(x[0]), window[0], 1.5).numpy()  # float penalty, 1-D logits
    np.testing.assert_allclose(one, want[0], rtol=1e-6)


def test_seen_mask_rows_pads_ragged_rows():
    m = S.seen_mask_rows([[2], [], [0, 3, 0]], 5).numpy()
    np.testing.assert_array_equal(m, [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 1, 0]])


def test_top_k_keeps_the_k_largest_and_boundary_ties():
    x = np.array([1.0, 5.0, 3.0, 5.0, 2.0, 4.0], dtype=np.float32)
    got = S.top_k_filter(_t(x), 3).numpy()
    np.testing.assert_array_equal(got, [NEG, 5.0, NEG, 5.0, NEG, 4.0])
    got = S.top_k_filter(_t([1.0, 5.0, 3.0, 3.0]), 2).numpy()  # the 2nd largest is tied: both kept
    np.testing.assert_array_equal(got, [NEG, 5.0, 3.0, 3.0])


def _np_top_p_keep(x, top_p):
    p = _np_softmax(x)
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]  # mass of the strictly larger candidates
    n = int((before < top_p).sum())
    return set(order[:max(n, 1)].tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.6, 0.8, 0.9, 0.999])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p):
    x = np.log(np.array([0.05, 0.4, 0.1, 0.25, 0.2], dtype=np.float64)).astype(np.float32)
    got = S.top_p_filter(_t(x), top_p).numpy()
    assert set(np.nonzero(np.isfinite(got))[0].tolist()) == _np_top_p_keep(x, top_p)
    np.testing.assert_array_equal(got[np.isfinite(got)], x[np.isfinite(got)])  # kept logits unchanged


def test_top_p_after_top_k_uses_the_renormalised_mass():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    # top-k 2 leaves 0.4/0.7 = 0.571 and 0.3/0.7: top_p 0.5 keeps the first only, 0.6 both
    k = S.top_k_filter(_t(x), 2)
    assert np.isfinite(S.top_p_filter(k, 0.5, 2).numpy()).tolist() == [True, False, False, False]
    assert np.isfinite(S.top_p_filter(k, 0.6, 2).numpy()).tolist() == [True, True, False, False]


def test_min_p_drops_below_a_fraction_of_the_top_probability():
    x = np.array([3.0, 1.0, 0.0, -2.0, 2.5], dtype=np.float32)
    p = _np_softmax(x)
    got = S.min_p_filter(_t(x), 0.2).numpy()
    np.testing.assert_array_equal(np.isfinite(got), p >= 0.2 * p.max())


def test_filtered_probs_renormalise_the_kept_ids():
    x = np.array([2.0, 1.0, 0.5, -1.0, 0.0], dtype=np.float32)
    got = S.filtered_probs(_t(x), top_k=3).numpy()
    keep = np.array([1, 1, 1, 0, 0], dtype=bool)
    want = np.where(keep, np.exp(x - x.max()), 0.0)
    np.testing.assert_allclose(got, want / want.sum(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(S.filtered_probs(_t(x)).numpy(), _np_softmax(x), rtol=1e-6)


def test_sample_with_noise_is_the_gumbel_argmax_in_vocabulary_order():
    x = np.array([[1.0, 0.5, 0.2, -1.0], [0.0, 0.0, 3.0, 0.1]], dtype=np.float32)
    noise = np.array([[2.0, 0.1, 0.05, 0.01], [0.3, 0.02, 5.0, 0.4]], dtype=np.float32)
    want = np.argmax(x - np.log(noise), axis=-1)
    got = S.sample_with_noise(_t(x), torch.from_numpy(noise)).numpy()
    np.testing.assert_array_equal(got, want)
    # with top-k 2 the ids outside the two largest cannot win whatever their noise
    want_k = np.argmax(np.where(x >= np.sort(x, -1)[:, -2:-1], x, NEG) - np.log(noise), axis=-1)
    np.testing.assert_array_equal(S.sample_with_noise(_t(x), torch.from_numpy(noise), top_k=2).numpy(), want_k)


def test_sample_follows_the_softmax_and_the_generator():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = np.array([int(S.sample(x, [g], temperature=1.0)[0]) for _ in range(n)])
    freq = np.bincount(draws, minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    # temperature 0.5 squares the odds: p ∝ [0.25, 0.09, 0.0225, 0.0025]
    draws = np.array([int(S.sample(x, [g], temperature=0.5)[0]) for _ in range(n)])
    want = np.array([0.25, 0.09, 0.0225, 0.0025])
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / n, want / want.sum(), atol=0.015)
    # top-p 0.6 keeps {0, 1} -> 0.5 / 0.8 and 0.3 / 0.8
    draws = np.array([int(S.sample(x, [g], top_p=0.6)[0]) for _ in range(n)])
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / n, [0.625, 0.375, 0, 0], atol=0.015)


def test_each_row_draws_from_its_own_generator():
    x = torch.zeros(3, 50)
    a = S.sample(x, [torch.Generator().manual_seed(s) for s in (1, 2, 1)])
    b = S.sample(x[:1], [torch.Generator().manual_seed(1)])
    assert a[0] == a[2] == b[0]
    e = S.exp_noise([torch.Generator().manual_seed(9)], 50, "cpu")[0]
    np.testing.assert_array_equal(e.numpy(), torch.empty(50).exponential_(generator=torch.Generator().manual_seed(9)).numpy())
    with pytest.raises(ValueError):
        S.sample(x, [None])
