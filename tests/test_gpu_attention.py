"""GPU tests (`pytest --gpu`): kernels that cannot run on the CPU, at real sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _attention_cases import loss_and_grads, make_qkv
from _tolerance import assert_close
from probjax_eqx import dot_product_attention, explain_attention, masks
from probjax_eqx.kernels.reference import attention as reference

pytestmark = pytest.mark.gpu


def _oracle(q, k, v, mask):
    return reference.attention(
        q, k, v, mask=mask, score_mod=None, scale=1.0 / np.sqrt(q.shape[-1]), oracle=True
    )


CUDNN_CASES = {
    "none": (None, 256, 256),
    "causal": (masks.Causal(), 256, 256),
    "causal_lq_lt_lkv_top_left": (masks.Causal(), 128, 320),
    "kv_lengths": (masks.KVLengths(jnp.array([200, 17])), 192, 256),
    "kv_lengths_zero": (masks.KVLengths(jnp.array([0, 130])), 128, 192),
    "q_lengths_causal": (masks.QLengths(jnp.array([100, 256])) & masks.Causal(), 256, 256),
    "causal_window": (masks.causal_local_window(64), 256, 256),
    "causal_and_window": (masks.Causal() & masks.LocalWindow(left=31), 256, 256),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(CUDNN_CASES))
def test_cudnn_matches_oracle(getkey, name, dtype):
    mask, lq, lkv = CUDNN_CASES[name]
    q, k, v = make_qkv(
        getkey(), batch=2, q_len=lq, kv_len=lkv, q_heads=8, kv_heads=2, qk_dim=64, dtype=dtype
    )
    ct = jax.random.normal(getkey(), (2, lq, 8, 64))
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="cudnn")  # noqa: E731
    g = lambda q, k, v: _oracle(q, k, v, mask)  # noqa: E731
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    out = jax.jit(f)(q, k, v)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_close(out, g(*up), dtype)
    _, grads = jax.jit(lambda *a: loss_and_grads(f, *a, ct))(q, k, v)
    _, ref_grads = loss_and_grads(g, *up, ct)
    for label, a, b in zip("qkv", grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"d{label} not finite"
        assert_close(a, b, dtype, grad=True, err_msg=f"d{label}")


def test_auto_picks_cudnn_on_sm90():
    dev = jax.devices()[0]
    if getattr(dev, "compute_capability", None) != "9.0":
        pytest.skip("not an sm_90 device")
    q, k, v = make_qkv(jax.random.key(0), q_len=128, kv_len=128, qk_dim=64, dtype=jnp.bfloat16)
    assert explain_attention(q, k, v, mask=masks.Causal()).kernel == "cudnn"
    assert (
        explain_attention(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
        ).kernel
        == "xla"
    )


@pytest.mark.float32_matmul
def test_xla_float32_is_exact_on_gpu(getkey):
    q, k, v = make_qkv(getkey(), q_len=64, kv_len=80)
    out = dot_product_attention(q, k, v, mask=masks.Causal(), implementation="xla")
    assert_close(out, _oracle(q, k, v, masks.Causal()), jnp.float32)


TRITON_CASES = {
    "none": None,
    "causal": masks.Causal(),
    "kv_lengths": masks.KVLengths(jnp.array([700, 33])),
    "causal_window": masks.causal_local_window(200),
    "segments": masks.Segments(jnp.repeat(jnp.arange(4), 256)[None].repeat(2, 0), sorted=True),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", sorted(TRITON_CASES))
def test_triton_matches_oracle_on_gpu(getkey, name, head_dim):
    mask = TRITON_CASES[name]
    q, k, v = make_qkv(
        getkey(),
        batch=2,
        q_len=1024,
        kv_len=1024,
        q_heads=8,
        kv_heads=2,
        qk_dim=head_dim,
        dtype=jnp.bfloat16,
    )
    ct = jax.random.normal(getkey(), q.shape)
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="triton")  # noqa: E731
    g = lambda q, k, v: _oracle(q, k, v, mask)  # noqa: E731
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(jax.jit(f)(q, k, v), g(*up), jnp.bfloat16)
    _, grads = jax.jit(lambda *a: loss_and_grads(f, *a, ct))(q, k, v)
    _, ref_grads = loss_and_grads(g, *up, ct)
    for label, a, b in zip("qkv", grads, ref_grads):
        assert_close(a, b, jnp.bfloat16, grad=True, err_msg=f"d{label}")


@pytest.mark.parametrize(
    "dtype, head_dim, q_len", [(jnp.float32, 128, 333), (jnp.bfloat16, 256, 200)]
)
def test_triton_large_head_dims_and_fp32(getkey, dtype, head_dim, q_len):
    q, k, v = make_qkv(
        getkey(),
        batch=1,
        q_len=q_len,
        kv_len=517,
        q_heads=4,
        kv_heads=4,
        qk_dim=head_dim,
        dtype=dtype,
    )
    ct = jax.random.normal(getkey(), q.shape)
    mask = masks.Causal("bottom_right")
    f = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, implementation="triton")  # noqa: E731
    g = lambda q, k, v: _oracle(q, k, v, mask)  # noqa: E731
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(jax.jit(f)(q, k, v), g(*up), dtype, tf32=True)
    _, grads = jax.jit(lambda *a: loss_and_grads(f, *a, ct))(q, k, v)
    _, ref_grads = loss_and_grads(g, *up, ct)
    for label, a, b in zip("qkv", grads, ref_grads):
        assert_close(a, b, dtype, grad=True, tf32=True, err_msg=f"d{label}")


def test_triton_agrees_with_cudnn(getkey):
    q, k, v = make_qkv(
        getkey(),
        batch=2,
        q_len=512,
        kv_len=512,
        q_heads=8,
        kv_heads=8,
        qk_dim=128,
        dtype=jnp.bfloat16,
    )
    mask = masks.Causal() & masks.KVLengths(jnp.array([512, 300]))
    ct = jax.random.normal(getkey(), q.shape)
    outs = {}
    for name in ("triton", "cudnn"):
        f = lambda q, k, v, name=name: dot_product_attention(
            q, k, v, mask=mask, implementation=name
        )  # noqa: E731
        outs[name] = jax.jit(lambda *a, f=f: (f(*a), loss_and_grads(f, *a, ct)[1]))(q, k, v)
    for a, b in zip(jax.tree.leaves(outs["triton"]), jax.tree.leaves(outs["cudnn"])):
        diff = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        assert diff <= 0.004 * max(1.0, float(jnp.max(jnp.abs(b.astype(jnp.float32))))), diff
