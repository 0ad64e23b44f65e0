import itertools

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from probjax_eqx import masks

B = 2


def brute(spec, q_len, kv_len):
    """Independent numpy evaluation of a mask description, by loops."""
    kind = spec[0]
    out = np.zeros((B, q_len, kv_len), bool)
    for b, i, j in itertools.product(range(B), range(q_len), range(kv_len)):
        if kind == "causal":
            off = 0 if spec[1] == "top_left" else kv_len - q_len
            out[b, i, j] = j <= i + off
        elif kind == "window":
            _, left, right, align = spec
            p = i + (0 if align == "top_left" else kv_len - q_len)
            out[b, i, j] = (left is None or j >= p - left) and (right is None or j <= p + right)
        elif kind == "prefix":
            out[b, i, j] = j <= i or j < spec[1][b]
        elif kind == "block":
            out[b, i, j] = i // spec[1] == j // spec[2]
        elif kind == "kv_len":
            out[b, i, j] = j < spec[1][b]
        elif kind == "q_len":
            out[b, i, j] = i < spec[1][b]
        elif kind == "segments":
            out[b, i, j] = spec[1][b, i] == spec[2][b, j]
    return out


def build(spec):
    kind = spec[0]
    if kind == "causal":
        return masks.Causal(spec[1])
    if kind == "window":
        return masks.LocalWindow(spec[1], spec[2], spec[3])
    if kind == "prefix":
        return masks.PrefixLM(jnp.asarray(spec[1]))
    if kind == "block":
        return masks.BlockDiagonal(spec[1], spec[2])
    if kind == "kv_len":
        return masks.KVLengths(jnp.asarray(spec[1]))
    if kind == "q_len":
        return masks.QLengths(jnp.asarray(spec[1]))
    if kind == "segments":
        return masks.Segments(jnp.asarray(spec[1]), jnp.asarray(spec[2]), sorted=spec[3])
    raise AssertionError(kind)


def leaf_specs(draw, q_len, kv_len):
    kind = draw(
        st.sampled_from(["causal", "window", "prefix", "block", "kv_len", "q_len", "segments"])
    )
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    side = st.one_of(st.none(), st.integers(0, 6))
    if kind == "causal":
        return ("causal", align)
    if kind == "window":
        return ("window", draw(side), draw(side), align)
    if kind == "prefix":
        return ("prefix", draw(st.lists(st.integers(0, kv_len), min_size=B, max_size=B)))
    if kind == "block":
        return ("block", draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    if kind in ("kv_len", "q_len"):
        n = kv_len if kind == "kv_len" else q_len
        return (kind, draw(st.lists(st.integers(0, n), min_size=B, max_size=B)))
    sorted_ids = draw(st.booleans())

    def ids(n):
        values = np.asarray(draw(st.lists(st.integers(0, 3), min_size=B * n, max_size=B * n)))
        values = values.reshape(B, n)
        return np.sort(values, axis=1) if sorted_ids else values

    return ("segments", ids(q_len), ids(kv_len), sorted_ids)


@st.composite
def mask_trees(draw):
    q_len, kv_len = draw(st.integers(1, 12)), draw(st.integers(1, 12))

    def tree(depth):
        op = draw(st.sampled_from(["leaf", "leaf", "and", "or", "not"])) if depth < 2 else "leaf"
        if op == "leaf":
            spec = leaf_specs(draw, q_len, kv_len)
            return build(spec), brute(spec, q_len, kv_len)
        if op == "not":
            m, d = tree(depth + 1)
            return ~m, ~d
        (m1, d1), (m2, d2) = tree(depth + 1), tree(depth + 1)
        return (m1 & m2, d1 & d2) if op == "and" else (m1 | m2, d1 | d2)

    mask, dense = tree(0)
    return mask, dense, q_len, kv_len


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mask_trees(), st.data())
def test_dense_and_tile_bounds_match_brute_force(case, data):
    mask, expected, q_len, kv_len = case
    dense = np.asarray(mask.dense(B, q_len, kv_len))[:, 0]
    np.testing.assert_array_equal(dense, expected)
    ctx = masks.MaskContext(B, q_len, kv_len)
    # Bounds are conservative: no valid pair lies outside them, for any block.
    q_lo = data.draw(st.integers(0, q_len - 1))
    q_hi = data.draw(st.integers(q_lo + 1, q_len))
    kv_lo = data.draw(st.integers(0, kv_len - 1))
    kv_hi = data.draw(st.integers(kv_lo + 1, kv_len))
    for b in range(B):
        lo, hi = (
            int(x) for x in mask.kv_range(ctx, jnp.int32(b), jnp.int32(q_lo), jnp.int32(q_hi))
        )
        assert 0 <= lo <= hi <= kv_len
        rows = expected[b, q_lo:q_hi]
        assert not rows[:, :lo].any() and not rows[:, hi:].any(), (b, lo, hi)
        lo, hi = (
            int(x) for x in mask.q_range(ctx, jnp.int32(b), jnp.int32(kv_lo), jnp.int32(kv_hi))
        )
        assert 0 <= lo <= hi <= q_len
        cols = expected[b, :, kv_lo:kv_hi]
        assert not cols[:lo].any() and not cols[hi:].any(), (b, lo, hi)
        # Full ranges are sound: every pair inside them is valid.
        lo, hi = (
            int(x) for x in mask.kv_full_range(ctx, jnp.int32(b), jnp.int32(q_lo), jnp.int32(q_hi))
        )
        assert 0 <= lo and hi <= kv_len and rows[:, lo:hi].all(), (b, lo, hi)
        lo, hi = (
            int(x) for x in mask.q_full_range(ctx, jnp.int32(b), jnp.int32(kv_lo), jnp.int32(kv_hi))
        )
        assert 0 <= lo and hi <= q_len and cols[lo:hi].all(), (b, lo, hi)


