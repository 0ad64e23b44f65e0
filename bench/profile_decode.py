"""Decode cases, one launch each after compiling, for a profiler (`ncu`) to read.

`python -m bench.profile_decode CASE [CASE ...]`, a CASE being
`IMPL/BATCH/KV_LEN/KV_HEADS[/BLOCK_K/WARPS/STAGES/SPLITS][:qQ_LEN][:ragged]`: IMPL
`triton`, `auto` or `cudnn` (ours), or `torch-cudnn` / `torch-flash`. bf16, 32 query
heads, hd 128, Lq 1 unless `:qQ_LEN`; `:ragged` gives our cases per-batch KV lengths
(the decode suite's).
The kernels launch in the order of the cases. With `--hlo` first, the JAX cases print
the instructions of their compiled program that launch work on the device instead (the
kernel, and every fusion or copy around it: at Lq 1 a few microseconds each are the gap
to torch cuDNN's 0.93-0.99x).
"""

import functools
import sys

import jax
import jax.numpy as jnp

from bench.decode_suite import ragged_lengths
from bench.harness import device_work, to_torch
from probjax_eqx import dot_product_attention, masks
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

HEADS, HEAD_DIM = 32, 128


def run_case(case: str, launches: int = 1):
    case, *options = case.split(":")
    q_len = next((int(o[1:]) for o in options if o.startswith("q")), 1)
    impl, *dims = case.split("/")
    batch, kv_len, kv_heads, *tiles = map(int, dims)
    lengths = ragged_lengths(batch, kv_len, "ragged" in options)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, q_len, HEADS, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (batch, kv_len, kv_heads, HEAD_DIM), jnp.bfloat16)
            for kk in keys[1:])  # fmt: skip
    jax.block_until_ready((q, k, v))
    if impl.startswith("torch"):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"torch-cudnn": SDPBackend.CUDNN_ATTENTION,
                   "torch-flash": SDPBackend.FLASH_ATTENTION}[impl]  # fmt: skip
        qt, kt, vt = (to_torch(x, copy=False) for x in (q, k, v))
        with sdpa_kernel(backend), torch.no_grad():
            for _ in range(launches):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        torch.cuda.synchronize()
        return
    config = None
    if tiles:
        block_k, warps, stages, splits = tiles
        config = TritonAttentionConfig(
            block_q=16, block_q_dkv=16, block_q_dq=16, block_k=block_k, num_warps=warps,
            num_stages=stages, num_splits=splits, pack_gqa=kv_heads < HEADS,
        )  # fmt: skip
    mask = None if lengths is None else masks.KVLengths(lengths)
    fwd = jax.jit(
        functools.partial(dot_product_attention, mask=mask, implementation=impl, config=config)
    )
    if launches == 0:
        for line in device_work(fwd.lower(q, k, v).compile().as_text()):
            print("  " + line)
        return
    for _ in range(launches):
        out = fwd(q, k, v)
    jax.block_until_ready(out)


if __name__ == "__main__":
    hlo = sys.argv[1:2] == ["--hlo"]
    for case in sys.argv[1 + hlo :]:
        print("case", case, flush=True)
        run_case(case, launches=0 if hlo else 1)
