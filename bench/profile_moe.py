"""Where an MoE layer's time goes: `python -m bench.profile_moe --out F [--tokens N]`.

The suite's layer (`bench.moe_suite.LAYERS[0]`, bfloat16 compute) per dispatch, each part
jitted alone on the previous parts' outputs: the router, the sort of the (token, slot)
pairs, the routed experts (gathers, grouped matmuls, combine) forward and fwd+bwd, the
shared expert, and the whole layer. Run 19: at 131k tokens the layer's forward took
7.3 ms (fused_gsum) for ~0.8 TFLOP; these rows say which part to work on.
"""

import argparse
import functools
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp

from bench.harness import RowWriter, classify, device_info, time_fn, versions, warm_up_device
from bench.moe_suite import LAYERS, _layer
from probjax_eqx.moe import top_k_by_passes

DISPATCHES = ("fused_gsum", "triton", "mosaic", "xla")


def _parts(moe, x):
    """`(name, fn, args)` of each part; `fn` jitted, `args` its inputs.

    The backward parts take the suite's random cotangent, an argument: a sum's all-ones
    cotangent let XLA fold broadcasts that a training step must materialise (run 33:
    Mosaic's layer fwd+bwd 81 ms at 1M tokens that way, 105 in the suite, run 25).
    """
    experts, weights, _ = eqx.filter_jit(lambda m, x: m.route(x))(moe, x)
    ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

    def routed_loss(m, x, ct):
        return jnp.sum(m.experts(x, experts, weights).astype(jnp.float32) * ct)

    def layer_loss(m, x, ct):
        return jnp.sum(m(x)[0].astype(jnp.float32) * ct)

    def grad(loss):  # with respect to the parameters and the tokens
        return lambda m, x, ct: eqx.filter_grad(lambda mx: loss(*mx, ct))((m, x))

    return [
        ("route", eqx.filter_jit(lambda m, x: m.route(x)), (moe, x)),
        ("sort", eqx.filter_jit(lambda m: m.sort_routing(experts, weights)), (moe,)),
        ("routed experts fwd", eqx.filter_jit(lambda m, x: m.experts(x, experts, weights)),
         (moe, x)),
        ("routed experts fwd+bwd", eqx.filter_jit(grad(routed_loss)), (moe, x, ct)),
        ("shared expert fwd", eqx.filter_jit(lambda m, x: m.shared_expert(x)), (moe, x)),
        ("layer fwd", eqx.filter_jit(lambda m, x: m(x)), (moe, x)),
        ("layer fwd+bwd", eqx.filter_jit(grad(layer_loss)), (moe, x, ct)),
    ]  # fmt: skip


def _route_parts(moe, x):
    """The router's pieces (run 24: `route` took 1.2 ms of the 4.8 ms forward at 131k),
    and three ways to count the (token, slot) pairs per expert."""
    e, k = moe.num_experts, moe.top_k
    logits = jax.jit(lambda x, r: x.astype(jnp.float32) @ r)(x, moe.router)
    scores = jax.nn.softmax(logits, axis=-1)
    experts = jax.lax.top_k(scores, moe.top_k)[1]
    flat = experts.reshape(-1)

    def from_sort(flat):
        ordered = jnp.sort(flat)
        return jnp.diff(jnp.searchsorted(ordered, jnp.arange(e + 1), side="left"))

    return [
        ("router logits", jax.jit(lambda x, r: x.astype(jnp.float32) @ r), (x, moe.router)),
        ("softmax", jax.jit(lambda z: jax.nn.softmax(z, axis=-1)), (logits,)),
        ("top_k", jax.jit(lambda s: jax.lax.top_k(s, moe.top_k)), (scores,)),
        ("top_k by passes", jax.jit(lambda s: top_k_by_passes(s, moe.top_k)), (scores,)),
        ("top_k values grad", jax.jit(jax.grad(lambda s: jnp.sum(jax.lax.top_k(s, k)[0]))),
         (scores,)),
        ("top_k by passes values grad",
         jax.jit(jax.grad(lambda s: jnp.sum(top_k_by_passes(s, k)[0]))), (scores,)),
        ("counts scatter-add",
         jax.jit(lambda f: jnp.zeros((e,), jnp.int32).at[f].add(1)), (flat,)),
        ("counts one-hot sum",
         jax.jit(lambda f: jnp.sum(f[:, None] == jnp.arange(e), axis=0, dtype=jnp.int32)),
         (flat,)),
        ("counts from sort", jax.jit(from_sort), (flat,)),
        ("argsort", jax.jit(lambda f: jnp.argsort(f, stable=True)), (flat,)),
        ("logsumexp", jax.jit(lambda z: jnp.sum(jax.nn.logsumexp(z, axis=-1) ** 2)), (logits,)),
    ]  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[131_072])
    parser.add_argument("--dispatch", nargs="+", default=list(DISPATCHES[:3]),
                        choices=DISPATCHES)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--route", action="store_true", help="the router's pieces instead")
    args = parser.parse_args()
    warm_up_device()
    writer, env = RowWriter(args.out), dict(device=device_info(), versions=versions())
    layer = LAYERS[0]
    for tokens in args.tokens:
        key_x, key_p = jax.random.split(jax.random.key(tokens))
        x = jax.random.normal(key_x, (tokens, layer[0]), jnp.float32).astype(jnp.bfloat16)
        for dispatch in args.dispatch:
            base = dict(tokens=tokens, layer=list(layer), dispatch=dispatch, **env)
            try:
                moe = _layer(layer, dispatch, key_p)
                parts = _route_parts(moe, x) if args.route else _parts(moe, x)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                status, message = classify(exc)
                writer.add(dict(base, part="setup", status=status, message=message))
                continue
            for name, fn, fn_args in parts:
                row = dict(base, part=name, status="ok")
                if "fwd+bwd" in name:
                    row["cotangent"] = "random"
                try:
                    call = functools.partial(fn, *fn_args)
                    row["ms"] = time_fn(call, jax.block_until_ready, repeats=args.repeats)
                except Exception as exc:  # noqa: BLE001
                    row["status"], row["message"] = classify(exc)
                writer.add(row)
                print(tokens, dispatch, name, row.get("ms", row.get("message")), flush=True)


if __name__ == "__main__":
    main()
