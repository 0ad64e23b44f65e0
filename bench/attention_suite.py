"""Attention suite: our implementations and peers on the same inputs and cotangents.

Every peer's forward output is checked on the first `CHECK_ROWS` queries against our
float32 oracle before its time counts, and its dQ, dK and dV under a cotangent on those
queries alone (`harness.rows_cotangent`); a mismatch makes the row an `error`.
"""

import functools
import itertools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import (
    GRAD_ATOL,
    attention_kernel,
    check_grads,
    classify,
    from_torch,
    fwd_bwd_program,
    layer_caches,
    oracle_grads,
    record,
    rows_cotangent,
    select_grid,
    stack,
    time_fn,
    to_torch,
    tokamax_peer,
    torch_attention,
    torch_copy,
    torch_fwd_bwd,
    torch_operands,
)
from probjax_eqx import dot_product_attention, masks
from probjax_eqx.kernels.reference import attention as reference

CHECK_ROWS = 128
# Forward output tolerance against the float32 oracle: bf16 rounding, or TF32 matmuls.
FWD_ATOL = {"bfloat16": 2e-2, "float32": 5e-3}

# The full grid; a run takes a slice with `--seq` and `--set` (e.g. `--set head_dim=128`).
# `layers` > 1 times each call inside a stack of that many (`harness.stack`), per call.
FULL = dict(batch=[4], heads=[8], seq=[1024, 4096, 16384], head_dim=[32, 64, 128, 256],
            causal=[False, True], dtype=["bfloat16", "float32"], layers=[1])  # fmt: skip
QUICK = dict(batch=[1], heads=[2], seq=[128], head_dim=[32], causal=[False, True],
             dtype=["bfloat16"], layers=[1])  # fmt: skip


def cases(quick: bool, seqs: list[int] | None = None, overrides=None) -> Iterator[dict]:
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="seq", seqs=seqs, overrides=overrides)
    for b, h, t, d, c, dtype, layers in itertools.product(*grid.values()):
        case = dict(batch=b, heads=h, seq=t, head_dim=d, causal=c, dtype=dtype)
        yield case | (dict(layers=layers) if layers > 1 else {})  # rows of one call: as before


def _jax_impls() -> dict[str, Callable]:
    def ours(name):
        def f(q, k, v, causal):
            return dot_product_attention(
                q, k, v, mask=masks.Causal() if causal else None, implementation=name
            )

        return f

    def jax_nn(name):
        def f(q, k, v, causal):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)

        return f

    def upstream_mha(q, k, v, causal):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as upstream
        return upstream.mha(q, k, v, None, sm_scale=1.0 / q.shape[-1] ** 0.5, causal=causal)

    impls = {f"probjax {n}": ours(n) for n in ("auto", "xla", "cudnn", "triton", "mosaic")}
    impls.update(
        {
            "jax.nn xla": jax_nn("xla"),
            "jax.nn cudnn": jax_nn("cudnn"),
            "jax pallas mha (deprecated)": upstream_mha,
        }
    )
    for impl in (None, "mosaic", "triton", "cudnn"):
        impls[f"tokamax {impl or 'auto'}"] = tokamax_peer(
            lambda tk, impl=impl: (
                lambda q, k, v, causal: tk.dot_product_attention(
                    q, k, v, is_causal=causal, implementation=impl
                )
            )
        )
    return impls


def _torch_impls() -> dict[str, Callable]:
    found = torch_attention()
    if found is None:
        return {}
    torch, SDPBackend, sdpa_kernel, create_block_mask, flex_attention = found

    def sdpa(backend):
        def f(q, k, v, causal):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
                )

        return f

    compiled = torch.compile(flex_attention)
    block_masks: dict = {}

    def flex(q, k, v, causal):
        if not causal:
            return compiled(q, k, v)
        key = q.shape[2], k.shape[2]
        if key not in block_masks:
            block_masks[key] = create_block_mask(
                lambda b, h, i, j: i >= j, None, None, *key, device="cuda"
            )
        return compiled(q, k, v, block_mask=block_masks[key])

    return {
        "torch sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "torch sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "torch sdpa efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "torch flex": flex,
    }


def forward_calls(q, k, v, names) -> dict[str, tuple[Callable, Callable]]:
    """`{name: (call, sync)}`: an unmasked forward of each implementation named on these
    operands (JAX's jitted, torch's on contiguous copies without autograd) and what waits
    for its result. Names this process lacks (torch's without torch) are left out."""
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    out = {}
    for name in names:
        if name in torch_impls:
            import torch

            qt, kt, vt = (to_torch(x) for x in (q, k, v))

            def torch_call(f=torch_impls[name], qt=qt, kt=kt, vt=vt):
                with torch.no_grad():
                    return f(qt, kt, vt, False)

            out[name] = (torch_call, lambda _: torch.cuda.synchronize())
        elif name in jax_impls:
            call = jax.jit(functools.partial(jax_impls[name], causal=False))
            out[name] = (functools.partial(call, q, k, v), jax.block_until_ready)
    return out


