"""What the timing harness itself adds: `python -m bench.probe_harness --out F`.

At B4 H8 bf16 (T, hd, causal from the flags), in one process and alternating:
- JAX routes timed as the suites did until run 92 (`grad` of `sum(out.astype(f32) * ct)`
  over a float32 `ct`) and as they do now (`fwd_bwd_program`: `jax.vjp` on a bf16 `ct`);
- torch SDPA (cuDNN, flash) on contiguous [B, H, T, D] copies, as the suites give it, and
  on the [B, H, T, D] view of the same [B, T, H, D] memory the JAX routes read (the layout
  of `x.view(B, T, H, D).transpose(1, 2)` in torch models).
"""

import argparse
import functools
import pathlib

import jax
import jax.numpy as jnp

from bench.attention_suite import _jax_impls, _torch_impls
from bench.harness import RowWriter, device_info, fwd_bwd_program, time_fn, versions, warm_up_device


def _with_mask(q, k, v, *, impl, causal):
    return impl(q, k, v, causal)


def _old_program(f):
    def loss(q, k, v, ct):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * ct)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _jax_timings(f, q, k, v, ct):
    old, new = _old_program(f), fwd_bwd_program(f)
    ct32 = ct.astype(jnp.float32)
    sync = jax.block_until_ready
    return {
        "grad, f32 ct": time_fn(lambda: old(q, k, v, ct32), sync),
        "vjp, bf16 ct": time_fn(lambda: new(q, k, v, ct), sync),
    }


def _torch_timings(f, q, k, v, ct):
    import torch

    out = {}
    for layout in ("contiguous", "view"):

        def to_torch(x, layout=layout):
            t = torch.from_dlpack(x).transpose(1, 2).detach()
            return t.clone() if layout == "contiguous" else t

        qt, kt, vt, ctt = (to_torch(x) for x in (q, k, v, ct))
        for t in (qt, kt, vt):
            t.requires_grad_(True)

        def fwd_bwd(qt=qt, kt=kt, vt=vt, ctt=ctt):
            for t in (qt, kt, vt):
                t.grad = None
            f(qt, kt, vt).backward(ctt)

        out[layout] = time_fn(fwd_bwd, lambda _: torch.cuda.synchronize())
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seq", type=int, nargs="*", default=[4096])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=2, help="alternations of every route")
    args = parser.parse_args()
    warm_up_device()
    writer = RowWriter(args.out)
    base = dict(device=device_info(), versions=versions(), suite="probe_harness")
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    jax_names = ["probjax auto", "probjax mosaic", "jax.nn cudnn"]
    if jax.devices()[0].platform != "gpu":  # a CPU smoke run
        jax_names = ["probjax auto", "jax.nn xla"]
    torch_names = [n for n in ("torch sdpa cudnn", "torch sdpa flash") if n in torch_impls]
    for t in args.seq:
        shape = (4, t, 8, args.head_dim)
        keys = jax.random.split(jax.random.key(t), 4)
        q, k, v, ct = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
        for causal in map(bool, args.causal):
            case = dict(batch=4, heads=8, seq=t, head_dim=args.head_dim, causal=causal)
            for round_ in range(args.rounds):
                for name in jax_names + torch_names:
                    is_torch = name in torch_names
                    impl = (torch_impls if is_torch else jax_impls)[name]
                    f = functools.partial(_with_mask, impl=impl, causal=causal)
                    timer = _torch_timings if is_torch else _jax_timings
                    for how, ms in timer(f, q, k, v, ct).items():
                        row = dict(base, implementation=name, how=how, round=round_,
                                   shape=case, dtype="bfloat16", fwd_bwd_ms=ms)  # fmt: skip
                        writer.add(row)
                        print(f"{t} hd{args.head_dim} causal={causal} {name:18s} {how:14s} "
                              f"{ms:.3f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
