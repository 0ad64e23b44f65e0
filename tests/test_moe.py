"""MoE and the grouped matmul against dense float32 oracles; Triton kernels in interpret mode."""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from _check import all_eqns, check_higher_derivatives, float_row_scatters
from _tolerance import assert_close
from probjax_eqx import MoE, UnsupportedError, grouped_matmul
from probjax_eqx import moe as moe_module
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels.mosaic.grouped_matmul import MosaicGroupedMatmulConfig
from probjax_eqx.kernels.triton.grouped_matmul import TritonGroupedMatmulConfig
from probjax_eqx.moe import SwiGLU, explain_grouped_matmul

GMM_CFG = TritonGroupedMatmulConfig(block_m=16, block_n=16, block_k=16, interpret=True)
MOSAIC_CFG = MosaicGroupedMatmulConfig(block_n=64, interpret=True)
H200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")


def dense_grouped_matmul(lhs, rhs, sizes):
    """Row r uses the matrix of the group whose [start, end) holds r (numpy, float64)."""
    lhs, rhs, sizes = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64), np.asarray(sizes)
    ends = np.cumsum(sizes)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for r in range(min(lhs.shape[0], ends[-1])):
        out[r] = lhs[r] @ rhs[np.searchsorted(ends, r, side="right")]
    return out


# An empty group and 2 rows past the groups; a worst-case buffer (expert parallelism)
# whose rows are mostly past the groups, so most row tiles hold none.
SIZES = {"ragged": [10, 0, 30, 3], "mostly_past": [5, 0, 7, 2]}


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_grouped_matmul_fwd_and_grads(getkey, impl, dtype, sizes):
    m, k, n = 45, 24, 40
    sizes = jnp.array(sizes)
    # O(1) outputs and gradients, as the tolerances assume.
    lhs = jax.random.normal(getkey(), (m, k)).astype(dtype)
    rhs = (jax.random.normal(getkey(), (4, k, n)) / k**0.5).astype(dtype)
    ct = jax.random.normal(getkey(), (m, n)) / m**0.5
    config = GMM_CFG if impl == "triton" else None
    f = lambda a, b: grouped_matmul(a, b, sizes, implementation=impl, config=config)
    out = f(lhs, rhs)
    assert out.dtype == dtype
    assert_close(out, dense_grouped_matmul(lhs, rhs, sizes), dtype, err_msg="out")
    assert not jnp.any(out[int(sizes.sum()) :])
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * ct)  # noqa: E731
    ref = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision="highest")  # noqa: E731
    got = jax.grad(loss(f), (0, 1))(lhs, rhs)
    want = jax.grad(loss(ref), (0, 1))(up(lhs), up(rhs))
    for name, a, b in zip(("dlhs", "drhs"), got, want):
        assert a.dtype == dtype
        assert_close(a, b, dtype, grad=True, err_msg=name)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("rhs_batched", [False, True])
def test_grouped_matmul_under_vmap(getkey, impl, rhs_batched):
    """A batch of calls with their own group sizes (rows past the groups included) equals
    the calls one by one, in outputs and in per-example and summed gradients."""
    sizes = jnp.array([SIZES["ragged"], [0, 20, 5, 13]])
    lhs = jax.random.normal(getkey(), (2, 45, 24))
    rhs = jax.random.normal(getkey(), (2, 4, 24, 40) if rhs_batched else (4, 24, 40)) / 5
    ct = jax.random.normal(getkey(), (2, 45, 40))
    config = GMM_CFG if impl == "triton" else None
    f = lambda a, b, g: grouped_matmul(a, b, g, implementation=impl, config=config)  # noqa: E731
    rhs_axis = 0 if rhs_batched else None
    rhs_of = lambda i: rhs[i] if rhs_batched else rhs  # noqa: E731
    out = jax.jit(jax.vmap(f, (0, rhs_axis, 0)))(lhs, rhs, sizes)
    for i in range(2):
        want = dense_grouped_matmul(lhs[i], rhs_of(i), sizes[i])
        assert_close(out[i], want, jnp.float32, err_msg=f"out[{i}]")
    loss = lambda a, b, g, c: jnp.sum(f(a, b, g) * c)  # noqa: E731
    per_example = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), (0, rhs_axis, 0, 0)))(
        lhs, rhs, sizes, ct
    )
    summed = jax.jit(jax.grad(
        lambda a, b: jnp.sum(jax.vmap(f, (0, rhs_axis, 0))(a, b, sizes) * ct), (0, 1)
    ))(lhs, rhs)  # fmt: skip
    ref = lambda a, b, g, c: jnp.sum(jax.lax.ragged_dot(a, b, g, precision="highest") * c)  # noqa: E731
    one_by_one = [jax.grad(ref, (0, 1))(lhs[i], rhs_of(i), sizes[i], ct[i]) for i in range(2)]
    want_dlhs = jnp.stack([g[0] for g in one_by_one])
    want_drhs = jnp.stack([g[1] for g in one_by_one])
    assert_close(per_example[0], want_dlhs, jnp.float32, grad=True, err_msg="vmap(grad) dlhs")
    assert_close(per_example[1], want_drhs, jnp.float32, grad=True, err_msg="vmap(grad) drhs")
    assert_close(summed[0], want_dlhs, jnp.float32, grad=True, err_msg="grad(vmap) dlhs")
    summed_drhs = want_drhs if rhs_batched else want_drhs.sum(0)
    assert_close(summed[1], summed_drhs, jnp.float32, grad=True, err_msg="grad(vmap) drhs")


