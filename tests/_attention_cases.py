"""Shared attention shapes and helpers for the tests (small: they run in interpret mode too)."""

import jax
import jax.numpy as jnp
import numpy as np

from probjax_eqx import masks


def make_qkv(
    key,
    *,
    batch=2,
    q_len=7,
    kv_len=9,
    q_heads=4,
    kv_heads=2,
    qk_dim=16,
    v_dim=None,
    dtype=jnp.float32,
):
    v_dim = qk_dim if v_dim is None else v_dim
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, q_len, q_heads, qk_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, kv_len, kv_heads, qk_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, kv_len, kv_heads, v_dim), jnp.float32).astype(dtype)
    return q, k, v


def numpy_attention(q, k, v, *, valid=None, bias=None, scale=None, score_fn=None):
    """Float64 numpy attention from first principles (`valid`/`bias`: [B, Hq, Lq, Lkv])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, q_heads, qk_dim = q.shape
    kv_heads = k.shape[2]
    groups = q_heads // kv_heads
    scale = 1.0 / np.sqrt(qk_dim) if scale is None else scale
    out = np.zeros((batch, q_len, q_heads, v.shape[3]))
    for b in range(batch):
        for h in range(q_heads):
            s = scale * q[b, :, h] @ k[b, :, h // groups].T
            if bias is not None:
                s = s + np.broadcast_to(bias, (batch, q_heads) + s.shape)[b, h]
            if score_fn is not None:
                s = score_fn(s, b, h)
            ok = (
                np.ones(s.shape, bool)
                if valid is None
                else np.broadcast_to(valid, (batch, q_heads) + s.shape)[b, h]
            )
            for i in range(q_len):
                if not ok[i].any():
                    continue
                row = np.where(ok[i], s[i], -np.inf)
                p = np.exp(row - row.max())
                out[b, i, h] = (p / p.sum()) @ v[b, :, h // groups]
    return out


def loss_and_grads(fn, q, k, v, cotangent):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


# Masks over batch=2, q_len=7, kv_len=9 (the `make_qkv` defaults).
MASKS = {
    "none": None,
    "causal": masks.Causal(),
    "causal_bottom_right": masks.Causal("bottom_right"),
    "window": masks.LocalWindow(2, 3),
    "causal_window": masks.causal_local_window(3),
    "prefix_lm": masks.PrefixLM(jnp.array([2, 5])),
    "block_diagonal": masks.BlockDiagonal(3, 4),
    "kv_lengths": masks.KVLengths(jnp.array([9, 4])),
    "q_lengths": masks.QLengths(jnp.array([7, 3])),
    "segments": masks.Segments(
        jnp.array([[0, 0, 0, 1, 1, 2, 2]] * 2),
        jnp.array([[0, 0, 1, 1, 1, 1, 2, 2, 2]] * 2),
        sorted=True,
    ),
    "causal_and_kv_lengths": masks.Causal() & masks.KVLengths(jnp.array([5, 9])),
    "or_not": (masks.Causal() | masks.BlockDiagonal(2)) & ~masks.KVLengths(jnp.array([1, 0])),
}
