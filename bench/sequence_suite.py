"""Sequence-mixer suite: Mamba, Mamba-2 and RLA per implementation; MLA against MHA.

B4, d_model 1024, bf16, forward and forward+backward (gradients of parameters and input).
Each implementation's output is checked against the sequential `"scan"` reference of the
same module and parameters (the first batch element) before its time counts; MLA and MHA
are timed on our default attention backend, MHA with the same heads and qk head dim.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import classify, record, time_fn
from probjax_eqx import MLA, RLA, Attention, Mamba, Mamba2, masks

FULL = dict(batch=4, d_model=1024, seq=[1024, 4096, 16384])
QUICK = dict(batch=1, d_model=32, seq=[40])
BF16_ATOL = 6e-2
BF16_RTOL = 2**-6  # two rounding steps of bf16 (8 significant bits), for outputs past O(1)


def _builders(d, quick):
    heads = 2 if quick else 8
    bf16 = jnp.bfloat16
    return {
        "mamba": (("scan", "associative", "triton"),
                  lambda impl, key: Mamba(d, implementation=impl, dtype=bf16, key=key)),
        "mamba2": (("scan", "chunked", "triton"),
                   lambda impl, key: Mamba2(d, implementation=impl, dtype=bf16, key=key)),
        "rla": (("scan", "chunked", "triton"),
                lambda impl, key: RLA(d, heads, window=16 if quick else 512, implementation=impl,
                                      dtype=bf16, key=key)),
        "mla": (("auto",),
                lambda impl, key: MLA(d, heads, kv_lora_rank=d // 2, nope_dim=96, rope_dim=32,
                                      v_dim=128, dtype=bf16, key=key)),
        "mha": (("auto",),
                lambda impl, key: _CausalAttention(Attention(d, heads, head_dim=128, dtype=bf16,
                                                             key=key))),
    }  # fmt: skip


class _CausalAttention(eqx.Module):
    attention: Attention

    def __call__(self, x):
        return self.attention(x, mask=masks.Causal())


def _measure(module, x, ct, repeats):
    params, static = eqx.partition(module, eqx.is_array)

    def fwd(params, x):
        m = eqx.combine(params, static)
        return jax.vmap(lambda row: m(row))(x)

    def loss(params, x, ct):  # ct an argument: closed over, XLA folds it
        return jnp.sum(fwd(params, x).astype(jnp.float32) * ct)

    f = jax.jit(fwd)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out = np.asarray(f(params, x)[0], np.float32)
    sync = jax.block_until_ready
    fwd_ms = time_fn(functools.partial(f, params, x), sync, repeats=repeats)
    bwd_ms = time_fn(functools.partial(g, params, x, ct), sync, repeats=repeats)
    return out, fwd_ms, bwd_ms


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    if overrides:
        raise ValueError(f"--set is not supported by this suite (got {sorted(overrides)})")
    grid = QUICK if quick else FULL
    b, d = grid["batch"], grid["d_model"]
    for seq in seqs or grid["seq"]:
        keys = jax.random.split(jax.random.key(seq), 3)
        x = jax.random.normal(keys[0], (b, seq, d), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(keys[1], (b, seq, d), jnp.float32)
        for model, (impls, build) in _builders(d, quick).items():
            expected = None
            for impl in impls:
                name = f"{model} {impl}"
                if only is not None and name not in only:
                    continue
                row = dict(base_row, suite="sequence", implementation=name,
                           peer=model == "mha", shape=dict(batch=b, seq=seq, d_model=d),
                           dtype="bfloat16", flops_fwd=1.0, status="ok", message="")  # fmt: skip
                try:
                    out, fwd_ms, bwd_ms = _measure(build(impl, keys[2]), x, ct, repeats)
                    if impl == "scan":
                        expected = out
                    want = out if expected is None else expected
                    record(row, out, want, fwd_ms, bwd_ms, atol=BF16_ATOL, rtol=BF16_RTOL,
                           against="the scan reference")  # fmt: skip
                    row.pop("tflops_fwd"), row.pop("tflops_fwd_bwd"), row.pop("flops_fwd")
                    if expected is None and impls[0] == "scan":
                        # The scan failed or `--only` left it out: nothing to compare with.
                        row["message"] = "unchecked: no scan reference in this run"
                except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                    row["status"], row["message"] = classify(exc)
                    row.pop("flops_fwd", None)
                writer.add(row)
                yield row