def test_xla_grouped_matmul_second_derivatives(getkey):
    # jax.lax.ragged_dot has none in reverse mode (RAGGED_CONTRACTING grad); ours does,
    # also under vmap: checked against a dense per-row gather of the group matrices.
    sizes = jnp.array(SIZES["ragged"])
    lhs = jax.random.normal(getkey(), (45, 6))
    rhs = jax.random.normal(getkey(), (4, 6, 5))
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(45), side="right")

    def dense(a, b):
        per_row = jnp.concatenate([b, jnp.zeros((1, *b.shape[1:]))])[group]
        return jnp.einsum("mk,mkn->mn", a, per_row, precision="highest")

    def grad_norm(f):
        inner = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 3), (0, 1))
        return lambda a, b: sum(jnp.sum(g**2) for g in inner(a, b))

    ours = grad_norm(lambda a, b: grouped_matmul(a, b, sizes, implementation="xla"))
    got = jax.jit(jax.grad(ours, (0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(grad_norm(dense), (0, 1)))(lhs, rhs)
    for a, b in zip(got, want):
        assert_close(a / jnp.abs(b).max(), b / jnp.abs(b).max(), jnp.float32, grad=True)
    batched = jax.jit(jax.vmap(jax.grad(ours, (0, 1)), (0, None)))(jnp.stack([lhs, lhs]), rhs)
    assert_close(batched[0][1], got[0], jnp.float32, grad=True)
    assert_close(batched[1][0], got[1], jnp.float32, grad=True)
    # Forward mode, and forward over reverse (a Hessian-vector product).
    tangents = (jax.random.normal(getkey(), lhs.shape), jax.random.normal(getkey(), rhs.shape))
    gmm = lambda a, b: grouped_matmul(a, b, sizes, implementation="xla")  # noqa: E731
    for f, g in ((gmm, dense), (ours, grad_norm(dense))):
        got_t, want_t = (jax.jvp(jax.jit(fn), (lhs, rhs), tangents)[1] for fn in (f, g))
        top = jnp.abs(want_t).max()
        assert_close(got_t / top, want_t / top, jnp.float32, grad=True)


def test_moe_forward_mode_against_finite_differences(getkey):
    """`jax.jvp` through the MoE layer (router top-k, expert matmuls, combine), tokens and
    weights: JAX's own derivatives serve here, none of ours in reverse mode."""
    from jax.test_util import check_grads

    moe = MoE(8, 12, num_experts=4, top_k=2, key=getkey())
    x = jax.random.normal(getkey(), (7, 8))
    params, static = eqx.partition(moe, eqx.is_inexact_array)

    def out(p, x):  # finite differences pass NumPy arrays
        p, x = jax.tree.map(jnp.asarray, (p, x))
        return eqx.combine(p, static)(x)[0]

    check_grads(jax.jit(out), (params, x), order=1, modes=["fwd"], atol=1e-2, rtol=1e-2)
    top_k = lambda s: moe_module.top_k_by_passes(jnp.asarray(s), 2)[0]  # noqa: E731
    check_grads(top_k, (x,), order=2, modes=["fwd"])
    h13 = jax.random.normal(getkey(), (5, 9))
    swiglu = lambda h: moe_module.swiglu(jnp.asarray(h), 4)  # noqa: E731
    check_grads(swiglu, (h13,), order=2, modes=["fwd", "rev"])


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_grouped_matmul_grad_of_jitted_call(getkey, impl):
    """Group sizes closed over by a jitted call under an outer `jit(grad)`: the custom
    VJP must take the layout as an argument, not close over its tracers."""
    sizes = jnp.array([10, 0, 22])
    lhs = jax.random.normal(getkey(), (32, 64)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(getkey(), (3, 64, 64)) / 8).astype(jnp.bfloat16)
    config = GMM_CFG if impl == "triton" else MOSAIC_CFG
    f = jax.jit(lambda a, b: grouped_matmul(a, b, sizes, implementation=impl, config=config))
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32))  # noqa: E731
    got = jax.jit(jax.grad(loss(f), (0, 1)))(lhs, rhs)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision="highest")  # noqa: E731
    want = jax.grad(loss(ref), (0, 1))(up(lhs), up(rhs))
    for a, b in zip(got, want):
        assert_close(a, b, jnp.bfloat16, grad=True)


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_padded_layout_moves_rows_and_gradients_by_gathers(getkey, sizes):
    """`to_padded` / `from_padded` and their gradients equal `jnp.take` and its transpose,
    but the gradients are gathers: no scatter-add (slow on GPUs) in the backward."""
    from probjax_eqx.kernels.triton.grouped_matmul import layout

    sizes = jnp.array(sizes)
    m, block, cols = int(sizes.sum()) + 2, 8, 12  # 2 rows past the groups
    lay = layout(sizes, m, block)
    x = jax.random.normal(getkey(), (m, 10))
    ct_p = jax.random.normal(getkey(), (lay.rows, cols))
    ct = jax.random.normal(getkey(), (m, cols - 2))

    def plain_to(x):
        return jnp.take(jnp.pad(x, ((0, 0), (0, 2))), lay.src, axis=0, mode="fill", fill_value=0)

    def plain_from(x):
        return jnp.take(x[:, : cols - 2], lay.dest, axis=0, mode="fill", fill_value=0)

    padded = lay.to_padded(x, cols)
    np.testing.assert_array_equal(padded, plain_to(x))
    np.testing.assert_array_equal(lay.from_padded(padded, 10), jnp.where(
        (jnp.arange(m) < sizes.sum())[:, None], x, 0))  # fmt: skip
    for ours, plain, arg, cot in (
        (lambda x: lay.to_padded(x, cols), plain_to, x, ct_p),
        (lambda x: lay.from_padded(x, cols - 2), plain_from, padded, ct),
    ):
        pullback = jax.vjp(ours, arg)[1]
        np.testing.assert_array_equal(pullback(cot)[0], jax.vjp(plain, arg)[1](cot)[0])
        backward = str(jax.make_jaxpr(pullback)(cot))
        assert "scatter" not in backward, backward


