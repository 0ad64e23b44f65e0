"""Kernel times in a sustained run, JAX's launches beside torch's, as CUPTI records them:
`python -m bench.probe_kernel_context --out F [--shape B,LQ,LKV,HQ,HKV] [--calls N]`.

ncu replays one kernel at a time, caches flushed; the suites time calls back to back.
Where those disagree (batch 8 MHA decoding: ncu timed our kernel and cuDNN's alike, 1.35
/ 1.36 ms, H100 run 147, yet JAX's calls took 2-4% longer than torch's, runs 148-149),
this records every kernel of `--calls` back-to-back forward calls of each route through
`torch.profiler` (CUPTI sees the whole process, JAX's kernels too): each kernel's device
time, and the idle gap before it, per route. Rows: route, kernel, median and mean ms,
median gap.
"""

import argparse
import pathlib
import statistics

from bench.attention_suite import forward_calls
from bench.harness import (
    RowWriter,
    attention_operands,
    device_info,
    parse_shape,
    versions,
    warm_up_device,
)

ROUTES = ["probjax auto", "jax.nn cudnn", "torch sdpa cudnn"]


def _kernels(calls: int, fn, sync) -> list[tuple[str, float, float]]:
    """`(name, start us, duration us)` of every GPU kernel that `calls` calls of `fn` ran."""
    import torch

    for _ in range(3):
        sync(fn())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = None
        for _ in range(calls):
            out = fn()
        sync(out)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(
        ((e.name, e.time_range.start, e.time_range.end - e.time_range.start) for e in events),
        key=lambda kernel: kernel[1],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shape", default="8,1,32768,32,32", metavar="B,LQ,LKV,HQ,HKV")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    warm_up_device()
    writer = RowWriter(args.out)
    base = dict(device=device_info(), versions=versions(), suite="probe_kernel_context")
    sizes = parse_shape(args.shape)
    q, k, v, _ = attention_operands(sizes, args.head_dim)
    routes = forward_calls(q, k, v, ROUTES)
    for round_ in range(args.rounds):
        for name, (fn, sync) in routes.items():
            kernels = _kernels(args.calls, fn, sync)
            by_name: dict[str, list[tuple[float, float]]] = {}
            end = None
            for kernel, start, duration in kernels:
                gap = start - end if end is not None else float("nan")
                by_name.setdefault(kernel, []).append((duration, gap))
                end = start + duration
            for kernel, times in by_name.items():
                durations = [d for d, _ in times]
                gaps = [g for _, g in times if g == g]
                row = dict(base, implementation=name, round=round_, kernel=kernel[:120],
                           shape=dict(zip(("batch", "q_len", "kv_len", "q_heads", "kv_heads"),
                                          sizes, strict=True), head_dim=args.head_dim),
                           launches=len(times), median_ms=statistics.median(durations) / 1e3,
                           mean_ms=statistics.mean(durations) / 1e3,
                           median_gap_us=statistics.median(gaps) if gaps else None)  # fmt: skip
                writer.add(row)
                print(f"{name:18s} r{round_} {kernel[:60]:60s} x{len(times):3d} "
                      f"median {row['median_ms']:.4f} ms mean {row['mean_ms']:.4f} "
                      f"gap {row['median_gap_us']} us", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
