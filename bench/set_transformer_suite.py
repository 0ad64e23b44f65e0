"""Set-transformer suite: the attention of an ISAB at head_dim 32, and ISAB train steps.

Attention rows: `m` inducing points attending to `n` set elements and back (`Lq != Lkv`),
bf16, heads of 32 dims, every implementation and peer of the attention suite on the
same inputs (output and gradients checked against the float32 oracle). Model rows: one
`ISAB` layer's forward and train step (gradients of parameters and input) over a batch
of sets, per attention implementation.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bench import attention_suite
from bench.harness import (
    GRAD_ATOL,
    check_grads,
    classify,
    oracle_grads,
    record,
    select_grid,
    time_model_step,
)
from probjax_eqx import ISAB
from probjax_eqx.kernels.reference import attention as reference

HEAD_DIM = 32
FULL = dict(sets=[64], heads=[4], elements=[1024, 4096], inducing=[128])
QUICK = dict(sets=[2], heads=[2], elements=[64], inducing=[16])
MODEL_IMPLS = ("auto", "triton", "cudnn", "mosaic", "xla")


def _attention_rows(writer, base_row, shape, names, jax_impls, torch_impls, repeats):
    b, h, n, m = shape.values()
    for lq, lkv in ((m, n), (n, m)):
        keys = jax.random.split(jax.random.key(lq * 7 + lkv), 4)
        q = jax.random.normal(keys[0], (b, lq, h, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (b, lkv, h, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
                for kk in keys[1:3])  # fmt: skip
        ct = jax.random.normal(keys[3], q.shape, jnp.float32).astype(jnp.bfloat16)
        rows = attention_suite.CHECK_ROWS
        oracle = functools.partial(reference.attention, mask=None, score_mod=None,
                                   scale=HEAD_DIM**-0.5, oracle=True)  # fmt: skip
        expected = np.asarray(oracle(q[:, :rows], k, v))
        expected_grads = oracle_grads(oracle, q, k, v, ct, rows)
        flops = 4.0 * b * h * lq * lkv * HEAD_DIM
        for name in names:
            row = dict(
                base_row, suite="set_transformer", implementation=name,
                peer=not name.startswith("probjax"),
                shape=dict(sets=b, heads=h, q_len=lq, kv_len=lkv, head_dim=HEAD_DIM),
                dtype="bfloat16", mask="none", flops_fwd=flops, flops_fwd_bwd=3.5 * flops,
                status="ok", message="",
            )  # fmt: skip
            try:
                is_torch = name in torch_impls
                timer = attention_suite._time_torch if is_torch else attention_suite._time_jax
                impl = torch_impls[name] if is_torch else jax_impls[name]
                out, fwd_ms, bwd_ms, grads = timer(impl, q, k, v, ct, False, repeats)
                record(
                    row, out, expected, fwd_ms, bwd_ms, atol=attention_suite.FWD_ATOL["bfloat16"]
                )
                check_grads(row, grads, expected_grads, atol=GRAD_ATOL["bfloat16"])
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(e)
            writer.add(row)
            yield row


def _model_rows(writer, base_row, shape, names, repeats):
    b, h, n, m = shape.values()
    dim = h * HEAD_DIM
    x = jax.random.normal(jax.random.key(n), (b, n, dim), jnp.float32).astype(jnp.bfloat16)
    expected = None
    # Two attentions of 4 b h n m d FLOPs each, plus the projections and MLPs (2 x 4 x 2 x n
    # x dim^2 per MAB, counted roughly): TFLOP/s here is a guide, the times are the data.
    flops = 2 * 4.0 * b * h * n * m * HEAD_DIM + 2 * 2 * 8.0 * b * (n + m) * dim * dim
    for impl in MODEL_IMPLS:
        name = f"isab {impl}"
        if names is not None and name not in names:
            continue
        row = dict(base_row, suite="set_transformer", implementation=name, peer=False,
                   shape=dict(sets=b, heads=h, elements=n, inducing=m, head_dim=HEAD_DIM),
                   dtype="bfloat16", flops_fwd=flops, status="ok", message="")  # fmt: skip
        try:
            model = ISAB(dim, h, m, implementation=impl, dtype=jnp.bfloat16, key=jax.random.key(0))
            out, fwd_ms, bwd_ms = time_model_step(
                model, (x,), lambda y: jnp.sum(y.astype(jnp.float32) ** 2), repeats,
                input_grads=True,
            )  # fmt: skip
            expected = out if expected is None else expected
            record(row, out, expected, fwd_ms, bwd_ms, atol=6e-2, bwd_factor=3.0,
                   against=f"isab {MODEL_IMPLS[0]}")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            row["status"], row["message"] = classify(e)
        writer.add(row)
        yield row


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="elements", seqs=seqs,
                       overrides=overrides)  # fmt: skip
    jax_impls, torch_impls = attention_suite._jax_impls(), attention_suite._torch_impls()
    names = [n for n in [*jax_impls, *torch_impls] if only is None or n in only]
    for values in itertools.product(*grid.values()):
        shape = dict(zip(grid, values))
        yield from _attention_rows(writer, base_row, shape, names, jax_impls, torch_impls,
                                   repeats)  # fmt: skip
        yield from _model_rows(writer, base_row, shape, only, repeats)
