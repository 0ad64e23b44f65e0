"""Sweep the split-KV (flash-decoding) forward: `python -m bench.sweep_decode --out F`.

bf16, 32 query heads over 8 KV heads, hd 128, Lq 1. For each shape: the default
config, then key tiles x warps x stages x total programs (splits = programs / the
programs one split has). `kv_tb_s` is the rate of reading K and V.
"""

import argparse
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp

from bench.harness import classify, time_fn
from probjax_eqx import dot_product_attention
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

SHAPES = [(1, 131072), (8, 32768), (8, 131072)]  # batch, kv_len
TILES = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 4), (256, 8, 2)]  # block_k, warps, stages
PROGRAMS = [264, 528, 1056, 2112]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    rows = []
    for batch, kv_len in SHAPES:
        keys = jax.random.split(jax.random.key(batch), 3)
        q = jax.random.normal(keys[0], (batch, 1, HEADS, HEAD_DIM), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (batch, kv_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
                for kk in keys[1:])  # fmt: skip
        kv_bytes = 2 * k.size * k.dtype.itemsize
        base = TritonAttentionConfig(block_q=16, pack_gqa=True)
        configs: list[TritonAttentionConfig | None] = [None]
        for block_k, warps, stages in TILES:
            for programs in PROGRAMS:
                splits = max(1, programs // (batch * KV_HEADS))
                if kv_len // block_k < splits:
                    continue
                configs.append(dataclasses.replace(
                    base, block_k=block_k, num_warps=warps, num_stages=stages, num_splits=splits
                ))  # fmt: skip
        for cfg in configs:
            impl = "auto" if cfg is None else "triton"
            row = dict(batch=batch, kv_len=kv_len, impl=impl, status="ok",
                       config=None if cfg is None else dataclasses.asdict(cfg))  # fmt: skip
            try:
                fwd = jax.jit(functools.partial(dot_product_attention, implementation=impl,
                                                config=cfg))  # fmt: skip
                row["fwd_ms"] = time_fn(functools.partial(fwd, q, k, v), jax.block_until_ready)
                row["kv_tb_s"] = kv_bytes / row["fwd_ms"] / 1e9
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(exc)
            rows.append(row)
            args.out.write_text(json.dumps({"rows": rows}, indent=1))
            cfg_s = "default" if cfg is None else (cfg.block_k, cfg.num_warps, cfg.num_stages,
                                                    cfg.num_splits)  # fmt: skip
            print(batch, kv_len, cfg_s, row.get("fwd_ms"), row.get("kv_tb_s"), row["status"],
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
