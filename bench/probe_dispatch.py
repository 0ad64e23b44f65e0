"""What a JAX dispatch adds to an attention call's time: `python -m bench.probe_dispatch`.

Torch SDPA cuDNN ran T 4096 hd 128 fwd in 0.452 ms where JAX's route to the same cuDNN
kernel took 0.482 (run 93), and ncu timed that kernel alike in both (run 66). Here each
JAX route runs (a) one call per dispatched program, as the suites time it, and (b)
`--calls` chained calls inside one program (each call's output the next one's queries),
as a model's layers run inside one jitted training step; per call, in ms. Torch runs
the same one call and chain, eagerly. Run 94 timed a `fori_loop` chain instead: slower
per call (0.489 vs 0.466 ms fwd), the loop's own work.
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp

from bench.attention_suite import _jax_impls, _torch_impls
from bench.harness import (
    RowWriter,
    device_info,
    fwd_bwd_program,
    stack,
    time_fn,
    versions,
    warm_up_device,
)


def _with_mask(q, k, v, *, impl, causal):
    return impl(q, k, v, causal)


def _programs(f, calls):
    chained = stack(f, calls)
    return {
        "fwd": (jax.jit(f), 1),
        "fwd+bwd": (fwd_bwd_program(f), 1),
        "fwd chain": (jax.jit(chained), calls),
        "fwd+bwd chain": (fwd_bwd_program(chained), calls),
    }


def _torch_timings(f, q, k, v, ct, calls):
    import torch

    qt, kt, vt, ctt = (torch.from_dlpack(x).transpose(1, 2).detach().clone() for x in (q, k, v, ct))
    for t in (qt, kt, vt):
        t.requires_grad_(True)
    out = {}
    for how, n in (("", 1), (" chain", calls)):
        chained = stack(f, n)

        def fwd(chained=chained):
            with torch.no_grad():
                return chained(qt, kt, vt)

        def fwd_bwd(chained=chained):
            for t in (qt, kt, vt):
                t.grad = None
            chained(qt, kt, vt).backward(ctt)

        sync = lambda _: torch.cuda.synchronize()  # noqa: E731
        out["fwd" + how] = time_fn(fwd, sync) / n
        out["fwd+bwd" + how] = time_fn(fwd_bwd, sync) / n
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seq", type=int, nargs="*", default=[4096])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    warm_up_device()
    writer = RowWriter(args.out)
    base = dict(device=device_info(), versions=versions(), suite="probe_dispatch")
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    names = ["probjax auto", "probjax mosaic", "jax.nn cudnn"]
    if jax.devices()[0].platform != "gpu":  # a CPU smoke run
        names = ["probjax auto", "jax.nn xla"]
    torch_names = [n for n in ("torch sdpa cudnn",) if n in torch_impls]
    for t in args.seq:
        shape = (4, t, 8, args.head_dim)
        keys = jax.random.split(jax.random.key(t), 4)
        q, k, v, ct = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
        for causal in map(bool, args.causal):
            case = dict(batch=4, heads=8, seq=t, head_dim=args.head_dim, causal=causal)
            for name in names + torch_names:
                impl = {**jax_impls, **torch_impls}[name]
                f = functools.partial(_with_mask, impl=impl, causal=causal)
                if name in torch_names:
                    timings = _torch_timings(f, q, k, v, ct, args.calls)
                else:
                    timings = {}
                    for how, (program, calls) in _programs(f, args.calls).items():
                        operands = (q, k, v, ct) if "bwd" in how else (q, k, v)
                        call = functools.partial(program, *operands)
                        ms = time_fn(call, jax.block_until_ready)
                        timings[how] = ms / calls
                for how, ms in timings.items():
                    writer.add(dict(base, implementation=name, how=how, shape=case,
                                    dtype="bfloat16", ms_per_call=ms))  # fmt: skip
                    print(f"{t} hd{args.head_dim} causal={causal} {name:18s} {how:14s} "
                          f"{ms:.3f} ms/call", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
