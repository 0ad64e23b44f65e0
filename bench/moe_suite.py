"""MoE suite: one `MoE` layer's forward and train step per dispatch mode, and the
grouped matmul alone against `jax.lax.ragged_dot` and a balanced dense ceiling (its
output and gradients checked against the exact product on sampled rows).

Every mode's output is checked against the `"xla"` dispatch (exact, in XLA) on the same
parameters before its time counts; `temp_bytes` is XLA's compiled scratch memory for the
forward+backward, the memory column of the report. The train step is the forward plus
gradients with respect to the parameters and the input.
"""

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import check_grads, classify, record, select_grid, time_fn, tokamax_peer
from probjax_eqx import MoE, grouped_matmul

# (d_model, d_ff, experts, top_k, shared_d_ff): a fine-grained DeepSeek-like layer.
LAYERS = [(512, 128, 64, 8, 1024)]
FULL = dict(tokens=[16_384, 131_072, 1_048_576], layer=LAYERS)
QUICK = dict(tokens=[64], layer=[(32, 48, 4, 2, 64)])
GMM_IMPLS = ("xla", "triton", "mosaic", "tokamax", "ragged_dot", "dense balanced")
GMM_PEERS = ("tokamax", "ragged_dot", "dense balanced")
MODES = ("auto", "xla", "triton", "mosaic", "pallas", "fused_gsum")
BF16_ATOL = 6e-2
BF16_RTOL = 2**-7  # one bf16 step: drhs sums a group's rows, past 8 at the quick shape


def _layer(layer, mode, key):
    d, f, e, k, shared = layer
    return MoE(
        d, f, num_experts=e, top_k=k, shared_d_ff=shared, dispatch=mode,
        compute_dtype="bfloat16", key=key,
    )  # fmt: skip


def _measure(moe, x, ct, repeats):
    params, static = eqx.partition(moe, eqx.is_array)

    def fwd(params, x):
        return eqx.combine(params, static)(x)[0]

    def loss(params, x, ct):  # ct an argument: closed over, XLA folds it (2 GB at 1M)
        return jnp.sum(fwd(params, x).astype(jnp.float32) * ct)

    f = jax.jit(fwd)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out = np.asarray(f(params, x)[:256], np.float32)
    memory = g.lower(params, x, ct).compile().memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None)
    fwd_ms = time_fn(lambda: f(params, x), jax.block_until_ready, repeats=repeats)
    bwd_ms = time_fn(lambda: g(params, x, ct), jax.block_until_ready, repeats=repeats)
    return out, fwd_ms, bwd_ms, temp


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="tokens", seqs=seqs,
                       overrides=overrides)  # fmt: skip
    names = [m for m in MODES if only is None or f"probjax moe {m}" in only]
    for tokens, layer in itertools.product(*grid.values()):
        yield from _grouped_matmul_rows(writer, base_row, tokens, layer, repeats, only)
        d, f, e, k, shared = layer
        keys = jax.random.split(jax.random.key(tokens), 3)
        x = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(keys[1], (tokens, d), jnp.float32)
        flops = 2.0 * tokens * 3 * d * (k * f + shared)
        expected = None
        for mode in names:
            row = dict(
                base_row,
                suite="moe",
                implementation=f"probjax moe {mode}",
                peer=False,
                shape=dict(
                    tokens=tokens, d_model=d, d_ff=f, experts=e, top_k=k, shared_d_ff=shared
                ),
                dtype="bfloat16",
                flops_fwd=flops,
                flops_fwd_bwd=3 * flops,
                status="ok",
                message="",
            )
            try:
                moe = _layer(layer, mode, keys[2])
                out, fwd_ms, bwd_ms, temp = _measure(moe, x, ct, repeats)
                if expected is None:
                    reference = _layer(layer, "xla", keys[2])  # same key: same parameters
                    # Routing is per token: the first 256 tokens alone give the same rows
                    # (ragged_dot on all of them runs out of memory at 131k tokens).
                    expected = np.asarray(eqx.filter_jit(reference)(x[:256])[0], np.float32)
                row["temp_bytes"] = temp
                record(row, out, expected, fwd_ms, bwd_ms, atol=BF16_ATOL, bwd_factor=3.0,
                       against="the xla dispatch")  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(exc)
            writer.add(row)
            yield row


