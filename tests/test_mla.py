"""MLA: the training path against a dense reference, the absorbed path and cache decoding."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tolerance import assert_close
from probjax_eqx import masks
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig
from probjax_eqx.mla import MLA


def make(key, **kwargs):
    args = dict(
        kv_lora_rank=24, q_lora_rank=20, nope_dim=16, rope_dim=8, v_dim=12, implementation="xla"
    )
    args.update(kwargs)
    return MLA(32, 4, key=key, **args)


def dense_reference(mla: MLA, x):
    """Float64 numpy MLA from the definitions (per-head keys, causal softmax)."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    seq = x.shape[0]

    def rms(a, w):
        return a / np.sqrt(np.mean(a**2, -1, keepdims=True) + 1e-6) * f(w)

    def rope(a, theta=mla.rope_theta):
        half = a.shape[-1] // 2
        inv = 1.0 / theta ** (np.arange(0, a.shape[-1], 2) / a.shape[-1])
        ang = np.arange(seq)[:, None] * inv[None]
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a1, a2 = a[..., :half], a[..., half:]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    xs = f(x)
    hq = xs if mla.w_dq is None else rms(xs @ f(mla.w_dq), mla.q_norm)
    q = (hq @ f(mla.w_q)).reshape(seq, mla.num_heads, -1)
    q = np.concatenate([q[..., : mla.nope_dim], rope(q[..., mla.nope_dim :])], -1)
    ckv = xs @ f(mla.w_dkv)
    latent = rms(ckv[:, : mla.kv_lora_rank], mla.kv_norm)
    k_rope = rope(ckv[:, None, mla.kv_lora_rank :])[:, 0]
    k_nope = (latent @ f(mla.w_uk)).reshape(seq, mla.num_heads, mla.nope_dim)
    k = np.concatenate([k_nope, np.repeat(k_rope[:, None], mla.num_heads, 1)], -1)
    v = (latent @ f(mla.w_uv)).reshape(seq, mla.num_heads, mla.v_dim)
    s = np.einsum("qhd,khd->hqk", q, k) * mla.scale
    s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khv->qhv", p, v).reshape(seq, -1)
    return o @ f(mla.w_o)


@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_training_and_absorbed_paths_match_the_reference(getkey, q_lora_rank):
    mla = make(getkey(), q_lora_rank=q_lora_rank)
    x = jax.random.normal(getkey(), (48, 32))  # 48: off the kernels' 64-row tiles
    expected = dense_reference(mla, x)
    assert_close(mla(x), expected, jnp.float32)
    assert_close(mla.absorbed(x), expected, jnp.float32)


def test_gradients_of_both_paths_agree(getkey):
    mla = make(getkey())
    x = jax.random.normal(getkey(), (17, 32))
    ct = jax.random.normal(getkey(), (17, 32))
    g1 = eqx.filter_jit(jax.grad(lambda m: jnp.sum(m(x) * ct)))(mla)
    g2 = eqx.filter_jit(jax.grad(lambda m: jnp.sum(m.absorbed(x) * ct)))(mla)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert_close(a, b, jnp.float32, grad=True)


def test_prefill_and_decode_equal_the_full_forward(getkey):
    mla = make(getkey())
    x = jax.random.normal(getkey(), (21, 32))
    full = mla(x)
    cache = mla.init_cache(32)
    out, cache = eqx.filter_jit(mla.prefill)(x[:9], cache)
    outs = [out]
    step = eqx.filter_jit(mla.decode_step)
    for t in range(9, 21):
        y, cache = step(x[t], cache)
        outs.append(y[None])
    assert int(cache.length) == 21
    assert_close(jnp.concatenate(outs), full, jnp.float32)


def test_vmap_over_a_batch_with_padding_masks(getkey):
    mla = make(getkey())
    xs = jax.random.normal(getkey(), (3, 10, 32))
    lengths = jnp.array([10, 4, 7])
    out = jax.vmap(lambda x, n: mla(x, mask=masks.Causal() & masks.KVLengths(n)))(xs, lengths)
    # Rows before each length only see valid keys: equal to running on the prefix alone.
    np.testing.assert_allclose(out[1, :4], mla(xs[1, :4]), atol=1e-5)


def test_absorbed_path_on_the_triton_kernel(getkey):
    """Latent-space MQA (qk dim 32, v dim 24) over 48 queries / 48 latents: padded tiles."""
    config = TritonAttentionConfig(
        block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32,
        interpret=True,
    )  # fmt: skip
    mla = make(getkey(), implementation="triton", attention_config=config)
    x = jax.random.normal(getkey(), (48, 32))
    assert_close(mla.absorbed(x), dense_reference(mla, x), jnp.float32)
    ct = jax.random.normal(getkey(), (48, 32))
    g_triton = eqx.filter_jit(jax.grad(lambda m: jnp.sum(m.absorbed(x) * ct)))(mla)
    xla = make(getkey(), implementation="xla")
    xla = eqx.tree_at(lambda m: [m.w_q, m.w_dkv, m.w_uk, m.w_uv, m.w_o, m.w_dq], xla,
                      [mla.w_q, mla.w_dkv, mla.w_uk, mla.w_uv, mla.w_o, mla.w_dq])  # fmt: skip
    g_xla = eqx.filter_jit(jax.grad(lambda m: jnp.sum(m.absorbed(x) * ct)))(xla)
    for a, b in zip(jax.tree.leaves(g_triton), jax.tree.leaves(g_xla)):
        assert_close(a, b, jnp.float32, grad=True)
