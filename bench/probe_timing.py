"""What the timing itself adds to an attention call: `python -m bench.probe_timing PROBE`.

At B4 H8 bf16 (T, hd, causal from the flags; `--shape` for cross-attention and GQA),
JAX's routes (ours and `jax.nn` cuDNN; `--routes` for others) beside torch SDPA, in one
process:

- `harness` (rows of suite `probe_harness`, fwd+bwd ms): JAX timed as the suites did
  until run 92 (`grad` of `sum(out.astype(f32) * ct)` over a float32 `ct`) and as they
  do now (`fwd_bwd_program`: `jax.vjp` on a bf16 `ct`); torch on contiguous [B, H, T, D]
  copies, as the suites give it, and on the [B, H, T, D] view of the same [B, T, H, D]
  memory the JAX routes read (`x.view(B, T, H, D).transpose(1, 2)` in torch models).
  `--rounds` alternates every route that many times.
- `dispatch` (suite `probe_dispatch`, ms per call): one call per dispatched program, as
  the suites time it, and `--calls` chained calls in one program (`harness.stack`), as a
  model's layers run in one jitted step; torch runs the same call and chain eagerly.
  Torch SDPA cuDNN ran T 4096 hd 128 fwd in 0.452 ms where JAX's route to the same
  kernels took 0.482 (run 93); ncu timed those kernels alike in both (run 95). Run 94
  chained with a `fori_loop` instead: slower per call (0.489 vs 0.466 ms fwd), the
  loop's own work. `--torch-layout view` times torch on the view of JAX's memory too.

Route variant `NAME+heads_major` reads K/V head-major (`[batch, kv_heads, keys, dim]`,
each head's keys contiguous, as torch's contiguous copies are), laid out before timing:
the call runs over `batch * kv_heads` rows of one KV head each, a group's query heads
its heads. Does decoding read K/V faster so than from `[batch, keys, heads, dim]`?
"""

import argparse
import ast
import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp

from bench.attention_suite import _jax_impls, _torch_impls
from bench.harness import (
    RowWriter,
    attention_operands,
    device_info,
    fwd_bwd_program,
    layer_caches,
    parse_shape,
    stack,
    time_fn,
    torch_copy,
    torch_fwd_bwd,
    torch_operands,
    versions,
    warm_up_device,
)
from probjax_eqx import dot_product_attention, explain_attention, masks

JAX_ROUTES = ["probjax auto", "probjax mosaic", "jax.nn cudnn"]


def _split_kv_forward(q, k, v, causal):
    """Our Mosaic backward after the split-KV Triton forward, each at its default config
    (`MosaicAttentionConfig.split_kv_forward`; unmasked calls only)."""
    if causal:
        raise NotImplementedError("split_kv_forward takes unmasked calls")
    mosaic = explain_attention(q, k, v, implementation="mosaic").config
    triton = explain_attention(q, k, v, implementation="triton").config
    config = dataclasses.replace(mosaic, split_kv_forward=triton)
    return dot_product_attention(q, k, v, implementation="mosaic", config=config)


def _with_fields(implementation: str, fields: str):
    """Our `implementation` at its default config with `fields` ("name=value,...") set."""
    changes = {}
    for item in fields.split(","):
        name, _, value = item.partition("=")
        changes[name] = ast.literal_eval(value)

    def attend(q, k, v, causal):
        mask = masks.Causal() if causal else None
        config = explain_attention(q, k, v, mask=mask, implementation=implementation).config
        config = dataclasses.replace(config, **changes)
        return dot_product_attention(
            q, k, v, mask=mask, implementation=implementation, config=config
        )

    return attend


def _repeat_kv(f):
    """`f` on K/V whose heads are repeated to the query heads' count (GQA run as MHA)."""

    def repeated(q, k, v, causal):
        groups = q.shape[2] // k.shape[2]
        k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
        return f(q, k, v, causal)

    return repeated


