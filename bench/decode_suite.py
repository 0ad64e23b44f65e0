"""Few queries over long KV (decoding, cross-attention to long contexts).

bf16, 32 query heads over 8 KV heads (and plain MHA), hd 128, Lq 1/16/128, Lkv up to
131,072, with and without per-batch KV lengths (each batch element keeps a different
share of the keys). Forward times for every case, forward+backward for Lq=128
(cross-attention trains: from 4096 keys on our Mosaic kernels, `attention.CROSS_MOSAIC_*`,
joined to the split-KV Triton forward at batch 1). `kv_tb_s` is the rate at which the
forward reads the valid keys and values: the decode roofline is the GPU's memory bandwidth.

Peers on the same inputs: torch SDPA (flash, cuDNN; no lengths: they take no length
argument), torch `flex_attention` compiled with a block mask built from the lengths,
`jax.nn.dot_product_attention` with cuDNN (`key_value_seq_lengths`). Every output is
checked against our float32 oracle on the first batch element before its time counts.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import (
    GRAD_ATOL,
    attention_kernel,
    cache_tensors,
    check_grads,
    classify,
    from_torch,
    fwd_bwd_program,
    layer_caches,
    oracle_grads,
    select_grid,
    stack,
    time_fn,
    to_torch,
    tokamax_peer,
    torch_attention,
    torch_copy,
    torch_fwd_bwd,
)
from probjax_eqx import dot_product_attention, masks
from probjax_eqx.kernels.reference import attention as reference

# `layers` > 1 times each call inside a stack of that many (`harness.stack`), per call.
FULL = dict(batch=[1, 8], heads=[(32, 8), (32, 32)], q_len=[1, 16, 128],
            kv_len=[8192, 32768, 131072], ragged=[False, True], layers=[1])  # fmt: skip
QUICK = dict(batch=[2], heads=[(4, 2)], q_len=[1], kv_len=[64], ragged=[True], layers=[1])
HEAD_DIM = 128
ATOL = 2e-2


def ragged_lengths(batch, kv_len, ragged):
    if not ragged:
        return None
    share = np.linspace(1.0, 0.25, batch) if batch > 1 else np.array([0.5])
    return jnp.asarray(np.maximum(1, (share * kv_len).astype(np.int32)))


def _jax_impls():
    def ours(name):
        def f(q, k, v, lengths):
            mask = None if lengths is None else masks.KVLengths(lengths)
            return dot_product_attention(q, k, v, mask=mask, implementation=name)

        return f

    def jax_nn_cudnn(q, k, v, lengths):
        return jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"
        )

    impls = {f"probjax {n}": ours(n) for n in ("auto", "triton", "cudnn")}
    impls["jax.nn cudnn"] = jax_nn_cudnn
    impls["tokamax auto"] = tokamax_peer(
        lambda tk: (
            lambda q, k, v, lengths: tk.dot_product_attention(
                q, k, v, key_value_seq_lengths=lengths
            )
        )
    )
    return impls


def _torch_impls():
    found = torch_attention()
    if found is None:
        return {}
    torch, SDPBackend, sdpa_kernel, create_block_mask, flex_attention = found

    def sdpa(backend):
        def f(q, k, v, lengths):
            if lengths is not None:
                raise NotImplementedError("SDPA's fused backends take no per-batch KV lengths")
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, enable_gqa=q.shape[1] != k.shape[1]
                )

        return f

    compiled = torch.compile(flex_attention)

    def flex(q, k, v, lengths):
        block_mask = None
        if lengths is not None:
            lens = torch.from_dlpack(lengths).to("cuda")
            block_mask = create_block_mask(
                lambda b, h, i, j: j < lens[b], q.shape[0], None, q.shape[2], k.shape[2],
                device="cuda",
            )  # fmt: skip
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return {
        "torch sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "torch sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "torch flex": flex,
    }


def _time_jax(f, q, k, v, ct, lengths, repeats, train, layers):
    # Lengths and cotangent are arguments, as the torch peers get them: closed over, they
    # are constants that XLA folds and specialises on.
    fwd = jax.jit(stack(f, layers))
    out = np.asarray((fwd if layers == 1 else jax.jit(f))(q, k, v, lengths)[:1], np.float32)
    sync = jax.block_until_ready
    ks, vs = layer_caches(k, v, layers, jnp.copy)
    fwd_ms = time_fn(functools.partial(fwd, q, ks, vs, lengths), sync, repeats=repeats) / layers
    bwd_ms = grads = None
    if train:
        grad = fwd_bwd_program(stack(f, layers))
        call = functools.partial(grad, q, ks, vs, lengths, ct)
        bwd_ms = time_fn(call, sync, repeats=repeats) / layers
        check = grad if layers == 1 else fwd_bwd_program(f)
        grads = tuple(g[:1] for g in check(q, k, v, lengths, ct)[1])
    return out, fwd_ms, bwd_ms, grads


def _time_torch(f, q, k, v, ct, lengths, repeats, train, layers):
    import torch

    qt, kt, vt, ctt = (to_torch(x) for x in (q, k, v, ct.astype(q.dtype)))
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731

    stacked = stack(f, layers)
    kts, vts = layer_caches(kt, vt, layers, torch_copy)

    def fwd(call=stacked, kts=kts, vts=vts):
        with torch.no_grad():
            return call(qt, kts, vts, lengths)

    out = from_torch(fwd(f, kt, vt)[:1])
    fwd_ms = time_fn(fwd, sync, repeats=repeats) / layers
    bwd_ms = grads = None
    if train:
        for t in cache_tensors(qt, kts, vts):
            t.requires_grad_(True)
        f(qt, kt, vt, lengths).backward(ctt)
        grads = tuple(from_torch(t.grad[:1]) for t in (qt, kt, vt))

        fwd_bwd = functools.partial(torch_fwd_bwd, stacked, qt, kts, vts, ctt, lengths)
        bwd_ms = time_fn(fwd_bwd, sync, repeats=repeats) / layers
    torch.cuda.empty_cache()
    return out, fwd_ms, bwd_ms, grads


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    grid = select_grid(FULL, QUICK, quick=quick, seq_key="kv_len", seqs=seqs,
                       overrides=overrides)  # fmt: skip
    jax_impls, torch_impls = _jax_impls(), _torch_impls()
    names = [n for n in [*jax_impls, *torch_impls] if only is None or n in only]
    d = 32 if quick else HEAD_DIM
    for b, (h, hk), lq, lkv, ragged, layers in itertools.product(*grid.values()):
        keys = jax.random.split(jax.random.key(lq * lkv + b), 4)
        q = jax.random.normal(keys[0], (b, lq, h, d), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (b, lkv, hk, d), jnp.float32).astype(jnp.bfloat16)
                for kk in keys[1:3])  # fmt: skip
        ct = jax.random.normal(keys[3], q.shape, jnp.float32).astype(jnp.bfloat16)
        lengths = ragged_lengths(b, lkv, ragged)
        mask = None if lengths is None else masks.KVLengths(lengths[:1])
        oracle = functools.partial(reference.attention, mask=mask, score_mod=None,
                                   scale=d**-0.5, oracle=True)  # fmt: skip
        expected = np.asarray(oracle(q[:1], k[:1], v[:1]))
        # Training rows (lq 128): the first batch element's gradients, every query's.
        expected_grads = (
            oracle_grads(oracle, q[:1], k[:1], v[:1], ct[:1], lq) if lq == 128 else None
        )
        valid = b * lkv if lengths is None else int(jnp.sum(lengths))
        kv_bytes = 2 * valid * hk * d * 2
        for name in names:
            row = dict(
                base_row, suite="decode", implementation=name, peer=not name.startswith("probjax"),
                shape=dict(batch=b, q_heads=h, kv_heads=hk, q_len=lq, kv_len=lkv, head_dim=d,
                           kv_lengths=ragged) | (dict(layers=layers) if layers > 1 else {}),
                dtype="bfloat16", status="ok", message="",
            )  # fmt: skip
            try:
                kv_mask = None if lengths is None else masks.KVLengths(lengths)
                attention_kernel(row, q, k, v, kv_mask)
                is_torch = name in torch_impls
                timer = _time_torch if is_torch else _time_jax
                impl = torch_impls[name] if is_torch else jax_impls[name]
                out, fwd_ms, bwd_ms, grads = timer(
                    impl, q, k, v, ct, lengths, repeats, lq == 128, layers
                )
                err = float(np.max(np.abs(out - expected)))
                row.update(fwd_ms=fwd_ms, kv_tb_s=kv_bytes / fwd_ms / 1e9, max_abs_err=err)
                if bwd_ms is not None:
                    row["fwd_bwd_ms"] = bwd_ms
                if not np.isfinite(err) or err > ATOL:
                    row.update(status="error", message=f"output differs from the oracle: {err:.3g}")
                if grads is not None:
                    check_grads(row, grads, expected_grads, atol=GRAD_ATOL["bfloat16"])
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(exc)
            writer.add(row)
            yield row