def test_row_moves_have_derivatives_of_every_order(getkey):
    # Copy and combine are each other's transposes, a permutation's is its inverse
    # (`probjax_eqx._rows`): first and second order against finite differences, with a
    # padding row (token out of range) and top-2.
    from jax.test_util import check_grads

    from probjax_eqx._rows import combine_rows, copy_to_rows, inverse_permutation, permute_rows

    tokens, k, d = 5, 2, 3
    order = jax.random.permutation(getkey(), tokens * k)
    slots = inverse_permutation(order).reshape(tokens, k)
    rows = jnp.concatenate([order // k, jnp.array([tokens])])  # one padding row at the end
    x = jax.random.normal(getkey(), (tokens, d))
    ys = jax.random.normal(getkey(), (tokens * k + 1, d))
    scale = jax.random.uniform(getkey(), (tokens * k + 1,))
    copied = copy_to_rows(x, rows, slots)
    np.testing.assert_array_equal(copied[-1], 0.0)
    np.testing.assert_allclose(copied[:-1], x[order // k])
    want = jnp.zeros((tokens, d)).at[rows[:-1]].add(ys[:-1] * scale[:-1, None])
    np.testing.assert_allclose(combine_rows(ys, slots, rows, scale), want, rtol=1e-6)
    modes = ["fwd", "rev"]  # and each over the other
    check_grads(jax.jit(lambda x: copy_to_rows(x, rows, slots)), (x,), order=2, modes=modes)
    check_grads(jax.jit(lambda ys, s: combine_rows(ys, slots, rows, s)), (ys, scale), order=2,
                modes=modes)  # fmt: skip
    index = jnp.concatenate([order, jnp.array([tokens * k])])  # the last row reads zeros
    check_grads(jax.jit(lambda y: permute_rows(y, index, inverse_permutation(order))),
                (ys[:-1],), order=2, modes=modes)  # fmt: skip


def test_grouped_matmul_refusals_and_choice(getkey):
    lhs, rhs = jnp.zeros((8, 16)), jnp.zeros((2, 16, 16))
    sizes = jnp.array([4, 4])
    with pytest.raises(UnsupportedError, match="Pallas Triton needs a GPU"):
        grouped_matmul(lhs, rhs, sizes, implementation="triton")
    bad = jnp.zeros((2, 8, 16))
    with pytest.raises((TypeError, ValueError)):  # jaxtyping's boundary check in tests
        grouped_matmul(lhs, bad, sizes)
    with pytest.raises(ValueError, match="shapes do not chain"):
        moe_module._describe(lhs, bad, sizes)
    # Mosaic tiles over the shared memory are refused, naming it, before compiling.
    big = MosaicGroupedMatmulConfig(block_m=128, block_n=256, block_k=128, num_stages=3,
                                    interpret=True)  # fmt: skip
    with pytest.raises(UnsupportedError, match="shared memory"):
        grouped_matmul(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes,
                       implementation="mosaic", config=big)  # fmt: skip
    choice = explain_grouped_matmul(lhs, rhs, sizes)
    if jax.devices()[0].platform == "cpu":
        assert choice.kernel == "xla"
        assert "needs a GPU" in dict(choice.rejected)["triton"]


# K, N off the 64-wide tiles; K > N: dRHS transposes dout rather than lhs; 128-row tiles
# (two compute warpgroups fed by a TMA one) over groups of 30 and 165 rows.
@pytest.mark.parametrize(
    "dtype, k, n, config",
    [(jnp.bfloat16, 72, 80, MOSAIC_CFG), (jnp.float16, 72, 80, MOSAIC_CFG),
     (jnp.bfloat16, 150, 40, MOSAIC_CFG),
     (jnp.bfloat16, 72, 80, dataclasses.replace(MOSAIC_CFG, block_m=128))],
)  # fmt: skip
def test_mosaic_grouped_matmul_fwd_and_grads(getkey, dtype, k, n, config):
    sizes = jnp.array([30, 0, 65]) if config.block_m == 64 else jnp.array([30, 0, 165])
    m = int(sizes.sum()) + 5  # one group empty, rows past the groups
    # O(1) outputs, as the tolerances assume (the interpreter rounds each wgmma's products
    # to the operand dtype before accumulating; the GPU accumulates in float32).
    lhs = jax.random.normal(getkey(), (m, k)).astype(dtype)
    rhs = (jax.random.normal(getkey(), (3, k, n)) / k**0.5).astype(dtype)
    ct = jax.random.normal(getkey(), (m, n)) / 8**0.5
    f = lambda a, b: grouped_matmul(a, b, sizes, implementation="mosaic", config=config)
    out = jax.jit(f)(lhs, rhs)  # jitted: the interpreter op by op is slow
    assert_close(out, dense_grouped_matmul(lhs, rhs, sizes), dtype, err_msg="out")
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * ct)  # noqa: E731
    ref = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision="highest")  # noqa: E731
    got = jax.jit(jax.grad(loss(f), (0, 1)))(lhs, rhs)
    want = jax.grad(loss(ref), (0, 1))(up(lhs), up(rhs))
    for name, a, b in zip(("dlhs", "drhs"), got, want):
        assert_close(a, b, dtype, grad=True, err_msg=name)


def test_dispatch_resolution_on_simulated_sm90():
    shapes = (
        jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 32, 32), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    pallas = moe_module.resolve_dispatch("pallas", device=H200, environ={})
    assert pallas.priority == ("mosaic", "triton")
    assert explain_grouped_matmul(*shapes, implementation=pallas).kernel == "mosaic"
    f32 = [jax.ShapeDtypeStruct(s.shape, jnp.float32) for s in shapes[:2]] + [shapes[2]]
    choice = explain_grouped_matmul(*f32, implementation=pallas)
    assert choice.kernel == "triton"
    assert "16-bit operands" in dict(choice.rejected)["mosaic"]
    # "auto" on sm_90: Mosaic for 16-bit compute, else the fused gather / scatter
    # (Triton), with the reason; sorted on the CPU.
    assert moe_module.auto_dispatch(H200) == "fused_gsum"
    auto = moe_module.resolve_dispatch("auto", device=H200, environ={})
    assert not auto.pinned and auto.priority == ("mosaic", "triton")
    assert explain_grouped_matmul(*shapes, implementation=auto).kernel == "mosaic"
    choice = explain_grouped_matmul(*f32, implementation=auto)
    assert choice.kernel == "triton" and "16-bit operands" in dict(choice.rejected)["mosaic"]
    generic = {"PROBJAX_ATTENTION_DEVICE_DEFAULTS": "0"}  # no sm_90 entry: no Mosaic
    assert moe_module.resolve_dispatch("auto", device=H200, environ=generic).priority == ("triton",)
    a100 = DeviceInfo("gpu", "NVIDIA A100", "sm_80")
    assert moe_module.resolve_dispatch("auto", device=a100, environ={}).priority == ("triton",)
    # Where results must repeat bit for bit: Mosaic (no atomics), then the sorted list.
    strict = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}
    auto = moe_module.resolve_dispatch("auto", device=H200, environ=strict)
    assert auto.priority == ("mosaic", "triton", "xla")
    assert moe_module.auto_dispatch(DeviceInfo("cpu", "cpu", None)) == "sorted"
    sorted_gmm = moe_module.resolve_dispatch("sorted", device=H200, environ={})
    assert sorted_gmm.priority == ("triton", "mosaic", "xla")  # measured: in-place Triton first


def test_bin_counts_match_bincount_and_ignore_values_past_the_bins(getkey):
    from probjax_eqx._rows import bin_counts

    values = jax.random.randint(getkey(), (37, 3), 0, 9)  # 8 and above fall outside
    got = bin_counts(values, 8)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.bincount(np.asarray(values).ravel(), minlength=9)[:8])
    # No scatter: a fused comparison and sum (a scatter-add contends on the counters).
    assert not [e for e in all_eqns(jax.make_jaxpr(lambda v: bin_counts(v, 8))(values).jaxpr)
                if "scatter" in e.primitive.name]  # fmt: skip


