"""Mamba: the selective scan against a numpy recurrence; scan == associative; decode == forward."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tolerance import assert_close
from probjax_eqx.mamba import Mamba, Mamba2, selective_scan, ssd


def numpy_scan(x, dt, a, b, c, d, h0):
    x, dt, a, b, c, d, h = (np.asarray(t, np.float64) for t in (x, dt, a, b, c, d, h0))
    ys = []
    for t in range(x.shape[0]):
        h = np.exp(dt[t][:, None] * a) * h + (dt[t] * x[t])[:, None] * b[t][None]
        ys.append(h @ c[t] + d * x[t])
    return np.stack(ys), h


@pytest.mark.parametrize("implementation", ["scan", "associative"])
def test_selective_scan_matches_the_recurrence(getkey, implementation):
    seq, d, n = 37, 6, 5
    x = jax.random.normal(getkey(), (seq, d))
    dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, d)))
    a = -jnp.exp(jax.random.normal(getkey(), (d, n)))
    b, c = jax.random.normal(getkey(), (seq, n)), jax.random.normal(getkey(), (seq, n))
    d_skip, h0 = jax.random.normal(getkey(), (d,)), jax.random.normal(getkey(), (d, n))
    y, h = selective_scan(x, dt, a, b, c, d_skip, h0=h0, implementation=implementation)
    y_ref, h_ref = numpy_scan(x, dt, a, b, c, d_skip, h0)
    assert_close(y, y_ref, jnp.float32)
    assert_close(h, h_ref, jnp.float32)


def test_official_initialisation(getkey):
    m = Mamba(32, d_state=8, key=getkey())
    np.testing.assert_allclose(np.exp(m.a_log[0]), np.arange(1, 9), rtol=1e-6)
    np.testing.assert_array_equal(m.d_skip, 1.0)
    dt = np.asarray(jax.nn.softplus(m.dt_bias))
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert m.dt_rank == 2 and m.d_inner == 64


def test_scan_and_associative_blocks_agree_in_value_and_gradient(getkey):
    key = getkey()
    scan = Mamba(16, d_state=4, implementation="scan", key=key)
    assoc = Mamba(16, d_state=4, implementation="associative", key=key)
    x = jax.random.normal(getkey(), (29, 16))
    ct = jax.random.normal(getkey(), (29, 16))
    assert_close(assoc(x), scan(x), jnp.float32)
    loss = lambda m, x: jnp.sum(m(x) * ct)  # noqa: E731
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    g_scan, g_assoc = grad(scan, x), grad(assoc, x)
    for a, b in zip(jax.tree.leaves(g_assoc), jax.tree.leaves(g_scan)):
        assert_close(a, b, jnp.float32, grad=True)


def test_decode_steps_and_chunks_equal_the_full_forward(getkey):
    m = Mamba(16, d_state=4, key=getkey())
    x = jax.random.normal(getkey(), (13, 16))
    full = m(x)
    cache = m.init_cache()
    step = eqx.filter_jit(m.decode_step)
    ys = []
    for t in range(13):
        y, cache = step(x[t], cache)
        ys.append(y)
    assert_close(jnp.stack(ys), full, jnp.float32)
    # Two chunks through the cache give the same as one pass.
    y1, cache = m._forward(x[:6], m.init_cache())
    y2, _ = m._forward(x[6:], cache)
    assert_close(jnp.concatenate([y1, y2]), full, jnp.float32)


def test_vmap_jit_and_scan_over_layers(getkey):
    keys = jax.random.split(getkey(), 3)
    stack = eqx.filter_vmap(lambda k: Mamba(16, d_state=4, key=k))(keys)
    params, static = eqx.partition(stack, eqx.is_array)
    xs = jax.random.normal(getkey(), (2, 9, 16))

    def run(params, x):
        def layer(h, p):
            return h + eqx.combine(p, static)(h), None

        return jax.lax.scan(layer, x, params)[0]

    out = eqx.filter_jit(jax.vmap(run, in_axes=(None, 0)))(params, xs)
    assert out.shape == xs.shape and np.all(np.isfinite(out))
    grads = jax.grad(lambda p: jnp.sum(jax.vmap(run, in_axes=(None, 0))(p, xs) ** 2))(params)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def numpy_ssd(x, dt, a, b, c, d, h0):
    x, dt, a, b, c, d, h = (np.asarray(t, np.float64) for t in (x, dt, a, b, c, d, h0))
    ys = []
    for t in range(x.shape[0]):
        h = np.exp(dt[t] * a)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * b[t]
        ys.append(h @ c[t] + d[:, None] * x[t])
    return np.stack(ys), h


@pytest.mark.parametrize("implementation, chunk", [("scan", 8), ("chunked", 8), ("chunked", 5)])
def test_ssd_matches_the_recurrence(getkey, implementation, chunk):
    seq, heads, p, n = 23, 3, 4, 5
    x = jax.random.normal(getkey(), (seq, heads, p))
    dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, heads)))
    a = -jnp.exp(jax.random.normal(getkey(), (heads,)))
    b, c = jax.random.normal(getkey(), (seq, n)), jax.random.normal(getkey(), (seq, n))
    d, h0 = jax.random.normal(getkey(), (heads,)), jax.random.normal(getkey(), (heads, p, n))
    y, h = ssd(x, dt, a, b, c, d, chunk=chunk, h0=h0, implementation=implementation)
    y_ref, h_ref = numpy_ssd(x, dt, a, b, c, d, h0)
    assert_close(y, y_ref, jnp.float32)
    assert_close(h, h_ref, jnp.float32)


def test_mamba2_chunked_equals_scan_and_decode(getkey):
    key = getkey()
    kwargs = dict(d_state=8, head_dim=8, chunk=4, key=key)
    chunked = Mamba2(16, implementation="chunked", **kwargs)
    scan = Mamba2(16, implementation="scan", **kwargs)
    x = jax.random.normal(getkey(), (14, 16))
    ct = jax.random.normal(getkey(), (14, 16))
    full = scan(x)
    assert_close(chunked(x), full, jnp.float32)
    loss = lambda m, x: jnp.sum(m(x) * ct)  # noqa: E731
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    g1, g2 = grad(scan, x), grad(chunked, x)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert_close(a, b, jnp.float32, grad=True)
    cache, step = chunked.init_cache(), eqx.filter_jit(chunked.decode_step)
    ys = []
    for t in range(14):
        y, cache = step(x[t], cache)
        ys.append(y)
    assert_close(jnp.stack(ys), full, jnp.float32)
