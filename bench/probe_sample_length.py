"""How much of a call's time is the timing's own sync: `python bench/probe_sample_length.py`.

Decoding one query, MHA at batch 8 and 1 over 32k keys: our default, jax.nn's cuDNN
and torch SDPA's cuDNN timed by `time_fn` at 20 ms and 200 ms samples (twice, in turn),
then one call and its sync alone. Run 152 (H100): JAX's one call and sync took 0.41 ms
longer than torch's, which 20 ms samples spread as 3% over each call of 1.4 ms; at 200
ms our default and torch's cuDNN took 1.366 ms each. Prints its lines.
"""

import functools
import statistics
import time

import jax

from bench.attention_suite import _jax_impls, _torch_impls
from bench.harness import attention_operands, time_fn, torch_operands, warm_up_device

SHAPES = [(8, 1, 32768, 32, 32), (1, 1, 32768, 32, 32)]  # B, LQ, LKV, HQ, HKV


def main():
    import torch

    warm_up_device()
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    for shape in SHAPES:
        q, k, v, ct = attention_operands(shape, 128)
        qt, kt, vt, _ = torch_operands(q, k, v, ct)

        def jax_call(name, q=q, k=k, v=v):
            return functools.partial(
                jax.jit(functools.partial(jax_impls[name], causal=False)), q, k, v
            )

        def torch_call(qt=qt, kt=kt, vt=vt):
            with torch.no_grad():
                return torch_impls["torch sdpa cudnn"](qt, kt, vt, False)

        def torch_sync(_):
            torch.cuda.synchronize()

        routes = {
            "ours": (jax_call("probjax auto"), jax.block_until_ready),
            "jax.nn": (jax_call("jax.nn cudnn"), jax.block_until_ready),
            "torch": (torch_call, torch_sync),
        }
        for sample_ms in (20.0, 200.0, 20.0, 200.0):
            times = {n: time_fn(f, s, min_sample_ms=sample_ms) for n, (f, s) in routes.items()}
            line = " ".join(f"{n} {ms:.4f}" for n, ms in times.items())
            print(shape, f"sample {sample_ms:5.0f} ms: {line}", flush=True)
        for name in ("ours", "torch"):
            fn, sync = routes[name]
            sync(fn())
            alone = []
            for _ in range(21):
                start = time.perf_counter()
                sync(fn())
                alone.append((time.perf_counter() - start) * 1e3)
            print(shape, name, f"one call + sync, median {statistics.median(alone):.4f} ms")


if __name__ == "__main__":
    main()