@pytest.mark.parametrize("k", [1, 2, 8])
def test_top_k_by_passes_is_top_k(getkey, k):
    scores = jax.nn.softmax(jax.random.normal(getkey(), (50, 16)), axis=-1)
    scores = scores.at[:5, 3:7].set(0.5)  # ties: the lower index first, as in top_k
    want, got = jax.lax.top_k(scores, k), moe_module.top_k_by_passes(scores, k)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert got[1].dtype == want[1].dtype
    weigh = jnp.arange(1.0, k + 1)
    grads = [jax.grad(lambda s, f=f: jnp.sum(f(s, k)[0] * weigh))(scores)
             for f in (jax.lax.top_k, moe_module.top_k_by_passes)]  # fmt: skip
    np.testing.assert_array_equal(*grads)


def saved_residuals(capsys, fn, module, *args) -> str:
    """What the backward of `fn(module, *args)` keeps (`print_saved_residuals`' listing)."""
    params, static = eqx.partition(module, eqx.is_array)
    print_saved_residuals(lambda p, *a: fn(eqx.combine(p, static), *a), params, *args)
    return capsys.readouterr().out


def test_top_k_by_passes_keeps_the_indices_alone(capsys):
    """Its backward needs the k indices of a row, not each pass's masked scores."""
    top_k = lambda s: jnp.sum(moe_module.top_k_by_passes(s, 8)[0])  # noqa: E731
    saved = saved_residuals(capsys, top_k, jnp.ones((50, 16)))
    assert "i32[50,8]" in saved and "[50,16]" not in saved, saved