def heads_major(q, k, v, ct):
    """The operands of `NAME+heads_major` (module docstring): one KV head a batch row."""
    batch, q_len, heads, d = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads

    def rows(x):  # [B, Lq, Hkv * G, D] -> [B * Hkv, Lq, G, D]
        x = x.reshape(batch, q_len, kv_heads, groups, x.shape[-1]).transpose(0, 2, 1, 3, 4)
        return x.reshape(batch * kv_heads, q_len, groups, x.shape[-1])

    def keys(x):  # [B, Lkv, Hkv, D] -> [B * Hkv, Lkv, 1, D]
        return x.transpose(0, 2, 1, 3).reshape(batch * kv_heads, x.shape[1], 1, x.shape[-1])

    return rows(q), keys(k), keys(v), rows(ct)


def _vmapped(f):
    """`f` as a vmapped module calls it: one example a call, `jax.vmap` over the batch."""

    def mapped(q, k, v, causal):
        def one(q, k, v):
            return f(q[None], k[None], v[None], causal)[0]

        return jax.vmap(one)(q, k, v)

    return mapped


def _with_mask(q, k, v, *, impl, causal):
    return impl(q, k, v, causal)


def _torch_time(fn):
    import torch

    return time_fn(fn, lambda _: torch.cuda.synchronize())


def _harness_jax(f, q, k, v, ct, args):
    def loss(q, k, v, ct):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * ct)

    old, new = jax.jit(jax.grad(loss, argnums=(0, 1, 2))), fwd_bwd_program(f)
    ct32 = ct.astype(jnp.float32)
    sync = jax.block_until_ready
    return {
        "grad, f32 ct": time_fn(lambda: old(q, k, v, ct32), sync),
        "vjp, bf16 ct": time_fn(lambda: new(q, k, v, ct), sync),
    }


def _harness_torch(f, q, k, v, ct, args):
    out = {}
    for layout in ("contiguous", "view"):
        operands = torch_operands(q, k, v, ct, copy=layout == "contiguous")
        out[layout] = _torch_time(functools.partial(torch_fwd_bwd, f, *operands))
    return out


def _dispatch_jax(f, q, k, v, ct, args):
    chained = stack(f, args.calls)
    programs = {
        "fwd": (jax.jit(f), 1),
        "fwd+bwd": (fwd_bwd_program(f), 1),
        "fwd chain": (jax.jit(chained), args.calls),
        "fwd+bwd chain": (fwd_bwd_program(chained), args.calls),
    }
    if args.calls == 1:  # no chains: one call per program alone
        programs = {how: p for how, p in programs.items() if "chain" not in how}
    if args.forward_only:
        programs = {how: p for how, p in programs.items() if "bwd" not in how}
    ks, vs = layer_caches(k, v, args.calls, jnp.copy)  # a chain's layers: their own K/V
    out = {}
    for how, (program, calls) in programs.items():
        operands = (q, k, v) if calls == 1 else (q, ks, vs)
        operands += (ct,) if "bwd" in how else ()
        out[how] = time_fn(functools.partial(program, *operands), jax.block_until_ready) / calls
    return out


def _dispatch_torch(f, q, k, v, ct, args):
    import torch

    out = {}
    for layout in ("contiguous", "view")[: 1 + (args.torch_layout == "view")]:
        qt, kt, vt, ctt = torch_operands(q, k, v, ct, copy=layout == "contiguous")
        tag = "" if layout == "contiguous" else ", view"
        for how, calls in (("", 1), (" chain", args.calls))[: 1 + (args.calls > 1)]:
            chained = stack(f, calls)
            kts, vts = layer_caches(kt, vt, calls, torch_copy)

            def fwd(chained=chained, qt=qt, kts=kts, vts=vts):
                with torch.no_grad():
                    return chained(qt, kts, vts)

            out["fwd" + how + tag] = _torch_time(fwd) / calls
            if not args.forward_only:
                out["fwd+bwd" + how + tag] = _torch_time(
                    functools.partial(torch_fwd_bwd, chained, qt, kts, vts, ctt)
                ) / calls  # fmt: skip
    return out


