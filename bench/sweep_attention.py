"""Sweep attention kernel configs on one shape.

python -m bench.sweep_attention --implementation triton|mosaic --out F
"""

import argparse
import dataclasses
import json
import pathlib

import jax

from bench.harness import RowWriter, classify, fwd_bwd_program, time_fn, warm_up_device
from probjax_eqx import biases, explain_attention, flex_attention, masks
from probjax_eqx.attention_call import AttentionCall
from probjax_eqx.backends import detect_device
from probjax_eqx.kernels.mosaic.attention import MosaicAttentionConfig
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig, tangent_config

# Triton: (block_q, block_k, num_warps, num_stages[, num_splits]) of the forward.
FWD = [
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (128, 32, 4, 3),
    (64, 128, 4, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (128, 32, 8, 4),
    (64, 64, 2, 3),  # small heads (hd 32, the set-transformer shapes)
    (32, 64, 2, 3),
    (64, 128, 4, 3),
    (128, 64, 4, 3, 2),  # 2 key splits: twice the programs of a one-wave grid
    (64, 64, 2, 3, 2),
]
# (queries per dK/dV step, keys per dK/dV program, num_warps, num_stages); dQ uses the
# transposed tiles.
BWD = [
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (32, 128, 4, 3),
    (32, 128, 8, 3),
    (64, 128, 8, 2),
    (32, 64, 4, 3),
    (16, 128, 4, 4),
    (128, 128, 8, 2),
]
# Forward mode's tangent kernel (`tangent_tiles`): (queries, keys per step, num_warps,
# num_stages). Tiles that `tangent_config` would shrink to fit are rows marked unsup.
TANGENT = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (64, 64, 8, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (128, 32, 4, 2),
    (32, 64, 4, 3),
    (128, 32, 8, 3),
    (32, 32, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 8, 3),  # hd 64 only, as the three below
    (128, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 2),
]
# float32: 2 x 32 x 256 float32 accumulators of the dK/dV kernel's 32-key tiles are 128
# registers a thread at 4 warps. hd 256, run 25: 378 ms fwd+bwd at 32 x 32 tiles; run 26:
# 51 ms with 16-query steps (32 x 32: 359 ms at 4 or 8 warps).
BWD_FLOAT32 = [
    (32, 32, 4, 2),
    (16, 32, 4, 2),
    (16, 32, 4, 1),
    (16, 32, 4, 3),
    (16, 32, 2, 2),
    (16, 16, 2, 2),
    (16, 16, 4, 1),
    (16, 64, 4, 2),
]


# Mosaic forward: (keys per step, TMA ring depth, TMA warpgroup registers, ping-pong[,
# intra-warpgroup overlap of softmax and P @ V[, P from registers]]), or the config's fields.
MOSAIC_FWD = [
    # Since run 44 the GPU's default has P in registers and K^T as a view of K's tiles;
    # tuples replace only the fields they name (rows record the resolved config).
    dict(p_in_registers=False, transposed_views=False),
    # FA3's ping-pong (turns on named barriers, or mbarriers), alone and with its
    # intra-warpgroup overlap, at FA3's and tokamax's register splits
    dict(pingpong=True),
    dict(pingpong=True, memory_registers=40),
    dict(pingpong=True, memory_registers=40, named_turns=False),
    dict(pingpong=True, overlap_softmax=True, memory_registers=24),
    dict(pingpong=True, overlap_softmax=True, memory_registers=40),
    dict(overlap_softmax=True, memory_registers=24),
    dict(num_stages=3),
    dict(num_stages=3, pingpong=True, overlap_softmax=True, memory_registers=24),
    (128, 2, None, False),
    (128, 2, None, True),
    (128, 2, 40, False),
    (128, 2, 40, True),
    (64, 3, None, False),
    (64, 3, None, True),
    (64, 3, 40, True),
    (128, 2, None, False, True),
    (128, 2, 24, False, True),
    (128, 2, 32, False, True),
    (128, 2, 40, False, True),
    # P from registers (FA3): its SMEM freed, a third stage fits (with 64-key dK/dV tiles,
    # which the fused dQ does not take)
    (128, 2, None, False, False, True),
    (128, 2, 24, False, True, True),
    (128, 2, 32, False, True, True),
    dict(block_k=128, num_stages=3, overlap_softmax=True, memory_registers=24,
         p_in_registers=True, block_k_dkv=64, fused_dq=False),
    # K^T as a view of K's tiles: no XLA transpose; the backward's rings then fit 3 stages
    dict(transposed_views=True),
    dict(transposed_views=True, p_in_registers=True, overlap_softmax=True, memory_registers=24),
    dict(transposed_views=True, p_in_registers=True, overlap_softmax=True, memory_registers=24,
         num_stages=3),
    dict(transposed_views=True, p_in_registers=True, overlap_softmax=True, memory_registers=24,
         num_stages=3, block_k=64),
]  # fmt: skip
# Mosaic backward, as overrides of the call's default config (FA3's fused dQ on the GPU):
# the TMA warpgroup's registers (FA3 takes 24), ring depth, the dQ kernel instead of the
# fused dQ, the launch order, the exact exp2.
MOSAIC_BWD = [{}, dict(backward_memory_registers=24), dict(backward_memory_registers=56),
              dict(num_stages=3), dict(fused_dq=False), dict(fused_dq=False, block_k_dq=128),
              dict(launch_group=None), dict(launch_group=4), dict(approx_math=False)]  # fmt: skip
CONFIG_TYPES = {"triton": TritonAttentionConfig, "mosaic": MosaicAttentionConfig}


def _configs(implementation, float32=False):
    if implementation == "mosaic":
        keys = ("block_k", "num_stages", "memory_registers", "pingpong", "overlap_softmax",
                "p_in_registers")  # fmt: skip
        out = [("fwd", dict(zip(keys, t)) if isinstance(t, tuple) else t) for t in MOSAIC_FWD]
        out += [("bwd", overrides) for overrides in MOSAIC_BWD]
        return out
    keys = ("block_q", "block_k", "num_warps", "num_stages", "num_splits")
    out = [("fwd", dict(zip(keys, tiles))) for tiles in FWD]
    out += [
        (
            "bwd",
            dict(
                block_q_dkv=a,
                block_k_dkv=b,
                block_q_dq=b,
                block_k_dq=a,
                num_warps_bwd=w,
                num_stages_bwd=s,
            ),
        )
        for a, b, w, s in (BWD_FLOAT32 if float32 else BWD)
    ]
    out += [("tangent", dict(tangent_tiles=tiles)) for tiles in TANGENT]
    return out


def _config(q, k, v, mask, mod, implementation, kwargs):
    """The default config for this call with `kwargs` replaced (the other half fits)."""
    choice = explain_attention(q, k, v, mask=mask, score_mod=mod, implementation=implementation)
    return dataclasses.replace(choice.config, **kwargs)


def tangent_launch(q, k, v, mask, mod, cfg, device) -> tuple[int, int, int, int]:
    """The forward-mode kernel's (block_q, block_k, num_warps, num_stages) for `cfg`."""
    call = AttentionCall.from_args(q.shape, k.shape, v.shape, q.dtype, mask, mod)
    launch = tangent_config(cfg, call, device)
    return (launch.block_q, launch.block_k, launch.num_warps, launch.num_stages)


def _measure(q, k, v, ct, mask, mod, cfg, part, implementation, moving="qkv"):
    def f(q, k, v):
        return flex_attention(
            q, k, v, mask=mask, score_mod=mod, implementation=implementation, config=cfg
        )

    if part == "fwd":
        fwd = jax.jit(f)
        return dict(fwd_ms=time_fn(lambda: fwd(q, k, v), jax.block_until_ready))
    if part == "tangent":  # `jax.jvp`: the forward (the same for every row) and the tangent
        # along the `moving` arguments; the others are held fixed (a context's K / V).
        args = dict(q=q, k=k, v=v)

        def g(*moved):
            return f(**dict(args, **dict(zip(moving, moved, strict=True))))

        jvp = jax.jit(lambda p, t: jax.jvp(g, p, t))
        primals, tangents = tuple(args[n] for n in moving), (ct,) * len(moving)
        return dict(jvp_ms=time_fn(lambda: jvp(primals, tangents), jax.block_until_ready))
    bwd = fwd_bwd_program(f)
    return dict(fwd_bwd_ms=time_fn(lambda: bwd(q, k, v, ct), jax.block_until_ready))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--implementation", choices=sorted(CONFIG_TYPES), default="triton")
    parser.add_argument("--seq", type=int, nargs="*", default=[4096])
    parser.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    parser.add_argument(
        "--part", choices=["fwd", "bwd", "tangent"], nargs="*", default=["fwd", "bwd"]
    )
    parser.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, help="KV heads, for GQA (default: --heads)")
    parser.add_argument("--kv-seq", type=int, help="keys per row (default: each --seq)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--softcap", type=float, help="a SoftCap score mod of this cap")
    parser.add_argument(
        "--moving", default="qkv", help="tangent part: the arguments with tangents (q, k, v)"
    )
    parser.add_argument("--defaults", action="store_true", help="only the default config")
    parser.add_argument(
        "--config", type=json.loads, nargs="*", help="only these JSON field overrides"
    )
    args = parser.parse_args()
    warm_up_device()
    writer = RowWriter(args.out)
    for seq in args.seq:
        _sweep(args, seq, args.kv_seq or seq, writer)