def test_forward_or_vjp_runs_the_forward_unless_differentiated():
    # Two stand-ins told apart by their values: the forward outside jax.grad, the other's
    # forward and VJP inside (value_and_grad's value is the differentiable one's).
    f = lambda x: moe_module.forward_or_vjp(lambda x: 2 * x, lambda x: 3 * x, x)  # noqa: E731
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(jax.jit(f)(x), 2 * x)
    value, grad = jax.value_and_grad(lambda x: jnp.sum(f(x)))(x)
    assert float(value) == float(jnp.sum(3 * x))
    np.testing.assert_array_equal(grad, jnp.full(3, 3.0))
    np.testing.assert_array_equal(jax.vmap(jax.grad(lambda x: f(x)))(x), jnp.full(3, 3.0))


def test_inference_dispatch_rules():
    rule = moe_module.resolve_inference_dispatch
    assert rule(None, "fused_gsum") is None
    assert rule("mosaic", "fused_gsum") == "mosaic"
    assert rule("fused_gsum", "fused_gsum") is None  # the dispatch's own
    for bad in ("fast", "auto"):
        with pytest.raises(ValueError, match=f"unknown inference_dispatch='{bad}'"):
            rule(bad, "fused_gsum")


def test_inference_dispatch_forward_and_gradients(getkey):
    # The sorted dispatch's forward outside differentiation, XLA's forward and VJP under
    # it: the same values and gradients as XLA alone, under jit, vmap and grad.
    key, x = getkey(), jax.random.normal(getkey(), (2, 9, 16))
    hybrid, plain = (make_moe(key, inference_dispatch=i) for i in ("sorted", None))
    assert (hybrid.inference_mode, plain.inference_mode) == ("sorted", None)
    assert hybrid.explain_inference(x[0]).kernel == "xla"  # the CPU's sorted dispatch
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x)[0])
    np.testing.assert_array_equal(run(hybrid, x), run(plain, x))
    grad = eqx.filter_jit(eqx.filter_grad(lambda mx: jnp.sum(run(*mx) ** 2)))
    for a, b in zip(jax.tree.leaves(grad((hybrid, x))), jax.tree.leaves(grad((plain, x)))):
        np.testing.assert_array_equal(a, b)
    # A mode named for inference that cannot run the call is refused, not skipped.
    with pytest.raises(UnsupportedError, match="Pallas Triton needs a GPU"):
        make_moe(key, inference_dispatch="triton")(x[0])


def dense_moe(moe: MoE, x):
    """Every expert on every token, combined with the top-k weights (float32 oracle)."""
    experts, weights, _ = moe.route(x)
    hp = jax.lax.Precision.HIGHEST
    x32 = x.astype(jnp.float32)
    gate = jnp.einsum("td,edf->etf", x32, moe.w_gate, precision=hp)
    up = jnp.einsum("td,edf->etf", x32, moe.w_up, precision=hp)
    out = jnp.einsum("etf,efd->etd", jax.nn.silu(gate) * up, moe.w_down, precision=hp)
    combine = (
        jnp.zeros((x.shape[0], moe.num_experts))
        .at[jnp.arange(x.shape[0])[:, None], experts]
        .add(weights)
    )
    y = jnp.einsum("te,etd->td", combine, out, precision=hp)
    if moe.shared is not None:
        y = y + jax.vmap(moe.shared)(x32)
    return y


def make_moe(key, dispatch="xla", num_experts=4, **kwargs):
    config = {"triton": GMM_CFG, "fused_gsum": GMM_CFG, "mosaic": MOSAIC_CFG}.get(dispatch)
    return MoE(16, 24, num_experts=num_experts, dispatch=dispatch, dispatch_config=config,
               key=key, **kwargs)  # fmt: skip


def test_explain_names_the_kernel_and_what_runs(getkey):
    x = jax.random.normal(getkey(), (9, 16))
    choice = make_moe(getkey(), "auto").explain(x)  # the CPU: sorted rows on XLA
    assert choice.kernel == "xla" and "runs dispatch mode 'sorted'" in str(choice)
    choice = make_moe(getkey(), "fused_gsum").explain(x)  # interpreted Triton kernels
    assert choice.kernel == "triton" and "runs dispatch mode 'fused_gsum'" in choice.reason
    choice = make_moe(getkey(), "mosaic", compute_dtype="bfloat16").explain(x)
    assert "padded layout" in choice.reason
    with pytest.raises(UnsupportedError, match="Pallas Triton needs a GPU"):
        MoE(16, 24, num_experts=4, dispatch="triton", key=getkey()).explain(x)


