"""KV-lengths suite: does time scale with the valid fraction of keys?

Every batch element keeps `fraction * seq` keys (`masks.KVLengths`); kernels that skip
key tiles past the length should take about `fraction` of the full time.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bench.attention_suite import CHECK_ROWS, FWD_ATOL
from bench.harness import (
    GRAD_ATOL,
    attention_kernel,
    check_grads,
    classify,
    fwd_bwd_program,
    oracle_grads,
    record,
    rows_cotangent,
    select_grid,
    time_fn,
)
from probjax_eqx import dot_product_attention, masks
from probjax_eqx.kernels.reference import attention as reference

FULL = dict(batch=[4], heads=[8], seq=[4096], head_dim=[128], fraction=[1.0, 0.5, 0.25])
QUICK = dict(batch=[1], heads=[2], seq=[128], head_dim=[32], fraction=[1.0, 0.5])
IMPLS = ("auto", "cudnn", "mosaic", "triton", "xla")


def _measure(name, q, k, v, ct, mask, repeats):
    def f(q, k, v):
        return dot_product_attention(q, k, v, mask=mask, implementation=name)

    fwd = jax.jit(f)
    grad = fwd_bwd_program(f)  # ct an argument: closed over, XLA folds it
    out = np.asarray(fwd(q, k, v)[:, :CHECK_ROWS], np.float32)
    fwd_ms = time_fn(lambda: fwd(q, k, v), jax.block_until_ready, repeats=repeats)
    bwd_ms = time_fn(lambda: grad(q, k, v, ct), jax.block_until_ready, repeats=repeats)
    return out, fwd_ms, bwd_ms, grad(q, k, v, rows_cotangent(ct, CHECK_ROWS))[1]


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="seq", seqs=seqs,
                       overrides=overrides)  # fmt: skip
    names = [n for n in IMPLS if only is None or f"probjax {n}" in only]
    for b, h, t, d, fraction in itertools.product(*grid.values()):
        keys = jax.random.split(jax.random.key(t + d), 4)
        q, k, v = (
            jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16) for kk in keys[:3]
        )
        ct = jax.random.normal(keys[3], q.shape, jnp.float32).astype(jnp.bfloat16)
        mask = masks.KVLengths(jnp.full((b,), int(fraction * t), jnp.int32))
        oracle = functools.partial(reference.attention, mask=mask, score_mod=None,
                                   scale=d**-0.5, oracle=True)  # fmt: skip
        expected = np.asarray(oracle(q[:, :CHECK_ROWS], k, v))
        expected_grads = oracle_grads(oracle, q, k, v, ct, CHECK_ROWS)
        flops = 4.0 * b * h * t * t * d * fraction
        for name in names:
            row = dict(
                base_row,
                suite="kv_lengths",
                implementation=f"probjax {name}",
                peer=False,
                shape=dict(batch=b, heads=h, seq=t, head_dim=d, kv_fraction=fraction),
                dtype="bfloat16",
                mask="kv_lengths",
                flops_fwd=flops,
                flops_fwd_bwd=3.5 * flops,
                status="ok",
                message="",
            )
            try:
                attention_kernel(row, q, k, v, mask)
                out, fwd_ms, bwd_ms, grads = _measure(name, q, k, v, ct, mask, repeats)
                record(row, out, expected, fwd_ms, bwd_ms, atol=FWD_ATOL["bfloat16"])
                check_grads(row, grads, expected_grads, atol=GRAD_ATOL["bfloat16"])
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(e)
            writer.add(row)
            yield row
