"""GPU tests (`pytest --gpu`): the Triton recurrence kernels at real sizes, default configs."""

import jax
import jax.numpy as jnp
import pytest

from _tolerance import assert_close
from probjax_eqx import selective_scan
from probjax_eqx.mamba import ssd
from probjax_eqx.rla import linear_outside_window

pytestmark = pytest.mark.gpu


def _agree(f, args, dtype):
    up = [a.astype(jnp.float32) for a in args]
    outs = lambda impl: lambda *a: f(impl, *a)  # noqa: E731
    got, want = jax.jit(outs("triton"))(*args), jax.jit(outs("scan"))(*up)
    for a, b in zip(got, want):
        assert_close(a, b, dtype, tf32=True)  # f32 dots may run as TF32 on the GPU
    loss = lambda g: lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in g(*a))  # noqa: E731
    n = tuple(range(len(args)))
    got = jax.jit(jax.grad(loss(outs("triton")), n))(*args)
    want = jax.jit(jax.grad(loss(outs("scan")), n))(*up)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = max(1.0, float(jnp.max(jnp.abs(b))))
        assert_close(a / scale, b / scale, dtype, grad=True, tf32=True, err_msg=f"argument {i}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_selective_scan_kernel(getkey, dtype):
    seq, d, n = 1000, 512, 16
    x = jax.random.normal(getkey(), (seq, d))
    dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, d)) - 3.0)
    a = -jnp.arange(1, n + 1, dtype=jnp.float32) * jnp.ones((d, 1))
    b, c = (jax.random.normal(getkey(), (seq, n)) / n**0.5 for _ in range(2))
    args = tuple(t.astype(dtype) for t in (x, dt, a, b, c))
    f = lambda impl, *a: selective_scan(*a, jnp.ones(d), implementation=impl)  # noqa: E731
    _agree(f, args, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ssd_kernel(getkey, dtype):
    seq, heads, p, n = 1000, 8, 64, 64
    x = jax.random.normal(getkey(), (seq, heads, p))
    dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, heads)) - 3.0)
    a = -jnp.linspace(1.0, 16.0, heads)
    b, c = (jax.random.normal(getkey(), (seq, n)) / n**0.5 for _ in range(2))
    args = tuple(t.astype(dtype) for t in (x, dt, a, b, c))
    f = lambda impl, *a: ssd(*a, jnp.ones(heads), implementation=impl)  # noqa: E731
    _agree(f, args, dtype)


# dk 128 (RLA's heads in the sequence suite): 384 features a step, whose default config
# splits the values over programs (block_dv 64) and runs the chunk-parallel backward.
@pytest.mark.parametrize("dk", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_branch_kernel(getkey, dtype, dk):
    seq, heads = 1000, 4
    q, k, v = (jax.random.normal(getkey(), (seq, heads, dk)).astype(dtype) for _ in range(3))

    def f(impl, q, k, v):
        out = linear_outside_window(q, k, v, window=128, implementation=impl)
        return (out / seq,)

    _agree(f, (q, k, v), dtype)


@pytest.mark.parametrize("op", ["ssd", "linear_branch"])
def test_non_default_backward_on_gpu(getkey, op):
    # Each op's other backward: the single-kernel one (both default to chunk-parallel).
    from probjax_eqx.kernels.triton.ssm import ChunkedLinearConfig

    seq, dtype = 1000, jnp.bfloat16
    if op == "ssd":
        heads, p, n = 8, 64, 64
        cfg = ChunkedLinearConfig(chunk_parallel_backward=False)
        x = jax.random.normal(getkey(), (seq, heads, p))
        dt = jax.nn.softplus(jax.random.normal(getkey(), (seq, heads)) - 3.0)
        a = -jnp.linspace(1.0, 16.0, heads)
        b, c = (jax.random.normal(getkey(), (seq, n)) / n**0.5 for _ in range(2))
        args = tuple(t.astype(dtype) for t in (x, dt, a, b, c))

        def f(impl, *a):
            config = cfg if impl == "triton" else None
            return ssd(*a, jnp.ones(heads), implementation=impl, config=config)

    else:
        heads, dk = 4, 128
        cfg = ChunkedLinearConfig(chunk=32, block_dv=32, chunk_parallel_backward=False)
        args = tuple(jax.random.normal(getkey(), (seq, heads, dk)).astype(dtype) for _ in range(3))

        def f(impl, q, k, v):
            config = cfg if impl == "triton" else None
            return (linear_outside_window(q, k, v, window=128, implementation=impl,
                                          config=config) / seq,)  # fmt: skip

    _agree(f, args, dtype)
