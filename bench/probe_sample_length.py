"""How much of a call's time is the timing's own sync: `python -m bench.probe_sample_length
--out F [--shape B,LQ,LKV,HQ,HKV ...] [--sample-ms MS ...] [--max-inner N ...]`.

Decoding (forward calls): our default, jax.nn's cuDNN and torch SDPA's cuDNN timed by
`time_fn` at every pair of sample length and most calls a sample, the routes in turn,
`--rounds` times; then one call and its sync alone. Run 152 (H100, batch 8 MHA over 32k
keys): JAX's one call and sync took 0.41 ms longer than torch's, which 20 ms samples
spread as 3% over each call of 1.4 ms; at 200 ms our default and torch's cuDNN took
1.366 ms each. Rows: suite `probe_sample_length`, `ms` per call, `how` the setting.
"""

import argparse
import pathlib
import statistics
import time

import jax

from bench.attention_suite import forward_calls
from bench.harness import (
    RowWriter,
    attention_operands,
    device_info,
    parse_shape,
    time_fn,
    versions,
    warm_up_device,
)

ROUTES = ["probjax auto", "jax.nn cudnn", "torch sdpa cudnn"]
CPU_ROUTES = ["probjax auto", "jax.nn xla"]  # a smoke run


def _alone_ms(fn, sync, calls: int = 21) -> float:
    """Median ms of one call and its sync."""
    sync(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sync(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shape", nargs="*", default=["8,1,32768,32,32", "1,1,32768,32,32"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sample-ms", type=float, nargs="*", default=[20.0, 200.0])
    parser.add_argument("--max-inner", type=int, nargs="*", default=[100])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    warm_up_device()
    writer = RowWriter(args.out)
    base = dict(device=device_info(), versions=versions(), suite="probe_sample_length")
    for text in args.shape:
        sizes = parse_shape(text)
        q, k, v, _ = attention_operands(sizes, args.head_dim)
        names = ROUTES if jax.devices()[0].platform == "gpu" else CPU_ROUTES
        routes = forward_calls(q, k, v, names)
        shape = dict(zip(("batch", "q_len", "kv_len", "q_heads", "kv_heads"), sizes,
                         strict=True), head_dim=args.head_dim)  # fmt: skip
        settings = [(ms, most) for ms in args.sample_ms for most in args.max_inner]
        for round_ in range(args.rounds):
            for sample_ms, most in settings:
                for name, (fn, sync) in routes.items():
                    ms = time_fn(fn, sync, min_sample_ms=sample_ms, max_inner=most)
                    how = f"{sample_ms:g} ms samples, at most {most} calls"
                    writer.add(dict(base, implementation=name, shape=shape, round=round_,
                                    how=how, dtype="bfloat16", ms=ms))  # fmt: skip
                    print(f"{text} r{round_} {how:34s} {name:18s} {ms:.4f} ms", flush=True)
        for name, (fn, sync) in routes.items():
            ms = _alone_ms(fn, sync)
            writer.add(dict(base, implementation=name, shape=shape, how="one call and its sync",
                            dtype="bfloat16", ms=ms))  # fmt: skip
            print(f"{text} one call and its sync {name:18s} {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
