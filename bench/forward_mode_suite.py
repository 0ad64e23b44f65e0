"""Forward-mode suite: `jax.jvp` of attention, value and tangent, per implementation.

Consistency-model training and `jax.jacfwd` push tangents through attention. Our
default runs its forward kernel for the value and Triton's one-pass tangent kernel for
the tangent (no score matrix); the references differentiate XLA's attention, which
keeps the score matrix and its tangent. `fwd_ms` is the time of the jitted `jax.jvp`
(value and tangent together), `temp_bytes` the compiled program's scratch. cuDNN's
route through `jax.nn` is a custom VJP without forward mode: an `unsup.` row. Each
tangent is checked against the float32 reference's on the first batch element's first
two heads (the whole float32 score matrix would not fit at T 16384).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import classify, select_grid, time_fn
from probjax_eqx import dot_product_attention, masks

FULL = dict(batch=[4], heads=[8], seq=[1024, 4096, 16384], head_dim=[64, 128],
            causal=[False, True])  # fmt: skip
QUICK = dict(batch=[1], heads=[2], seq=[32], head_dim=[16], causal=[False, True])
TOLERANCE = dict(atol=6e-2, rtol=2e-2)  # bf16 tangents of O(1) entries


def _implementations(causal: bool) -> dict:
    mask = masks.Causal() if causal else None

    def ours(implementation):
        return lambda q, k, v: dot_product_attention(
            q, k, v, mask=mask, implementation=implementation
        )

    def jax_nn(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    return {
        "probjax auto": (ours(None), False),
        "probjax xla": (ours("xla"), False),
        "jax.nn xla": (jax_nn("xla"), True),
        "jax.nn cudnn": (jax_nn("cudnn"), True),
    }


def _oracle_tangent(primals, tangents, causal: bool):
    """The float32 reference's tangent on batch element 0, heads 0 and 1."""
    cut = [x[:1, :, :2].astype(jnp.float32) for x in (*primals, *tangents)]
    mask = masks.Causal() if causal else None
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="xla")  # noqa: E731
    return np.asarray(jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:])[1])(*cut))


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="seq", seqs=seqs, overrides=overrides)
    for values in itertools.product(*grid.values()):
        shape = dict(zip(grid, values))
        batch, heads, seq, head_dim, causal = values
        keys = jax.random.split(jax.random.key(seq + head_dim), 6)
        arrays = [jax.random.normal(kk, (batch, seq, heads, head_dim), jnp.bfloat16)
                  for kk in keys]  # fmt: skip
        primals, tangents = tuple(arrays[:3]), tuple(arrays[3:])
        expected = _oracle_tangent(primals, tangents, causal)
        for name, (f, peer) in _implementations(causal).items():
            if only is not None and name not in only:
                continue
            row = dict(base_row, suite="forward_mode", implementation=name, peer=peer,
                       shape=shape, dtype="bfloat16", mask="causal" if causal else "none",
                       status="ok", message="")  # fmt: skip
            try:
                program = jax.jit(lambda p, t, f=f: jax.jvp(f, p, t))
                compiled = program.lower(primals, tangents).compile()
                memory = compiled.memory_analysis()
                if memory is not None:
                    row["temp_bytes"] = int(memory.temp_size_in_bytes)
                _, tangent = compiled(primals, tangents)
                got = np.asarray(tangent[:1, :, :2], np.float32)
                err = float(np.max(np.abs(got - expected)))
                call = lambda c=compiled, p=primals, t=tangents: c(p, t)  # noqa: E731
                ms = time_fn(call, jax.block_until_ready, repeats=repeats)
                row.update(fwd_ms=ms, max_abs_err=err)
                bound = TOLERANCE["atol"] + TOLERANCE["rtol"] * np.abs(expected)
                if not np.all(np.abs(got - expected) <= bound):
                    row.update(status="error", message=f"tangent differs from float32: {err:.3g}")
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(e)
            writer.add(row)
            yield row
