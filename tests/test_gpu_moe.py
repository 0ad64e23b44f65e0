"""GPU tests (`pytest --gpu`): grouped-matmul kernels and MoE dispatch modes at real sizes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from _tolerance import assert_close
from probjax_eqx import MoE, grouped_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_grouped_matmul_matches_ragged_dot(getkey, impl):
    sizes = jnp.array([1000, 0, 3, 2093, 900])  # ragged, one empty group
    m, k, n = int(sizes.sum()), 1024, 768
    lhs = jax.random.normal(getkey(), (m, k)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(getkey(), (5, k, n)) / k**0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(getkey(), (m, n)) / 8
    f = jax.jit(lambda a, b: grouped_matmul(a, b, sizes, implementation=impl))
    ref = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision="highest")  # noqa: E731
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    assert_close(f(lhs, rhs), ref(up(lhs), up(rhs)), jnp.bfloat16)
    loss = lambda g: lambda a, b: jnp.sum(g(a, b).astype(jnp.float32) * ct)  # noqa: E731
    got = jax.jit(jax.grad(loss(f), (0, 1)))(lhs, rhs)
    want = jax.grad(loss(ref), (0, 1))(up(lhs), up(rhs))
    for a, b in zip(got, want):
        # dRHS sums ~2000 rows: O(1) after dividing by its scale, as the tolerances assume.
        scale = float(jnp.max(jnp.abs(b)))
        assert_close(a / scale, b / scale, jnp.bfloat16, grad=True)


@pytest.mark.parametrize("dispatch", ["triton", "mosaic", "fused_gsum"])
def test_moe_dispatch_matches_xla(getkey, dispatch):
    key = getkey()

    def make(d):
        return MoE(
            512, 1024, num_experts=16, top_k=4, dispatch=d, compute_dtype="bfloat16", key=key
        )

    x = jax.random.normal(getkey(), (4096, 512))
    y, _ = eqx.filter_jit(make(dispatch))(x)
    y_ref, _ = eqx.filter_jit(make("xla"))(x)
    assert_close(y, y_ref, jnp.bfloat16)


@pytest.mark.parametrize("compute_dtype", ["bfloat16", None])
def test_auto_runs_mosaic_for_16_bit_compute_else_fused_gsum(getkey, compute_dtype):
    # sm_90: Mosaic on the sorted rows for 16-bit compute, forward and backward; for
    # float32 compute the fused gather / scatter (Triton), with Mosaic's refusal named.
    key = getkey()

    def make(d):
        return MoE(512, 1024, num_experts=16, top_k=4, dispatch=d, compute_dtype=compute_dtype,
                   key=key)  # fmt: skip

    auto, dtype = make("auto"), jnp.dtype(compute_dtype or jnp.float32)
    x = jax.random.normal(getkey(), (4096, 512))
    choice = auto.explain(x)
    if compute_dtype is None:
        assert (choice.kernel, auto.dispatch_mode) == ("triton", "fused_gsum")
        assert "16-bit operands" in dict(choice.rejected)["mosaic"]
    else:
        assert choice.kernel == "mosaic"
    assert auto.explain_inference(x) is None  # one mode, forward and train step
    y, _ = eqx.filter_jit(auto)(x)
    tf32 = True  # float32 dots may run as TF32 on the GPU (either side)
    assert_close(y, eqx.filter_jit(make("xla"))(x)[0], dtype, tf32=tf32)
    loss = lambda m, x: jnp.sum(m(x)[0].astype(jnp.float32))  # noqa: E731
    got = eqx.filter_jit(eqx.filter_grad(loss))(auto, x)
    want = eqx.filter_jit(eqx.filter_grad(loss))(make("xla"), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        assert_close(a / scale, b / scale, dtype, grad=True, tf32=tf32)


def test_inference_dispatch_beside_a_fused_gsum_train_step(getkey):
    # The lean train step (fused_gsum) with Mosaic's forward outside differentiation.
    key = getkey()

    def make(d, inference=None):
        return MoE(512, 1024, num_experts=16, top_k=4, dispatch=d, compute_dtype="bfloat16",
                   inference_dispatch=inference, key=key)  # fmt: skip

    hybrid = make("fused_gsum", "mosaic")
    x = jax.random.normal(getkey(), (4096, 512))
    assert hybrid.explain_inference(x).kernel == "mosaic"
    assert_close(eqx.filter_jit(hybrid)(x)[0], eqx.filter_jit(make("mosaic"))(x)[0],
                 jnp.bfloat16)  # fmt: skip
    loss = lambda m, x: jnp.sum(m(x)[0].astype(jnp.float32))  # noqa: E731
    got = eqx.filter_jit(eqx.filter_grad(loss))(hybrid, x)
    want = eqx.filter_jit(eqx.filter_grad(loss))(make("xla"), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        assert_close(a / scale, b / scale, jnp.bfloat16, grad=True)


@pytest.mark.parametrize("dispatch", ["auto", "fused_gsum"])
def test_vmap_over_moe_on_gpu(getkey, dispatch):
    # The unbatched module under jax.vmap on the GPU kernels: auto (Mosaic on sm_90) and
    # fused_gsum, against the XLA dispatch of the same weights under vmap.
    key = getkey()

    def make(d):
        return MoE(256, 512, num_experts=8, top_k=2, dispatch=d, compute_dtype="bfloat16",
                   key=key)  # fmt: skip

    x = jax.random.normal(getkey(), (4, 1024, 256))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x)[0])
    assert_close(run(make(dispatch), x), run(make("xla"), x), jnp.bfloat16)
    loss = lambda m, x: jnp.sum(run(m, x).astype(jnp.float32))  # noqa: E731
    got = eqx.filter_jit(eqx.filter_grad(loss))(make(dispatch), x)
    want = eqx.filter_jit(eqx.filter_grad(loss))(make("xla"), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        assert_close(a / scale, b / scale, jnp.bfloat16, grad=True)


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_grouped_matmul_past_65535_row_tiles(getkey, impl):
    # 4.5M rows are more than 65535 row tiles of 64: CUDA's grid y and z limit (the
    # Mosaic kernel failed to launch at 8M rows in run 20). Forward and dLHS.
    sizes = (2_000_003, 1, 2_500_000)
    lhs = jax.random.normal(getkey(), (sum(sizes), 64)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(getkey(), (3, 64, 128)) / 8).astype(jnp.bfloat16)
    group_sizes = jnp.array(sizes)
    f = jax.jit(lambda a: grouped_matmul(a, rhs, group_sizes, implementation=impl))
    starts = [0, sizes[0], sizes[0] + sizes[1]]

    def ref(a):
        w = rhs.astype(jnp.float32)
        parts = [jnp.matmul(a[s : s + m], w[g], precision="highest") for g, (s, m) in
                 enumerate(zip(starts, sizes))]  # fmt: skip
        return jnp.concatenate(parts)

    up = lhs.astype(jnp.float32)
    assert_close(f(lhs), jax.jit(ref)(up), jnp.bfloat16)
    ct = jax.random.normal(getkey(), (sum(sizes), 128)) / 8  # an argument: 2.3 GB
    loss = lambda g: lambda a, ct: jnp.sum(g(a).astype(jnp.float32) * ct)  # noqa: E731
    got = jax.jit(jax.grad(loss(f)))(lhs, ct)
    assert_close(got, jax.jit(jax.grad(loss(ref)))(up, ct), jnp.bfloat16, grad=True)


def test_deterministic_flag_gives_identical_reruns():
    # Under XLA's determinism flag (read when XLA starts: a fresh process) the MoE's auto
    # dispatch (Mosaic, else sorted) and the attention backward avoid float atomics: two
    # train steps agree bit for bit.
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import equinox as eqx, jax, jax.numpy as jnp, numpy as np
        import probjax_eqx as pjx
        moe = pjx.MoE(256, 512, num_experts=8, top_k=2, compute_dtype="bfloat16",
                      key=jax.random.key(0))
        assert moe.dispatch_mode == "sorted", moe.dispatch_mode
        x = jax.random.normal(jax.random.key(1), (8192, 256))
        assert moe.explain(x).kernel == "mosaic"  # no atomics: "auto" keeps it
        q = jax.random.normal(jax.random.key(2), (2, 1024, 8, 64), jnp.bfloat16)
        def loss(m, x, q):
            att = pjx.dot_product_attention(q, q, q, implementation="triton")
            return jnp.sum(m(x)[0]) + jnp.sum(att.astype(jnp.float32))
        step = eqx.filter_jit(eqx.filter_grad(loss))
        a = jax.tree.leaves(step(moe, x, q))
        b = jax.tree.leaves(step(moe, x, q))
        assert all(np.array_equal(u, v) for u, v in zip(a, b))
        print("identical")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_deterministic_ops=true")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "identical" in done.stdout, done.stderr[-3000:]
