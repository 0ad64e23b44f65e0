import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from _attention_cases import MASKS, loss_and_grads, make_qkv, numpy_attention
from _check import check_against_oracle, oracle
from probjax_eqx import (
    UnsupportedError,
    biases,
    dot_product_attention,
    flex_attention,
    masks,
    resolve,
)
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels.reference import attention as reference


@pytest.mark.parametrize("name", sorted(MASKS))
def test_reference_matches_numpy(getkey, name):
    q, k, v = make_qkv(getkey(), v_dim=12)
    mask = MASKS[name]
    valid = None if mask is None else np.asarray(mask.dense(2, 7, 9))
    np.testing.assert_allclose(
        oracle(q, k, v, mask), numpy_attention(q, k, v, valid=valid), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["none", "causal", "kv_lengths", "segments", "or_not"])
def test_xla_matches_oracle_fwd_and_grads(getkey, dtype, name):
    q, k, v = make_qkv(getkey(), dtype=dtype)
    mask = MASKS[name]
    ct = jax.random.normal(getkey(), (2, 7, 4, 16))
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="xla")
    check_against_oracle(f, q, k, v, ct, mask=mask)


def test_rows_without_valid_keys_are_zero_with_zero_grads(getkey):
    q, k, v = make_qkv(getkey())
    mask = masks.KVLengths(jnp.array([0, 9])) & masks.QLengths(jnp.array([7, 4]))
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask)  # noqa: E731
    out = f(q, k, v)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1, 4:], 0.0)
    _, (dq, dk, dv) = loss_and_grads(f, q, k, v, jnp.ones((2, 7, 4, 16)))
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(dq[0], 0.0)
    np.testing.assert_array_equal(dk[0], 0.0)
    np.testing.assert_array_equal(dv[0], 0.0)
    np.testing.assert_array_equal(dq[1, 4:], 0.0)


def test_reference_gradients_match_finite_differences(getkey):
    q, k, v = make_qkv(getkey(), batch=1, q_len=4, kv_len=5, q_heads=2, kv_heads=1, qk_dim=4)

    def f(q, k, v):
        return oracle(q, k, v, masks.Causal("bottom_right"), biases.ALiBi.from_num_heads(2))

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_lse_residual(getkey):
    q, k, v = make_qkv(getkey())
    mask = masks.KVLengths(jnp.array([0, 5]))
    _, lse = reference.attention(q, k, v, mask=mask, score_mod=None, scale=0.25, return_lse=True)
    assert lse.shape == (2, 4, 7)
    assert np.all(np.isneginf(lse[0]))
    scores = (
        0.25
        * np.einsum(
            "qhd,khd->hqk",
            np.asarray(q[1], np.float64),
            np.repeat(np.asarray(k[1], np.float64), 2, axis=1),
        )[:, :, :5]
    )
    expected = np.log(np.exp(scores).sum(-1))
    np.testing.assert_allclose(lse[1], expected, atol=1e-5, rtol=1e-5)


def test_score_mods_match_numpy(getkey):
    q, k, v = make_qkv(getkey(), q_len=6, kv_len=6)
    slopes = biases.alibi_slopes(4)
    table = jax.random.normal(getkey(), (4, 8))
    rel = biases.RelativePosition(table, bidirectional=True, max_distance=16)
    idx = np.arange(6)
    alibi_np = -slopes[None, :, None, None] * np.abs(idx[:, None] - idx[None, :])[None, None]
    bucket = np.asarray(
        biases.relative_position_bucket(
            idx[None, :] - idx[:, None], bidirectional=True, num_buckets=8, max_distance=16
        )
    )
    rel_np = np.asarray(table)[:, bucket][None]
    bias = biases.ALiBi(slopes) + rel
    out = dot_product_attention(q, k, v, bias=bias)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, bias=alibi_np + rel_np), atol=1e-5)
    cap = biases.Compose((biases.HeadScale(jnp.arange(1.0, 5.0)), biases.SoftCap(2.0)))
    out = flex_attention(q, k, v, score_mod=cap)
    expected = numpy_attention(q, k, v, score_fn=lambda s, b, h: 2.0 * np.tanh(s * (h + 1) / 2.0))
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_t5_buckets():
    rel = np.arange(-20, 21)
    got = np.asarray(
        biases.relative_position_bucket(rel, bidirectional=False, num_buckets=8, max_distance=16)
    )
    # Causal buckets: exact for distances < 4, log-spaced up to 7, zero for the future.
    assert list(got[rel >= 0]) == [0] * 21
    assert list(got[(rel < 0) & (rel > -4)][::-1]) == [1, 2, 3]
    assert got.max() == 7 and np.all(np.diff(got[rel <= 0][::-1]) >= 0)