@pytest.mark.parametrize("dispatch", ["xla", "sorted", "triton", "fused_gsum"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=2),
        dict(top_k=1, router_type="sigmoid", shared_d_ff=8),
        dict(top_k=3),
        dict(top_k=8, num_experts=10),
    ],
)
def test_moe_matches_dense_oracle(getkey, dispatch, kwargs):
    moe = make_moe(getkey(), dispatch, **kwargs)
    x = jax.random.normal(getkey(), (19, 16))
    ct = jax.random.normal(getkey(), (19, 16))
    y, aux = eqx.filter_jit(moe)(x)  # jitted: op by op, a MoE call takes seconds on CPUs
    assert_close(y, dense_moe(moe, x), jnp.float32, err_msg="y")
    assert int(aux.tokens_per_expert.sum()) == 19 * moe.top_k

    def loss(f):
        return lambda m, x: jnp.sum(f(m, x) * ct)

    got = eqx.filter_jit(eqx.filter_grad(loss(lambda m, x: m(x)[0])))(moe, x)
    want = eqx.filter_grad(loss(dense_moe))(moe, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, jnp.float32, grad=True)
    gx = jax.jit(jax.grad(loss(lambda m, x: m(x)[0]), argnums=1))(moe, x)
    assert_close(gx, jax.grad(loss(dense_moe), argnums=1)(moe, x), jnp.float32, grad=True)


def test_shared_expert_runs_in_compute_dtype(getkey):
    # float32 parameters, bfloat16 compute: the shared expert's matmuls (forward and
    # backward) are bfloat16 like the routed experts', only the router's float32.
    moe = make_moe(getkey(), "xla", top_k=2, shared_d_ff=8, compute_dtype="bfloat16")
    x = jax.random.normal(getkey(), (19, 16))
    step = eqx.filter_grad(lambda m, x: jnp.sum(m.shared_expert(x)))
    dots = [eqn for eqn in all_eqns(jax.make_jaxpr(step)(moe, x).jaxpr)
            if eqn.primitive.name == "dot_general"]  # fmt: skip
    # Two matmuls (gate | up merged, down), their weights' gradients, dh of the down one.
    assert len(dots) == 5
    assert all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars)
    y = moe.shared_expert(x)
    assert y.dtype == jnp.float32
    assert_close(y, jax.vmap(moe.shared)(x), jnp.bfloat16)


@pytest.mark.parametrize("dispatch", ["xla", "triton", "fused_gsum", "mosaic"])
def test_moe_train_step_moves_rows_by_gathers(getkey, dispatch):
    # Copying tokens to their expert rows and combining them back are gathers both ways
    # (scatter-adds of rows are slow on GPUs); only the dense oracle scatters.
    moe = make_moe(getkey(), dispatch, top_k=2, compute_dtype="bfloat16")
    x = jax.random.normal(getkey(), (19, 16))
    step = eqx.filter_grad(lambda m, x: jnp.sum(m(x)[0]))
    assert float_row_scatters(jax.make_jaxpr(step)(moe, x).jaxpr, width=16) == []
    # The check sees such scatters: the combine as a scatter-add of rows.
    scatter_combine = lambda x: jnp.zeros((19, 16)).at[jnp.arange(38) // 2].add(x)  # noqa: E731
    closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(scatter_combine(x)))))(
        jnp.ones((38, 16))
    )
    assert float_row_scatters(closed.jaxpr, width=16)


@pytest.mark.parametrize("dispatch", ["auto", "xla", "triton", "fused_gsum"])
def test_vmap_over_moe_equals_calls_one_by_one(getkey, dispatch):
    # The unbatched module under jax.vmap, as Equinox users batch it (sequences of tokens).
    moe = make_moe(getkey(), dispatch, top_k=2)
    x = jax.random.normal(getkey(), (3, 11, 16))
    ct = jax.random.normal(getkey(), (3, 11, 16))
    y, aux = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(moe, x)
    call = eqx.filter_jit(lambda m, x: m(x))  # one trace for the three calls
    for i in range(3):
        y_i, aux_i = call(moe, x[i])
        assert_close(y[i], y_i, jnp.float32, err_msg=f"y[{i}]")
        np.testing.assert_array_equal(aux.tokens_per_expert[i], aux_i.tokens_per_expert)

    def loss(m, x):
        return jnp.sum(jax.vmap(lambda row: m(row)[0])(x) * ct)

    got = eqx.filter_jit(eqx.filter_grad(loss))(moe, x)
    one = eqx.filter_jit(eqx.filter_grad(lambda m, x, c: jnp.sum(m(x)[0] * c)))
    one_by_one = [one(moe, x[i], ct[i]) for i in range(3)]
    want = jax.tree.map(lambda *g: sum(g), *one_by_one)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, jnp.float32, grad=True)