def _sweep(args, seq, kv_seq, writer):
    for d in args.head_dim:
        keys = jax.random.split(jax.random.key(0), 4)
        shape = (args.batch, seq, args.heads, d)
        q = jax.random.normal(keys[0], shape, args.dtype)
        kv_shape = (args.batch, kv_seq, args.kv_heads or args.heads, d)
        k, v = (jax.random.normal(kk, kv_shape, args.dtype) for kk in keys[1:3])
        ct = jax.random.normal(keys[3], q.shape, args.dtype)
        mod = None if args.softcap is None else biases.SoftCap(args.softcap)
        configs = _configs(args.implementation, args.dtype == "float32")
        only = [{}] if args.defaults else args.config  # --defaults: `--config '{}'`
        if only is not None:
            configs = [(part, kwargs) for part in ("fwd", "bwd", "tangent") for kwargs in only]
        for causal in map(bool, args.causal):
            mask = masks.Causal() if causal else None
            for part, kwargs in configs:
                if part not in args.part:
                    continue
                row = dict(
                    implementation=args.implementation,
                    batch=args.batch,
                    heads=args.heads,
                    kv_heads=args.kv_heads or args.heads,
                    seq=seq,
                    kv_seq=kv_seq,
                    head_dim=d,
                    dtype=args.dtype,
                    causal=causal,
                    softcap=args.softcap,
                    **({"moving": args.moving} if part == "tangent" else {}),
                    config=kwargs,
                    status="ok",
                )
                try:
                    cfg = _config(q, k, v, mask, mod, args.implementation, kwargs)
                    row["resolved"] = dataclasses.asdict(cfg)  # kwargs over the default
                    if part == "tangent":
                        launch = tangent_launch(q, k, v, mask, mod, cfg, detect_device())
                        row["tangent_launch"] = launch
                        named = kwargs.get("tangent_tiles")
                        if named is not None and tuple(named) != launch:
                            row["status"] = "unsup."
                            row["message"] = f"shrinks to {launch} to fit shared memory"
                            writer.add(row)
                            continue
                    row.update(
                        _measure(
                            q, k, v, ct, mask, mod, cfg, part, args.implementation, args.moving
                        )
                    )
                except Exception as e:  # noqa: BLE001 - every failure becomes a row
                    row["status"], row["message"] = classify(e)
                writer.add(row)
                print(
                    d,
                    causal,
                    kwargs,
                    row.get("fwd_ms"),
                    row.get("fwd_bwd_ms"),
                    row.get("jvp_ms"),
                    row["status"],
                    flush=True,
                )


if __name__ == "__main__":
    main()
