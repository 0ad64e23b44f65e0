"""The Triton recurrence kernels (interpret mode) against the sequential `lax.scan` references.

Forward and every gradient, lengths off the chunk, channel and state counts off the
tiles, an initial state, float32 and bfloat16; the modules on the kernels.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from _check import check_higher_derivatives
from _tolerance import assert_close
from probjax_eqx import RLA, Mamba, Mamba2, UnsupportedError, resolve, selective_scan
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels.triton.ssm import ChunkedLinearConfig, SelectiveScanConfig
from probjax_eqx.mamba import ssd
from probjax_eqx.rla import linear_outside_window

SCAN_CFG = SelectiveScanConfig(block_d=16, interpret=True)
CHUNK_CFG = ChunkedLinearConfig(chunk=16, interpret=True)
H200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")


def _grads_agree(f_kernel, f_ref, args, cotangents, dtype):
    """Outputs and the gradients of every argument agree (float32 reference)."""
    up = [a.astype(jnp.float32) for a in args]
    got, want = f_kernel(*args), f_ref(*up)
    for a, b in zip(got, want):
        assert_close(a, b, dtype)

    def loss(f):
        return lambda *a: sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(f(*a), cotangents))

    argnums = tuple(range(len(args)))
    got = jax.jit(jax.grad(loss(f_kernel), argnums))(*args)
    want = jax.grad(loss(f_ref), argnums)(*up)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == args[i].dtype
        assert_close(a, b, dtype, grad=True, err_msg=f"gradient of argument {i}")


# 16 steps a load: 37 steps are three blocks, the last padded; one step a load too.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "seq, d, n, config",
    [(37, 40, 12, SCAN_CFG), (1, 16, 16, SCAN_CFG),
     (37, 40, 12, SelectiveScanConfig(block_d=16, steps=1, interpret=True))],
)  # fmt: skip
def test_selective_scan_kernel(getkey, dtype, seq, d, n, config):
    x = jax.random.normal(getkey(), (seq, d))
    dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, d)) - 1.0)
    a = -jnp.exp(jax.random.normal(getkey(), (d, n)))
    b, c = (jax.random.normal(getkey(), (seq, n)) / n**0.5 for _ in range(2))
    d_skip, h0 = jax.random.normal(getkey(), (d,)), jax.random.normal(getkey(), (d, n)) / 4
    args = tuple(t.astype(dtype) for t in (x, dt, a, b, c, d_skip, h0))

    def run(impl, config=None):
        def f(x, dt, a, b, c, d_skip, h0):
            return selective_scan(x, dt, a, b, c, d_skip, h0=h0, implementation=impl, config=config)

        return f

    cts = (jax.random.normal(getkey(), (seq, d)) / 4, jax.random.normal(getkey(), (d, n)) / 4)
    _grads_agree(run("triton", config), run("scan"), args, cts, dtype)


# block_dv=16 splits the 20 (padded: 32) value columns over two programs per head.
SPLIT_CFG = ChunkedLinearConfig(chunk=16, block_dv=16, interpret=True)
# The two-kernel backward: the state's gradient per chunk, then a program per chunk.
PARALLEL_CFG = ChunkedLinearConfig(
    chunk=16, block_dv=16, chunk_parallel_backward=True, interpret=True
)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "seq, config", [(37, CHUNK_CFG), (16, CHUNK_CFG), (37, SPLIT_CFG), (37, PARALLEL_CFG)]
)
def test_ssd_kernel(getkey, dtype, seq, config):
    heads, p, n = 3, 20, 12
    x = jax.random.normal(getkey(), (seq, heads, p))
    dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, heads)) - 1.0)
    a = -jnp.exp(jax.random.normal(getkey(), (heads,)))
    b, c = (jax.random.normal(getkey(), (seq, n)) / n**0.5 for _ in range(2))
    d_skip, h0 = jax.random.normal(getkey(), (heads,)), jax.random.normal(getkey(), (heads, p, n))
    args = tuple(t.astype(dtype) for t in (x, dt, a, b, c, d_skip, h0 / 4))

    def run(impl, config=None):
        def f(x, dt, a, b, c, d_skip, h0):
            return ssd(x, dt, a, b, c, d_skip, h0=h0, implementation=impl, config=config)

        return f

    cts = (jax.random.normal(getkey(), (seq, heads, p)) / 4,
           jax.random.normal(getkey(), (heads, p, n)) / 4)  # fmt: skip
    _grads_agree(run("triton", config), run("scan"), args, cts, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "window, config",
    [(1, CHUNK_CFG), (5, CHUNK_CFG), (40, CHUNK_CFG), (5, SPLIT_CFG), (5, PARALLEL_CFG)],
)  # 40 > seq: the branch is all zeros
def test_linear_branch_kernel(getkey, dtype, window, config):
    seq, heads, dk = 37, 2, 20
    q, k, v = (jax.random.normal(getkey(), (seq, heads, dk)).astype(dtype) for _ in range(3))

    def run(impl, config=None):
        def f(q, k, v):
            out = linear_outside_window(
                q, k, v, window=window, chunk=8, implementation=impl, config=config
            )
            return (out / seq,)  # O(1): the branch sums up to `seq` values

        return f

    cts = (jax.random.normal(getkey(), (seq, heads, dk)),)
    _grads_agree(run("triton", config), run("scan"), (q, k, v), cts, dtype)


MODULE_PAIRS = {
    "mamba": lambda key: (
        Mamba(16, d_state=4, implementation="triton", config=SCAN_CFG, key=key),
        Mamba(16, d_state=4, implementation="scan", key=key),
    ),
    "mamba2": lambda key: (
        Mamba2(16, d_state=8, head_dim=8, implementation="triton", config=CHUNK_CFG, key=key),
        Mamba2(16, d_state=8, head_dim=8, implementation="scan", key=key),
    ),
    "rla": lambda key: (
        RLA(16, 2, window=5, implementation="triton", linear_config=CHUNK_CFG, key=key),
        RLA(16, 2, window=5, implementation="scan", key=key),
    ),
}


@pytest.mark.parametrize("name", MODULE_PAIRS)
def test_modules_on_the_kernels_decode_and_vmap(getkey, name):
    fast, ref = MODULE_PAIRS[name](getkey())
    x = jax.random.normal(getkey(), (2, 21, 16))
    batched = lambda m, x: jax.vmap(lambda row: m(row))(x)  # noqa: E731
    assert fast.explain(x[0]).kernel == "triton"
    out = eqx.filter_jit(batched)(fast, x)
    assert_close(out, eqx.filter_jit(batched)(ref, x), jnp.float32)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(batched(m, x) ** 2)))
    for a, b in zip(jax.tree.leaves(grads(fast)), jax.tree.leaves(grads(ref))):
        assert_close(a / 10, b / 10, jnp.float32, grad=True)  # sums of squares: O(10)
    step, cache, rows = eqx.filter_jit(type(fast).decode_step), fast.init_cache(), []
    for t in range(x.shape[1]):
        y, cache = step(fast, x[0, t], cache)
        rows.append(y)
    assert_close(jnp.stack(rows), out[0], jnp.float32)


def test_recurrence_dispatch():
    for op, fallback in [("selective_scan", "scan"), ("ssd", "chunked"),
                         ("linear_attention", "chunked")]:  # fmt: skip
        assert resolve(op, device=H200).priority == ("triton", fallback)
    m = Mamba(16, key=jax.random.key(0))
    if jax.devices()[0].platform == "cpu":
        choice = m.explain(jnp.zeros((8, 16)))
        assert choice.kernel == "scan"
        assert "needs a GPU" in dict(choice.rejected)["triton"]
        with pytest.raises(UnsupportedError, match="interpret=True"):
            Mamba(16, implementation="triton", key=jax.random.key(0))(jnp.zeros((8, 16)))
    with pytest.raises(ValueError, match="one of"):
        Mamba(16, implementation="chunked", key=jax.random.key(0))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chunked_linear_defaults_split_wide_states_on_the_gpu(dtype):
    from probjax_eqx.recurrence import RecurrenceCall

    # RLA with 128-dim heads: 2 x 128 features + 128 values a step. 16-bit takes the
    # sweep's fastest (run 21: 64-step chunks of 64 columns, chunk-parallel backward);
    # float32's forward at that config asked for 311,296 bytes of shared memory (run 22).
    wide = resolve("linear_attention", device=H200).select(
        RecurrenceCall(4096, dtype, features=384), None
    )
    assert wide.kernel == "triton" and not wide.config.interpret
    cfg = wide.config
    assert (cfg.chunk, cfg.block_dv, cfg.chunk_parallel_backward) == (
        (64, 64, True) if dtype == "bfloat16" else (32, 32, False)
    )
    # Mamba-2 (64 state x 64 head dims): one program per head, as measured in run 6, and
    # the chunk-parallel backward (run 24).
    narrow = resolve("ssd", device=H200).select(RecurrenceCall(4096, "bfloat16", 128), None)
    assert narrow.config.block_dv is None and narrow.config.chunk_parallel_backward


@pytest.mark.parametrize("op", ["selective_scan", "ssd", "linear_outside_window"])
def test_higher_derivatives(getkey, op):
    """Beyond the interpreted kernels' own VJP: forward mode and derivatives of derivatives
    equal the pure-JAX path's throughout."""
    keys = jax.random.split(getkey(), 5)
    normal = lambda i, shape: jax.random.normal(keys[i], shape)  # noqa: E731
    if op == "selective_scan":
        args = (normal(0, (12, 16)), jax.nn.softplus(normal(1, (12, 16))),
                -jnp.exp(normal(2, (16, 4))), normal(3, (12, 4)), normal(4, (12, 4)),
                jnp.ones(16))  # fmt: skip
        f = lambda *a: selective_scan(*a, implementation="triton", config=SCAN_CFG)[0]  # noqa: E731
        ref = lambda *a: selective_scan(*a, implementation="scan")[0]  # noqa: E731
    elif op == "ssd":
        args = (normal(0, (20, 2, 8)), jax.nn.softplus(normal(1, (20, 2))),
                -jnp.exp(normal(2, (2,))), normal(3, (20, 4)), normal(4, (20, 4)),
                jnp.ones(2))  # fmt: skip
        f = lambda *a: ssd(*a, implementation="triton", config=CHUNK_CFG)[0]  # noqa: E731
        ref = lambda *a: ssd(*a, chunk=8, implementation="chunked")[0]  # noqa: E731
    else:
        args = tuple(normal(i, (20, 2, 8)) for i in range(3))
        f = lambda *a: linear_outside_window(  # noqa: E731
            *a, window=3, implementation="triton", config=CHUNK_CFG
        )
        ref = lambda *a: linear_outside_window(*a, window=3, chunk=8, implementation="chunked")  # noqa: E731
    check_higher_derivatives(f, ref, *args)