def test_moe_mosaic_dispatch_matches_dense_oracle(getkey):
    # The padded-layout path on the Mosaic kernels (interpreted): bf16 like on the GPU.
    moe = make_moe(getkey(), "mosaic", top_k=2, compute_dtype="bfloat16")
    x = jax.random.normal(getkey(), (19, 16))
    ct = jax.random.normal(getkey(), (19, 16))
    assert_close(eqx.filter_jit(moe)(x)[0], dense_moe(moe, x), jnp.bfloat16, err_msg="y")
    loss = lambda f: lambda m, x: jnp.sum(f(m, x) * ct)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss(lambda m, x: m(x)[0])))(moe, x)
    want_grads = eqx.filter_grad(loss(dense_moe))(moe, x)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        scale = float(jnp.max(jnp.abs(b)))  # parameter gradients sum over tokens
        assert_close(a / scale, b / scale, jnp.bfloat16, grad=True)


@pytest.mark.parametrize("dispatch", ["mosaic", "xla"])
def test_moe_backward_keeps_two_row_arrays(getkey, capsys, dispatch):
    """The training residuals over the (token, slot) rows: the first product (gate | up)
    and the SwiGLU output; not the tokens' gathered copies (gathered again), the expert
    outputs (the router weights' gradient comes from the second matmul's inputs) nor
    SwiGLU intermediates. Mosaic's rows are its padded layout's; the sorted dispatch's
    (here on XLA) are 19 x 2."""
    moe = make_moe(getkey(), dispatch, top_k=2, compute_dtype="bfloat16")
    x = jax.random.normal(getkey(), (19, 16))
    saved = saved_residuals(capsys, lambda m, x: jnp.sum(m(x)[0]), moe, x)
    shapes = re.findall(r"(?:bf16|f32)\[(\d+),(\d+)\]", saved)
    padded = dispatch == "mosaic"
    rows = [s for s in shapes if (int(s[0]) > 38 if padded else int(s[0]) == 38)]
    assert len(rows) == 2, rows


def test_dropless_under_skewed_routing(getkey):
    moe = make_moe(getkey(), "sorted", top_k=2)
    # Expert 3 wins every token by a wide margin: nothing may be dropped.
    moe = eqx.tree_at(lambda m: m.router, moe, moe.router.at[:, 3].set(0.0))
    x = jnp.abs(jax.random.normal(getkey(), (33, 16)))
    moe = eqx.tree_at(lambda m: m.router, moe, moe.router.at[:, 3].set(5.0))
    y, aux = moe(x)
    assert int(aux.tokens_per_expert[3]) == 33
    assert float(aux.load_balancing_loss) > 1.5  # far from even routing
    assert_close(y, dense_moe(moe, x), jnp.float32)


def test_aux_losses_match_their_definitions(getkey):
    moe = make_moe(getkey(), top_k=2)
    x = jax.random.normal(getkey(), (25, 16))
    _, aux = moe(x)
    logits = np.asarray(x, np.float64) @ np.asarray(moe.router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    counts = np.bincount(top.reshape(-1), minlength=4)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    lb = 4 * np.sum(counts / 50 * probs.mean(0))
    np.testing.assert_allclose(aux.load_balancing_loss, lb, rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(aux.router_z_loss, np.mean(lse**2), rtol=1e-5)


def test_unbatched_token_jit_and_scan_over_layers(getkey):
    moe = make_moe(getkey(), compute_dtype="bfloat16")
    x = jax.random.normal(getkey(), (9, 16))
    y, _ = eqx.filter_jit(moe)(x)
    y0, _ = moe(x[0])
    assert y0.shape == (16,)
    np.testing.assert_allclose(y0, y[0], atol=2e-2)
    keys = jax.random.split(getkey(), 3)
    stack = eqx.filter_vmap(lambda k: make_moe(k))(keys)
    params, static = eqx.partition(stack, eqx.is_array)

    def layer(h, p):
        out, aux = eqx.combine(p, static)(h)
        return h + out, aux.load_balancing_loss

    def run(params, x):
        h, lb = jax.lax.scan(layer, x, params)
        return jnp.sum(h**2) + jnp.sum(lb)

    grads = jax.jit(jax.grad(run))(params, x)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_dispatch_errors_name_the_reason(getkey):
    with pytest.raises(ValueError, match="unknown dispatch='dense'"):
        moe_module.resolve_dispatch("dense")
    with pytest.raises(ValueError, match="top_k=5"):
        MoE(8, 8, num_experts=4, top_k=5, key=getkey())
    moe = MoE(16, 24, num_experts=4, key=getkey())
    expected = r"MoE takes x of shape \[16\] or \[rows, 16\], got "
    with pytest.raises(ValueError, match=expected + r"\(3, 15\)$"):
        moe(jnp.zeros((3, 15)))
    with pytest.raises(ValueError, match=expected + r"\(2, 3, 16\); .* map it over the batch"):
        moe(jnp.zeros((2, 3, 16)))
    for dispatch in ("triton", "fused_gsum"):
        moe = MoE(16, 24, num_experts=4, dispatch=dispatch, key=getkey())
        if jax.devices()[0].platform == "cpu":
            with pytest.raises(UnsupportedError, match="Pallas Triton needs a GPU"):
                moe(jnp.zeros((4, 16)))


@pytest.mark.parametrize("dispatch", ["xla", "sorted", "triton", "fused_gsum", "mosaic"])
def test_moe_on_no_tokens(getkey, dispatch):
    # An empty batch: an empty output, statistics 0 (not NaN), zero gradients.
    compute_dtype = "bfloat16" if dispatch == "mosaic" else None  # Mosaic: 16-bit only
    moe = make_moe(getkey(), dispatch, top_k=2, shared_d_ff=8, compute_dtype=compute_dtype)
    x = jnp.zeros((0, 16))
    y, aux = moe(x)
    assert y.shape == (0, 16)
    for stat in jax.tree.leaves(aux):
        assert np.all(np.asarray(stat) == 0)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x)[0]) + m(x)[1].load_balancing_loss)(moe, x)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic"])
