"""Benchmark harness: timing, environment metadata, JSON rows.

A row: suite, implementation, peer, shape, dtype, mask, fwd_ms, fwd_bwd_ms, tflops_fwd,
tflops_fwd_bwd, status (ok / OOM / unsup. / error), message, max_abs_err, max_grad_err
(where gradients are checked), device, versions. Times are medians over `repeats` runs
after `warmup` runs, each synchronised (`block_until_ready` for JAX,
`torch.cuda.synchronize` for torch), so every implementation is timed the same way.
"""

import dataclasses
import importlib.metadata
import json
import pathlib
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import jax

STATUSES = ("ok", "OOM", "unsup.", "error")


def versions() -> dict[str, str]:
    out = {}
    for name in ("jax", "jaxlib", "equinox", "torch", "triton", "tokamax", "probjax-eqx"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict[str, Any]:
    dev = jax.devices()[0]
    info = {"platform": dev.platform, "kind": getattr(dev, "device_kind", dev.platform)}
    if dev.platform == "gpu":
        info["compute_capability"] = getattr(dev, "compute_capability", None)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def warm_up_device(seconds: float = 2.0) -> None:
    """Keep the GPU busy with matmuls for `seconds` before the first timed row.

    Rows timed first ran slower than the same kernel timed next (run 18's set-transformer
    suite: auto, which is Triton there, 0.063 ms forward against Triton pinned 0.049):
    clocks and libraries warm up on the first work, not on a row's own warm-up calls.
    """
    if jax.devices()[0].platform != "gpu":
        return
    import jax.numpy as jnp

    a = jnp.ones((4096, 4096), jnp.bfloat16)
    step = jax.jit(lambda a: (a @ a) * jnp.bfloat16(1e-4))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = step(a).block_until_ready()


def time_fn(
    fn: Callable[[], Any],
    sync: Callable[[Any], Any],
    *,
    warmup: int = 3,
    repeats: int = 20,
    budget_s: float = 10.0,
    min_sample_ms: float = 100.0,
    max_inner: int = 100,
) -> float:
    """Median wall time in ms of one `fn()` after `warmup` untimed calls.

    A sample is `sync` after `inner` back-to-back calls (at most `max_inner`), divided by
    `inner`, with `inner` chosen so that a sample lasts about `min_sample_ms`: launches
    queue asynchronously, so a kernel is timed without the host's dispatch and sync gap.
    That gap is JAX's more than torch's: one call and its sync took 0.41 ms longer through
    JAX than through torch at batch 8 MHA decoding over 32k keys (H100 run 152,
    `bench.probe_sample_length`; the kernels took 1.37 ms alike by CUPTI, run 151),
    which 20 ms samples (until run 152) spread as 3% over each call (ours 1.414 ms,
    torch's cuDNN 1.378; with 200 ms samples 1.366 each). Calls under 1 ms still carry
    the sync's share over 100 calls; samples of up to 1000 timed one 0.04 ms call slower
    (run 153: 0.055 ms, 0.042 in run 154; its other rows alike), unexplained so far. Slow
    cases (a reference at a large size) take fewer samples, at least 5, so that one case
    spends about `budget_s` seconds.
    """
    last_ms = 0.0
    for i in range(warmup):
        start = time.perf_counter()
        sync(fn())
        last_ms = (time.perf_counter() - start) * 1e3
        if i and last_ms > budget_s * 100:
            break  # the first call compiled; a slow case needs no more warm-up
    inner = max(1, min(max_inner, int(min_sample_ms / max(last_ms, 1e-3))))
    samples: list[float] = []
    while len(samples) < repeats:
        start = time.perf_counter()
        for _ in range(inner - 1):
            fn()
        sync(fn())
        samples.append((time.perf_counter() - start) * 1e3 / inner)
        if len(samples) >= 5 and sum(samples) * inner > budget_s * 1e3:
            break
    return statistics.median(samples)


def fwd_bwd_program(f: Callable, n_diff: int = 3) -> Callable:
    """`jit((*args, ct) -> (f(*args), cotangents of args[:n_diff]))`: what torch's
    `f(*args).backward(ct)` computes, on a cotangent in the output's dtype as torch gets it.

    A loss `sum(f(...).astype(f32) * ct)` over a float32 `ct` (this harness until run 92)
    added a conversion of the cotangent to every JAX timing: H100 run 93, T 4096 hd 128,
    JAX's cuDNN 1.971 -> 1.943 ms (1.220 -> 1.199 causal).
    """

    def step(*args):
        *args, ct = args
        diff, rest = args[:n_diff], args[n_diff:]
        out, pullback = jax.vjp(lambda *d: f(*d, *rest), *diff)
        return out, pullback(ct.astype(out.dtype))

    return jax.jit(step)


# Attention gradients against the float32 oracle: bf16 (issue 9's bound) and TF32 peers.
GRAD_ATOL = {"bfloat16": 0.06, "float16": 0.06, "float32": 0.02}


def rows_cotangent(ct, rows: int):
    """`ct` [batch, queries, ...] with the queries past the first `rows` zeroed.

    Under such a cotangent dS vanishes on the other rows, so dK and dV, as dQ, come from
    the first `rows` queries alone: `oracle_grads` computes all three at any length.
    """
    return ct.at[:, rows:].set(0)


def oracle_grads(attend: Callable, q, k, v, ct, rows: int) -> tuple:
    """Float32 `(dq, dk, dv)` of `attend(q, k, v)` for `rows_cotangent(ct, rows)`, with
    `attend` computed on the first `rows` queries only (dq is zero past them). Its mask
    must not depend on the number of queries (top-left causal, KV lengths, none): a
    bottom-right causal mask shifts with it."""
    import jax.numpy as jnp

    rows = min(rows, q.shape[1])
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    _, pullback = jax.vjp(attend, f32(q[:, :rows]), f32(k), f32(v))
    dq, dk, dv = pullback(f32(ct[:, :rows]))
    dq = jnp.pad(dq, [(0, 0), (0, q.shape[1] - rows)] + [(0, 0)] * (q.ndim - 2))
    return dq, dk, dv


def check_grads(row: dict, grads, expected, *, atol: float, rtol: float = 0.0) -> None:
    """Record the largest |gradient - oracle| over `grads` in `row`; an element off by more
    than `atol + rtol * |oracle|` (or not finite) makes the row an `error`, unless it
    already is one. Sums of many products need `rtol` (`record` says why)."""
    import numpy as np

    err, within = 0.0, True
    for g, e in zip(grads, expected, strict=True):
        g, e = np.asarray(g, np.float32), np.asarray(e, np.float32)
        diff = np.abs(g - e)
        err = max(err, float(np.max(diff)))
        within &= bool(np.all(diff <= atol + rtol * np.abs(e)))
    row["max_grad_err"] = err
    if row["status"] == "ok" and (not np.isfinite(err) or not within):
        row.update(status="error", message=f"gradients differ from the reference: {err:.3g}")


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """`"B,LQ,LKV,HQ,HKV"` (a probe's `--shape`) -> `(batch, q_len, kv_len, heads, kv_heads)`."""
    batch, q_len, kv_len, heads, kv_heads = map(int, text.split(","))
    return batch, q_len, kv_len, heads, kv_heads


def attention_operands(shape: tuple[int, int, int, int, int], head_dim: int, seed: int = 0):
    """Random bf16 `(q, k, v, ct)` of a `parse_shape` shape, `[batch, seq, heads, dim]`."""
    import jax.numpy as jnp

    batch, q_len, kv_len, heads, kv_heads = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q, ct = (jax.random.normal(kk, (batch, q_len, heads, head_dim), jnp.bfloat16)
             for kk in keys[::3])  # fmt: skip
    k, v = (jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
            for kk in keys[1:3])  # fmt: skip
    return q, k, v, ct


def stack(f: Callable, layers: int) -> Callable:
    """`layers` calls of `f(q, k, v, *rest)` in a row, each one's output the next one's queries:
    a stack of attention layers, timed per call as a model runs them in one program.

    `k` and `v` are one array each, which every layer reads, or tuples of per-layer caches
    (`layer_caches`), which the layers take in turn.

    JAX pays a fixed cost per dispatched program that torch's eager launches do not
    (H100 run 96, T 4096 hd 128 fwd+bwd per call through the same cuDNN kernels: JAX 1.922
    ms alone, 1.866 in a stack of 8; torch 1.822 alone, 1.903 in a stack).
    """

    def stacked(q, k, v, *rest):
        for i in range(layers):
            q = f(q, _layer(k, i), _layer(v, i), *rest)
        return q

    return stacked


def _layer(cache, i: int):
    return cache[i % len(cache)] if isinstance(cache, tuple) else cache


# Hopper's L2 (H100 and H200 alike). A stack whose layers all read one K/V smaller than it
# reads them from L2 after the first layer, where a model's layers each read their own
# cache from HBM: H100 run 145, batch 1 GQA 8192 keys (34 MB), 0.036 ms per call alone,
# 0.011 per layer in a stack of 16.
L2_BYTES = 50 * 2**20


def layer_caches(k, v, layers: int, copy: Callable):
    """`(k, v)` for `stack(f, layers)`: as they are where one layer's K and V fill 4x L2
    or more; else tuples of distinct copies (`copy(x)`: `jnp.copy`, `torch_copy`), as
    many as it takes to read past L2 (at most `layers`), so that every layer reads its
    K/V from memory. JAX arrays and torch tensors alike."""
    copies = min(layers, -(-4 * L2_BYTES // (k.nbytes + v.nbytes)))
    if copies <= 1:
        return k, v
    return tuple((x, *(copy(x) for _ in range(copies - 1))) for x in (k, v))


def torch_copy(t):
    """A distinct copy of torch tensor `t` that requires gradients as `t` does."""
    return t.detach().clone().requires_grad_(t.requires_grad)


def cache_tensors(*caches) -> tuple:
    """The tensors of `caches`, each one tensor or a tuple of per-layer ones."""
    return tuple(t for c in caches for t in (c if isinstance(c, tuple) else (c,)))


def torch_fwd_bwd(f: Callable, qt, kts, vts, ctt, *rest) -> None:
    """One forward and backward of torch `f(qt, kts, vts, *rest)` (a `stack`'s), after
    clearing the gradients of q and of every K/V cache."""
    for t in cache_tensors(qt, kts, vts):
        t.grad = None
    f(qt, kts, vts, *rest).backward(ctt)


def time_model_step(model, inputs: tuple, loss_of, repeats: int, *, input_grads=False):
    """`(first output row, forward ms, train step ms)` of `jax.vmap(model)(*inputs)`.

    The step is the forward plus the gradients of `loss_of(output)` with respect to the
    model's arrays (and the first input, with `input_grads`).
    """
    import equinox as eqx
    import numpy as np

    params, static = eqx.partition(model, eqx.is_array)

    def fwd(params, *inputs):
        return jax.vmap(eqx.combine(params, static))(*inputs)

    def loss(params, *inputs):
        return loss_of(fwd(params, *inputs))

    f = jax.jit(fwd)
    g = jax.jit(jax.grad(loss, argnums=(0, 1) if input_grads else 0))
    out = np.asarray(f(params, *inputs)[:1], np.float32)
    fwd_ms = time_fn(lambda: f(params, *inputs), jax.block_until_ready, repeats=repeats)
    step_ms = time_fn(lambda: g(params, *inputs), jax.block_until_ready, repeats=repeats)
    return out, fwd_ms, step_ms


def record(row: dict, out, expected, fwd_ms: float, fwd_bwd_ms: float, *, atol: float,
           rtol: float = 0.0, bwd_factor: float = 3.5,
           against: str = "the reference") -> None:  # fmt: skip
    """Fill a row's timings and TFLOP/s; an output off `expected` by more than
    `atol + rtol * |expected|` anywhere makes it an `error`.

    Outputs that grow past O(1) need `rtol`: one bf16 rounding step at |x| in [8, 16) is
    0.0625 (RLA at T=4096 reached 8.6).
    """
    import numpy as np

    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    diff = np.abs(out - expected)
    err = float(np.max(diff))
    within = bool(np.all(diff <= atol + rtol * np.abs(expected)))
    row.update(
        fwd_ms=fwd_ms,
        fwd_bwd_ms=fwd_bwd_ms,
        max_abs_err=err,
        tflops_fwd=row["flops_fwd"] / fwd_ms / 1e9,
        tflops_fwd_bwd=bwd_factor * row["flops_fwd"] / fwd_bwd_ms / 1e9,
    )
    if not np.isfinite(err) or not within:
        row.update(status="error", message=f"output differs from {against}: {err:.3g}")


def attention_kernel(row: dict, q, k, v, mask) -> None:
    """Name in `row` the kernel that our attention (`row["implementation"]` "probjax
    auto", ...) runs on these operands (`explain_attention`: auto's choice), and the
    family of a half its config joins to it, for the report to show beside it; a peer's
    row is left as it is."""
    from probjax_eqx import explain_attention

    name = row["implementation"]
    if name.startswith("probjax "):
        implementation = name.removeprefix("probjax ")
        choice = explain_attention(q, k, v, mask=mask, implementation=implementation)
        kernel = choice.kernel
        forward, backward = getattr(choice.config, "halves", (kernel, kernel))
        if (forward, backward) != (kernel, kernel):
            kernel = f"{forward} fwd + {backward} bwd"
        row["kernel"] = kernel


def select_grid(full: dict, quick_grid: dict, *, quick: bool, seq_key: str, seqs=None,
                overrides: dict | None = None) -> dict:  # fmt: skip
    """A suite's grid of cases: `--quick`'s or the full one, `--seq` and `--set` applied."""
    grid = dict(quick_grid if quick else full)
    if seqs:
        grid[seq_key] = list(seqs)
    for key, values in (overrides or {}).items():
        if key not in grid:
            raise ValueError(f"--set {key}=...: this suite's grid has {sorted(grid)}")
        grid[key] = list(values)
    return grid


def parse_overrides(items: list[str] | None) -> dict[str, list]:
    """`["head_dim=64,128", "causal=false", "fraction=0.25", "heads=32:8"]` ->
    `{"head_dim": [64, 128], "causal": [False], "fraction": [0.25], "heads": [(32, 8)]}`."""

    def value(text: str):
        if ":" in text:  # a tuple-valued axis, as the decode suite's (q heads, KV heads)
            return tuple(value(part) for part in text.split(":"))
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        for number in (int, float):
            try:
                return number(text)
            except ValueError:
                pass
        return text

    out = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--set takes KEY=V1[,V2...], got {item!r}")
        out[key] = [value(v) for v in values.split(",")]
    return out


# How peers refuse a call they cannot compute (their own words).
_PEER_REJECTIONS = (
    "No available kernel",  # torch SDPA with a backend pinned
    # the deprecated jax.experimental.pallas.ops.gpu.attention.mha: Lq != Lkv in its backward
    "must be divided into the same number of blocks",
    # a custom VJP without forward mode (jax.nn's cuDNN route) under `jax.jvp`
    "can't apply forward-mode autodiff (jvp) to a custom_vjp function",
)


def classify(err: BaseException) -> tuple[str, str]:
    """Map an exception to a row status and a one-line message."""
    from probjax_eqx import UnsupportedError

    text = f"{type(err).__name__}: {err}".splitlines()[0][:400]
    if isinstance(err, UnsupportedError | NotImplementedError) or any(
        rejection in text for rejection in _PEER_REJECTIONS
    ):
        return "unsup.", text
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemory" in text:
        return "OOM", text
    return "error", text


@dataclasses.dataclass
class RowWriter:
    """Appends rows to a JSON file after each one, so a killed run keeps what it measured."""

    path: pathlib.Path
    rows: list[dict] = dataclasses.field(default_factory=list)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"rows": self.rows}, indent=1))


