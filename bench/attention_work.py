"""What an attention call runs on the device: `python -m bench.attention_work [IMPL...]`.

For each implementation (ours: `auto`, `cudnn`, `mosaic`, `triton`, `xla`, or one of them
with config fields set over its default, `mosaic+fused_dq+launch_group=4`; the peers
`jax.nn-cudnn` and `tokamax-mosaic`), the compiled forward and forward+backward programs'
device work (the kernels, and every fusion, copy or transpose around them), at B4 H8
bf16 (`--shape` for others: cross-attention, GQA); `torch-cudnn` (torch SDPA pinned to
cuDNN) only launches, for the profiler. JAX's
route to cuDNN and torch's run the same kernels for the same time under ncu (run 95, T
4096 hd 128: fwd 408 us, bwd 1.15 ms); these lists show what a route adds around them.

`--launch N` then runs each program N times, for a profiler (`bench/ncu.sh`) to time
each kernel: where our Mosaic backward's time goes beside tokamax's (run 45: fwd+bwd
2.40 vs 2.09 ms at T 4096 hd 128).
"""

import argparse
import dataclasses
import functools
import json

import jax

from bench.harness import (
    attention_operands,
    device_work,
    fwd_bwd_program,
    parse_shape,
    tokamax_peer,
    torch_attention,
    torch_operands,
)
from probjax_eqx import dot_product_attention, explain_attention, masks


def _field(text: str):
    name, _, value = text.partition("=")
    return name, json.loads(value) if value else True


def _attend(impl: str, causal: bool):
    if impl == "tokamax-mosaic":
        return tokamax_peer(lambda tk: functools.partial(
            tk.dot_product_attention, is_causal=causal, implementation="mosaic"))  # fmt: skip
    if impl == "jax.nn-cudnn":
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                 implementation="cudnn")  # fmt: skip
    mask = masks.Causal() if causal else None
    impl, *fields = impl.split("+")  # `mosaic+fused_dq+launch_group=4`: `field` is `field=true`
    if not fields:
        return functools.partial(dot_product_attention, mask=mask, implementation=impl)

    def attend(q, k, v):
        choice = explain_attention(q, k, v, mask=mask, implementation=impl)
        config = dataclasses.replace(choice.config, **dict(map(_field, fields)))
        return dot_product_attention(q, k, v, mask=mask, implementation=impl, config=config)

    return attend


def _launch_torch(q, k, v, ct, causal, launches, forward_only=False):
    """Torch SDPA pinned to cuDNN on the same operands, `launches` times fwd and fwd+bwd:
    which cuDNN kernels torch's graphs select, for ncu to time beside JAX's."""
    torch, SDPBackend, sdpa_kernel, *_ = torch_attention()
    qt, kt, vt, ctt = torch_operands(q, k, v, ct)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                             is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        part = "fwd" if forward_only else "fwd+bwd"
        print(f"torch-cudnn {part} {tuple(q.shape)} causal={causal}", flush=True)
        for _ in range(launches):
            with torch.no_grad():
                sdpa(qt, kt, vt)
            if not forward_only:
                sdpa(qt, kt, vt).backward(ctt)
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("impls", nargs="*", default=["auto", "jax.nn-cudnn"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--shape", metavar="B,LQ,LKV,HQ,HKV", help="not B4, --seq, H8")
    parser.add_argument("--launch", type=int, default=0, help="runs of each program")
    parser.add_argument("--forward-only", action="store_true", help="no fwd+bwd (decoding)")
    args = parser.parse_args()
    sizes = parse_shape(args.shape) if args.shape else (4, args.seq, args.seq, 8, 8)
    q, k, v, ct = attention_operands(sizes, args.head_dim)
    shape, kv_shape = q.shape, k.shape
    for impl in args.impls:
        if impl == "torch-cudnn":
            _launch_torch(q, k, v, ct, args.causal, args.launch, args.forward_only)
            continue
        f = _attend(impl, args.causal)
        programs = {"fwd": (jax.jit(f), (q, k, v))}
        if not args.forward_only:
            programs["fwd+bwd"] = (fwd_bwd_program(f), (q, k, v, ct))
        for part, (fn, operands) in programs.items():
            print(f"{impl} {part} {shape} over {kv_shape} causal={args.causal}", flush=True)
            try:
                compiled = fn.lower(*operands).compile()
                for line in device_work(compiled.as_text()):
                    print("  " + line)
                for _ in range(args.launch):
                    jax.block_until_ready(compiled(*operands))
            except Exception as exc:  # noqa: BLE001 - a refusal is an answer too
                print(f"  {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
