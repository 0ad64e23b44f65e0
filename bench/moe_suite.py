"""MoE suite: one `MoE` layer's forward and forward+backward per dispatch mode.

Every mode's output is checked against the `"xla"` dispatch (ragged_dot) on the same
parameters before its time counts; `temp_bytes` is XLA's compiled scratch memory for the
forward+backward, the memory column of the report.
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import classify, record, time_fn
from probjax_eqx import MoE

# (d_model, d_ff, experts, top_k): Mixtral-like and fine-grained DeepSeek-like layers.
LAYERS = [(1024, 2048, 8, 2), (1024, 512, 64, 8)]
FULL = dict(tokens=[16_384, 131_072, 1_048_576], layer=LAYERS)
QUICK = dict(tokens=[64], layer=[(32, 48, 4, 2)])
MODES = ("auto", "xla", "triton", "mosaic", "pallas", "fused_gsum")
BF16_ATOL = 6e-2


def _layer(layer, mode, key):
    d, f, e, k = layer
    return MoE(d, f, num_experts=e, top_k=k, dispatch=mode, compute_dtype="bfloat16", key=key)


def _measure(moe, x, ct, repeats):
    params, static = eqx.partition(moe, eqx.is_array)

    def fwd(params, x):
        return eqx.combine(params, static)(x)[0]

    def loss(params, x):
        return jnp.sum(fwd(params, x).astype(jnp.float32) * ct)

    f = jax.jit(fwd)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out = np.asarray(f(params, x)[:256], np.float32)
    memory = g.lower(params, x).compile().memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None)
    fwd_ms = time_fn(lambda: f(params, x), jax.block_until_ready, repeats=repeats)
    bwd_ms = time_fn(lambda: g(params, x), jax.block_until_ready, repeats=repeats)
    return out, fwd_ms, bwd_ms, temp


def run(writer, base_row, *, quick, repeats, only=None, seqs=None):
    grid = dict(QUICK if quick else FULL)
    if seqs:
        grid["tokens"] = seqs
    names = [m for m in MODES if only is None or f"probjax moe {m}" in only]
    for tokens, layer in itertools.product(*grid.values()):
        d, f, e, k = layer
        keys = jax.random.split(jax.random.key(tokens), 3)
        x = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(keys[1], (tokens, d), jnp.float32)
        flops = 2.0 * tokens * k * 3 * d * f
        expected = None
        for mode in names:
            row = dict(
                base_row,
                suite="moe",
                implementation=f"probjax moe {mode}",
                peer=False,
                shape=dict(tokens=tokens, d_model=d, d_ff=f, experts=e, top_k=k),
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
                    expected = np.asarray(eqx.filter_jit(reference)(x)[0][:256], np.float32)
                row["temp_bytes"] = temp
                record(row, out, expected, fwd_ms, bwd_ms, atol=BF16_ATOL, bwd_factor=3.0,
                       against="the xla dispatch")  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(exc)
            writer.add(row)
            yield row