PROBES = {  # name: (JAX timings, torch timings, torch routes, the rows' time field)
    "harness": (_harness_jax, _harness_torch, ["torch sdpa cudnn", "torch sdpa flash"],
                "fwd_bwd_ms"),
    "dispatch": (_dispatch_jax, _dispatch_torch, ["torch sdpa cudnn"], "ms_per_call"),
}  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seq", type=int, nargs="*", default=[4096])
    parser.add_argument(
        "--shape",
        nargs="*",
        default=[],
        metavar="B,LQ,LKV,HQ,HKV",
        help="shapes other than B4 H8 at --seq (cross-attention, GQA)",
    )
    parser.add_argument(
        "--routes",
        nargs="*",
        help=f"JAX routes (default {JAX_ROUTES}); "
        "NAME+repeat_kv runs NAME on K/V repeated to the query heads; "
        "NAME+heads_major on head-major K/V (module docstring); "
        "NAME+vmap as a vmapped module calls it (one example a call); "
        "probjax mosaic+split_kv the split-KV Triton forward with the Mosaic backward; "
        "probjax NAME+set:FIELD=VALUE,... NAME at its default config with those fields",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=1, help="alternations of every route")
    parser.add_argument("--forward-only", action="store_true",
                        help="dispatch: forward programs only (decoding)")  # fmt: skip
    parser.add_argument("--torch-layout", choices=["contiguous", "view"], default="contiguous",
                        help="dispatch: view also times torch on JAX's memory")  # fmt: skip
    parser.add_argument("--calls", type=int, default=8,
                        help="calls in a chain (dispatch); 1: no chains")  # fmt: skip
    args = parser.parse_args()
    jax_timings, torch_timings, torch_routes, field = PROBES[args.probe]
    warm_up_device()
    writer = RowWriter(args.out)
    base = dict(device=device_info(), versions=versions(), suite=f"probe_{args.probe}")
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    jax_routes = args.routes or JAX_ROUTES
    major = {n for n in jax_routes if n.endswith("+heads_major")}
    if jax.devices()[0].platform != "gpu":  # a CPU smoke run
        jax_routes = args.routes or ["probjax auto", "jax.nn xla"]
    for name in jax_routes:
        base_name, _, variant = name.partition("+")
        if variant == "repeat_kv":
            jax_impls[name] = _repeat_kv(jax_impls[base_name])
        elif variant == "vmap":
            jax_impls[name] = _vmapped(jax_impls[base_name])
        elif variant == "heads_major":
            jax_impls[name] = jax_impls[base_name]
        elif variant == "split_kv":
            jax_impls[name] = _split_kv_forward
        elif variant.startswith("set:"):
            jax_impls[name] = _with_fields(base_name.removeprefix("probjax "), variant[4:])
    torch_routes = [n for n in torch_routes if n in torch_impls]
    shapes = [parse_shape(s) for s in args.shape] or [(4, t, t, 8, 8) for t in args.seq]
    for sizes in shapes:
        batch, q_len, kv_len, heads, kv_heads = sizes
        q, k, v, ct = attention_operands(sizes, args.head_dim, seed=q_len)
        for causal in map(bool, args.causal):
            case = dict(batch=batch, heads=heads, seq=q_len, head_dim=args.head_dim,
                        causal=causal)  # fmt: skip
            if (kv_len, kv_heads) != (q_len, heads):
                case.update(kv_seq=kv_len, kv_heads=kv_heads)
            for round_ in range(args.rounds):
                for name in jax_routes + torch_routes:
                    is_torch = name in torch_routes
                    impl = (torch_impls if is_torch else jax_impls)[name]
                    f = functools.partial(_with_mask, impl=impl, causal=causal)
                    operands = heads_major(q, k, v, ct) if name in major else (q, k, v, ct)
                    timings = (torch_timings if is_torch else jax_timings)(f, *operands, args)
                    for how, ms in timings.items():
                        writer.add(dict(base, implementation=name, how=how, round=round_,
                                        shape=case, dtype="bfloat16", **{field: ms}))  # fmt: skip
                        print(f"{q_len}/{kv_len} hd{args.head_dim} causal={causal} "
                              f"{name:18s} {how:14s} {ms:.3f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
