"""RLA: the linear branch against explicit sums; scan == chunked; decode == forward."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tolerance import assert_close
from probjax_eqx.rla import RLA, feature_map, linear_outside_window


def numpy_linear(q, k, v, window):
    fq, fk = (np.asarray(feature_map(a), np.float64) for a in (q, k))
    v = np.asarray(v, np.float64)
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        for s in range(t - window + 1):
            out[t] += np.einsum("hf,hf->h", fq[t], fk[s])[:, None] * v[s]
    return out


@pytest.mark.parametrize("implementation", ["scan", "chunked"])
@pytest.mark.parametrize("window, chunk", [(5, 4), (1, 3), (30, 8)])
def test_linear_branch_matches_explicit_sums(getkey, implementation, window, chunk):
    q, k, v = (jax.random.normal(getkey(), (23, 2, 6)) for _ in range(3))
    out = linear_outside_window(q, k, v, window=window, chunk=chunk, implementation=implementation)
    assert_close(out, numpy_linear(q, k, v, window), jnp.float32)


def test_scan_and_chunked_blocks_agree_with_gradients(getkey):
    key = getkey()
    scan = RLA(16, 2, window=5, chunk=4, implementation="scan", key=key)
    chunked = RLA(16, 2, window=5, chunk=4, implementation="chunked", key=key)
    x = jax.random.normal(getkey(), (19, 16))
    ct = jax.random.normal(getkey(), (19, 16))
    assert_close(chunked(x), scan(x), jnp.float32)
    loss = lambda m, x: jnp.sum(m(x) * ct)  # noqa: E731
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    g1, g2 = grad(scan, x), grad(chunked, x)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert_close(a, b, jnp.float32, grad=True)


def test_decode_steps_equal_the_full_forward(getkey):
    m = RLA(16, 2, window=4, chunk=4, key=getkey())
    x = jax.random.normal(getkey(), (11, 16))
    full = m(x)
    cache, step = m.init_cache(), eqx.filter_jit(m.decode_step)
    ys = []
    for t in range(11):
        y, cache = step(x[t], cache)
        ys.append(y)
    assert_close(jnp.stack(ys), full, jnp.float32)


def test_vmap_and_bf16(getkey):
    m = RLA(16, 2, window=4, chunk=4, key=getkey())
    xs = jax.random.normal(getkey(), (3, 9, 16))
    out = eqx.filter_jit(lambda m, xs: jax.vmap(lambda x: m(x))(xs))(m, xs)
    np.testing.assert_allclose(out[1], m(xs[1]), atol=1e-5)
    m16 = eqx.tree_at(lambda r: [r.w_q, r.w_k, r.w_v, r.w_o], m,
                      [w.astype(jnp.bfloat16) for w in (m.w_q, m.w_k, m.w_v, m.w_o)])  # fmt: skip
    x16 = xs[1].astype(jnp.bfloat16)
    out16 = m16(x16)
    assert out16.dtype == jnp.bfloat16
    # The same bf16-rounded weights and input in float32: only the compute precision differs.
    m32 = jax.tree.map(lambda w: w.astype(jnp.float32) if eqx.is_array(w) else w, m16)
    assert_close(out16, m32(x16.astype(jnp.float32)), jnp.bfloat16)
