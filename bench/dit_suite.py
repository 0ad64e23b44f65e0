"""DiT suite: one train step of a `DiffusionTransformer` per attention implementation.

bf16 compute, a batch of images as patch tokens (`vmap` over the batch), layers under
`lax.scan`; the step is the forward plus the gradients of every parameter. The first
implementation's output is the reference the others are checked against.
"""

import itertools

import jax
import jax.numpy as jnp

from bench.harness import classify, record, select_grid, time_model_step
from probjax_eqx import DiffusionTransformer

FULL = dict(batch=[16], tokens=[256, 1024], model_dim=[512], heads=[8], layers=[8])
QUICK = dict(batch=[2], tokens=[16], model_dim=[32], heads=[2], layers=[2])
IMPLS = ("auto", "triton", "cudnn", "mosaic", "xla")
IN_DIM = 16  # a 2x2 patch of a 4-channel latent


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="tokens", seqs=seqs,
                       overrides=overrides)  # fmt: skip
    for values in itertools.product(*grid.values()):
        shape = dict(zip(grid, values))
        b, n, dim, heads, layers = values
        keys = jax.random.split(jax.random.key(n), 3)
        x = jax.random.normal(keys[0], (b, n, IN_DIM), jnp.float32)
        t = jax.random.uniform(keys[1], (b,))
        target = jax.random.normal(keys[2], x.shape, jnp.float32)
        # 24 n dim^2 per layer for the projections and MLP, 4 n^2 dim for attention.
        flops = 2.0 * b * layers * (12 * n * dim * dim + 2 * n * n * dim)
        expected = None
        for impl in IMPLS:
            name = f"dit {impl}"
            if only is not None and name not in only:
                continue
            row = dict(base_row, suite="dit", implementation=name, peer=False, shape=shape,
                       dtype="bfloat16", flops_fwd=flops, status="ok", message="")  # fmt: skip
            try:
                model = DiffusionTransformer(
                    IN_DIM, model_dim=dim, num_heads=heads, num_layers=layers,
                    implementation=impl, key=jax.random.key(0),
                )  # fmt: skip
                out, fwd_ms, step_ms = time_model_step(
                    model, (x, t), lambda y, target=target: jnp.mean((y - target) ** 2), repeats
                )
                expected = out if expected is None else expected
                record(row, out, expected, fwd_ms, step_ms, atol=6e-2, bwd_factor=3.0,
                       against=f"dit {IMPLS[0]}")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(e)
            writer.add(row)
            yield row
