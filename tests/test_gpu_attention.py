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
