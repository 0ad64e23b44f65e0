"""Sweep the recurrence kernels' configs: `python -m bench.sweep_ssm --out F`.

The shapes of the sequence suite (B4, T 4096, d_model 1024, bf16): Mamba's selective
scan (d_inner 2048, 16 states) over `steps` per load and `block_d`, RLA's linear
branch (8 heads, 256 features, 128 values) over `block_dv`, `chunk`, warps and the
backward's form, and Mamba-2's SSD (32 heads of 64 channels, 64 states) over the same.
Rows: fwd and fwd+bwd per config, batched with `jax.vmap` like the modules.
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp

from bench.harness import RowWriter, classify, device_info, time_fn, versions, warm_up_device
from probjax_eqx.kernels.triton import ssm

SCAN = [  # steps, block_d, num_warps
    (1, 32, 2),
    (8, 32, 2),
    (16, 32, 2),
    (32, 32, 2),
    (16, 16, 1),
    (16, 64, 4),
]
LINEAR = [  # block_dv, chunk, num_stages, num_warps, chunk_parallel_backward
    (32, 32, 1, 4, False),  # the default for RLA's wide states
    (32, 32, 1, 8, False),
    (32, 32, 1, 4, True),
    (32, 64, 1, 4, True),
    (64, 64, 1, 8, True),
    (64, 32, 1, 4, True),
    (None, 32, 1, 4, False),
    (16, 32, 1, 4, False),
    (32, 64, 2, 4, False),
]


def _scan_case(key, batch, seq, d, n):
    keys = jax.random.split(key, 5)
    x = jax.random.normal(keys[0], (batch, seq, d), jnp.bfloat16)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (batch, seq, d)) - 4).astype(jnp.bfloat16)
    a = -jnp.exp(jax.random.normal(keys[2], (d, n)))
    b, c = (jax.random.normal(k, (batch, seq, n), jnp.bfloat16) for k in keys[3:])
    h0 = jnp.zeros((batch, d, n))

    def run(cfg):
        f = functools.partial(ssm.selective_scan, config=cfg)
        return jax.vmap(lambda x, dt, b, c, h0: f(x, dt, a, b, c, h0)[0])

    return run, (x, dt, b, c, h0)


def _linear_case(key, batch, seq, heads, features, dv):
    keys = jax.random.split(key, 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, features), jnp.bfloat16) / features
    k = jax.random.normal(keys[1], (batch, seq, heads, features), jnp.bfloat16) / features
    v = jax.random.normal(keys[2], (batch, seq, heads, dv), jnp.bfloat16)
    h0 = jnp.zeros((batch, heads, features, dv))

    def run(cfg):
        f = functools.partial(ssm.chunked_linear_attention, config=cfg)
        return jax.vmap(lambda q, k, v, h0: f(q, k, v, None, h0)[0])

    return run, (q, k, v, h0)


SSD = [  # block_dv, chunk, num_stages, num_warps, chunk_parallel_backward
    (None, 64, 2, 4, False),  # the default (narrow states)
    (None, 64, 2, 4, True),
    (32, 64, 2, 4, False),
    (32, 64, 1, 4, True),
    (64, 64, 1, 8, True),
    (None, 128, 1, 8, False),
]


def _ssd_case(key, batch, seq, heads, p, n):
    from probjax_eqx.mamba import ssd

    keys = jax.random.split(key, 4)
    x = jax.random.normal(keys[0], (batch, seq, heads, p), jnp.bfloat16)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (batch, seq, heads)) - 3).astype(jnp.bfloat16)
    a = -jnp.linspace(1.0, 16.0, heads)
    b, c = (jax.random.normal(k, (batch, seq, n), jnp.bfloat16) / n**0.5 for k in keys[2:])
    d_skip = jnp.ones(heads)

    def run(cfg):
        f = functools.partial(ssd, implementation="triton", config=cfg)
        body = lambda x, dt, b, c, d_skip: f(x, dt, a, b, c, d_skip)[0]  # noqa: E731
        return jax.vmap(body, in_axes=(0, 0, 0, 0, None))

    return run, (x, dt, b, c, d_skip)


def _measure(fn, args):
    sync = jax.block_until_ready
    fwd = jax.jit(fn)
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args) - 1))))
    return dict(
        fwd_ms=time_fn(lambda: fwd(*args), sync), fwd_bwd_ms=time_fn(lambda: grad(*args), sync)
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kernel", nargs="+", default=["selective_scan", "chunked_linear", "ssd"],
                        choices=["selective_scan", "chunked_linear", "ssd"])  # fmt: skip
    args = parser.parse_args()
    warm_up_device()
    key = jax.random.key(0)
    interpret = jax.devices()[0].platform != "gpu"  # a CPU smoke run
    scan, scan_args = _scan_case(key, args.batch, args.seq, 2048, 16)
    linear, linear_args = _linear_case(key, args.batch, args.seq, 8, 256, 128)
    ssd_run, ssd_args = _ssd_case(key, args.batch, args.seq, 32, 64, 64)
    cases = [
        (
            "selective_scan",
            scan,
            scan_args,
            ssm.SelectiveScanConfig(steps=s, block_d=bd, num_warps=w, interpret=interpret),
        )
        for s, bd, w in SCAN
    ]
    cases += [("chunked_linear", linear, linear_args,
               ssm.ChunkedLinearConfig(block_dv=bdv, chunk=c, num_stages=st, num_warps=w,
                                       chunk_parallel_backward=par, interpret=interpret))
              for bdv, c, st, w, par in LINEAR]  # fmt: skip
    cases += [("ssd", ssd_run, ssd_args,
               ssm.ChunkedLinearConfig(block_dv=bdv, chunk=c, num_stages=st, num_warps=w,
                                       chunk_parallel_backward=par, interpret=interpret))
              for bdv, c, st, w, par in SSD]  # fmt: skip
    writer, env = RowWriter(args.out), dict(device=device_info(), versions=versions())
    for kernel, build, operands, cfg in cases:
        if kernel not in args.kernel:
            continue
        row = dict(kernel=kernel, batch=args.batch, seq=args.seq, config=repr(cfg), status="ok")
        row.update(env)
        try:
            row.update(_measure(build(cfg), operands))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a row
            row["status"], row["message"] = classify(exc)
        writer.add(row)
        print(row, flush=True)


if __name__ == "__main__":
    main()
