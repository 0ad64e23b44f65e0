"""Sweep the split-KV (flash-decoding) forward: `python -m bench.sweep_decode --out F`.

bf16, 32 query heads over 8 KV heads, hd 128, Lq 1. For each shape: the default
config, then key tiles x warps x stages x total programs (splits = programs / the
programs one split has). `kv_tb_s` is the rate of reading K and V.
"""

import argparse
import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp

from bench.harness import RowWriter, classify, time_fn, to_torch, warm_up_device
from probjax_eqx import dot_product_attention
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

SHAPES = [(1, 131072, 8), (8, 32768, 8), (8, 131072, 8), (8, 131072, 32)]  # batch, kv_len, kv heads
# block_k, warps, stages
TILES = [(64, 4, 3), (64, 8, 3), (64, 8, 4), (128, 8, 2), (128, 4, 3), (128, 8, 3), (256, 8, 2)]
PROGRAMS = [132, 264, 528]
HEADS, HEAD_DIM = 32, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--passes", type=int, default=2, help="times each config runs (noise)")
    parser.add_argument("--shape", nargs="+", metavar="B,KV_LEN,KV_HEADS", help="not SHAPES")
    parser.add_argument("--programs", nargs="+", type=int, default=PROGRAMS)
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shape] if args.shape else SHAPES
    warm_up_device()
    writer = RowWriter(args.out)
    for batch, kv_len, kv_heads in shapes:
        keys = jax.random.split(jax.random.key(batch), 3)
        q = jax.random.normal(keys[0], (batch, 1, HEADS, HEAD_DIM), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (batch, kv_len, kv_heads, HEAD_DIM), jnp.bfloat16)
                for kk in keys[1:])  # fmt: skip
        kv_bytes = 2 * k.size * k.dtype.itemsize
        # Backward tiles as the default's: they set the query padding (one tile of rows).
        base = TritonAttentionConfig(
            block_q=16, block_q_dkv=16, block_q_dq=16, pack_gqa=kv_heads < HEADS
        )
        entries: list[tuple[str, TritonAttentionConfig | None]] = [
            ("auto", None),
            ("cudnn", None),
            ("triton", None),
            ("torch sdpa cudnn", None),
        ]
        seen = set()
        for block_k, warps, stages in TILES:
            for programs in args.programs:
                splits = max(1, programs // (batch * kv_heads))
                if kv_len // block_k < splits or (block_k, warps, stages, splits) in seen:
                    continue
                seen.add((block_k, warps, stages, splits))
                entries.append(("triton", dataclasses.replace(
                    base, block_k=block_k, num_warps=warps, num_stages=stages, num_splits=splits
                )))  # fmt: skip
        for impl, cfg in entries * args.passes:
            row = dict(batch=batch, kv_len=kv_len, kv_heads=kv_heads, impl=impl, status="ok",
                       config=None if cfg is None else dataclasses.asdict(cfg))  # fmt: skip
            try:
                row["fwd_ms"] = time_fn(_runner(impl, cfg, q, k, v), _sync(impl))
                row["kv_tb_s"] = kv_bytes / row["fwd_ms"] / 1e9
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(exc)
            writer.add(row)
            cfg_s = "default" if cfg is None else (cfg.block_k, cfg.num_warps, cfg.num_stages,
                                                    cfg.num_splits)  # fmt: skip
            print(batch, kv_len, kv_heads, impl, cfg_s, row.get("fwd_ms"), row.get("kv_tb_s"),
                  row["status"], flush=True)  # fmt: skip


@functools.cache
def _jitted(impl, cfg):
    return jax.jit(functools.partial(dot_product_attention, implementation=impl, config=cfg))


def _runner(impl, cfg, q, k, v):
    if impl.startswith("torch"):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (to_torch(x, copy=False) for x in (q, k, v))

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        return run
    return functools.partial(_jitted(impl, cfg), q, k, v)


def _sync(impl):
    if impl.startswith("torch"):
        import torch

        return lambda _: torch.cuda.synchronize()
    return jax.block_until_ready


if __name__ == "__main__":
    main()