def _grouped_matmul(name, rhs):
    """`(lhs, rhs, sizes) -> out`. The sizes stay an argument: closed over, they are a
    constant that XLA folds the whole layout computation over (10 s a compile at 1M rows,
    H200 runs 17 and 18)."""
    if name == "dense balanced":  # the same FLOPs with every group the same size
        g, kk, n = rhs.shape
        return lambda a, b, sizes: (
            jnp.einsum("gmk,gkn->gmn", a.reshape(g, -1, kk), b, preferred_element_type=jnp.float32)
            .astype(a.dtype)
            .reshape(-1, n)
        )
    if name == "tokamax":
        return tokamax_peer(lambda tk: lambda a, b, sizes: tk.ragged_dot(a, b, sizes))
    if name == "ragged_dot":  # JAX's own op, float32 accumulation like ours
        return lambda a, b, sizes: jax.lax.ragged_dot(
            a, b, sizes, preferred_element_type=jnp.float32
        ).astype(a.dtype)
    return lambda a, b, sizes: grouped_matmul(a, b, sizes, implementation=name)


def _grouped_matmul_rows(writer, base_row, tokens, layer, repeats, only):
    """The first expert matmul (`[tokens * top_k, d_model] x [experts, d_model, 2 d_ff]`)
    alone, fwd and fwd+bwd (dlhs, drhs), on routing drawn from a random softmax router."""
    d, f, e, k, _ = layer
    rows, n = tokens * k, 2 * f
    keys = jax.random.split(jax.random.key(rows), 4)
    logits = jax.random.normal(keys[0], (tokens, e))
    chosen = jax.lax.top_k(logits, k)[1].reshape(-1)
    sizes = jnp.bincount(chosen, length=e).astype(jnp.int32)
    lhs = jax.random.normal(keys[1], (rows, d), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[2], (e, d, n), jnp.float32) / d**0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[3], (rows, n), jnp.float32).astype(jnp.bfloat16)
    ends = np.cumsum(np.asarray(sizes))
    check = np.arange(0, rows, max(1, rows // 256))[:256]
    # The checked rows' exact products (ragged_dot itself runs out of memory at 1M rows).
    group_of = np.searchsorted(ends, check, side="right")
    up = lambda x: np.asarray(x, np.float32)  # noqa: E731
    expected = np.einsum("rk,rkn->rn", up(lhs[check]), up(rhs)[group_of])
    # Gradients under a cotangent on the checked rows alone: dlhs there and all of drhs
    # come from those rows, so they are checked exactly at any size.
    ct_check = jnp.zeros_like(ct).at[check].set(ct[check])
    expected_dlhs = np.einsum("rn,rkn->rk", up(ct[check]), up(rhs)[group_of])
    expected_drhs = np.zeros(rhs.shape, np.float32)
    np.add.at(expected_drhs, group_of, np.einsum("rk,rn->rkn", up(lhs[check]), up(ct[check])))
    for name in GMM_IMPLS:
        if only is not None and f"grouped_matmul {name}" not in only:
            continue
        row = dict(
            base_row,
            suite="grouped_matmul",
            implementation=f"grouped_matmul {name}",
            peer=name in GMM_PEERS,
            shape=dict(
                rows=rows, k=d, n=n, groups=e, max_group=int(np.max(np.diff(ends, prepend=0)))
            ),
            dtype="bfloat16",
            flops_fwd=2.0 * rows * d * n,
            flops_fwd_bwd=6.0 * rows * d * n,
            status="ok",
            message="",
        )
        try:
            fn = _grouped_matmul(name, rhs)
            fwd = jax.jit(fn)

            def step(a, b, sizes, ct, fn=fn):
                out, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), a, b)
                return out, pullback(ct)

            step = jax.jit(step)
            got = np.asarray(fwd(lhs, rhs, sizes)[check], np.float32)
            sync = jax.block_until_ready
            fwd_ms = time_fn(functools.partial(fwd, lhs, rhs, sizes), sync, repeats=repeats)
            bwd_ms = time_fn(functools.partial(step, lhs, rhs, sizes, ct), sync, repeats=repeats)
            # The balanced ceiling computes another product: there is nothing to check.
            want = got if name == "dense balanced" else expected
            record(row, got, want, fwd_ms, bwd_ms, atol=BF16_ATOL,
                   bwd_factor=3.0, against="the exact product")  # fmt: skip
            if name != "dense balanced":
                dlhs, drhs = step(lhs, rhs, sizes, ct_check)[1]
                check_grads(row, (dlhs[check], drhs), (expected_dlhs, expected_drhs),
                            atol=BF16_ATOL, rtol=BF16_RTOL)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row
            row["status"], row["message"] = classify(exc)
        writer.add(row)
        yield row
