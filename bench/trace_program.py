"""Everything a compiled attention program puts on the device, from JAX's own profiler:
`python -m bench.trace_program --shape B,LQ,LKV,HQ,HKV [...] [--routes NAME ...]`.
Torch peers' routes (`torch ...`) list their CUDA kernels from torch.profiler.

ncu times kernels only; this lists every device event of the program's last launch
(kernels, memsets, copies) with its duration and the idle gap before it, read from the
trace `jax.profiler` writes (the XSpace, parsed by jaxlib's `_profile_data`). Run 102:
JAX's route to cuDNN took 2.27 ms fwd+bwd for 8 x 128 queries over 8192 keys (32 heads
over 8) where its kernels took 1.69 under ncu and torch's same kernels 1.74 in all.
"""

import argparse
import functools
import pathlib
import tempfile

import jax

from bench.attention_suite import _jax_impls, _torch_impls
from bench.harness import attention_operands, fwd_bwd_program, parse_shape, torch_operands


def device_events(trace_dir: pathlib.Path) -> list[tuple[str, float, float]]:
    """`(name, start_us, duration_us)` of every event on the GPU planes, by start."""
    from jax._src.lib import _profile_data

    events = []
    for path in trace_dir.rglob("*.xplane.pb"):
        for plane in _profile_data.ProfileData.from_file(str(path)).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                for event in line.events:
                    events.append((event.name, event.start_ns / 1e3, event.duration_ns / 1e3))
    return sorted(events, key=lambda e: e[1])


def _last_launch(events, launches: int):
    """The events of the last of `launches` equal launches (the trace holds them all)."""
    per_launch = len(events) // launches if launches else 0
    return events[-per_launch:] if per_launch else events


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", nargs="+", required=True, metavar="B,LQ,LKV,HQ,HKV")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--routes", nargs="*", default=["probjax cudnn", "jax.nn cudnn"])
    parser.add_argument("--part", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    impls = _jax_impls()
    # JAX's profiler first: once torch.profiler has subscribed to CUPTI, JAX's cannot
    # (run 119: CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED, no events).
    jax_routes = [r for r in args.routes if not r.startswith("torch ")]
    for route in jax_routes:
        for shape in args.shape:
            _trace(impls[route], route, shape, args)
    torch_routes = [r for r in args.routes if r not in jax_routes]
    torch_impls = _torch_impls() if torch_routes else {}
    for route in torch_routes:
        for shape in args.shape:
            _trace_torch(torch_impls[route], route, shape, args)


def _trace(impl, route: str, shape: str, args):
    q, k, v, ct = attention_operands(parse_shape(shape), args.head_dim)
    f = functools.partial(impl, causal=False)
    program, operands = (
        (jax.jit(f), (q, k, v)) if args.part == "fwd" else (fwd_bwd_program(f), (q, k, v, ct))
    )
    compiled = program.lower(*operands).compile()
    jax.block_until_ready(compiled(*operands))  # warm: allocations, autotuning
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(args.launches):
                jax.block_until_ready(compiled(*operands))
        events = _last_launch(device_events(pathlib.Path(tmp)), args.launches)
    _print_events(route, shape, args, events)


def _trace_torch(impl, route: str, shape: str, args):
    """`_trace` for a torch peer: the CUDA kernels of its last launch, from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    qt, kt, vt, ctt = torch_operands(*attention_operands(parse_shape(shape), args.head_dim))

    def launch():
        if args.part == "fwd":
            with torch.no_grad():
                impl(qt, kt, vt, False)
        else:
            impl(qt, kt, vt, False).backward(ctt)
        torch.cuda.synchronize()

    launch()  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.launches):
            launch()
    events = sorted(
        (
            (e.name, e.time_range.start, e.time_range.end - e.time_range.start)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ),
        key=lambda e: e[1],
    )
    _print_events(route, shape, args, _last_launch(events, args.launches))


def _print_events(route: str, shape: str, args, events):
    print(f"{route} {args.part} {shape} hd{args.head_dim}: {len(events)} events", flush=True)
    end = None
    for name, start, duration in events:
        gap = 0.0 if end is None else start - end
        print(f"  {duration:9.1f} us  (gap {gap:7.1f})  {name[:110]}")
        end = start + duration if end is None else max(end, start + duration)
    if events:
        busy = sum(d for _, _, d in events)
        print(f"  span {end - events[0][1]:.1f} us, events {busy:.1f} us", flush=True)


if __name__ == "__main__":
    main()