def test_grouped_matmul_of_no_rows(impl):
    config = {"triton": GMM_CFG, "mosaic": MOSAIC_CFG}.get(impl)
    dtype = jnp.bfloat16 if impl == "mosaic" else jnp.float32
    lhs, rhs = jnp.zeros((0, 16), dtype), jnp.ones((3, 16, 64), dtype)
    f = lambda a, b: grouped_matmul(a, b, jnp.zeros(3, jnp.int32), implementation=impl,  # noqa: E731
                                    config=config)  # fmt: skip
    assert f(lhs, rhs).shape == (0, 64)
    d_rhs = jax.grad(lambda b: jnp.sum(f(lhs, b).astype(jnp.float32)))(rhs)
    assert np.all(np.asarray(d_rhs, np.float32) == 0)


@pytest.mark.parametrize("sizes", [(3, 3), (1, 1), (0, 4)])
def test_group_sizes_that_miss_the_row_count(sizes):
    # Groups past the last row end there; rows past the groups are zeros: every
    # implementation the same as the row-by-row definition.
    lhs = jnp.arange(4 * 16, dtype=jnp.float32).reshape(4, 16) / 10
    rhs = jnp.stack([jnp.eye(16, 16), 2 * jnp.eye(16, 16)])
    group = np.repeat(np.arange(2), sizes)[:4]
    want = np.zeros((4, 16), np.float32)
    want[: len(group)] = np.asarray(lhs)[: len(group)] * (group[:, None] + 1)
    for impl, config in [("xla", None), ("triton", GMM_CFG)]:
        got = grouped_matmul(lhs, rhs, jnp.array(sizes), implementation=impl, config=config)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=impl)
    # Mosaic: 16-bit operands; doubling a bfloat16 value is exact.
    bf16 = [x.astype(jnp.bfloat16) for x in (lhs, rhs)]
    got = grouped_matmul(*bf16, jnp.array(sizes), implementation="mosaic", config=MOSAIC_CFG)
    want_bf16 = np.zeros_like(want)  # the same rows, from the rounded inputs
    want_bf16[: len(group)] = np.asarray(bf16[0], np.float32)[: len(group)] * (group[:, None] + 1)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want_bf16)


def test_shared_expert_keeps_its_projections_and_product_alone(getkey, capsys):
    """The shared expert's training residuals over the tokens: the gate | up projections
    (one array) and the SwiGLU product, not silu's intermediates (`swiglu`)."""
    shared = SwiGLU(16, 24, key=getkey())
    x = jax.random.normal(getkey(), (19, 16))
    saved = saved_residuals(capsys, lambda m, x: jnp.sum(jax.vmap(m)(x)), shared, x)
    rows = re.findall(r"f32\[19,(?:1,)?(\d+)\]", saved)
    assert sorted(map(int, rows)) == [16, 24, 48], rows  # x, the product, gate | up
    assert_close(jax.vmap(shared)(x), jax.vmap(lambda t: shared.down(
        jax.nn.silu(shared.gate(t)) * shared.up(t)))(x), jnp.float32)  # fmt: skip


def test_router_keeps_no_float32_copy_of_the_tokens(capsys):
    """The router's float32 logits of 16-bit tokens keep the tokens, not their cast."""
    moe = MoE(16, 24, num_experts=4, top_k=2, key=jax.random.key(0))
    x = jnp.ones((19, 16), jnp.bfloat16)
    saved = saved_residuals(capsys, lambda m, x: jnp.sum(m.route(x)[1]), moe, x)
    assert "f32[19,16]" not in saved


@pytest.mark.parametrize("dispatch", ["triton", "fused_gsum"])
def test_higher_derivatives(getkey, dispatch):
    """Beyond the interpreted kernels' own VJP (the grouped matmul; the fused gather /
    scatter dispatch): forward mode and derivatives of derivatives, with respect to the
    tokens and the expert weights, equal XLA's throughout."""
    x = jax.random.normal(getkey(), (9, 16))
    key = getkey()
    moe, reference = make_moe(key, dispatch), make_moe(key, "xla")  # the same weights

    def run(module):  # a function of the module's float arrays (the dispatch is static)
        params, static = eqx.partition(module, eqx.is_inexact_array)
        treedef = jax.tree.structure(params)
        return lambda leaves, x: eqx.combine(jax.tree.unflatten(treedef, leaves), static)(x)[0]

    weights = jax.tree.leaves(eqx.filter(moe, eqx.is_inexact_array))
    check_higher_derivatives(run(moe), run(reference), weights, x)
