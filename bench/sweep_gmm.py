"""Sweep grouped-matmul tiles and time its parts: `python -m bench.sweep_gmm --out F`.

One MoE-like shape (`[tokens * top_k, d_model] x [experts, d_model, n]`, rows drawn from
a random top-k router). Rows: the layout computation, the row padding, the whole
`grouped_matmul` fwd and fwd+bwd for each config of each kernel, and for Mosaic configs
each of its three kernels alone on the padded layout (`part="kernel"`): where the
backward's time goes (run 17: 18.6 ms fwd+bwd at 1M rows against Triton's 3.4).
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp

from bench.harness import RowWriter, classify, time_fn, warm_up_device
from probjax_eqx import grouped_matmul
from probjax_eqx.kernels.mosaic import grouped_matmul as mosaic_gmm
from probjax_eqx.kernels.mosaic.grouped_matmul import MosaicGroupedMatmulConfig
from probjax_eqx.kernels.triton import grouped_matmul as triton_gmm

TRITON = [  # block_m, block_n, block_k, num_warps, num_stages
    (64, 64, 32, 4, 2),
    (64, 128, 64, 4, 3),
    (128, 128, 32, 4, 4),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 2),
    (64, 256, 64, 4, 3),
]
MOSAIC = [  # block_m (128: two compute warpgroups and a TMA one), n, k, stages
    (64, 128, 64, 2),
    (64, 256, 64, 2),
    (128, 128, 64, 3),
    (128, 128, 64, 4),
    (128, 256, 64, 2),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 512, 256, 64], metavar="KDNE")
    parser.add_argument("--impl", choices=("triton", "mosaic"), nargs="+",
                        default=["triton", "mosaic"])  # fmt: skip
    args = parser.parse_args()
    warm_up_device()
    top_k, d, n, e = args.shape
    rows = args.tokens * top_k
    keys = jax.random.split(jax.random.key(0), 4)
    chosen = jax.lax.top_k(jax.random.normal(keys[0], (args.tokens, e)), top_k)[1]
    sizes = jnp.bincount(chosen.reshape(-1), length=e).astype(jnp.int32)
    lhs = jax.random.normal(keys[1], (rows, d), jnp.bfloat16)
    rhs = jax.random.normal(keys[2], (e, d, n), jnp.bfloat16) / d**0.5
    ct = jax.random.normal(keys[3], (rows, n), jnp.bfloat16)
    writer = RowWriter(args.out)

    def add(row):
        writer.add(row)
        print(row, flush=True)

    sync = jax.block_until_ready
    lay_fn = jax.jit(lambda s: triton_gmm.layout(s, rows, 64))
    lay = lay_fn(sizes)
    add(dict(part="layout", ms=time_fn(functools.partial(lay_fn, sizes), sync)))
    pad = jax.jit(lambda x, lay: lay.to_padded(x))
    add(dict(part="to_padded", ms=time_fn(functools.partial(pad, lhs, lay), sync)))
    unpad = jax.jit(lambda x, lay: lay.from_padded(x, x.shape[1]))
    padded = pad(lhs, lay)
    add(dict(part="from_padded", ms=time_fn(functools.partial(unpad, padded, lay), sync)))
    configs = [("triton", triton_gmm.TritonGroupedMatmulConfig(
        block_m=m, block_n=bn, block_k=bk, num_warps=w, num_stages=s))
        for m, bn, bk, w, s in TRITON]  # fmt: skip
    configs += [("mosaic", MosaicGroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk,
                                                     num_stages=s))
                for bm, bn, bk, s in MOSAIC]  # fmt: skip
    configs = [(impl, cfg) for impl, cfg in configs if impl in args.impl]
    for impl, cfg in configs:
        if impl == "mosaic":
            for row in _mosaic_kernel_rows(cfg, lhs, rhs, ct, sizes, sync):
                add(row)
        row = dict(part="grouped_matmul", impl=impl, config=repr(cfg), status="ok")
        try:
            # The sizes are an argument: a closed-over constant makes XLA fold the layout.
            fn = functools.partial(grouped_matmul, implementation=impl, config=cfg)
            fwd = jax.jit(fn)

            def step(a, b, sizes, ct, fn=fn):
                y, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), a, b)
                return y, pullback(ct)

            step = jax.jit(step)
            row["fwd_ms"] = time_fn(functools.partial(fwd, lhs, rhs, sizes), sync)
            row["fwd_bwd_ms"] = time_fn(functools.partial(step, lhs, rhs, sizes, ct), sync)
            flops = 2.0 * rows * d * n
            row["tflops_fwd"] = flops / row["fwd_ms"] / 1e9
            row["tflops_fwd_bwd"] = 3 * flops / row["fwd_bwd_ms"] / 1e9
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row
            row["status"], row["message"] = classify(exc)
        add(row)


def _mosaic_kernel_rows(cfg, lhs, rhs, ct, sizes, sync):
    """One row per Mosaic kernel (matmul, dLHS matmul_t, dRHS transposed), timed alone."""
    kernels = mosaic_gmm.kernels(cfg, rhs.shape[0])
    lay = jax.jit(lambda s: triton_gmm.layout(s, lhs.shape[0], cfg.block_m))(sizes)
    rhs_p, k_pad, n_pad = triton_gmm.padded_rhs(rhs, cfg)
    lhs_p, ct_p = lay.to_padded(lhs, k_pad), lay.to_padded(ct, n_pad)
    parts = {
        "matmul": (kernels.matmul, (lhs_p, rhs_p)),
        "matmul_t": (kernels.matmul_t, (ct_p, rhs_p)),
        "transposed": (kernels.transposed, (lhs_p, ct_p)),
    }
    for name, (kernel, operands) in parts.items():
        row = dict(part="kernel", impl="mosaic", kernel=name, config=repr(cfg), status="ok")
        try:
            fn = jax.jit(lambda a, b, lay, kernel=kernel: kernel(a, b, lay))
            row["ms"] = time_fn(functools.partial(fn, *operands, lay), sync)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row
            row["status"], row["message"] = classify(exc)
        yield row


if __name__ == "__main__":
    main()