def torch_attention():
    """`(torch, SDPBackend, sdpa_kernel, create_block_mask, flex_attention)` when torch
    with CUDA is importable, else `None`: the torch attention peers run only then."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch, SDPBackend, sdpa_kernel, create_block_mask, flex_attention


def to_torch(x, *, copy: bool = True):
    """A JAX `[B, T, H, D]` array as torch's `[B, H, T, D]`: a contiguous copy, as the
    suites give torch, or (`copy=False`) a view of the same memory."""
    import torch

    t = torch.from_dlpack(x).transpose(1, 2).detach()
    return t.clone() if copy else t


def torch_operands(q, k, v, ct, *, copy: bool = True):
    """`to_torch` of each of `(q, k, v, ct)` (`ct` in `q`'s dtype), q, k and v requiring
    gradients: one attention call's torch operands."""
    qt, kt, vt, ctt = (to_torch(x, copy=copy) for x in (q, k, v, ct.astype(q.dtype)))
    for t in (qt, kt, vt):
        t.requires_grad_(True)
    return qt, kt, vt, ctt


def from_torch(t):
    """A torch `[B, H, T, D]` tensor as a float32 NumPy `[B, T, H, D]` array."""
    return t.transpose(1, 2).float().cpu().numpy()


def tokamax():
    """The `tokamax` module when it imports (a carried wheel, Python >= 3.12, jax >= 0.11.1),
    else the reason it does not: its peers then record `unsup.` rows with that reason.

    tokamax imports its profiler (`xprof`, a 32 MB wheel with cloud-storage dependencies)
    at import time for its own benchmarking only; a stub stands in for it when absent.
    """
    import sys
    import types

    try:
        import xprof.cli.tools  # noqa: F401
    except ImportError:
        names = ("xprof", "xprof.cli", "xprof.cli.tools")
        stubs = {name: types.ModuleType(name) for name in names}

        def get_kernel_stats_tool(*args, **kwargs):
            raise NotImplementedError("xprof is stubbed in probjax-eqx's benchmarks")

        stubs["xprof.cli.tools"].get_kernel_stats_tool = get_kernel_stats_tool  # type: ignore
        for name, module in stubs.items():
            sys.modules.setdefault(name, module)
    try:
        import tokamax as module
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return f"tokamax does not import: {type(exc).__name__}: {exc}"[:300]
    return module


def tokamax_peer(fn_of_module):
    """A peer that calls `fn_of_module(tokamax)(*args)`, or raises `NotImplementedError`
    (an `unsup.` row) naming why tokamax is not there."""

    def peer(*args):
        module = tokamax()
        if isinstance(module, str):
            raise NotImplementedError(module)
        return fn_of_module(module)(*args)

    return peer


_NO_WORK = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")


def device_work(hlo_text: str) -> list[str]:
    """`opcode name: shape` of each instruction of the entry computation that runs work."""
    entry = hlo_text[hlo_text.index("\nENTRY") :].split("\n")[2:]  # past its header
    found = []
    for line in entry:
        if line.strip() == "}":
            break
        name, _, rhs = line.strip().removeprefix("ROOT ").partition(" = ")
        shape, _, rest = rhs.partition(" ")
        opcode = rest.split("(")[0]
        if opcode not in _NO_WORK:
            target = rest.partition('custom_call_target="')[2].partition('"')[0]
            found.append(f"{opcode} {target or name}: {shape}")
    return found