def _time_jax(f, q, k, v, ct, causal, repeats, layers=1):
    """`(out's first CHECK_ROWS queries, fwd ms, fwd+bwd ms, (dq, dk, dv) under
    rows_cotangent(ct, CHECK_ROWS))`, per call of a stack of `layers`."""
    one = functools.partial(_call, f, causal=causal)
    fwd = jax.jit(stack(one, layers))
    out = (fwd if layers == 1 else jax.jit(one))(q, k, v)
    # ct an argument: closed over, XLA folds a copy of it
    fwd_bwd = fwd_bwd_program(stack(one, layers))
    check = fwd_bwd if layers == 1 else fwd_bwd_program(one)
    grads = check(q, k, v, rows_cotangent(ct, CHECK_ROWS))[1]
    ks, vs = layer_caches(k, v, layers, jnp.copy)
    sync = jax.block_until_ready
    fwd_ms = time_fn(lambda: fwd(q, ks, vs), sync, repeats=repeats) / layers
    bwd_ms = time_fn(lambda: fwd_bwd(q, ks, vs, ct), sync, repeats=repeats) / layers
    return np.asarray(out[:, :CHECK_ROWS], np.float32), fwd_ms, bwd_ms, grads


def _call(f, q, k, v, *, causal):
    return f(q, k, v, causal)


def _time_torch(f, q, k, v, ct, causal, repeats, layers=1):
    """`_time_jax`'s results for a torch implementation, in JAX's layout."""
    import torch

    qt, kt, vt, ctt = torch_operands(q, k, v, ct)
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731

    one = functools.partial(_call, f, causal=causal)
    stacked = stack(one, layers)
    kts, vts = layer_caches(kt, vt, layers, torch_copy)

    def fwd(call=stacked, kts=kts, vts=vts):
        with torch.no_grad():
            return call(qt, kts, vts)

    fwd_bwd = functools.partial(torch_fwd_bwd, stacked, qt, kts, vts, ctt)

    out = from_torch(fwd(one, kt, vt)[:, :, :CHECK_ROWS])
    one(qt, kt, vt).backward(to_torch(rows_cotangent(ct.astype(q.dtype), CHECK_ROWS)))
    grads = tuple(from_torch(t.grad) for t in (qt, kt, vt))
    fwd_ms = time_fn(fwd, sync, repeats=repeats) / layers
    bwd_ms = time_fn(fwd_bwd, sync, repeats=repeats) / layers
    torch.cuda.empty_cache()
    return out, fwd_ms, bwd_ms, grads


def run(
    writer,
    base_row: dict,
    *,
    quick: bool,
    repeats: int,
    only: set[str] | None = None,
    seqs: list[int] | None = None,
    overrides: dict | None = None,
):
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    names = [n for n in [*jax_impls, *torch_impls] if only is None or n in only]
    for case in cases(quick, seqs, overrides):
        dtype = case.pop("dtype")
        b, h, t, d, causal = (case[n] for n in ("batch", "heads", "seq", "head_dim", "causal"))
        keys = jax.random.split(jax.random.key(t * d + causal), 4)
        q, k, v = (
            jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype) for kk in keys[:3]
        )
        ct = jax.random.normal(keys[3], (b, t, h, d), jnp.float32).astype(dtype)
        oracle = functools.partial(reference.attention, mask=masks.Causal() if causal else None,
                                   score_mod=None, scale=1.0 / np.sqrt(d), oracle=True)  # fmt: skip
        expected = np.asarray(oracle(q[:, :CHECK_ROWS], k, v))
        expected_grads = oracle_grads(oracle, q, k, v, ct, CHECK_ROWS)
        flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
        for name in names:
            is_torch = name in torch_impls
            row = dict(
                base_row,
                suite="attention",
                implementation=name,
                peer=not name.startswith("probjax"),
                shape=case,
                dtype=dtype,
                mask="causal" if causal else "none",
                flops_fwd=flops,
                flops_fwd_bwd=3.5 * flops,
                status="ok",
                message="",
            )
            try:
                attention_kernel(row, q, k, v, masks.Causal() if causal else None)
                timer = _time_torch if is_torch else _time_jax
                impl = torch_impls[name] if is_torch else jax_impls[name]
                layers = case.get("layers", 1)
                out, fwd_ms, bwd_ms, grads = timer(impl, q, k, v, ct, causal, repeats, layers)
                record(row, out, expected, fwd_ms, bwd_ms, atol=FWD_ATOL[dtype])
                check_grads(row, grads, expected_grads, atol=GRAD_ATOL[dtype])
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(e)
            writer.add(row)
            yield row