def test_flex_callables_equal_dot_product_forms(getkey):
    q, k, v = make_qkv(getkey())
    out = flex_attention(
        q,
        k,
        v,
        score_mod=lambda s, b, h, qi, ki: s - 0.1 * jnp.abs(qi - ki).astype(s.dtype),
        mask=lambda b, h, qi, ki: ki <= qi,
    )
    bias = -0.1 * np.abs(np.arange(7)[:, None] - np.arange(9)[None])[None, None]
    expected = dot_product_attention(q, k, v, bias=bias, mask=masks.Causal())
    np.testing.assert_allclose(out, expected, atol=1e-5)
    dense = dot_product_attention(q, k, v, mask=np.tril(np.ones((7, 9), bool))[None, None])
    np.testing.assert_allclose(
        dense, expected * 0 + dot_product_attention(q, k, v, mask=masks.Causal()), atol=1e-6
    )


def test_transforms_jit_vmap_grad(getkey):
    q, k, v = make_qkv(getkey())
    mask = masks.Causal() & masks.KVLengths(jnp.array([9, 6]))
    f = lambda q, k, v, m: dot_product_attention(q, k, v, mask=m)  # noqa: E731
    eager = f(q, k, v, mask)
    np.testing.assert_allclose(jax.jit(f)(q, k, v, mask), eager, atol=1e-6)
    np.testing.assert_allclose(eqx.filter_jit(f)(q, k, v, mask), eager, atol=1e-6)
    # vmap over a batch of calls, with per-call masks.
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), (q, k, v))
    lens = masks.Causal() & masks.KVLengths(jnp.array([[9, 6], [9, 6]]))
    batched = jax.vmap(f)(*stacked, lens)
    np.testing.assert_allclose(batched[1], eager, atol=1e-6)
    grads = jax.jit(jax.grad(lambda q: f(q, k, v, mask).sum()))(q)
    assert grads.shape == q.shape and np.all(np.isfinite(grads))


def test_unsupported_and_unknown_implementations():
    q, k, v = make_qkv(jax.random.key(0))
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(UnsupportedError, match="implementation='mosaic'.*needs an sm_90 GPU"):
        dot_product_attention(q16, k16, v16, implementation="mosaic")
    cpu_cudnn = resolve("attention", "cudnn", device=DeviceInfo("cpu", "cpu"), environ={})
    with pytest.raises(UnsupportedError, match="not on platform 'cpu'"):
        dot_product_attention(q, k, v, implementation=cpu_cudnn)
    # The message lists the op's own implementations (not every op's names).
    with pytest.raises(
        ValueError, match=r"'auto' or one of \['cudnn', 'mosaic', 'triton', 'xla'\]"
    ):
        dot_product_attention(q, k, v, implementation="flash")


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((2, 7, 4, 16), (2, 9, 2, 16), (2, 8, 2, 16)), "kv_seq"),
        (((2, 7, 4, 16), (2, 9, 3, 16), (2, 9, 3, 16)), "kv_heads"),
        (((2, 7, 4, 16), (2, 9, 2, 8), (2, 9, 2, 16)), "qk_dim"),
        (((2, 7, 4, 16), (3, 9, 2, 16), (3, 9, 2, 16)), "batch"),
    ],
)
def test_bad_shapes_name_the_dimension(shapes, match):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(Exception, match=match) as info:
        dot_product_attention(q, k, v)
    assert info.type.__name__ in ("ValueError", "TypeCheckError")