def test_bounds_are_tight_for_structured_masks():
    ctx = masks.MaskContext(1, 64, 64)
    b = jnp.int32(0)
    assert [int(x) for x in masks.Causal().kv_range(ctx, b, jnp.int32(16), jnp.int32(32))] == [
        0,
        32,
    ]
    window = masks.causal_local_window(8)
    assert [int(x) for x in window.kv_range(ctx, b, jnp.int32(32), jnp.int32(48))] == [25, 48]
    lengths = masks.KVLengths(jnp.array([20]))
    assert [
        int(x) for x in (masks.Causal() & lengths).kv_range(ctx, b, jnp.int32(32), jnp.int32(48))
    ] == [0, 20]
    seg = masks.Segments(jnp.repeat(jnp.arange(4), 16)[None], sorted=True)
    assert [int(x) for x in seg.kv_range(ctx, b, jnp.int32(16), jnp.int32(32))] == [16, 32]
    assert [int(x) for x in masks.Causal().q_range(ctx, b, jnp.int32(16), jnp.int32(32))] == [
        16,
        64,
    ]


def test_full_ranges_are_tight_for_structured_masks():
    ctx = masks.MaskContext(1, 64, 64)
    b = jnp.int32(0)

    def kv_full(mask, lo, hi):
        return [int(x) for x in mask.kv_full_range(ctx, b, jnp.int32(lo), jnp.int32(hi))]

    assert kv_full(masks.Causal(), 16, 32) == [0, 17]
    assert kv_full(masks.causal_local_window(8), 32, 34) == [26, 33]
    assert kv_full(masks.Causal() & masks.KVLengths(jnp.array([10])), 16, 32) == [0, 10]
    seg = masks.Segments(jnp.repeat(jnp.arange(4), 16)[None], sorted=True)
    assert kv_full(seg, 16, 32) == [16, 32]
    assert kv_full(seg, 8, 24)[1] <= kv_full(seg, 8, 24)[0]  # two segments: nothing
    assert kv_full(masks.MaskFn(lambda b, h, q, kv: q >= kv), 0, 8) == [0, 0]


def test_causal_local_window_equals_causal_and_window():
    a = masks.causal_local_window(4).dense(1, 10, 10)
    b = (masks.Causal() & masks.LocalWindow(left=3)).dense(1, 10, 10)
    np.testing.assert_array_equal(a, b)


def test_per_batch_arrays_broadcast():
    scalar = masks.KVLengths(3).dense(2, 4, 5)
    batched = masks.KVLengths(jnp.array([3, 3])).dense(2, 4, 5)
    np.testing.assert_array_equal(scalar, batched)


def test_mask_fn_and_dense_mask():
    fn = masks.MaskFn(lambda b, h, q, kv: (q + kv) % 2 == 0)
    dense = np.asarray(fn.dense(1, 4, 4))[0, 0]
    expected = (np.arange(4)[:, None] + np.arange(4)[None]) % 2 == 0
    np.testing.assert_array_equal(dense, expected)
    np.testing.assert_array_equal(
        masks.DenseMask(expected[None, None]).dense(1, 4, 4)[0, 0], expected
    )


def test_invalid_masks_raise():
    with pytest.raises(ValueError, match="left=-1"):
        masks.LocalWindow(left=-1)
    with pytest.raises(ValueError, match="window=0"):
        masks.causal_local_window(0)
    with pytest.raises(ValueError, match="block sizes"):
        masks.BlockDiagonal(0)
    with pytest.raises(TypeError, match="masks combine with masks"):
        masks.Causal() & True  # type: ignore[operator]