@pytest.mark.parametrize(
    "mask, score_mod, match",
    [
        # batch 3, 7 queries, 4 heads, 9 keys: per-batch arrays of 2 or 4 would be clamped
        (masks.KVLengths(jnp.array([3, 4])), None, r"KVLengths.lengths has shape \(2,\)"),
        (masks.QLengths(jnp.arange(4)), None, r"QLengths.lengths .* \(batch=3\)"),
        (masks.KVLengths(jnp.ones((3, 1), jnp.int32)), None, r"shape \(3, 1\)"),
        (masks.Causal() & masks.PrefixLM(jnp.array([1, 2])), None, "PrefixLM.prefix_length"),
        (masks.Segments(jnp.zeros((3, 8), jnp.int32), jnp.zeros((3, 9), jnp.int32)), None,
         r"Segments.q_segment_ids .* \(batch=3, q_len=7\)"),
        (masks.DenseMask(jnp.ones((1, 2, 7, 9), bool)), None, r"DenseMask.mask .*heads=4"),
        (None, biases.ALiBi(jnp.ones(2)), r"ALiBi.slopes .* \(heads=4\)"),
        (None, biases.Compose((biases.SoftCap(5.0), biases.HeadScale(jnp.ones(8)))),
         "HeadScale.scales"),
        (None, biases.DenseBias(jnp.zeros((3, 4, 7, 10))), r"DenseBias.values .*kv_len=9"),
    ],
)  # fmt: skip
def test_mask_and_score_mod_arrays_must_fit_the_call(mask, score_mod, match):
    q, k = jnp.zeros((3, 7, 4, 16)), jnp.zeros((3, 9, 2, 16))
    with pytest.raises(ValueError, match=match):
        flex_attention(q, k, k, mask=mask, score_mod=score_mod)
    # Every size 1 (or the axis left out) broadcasts.
    segments = masks.Segments(jnp.zeros((1, 7), jnp.int32), jnp.zeros((1, 9), jnp.int32))
    ones = masks.KVLengths(jnp.array([5])) & segments
    out = flex_attention(q, k, k, mask=ones, score_mod=biases.ALiBi(jnp.ones(4)))
    assert out.shape == q.shape


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_scale_must_be_positive(scale):
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        dot_product_attention(q, q, q, scale=scale)


def test_internal_validation_errors():
    from probjax_eqx.attention import _as_mask, _describe

    z = jnp.zeros
    with pytest.raises(ValueError, match="q_heads=3 must be a multiple of kv_heads=2"):
        _describe(z((1, 4, 3, 8)), z((1, 4, 2, 8)), z((1, 4, 2, 8)), None, None)
    with pytest.raises(TypeError, match="share a dtype"):
        _describe(z((1, 4, 2, 8)), z((1, 4, 2, 8), jnp.bfloat16), z((1, 4, 2, 8)), None, None)
    with pytest.raises(ValueError, match="dimension kv_seq"):
        _describe(z((1, 4, 2, 8)), z((1, 4, 2, 8)), z((1, 5, 2, 8)), None, None)
    with pytest.raises(TypeError, match="floating point"):
        _describe(
            z((1, 4, 2, 8), jnp.int32),
            z((1, 4, 2, 8), jnp.int32),
            z((1, 4, 2, 8), jnp.int32),
            None,
            None,
        )
    with pytest.raises(ValueError, match="rank 4"):
        _describe(z((4, 2, 8)), z((1, 4, 2, 8)), z((1, 4, 2, 8)), None, None)
    with pytest.raises(TypeError, match="boolean"):
        _as_mask(z((1, 1, 4, 4)))


def test_reruns_are_bitwise_identical(getkey):
    q, k, v = make_qkv(getkey())
    f = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask=masks.Causal()))
    np.testing.assert_array_equal(f(q, k, v), f(q, k, v))


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("lq, lkv", [(0, 8), (8, 0), (0, 0)])
def test_empty_sequences(impl, lq, lkv):
    # No queries: an empty output. No keys: every row has no valid key, so zeros. The
    # gradients are zeros of the inputs' shapes.
    from probjax_eqx.kernels.mosaic.attention import MosaicAttentionConfig
    from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

    config = {"triton": TritonAttentionConfig(interpret=True),
              "mosaic": MosaicAttentionConfig(interpret=True)}.get(impl)  # fmt: skip
    q = jnp.ones((2, lq, 4, 64), jnp.bfloat16)
    kv = jnp.ones((2, lkv, 2, 64), jnp.bfloat16)

    def f(q, k, v):
        return dot_product_attention(q, k, v, implementation=impl, config=config)

    out = f(q, kv, kv)
    assert out.shape == (2, lq, 4, 64) and out.dtype == jnp.bfloat16
    assert np.all(np.asarray(out, np.float32) == 0)
    grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))(q, kv, kv)
    for g, x in zip(grads, (q, kv, kv)):
        assert g.shape == x.shape and np.all(np.asarray(g, np.float32) == 0)
