"""Every Pallas Triton kernel lowers, for the GPU, to a Triton module that verifies.

Interpret mode runs the kernels' semantics on the CPU but never builds their Triton IR,
so a module that the GPU's Triton rejects (loop bounds of two integer types, say) would
pass every CPU test. Here each kernel family is lowered for "cuda" on the CPU (no GPU
needed) and every Triton module it produces is verified.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from probjax_eqx import biases, masks
from probjax_eqx.kernels.triton import attention as triton_attention
from probjax_eqx.kernels.triton import grouped_matmul as triton_gmm
from probjax_eqx.kernels.triton import ssm as triton_ssm


@pytest.fixture
def verified_modules(monkeypatch):
    """Counts the Triton modules built while lowering; each one is verified as it is built."""
    # Private: the one place the tests reach into the Pallas Triton lowering.
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    lower = registration.lowering.lower_jaxpr_to_triton_module
    built = []

    def verifying(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises with the op that fails
        built.append(result)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verifying)
    return built


def lower_for_gpu(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def value_and_grads(f, argnums):
    """`f`'s value and gradients, as one function to lower (forward and backward kernels)."""
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
    return jax.value_and_grad(loss, argnums)


def qkv(q_len=100, kv_len=129, heads=4, kv_heads=2, d=64, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, q_len, heads, d), dtype)
    k, v = (jax.random.normal(kk, (2, kv_len, kv_heads, d), dtype) for kk in keys[1:])
    return q, k, v


ATTENTION_CASES = {
    "causal_split": (dict(), masks.Causal(), None),
    "causal_fused": (dict(backward_pass_impl="triton_fused"), masks.Causal(), None),
    "kv_lengths_split_kv": (
        dict(num_splits=3, num_splits_dq=3),
        masks.KVLengths(jnp.array([50, 129])),
        None,
    ),
    "window_softcap": (dict(), masks.LocalWindow(16, 16), biases.SoftCap(30.0)),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_kernels_lower(verified_modules, case):
    overrides, mask, score_mod = case
    config = triton_attention.TritonAttentionConfig(**overrides)
    f = functools.partial(
        triton_attention.flash_attention, mask=mask, score_mod=score_mod, scale=0.125,
        config=config,
    )  # fmt: skip
    lower_for_gpu(value_and_grads(f, (0, 1, 2)), *qkv())
    assert len(verified_modules) >= 2  # forward, and the backward's kernel(s)


def test_fused_backward_over_one_key_tile_lowers(verified_modules):
    """Keys in one dK/dV tile: dQ stored, the skipped query tiles' rows zeroed."""
    config = triton_attention.TritonAttentionConfig(
        backward_pass_impl="triton_fused", block_k=64, block_k_dkv=128, block_k_dq=64
    )
    f = functools.partial(
        triton_attention.flash_attention, mask=masks.KVLengths(jnp.array([50, 0])),
        score_mod=None, scale=0.125, config=config,
    )  # fmt: skip
    lower_for_gpu(value_and_grads(f, (0, 1, 2)), *qkv(kv_len=128))
    assert len(verified_modules) == 2  # forward, the fused backward


@pytest.mark.parametrize("heads", [4, 6], ids=["groups_2", "groups_3"])
def test_group_dkv_lowers(verified_modules, heads):
    """One dK/dV program per KV head, its query heads a block of 2 or 3 (not a power of
    two: only single heads are loaded from it), ALiBi's slopes indexed per query head."""
    config = triton_attention.TritonAttentionConfig(
        group_dkv=True, backward_pass_impl="triton_split"
    )
    mod = biases.ALiBi(jnp.asarray(biases.alibi_slopes(heads)))
    f = functools.partial(
        triton_attention.flash_attention, mask=masks.Causal(), score_mod=mod, scale=0.125,
        config=config,
    )  # fmt: skip
    lower_for_gpu(value_and_grads(f, (0, 1, 2)), *qkv(heads=heads))
    assert len(verified_modules) == 3  # forward, dK/dV, dQ


def test_packed_gqa_decode_lowers(verified_modules):
    config = triton_attention.TritonAttentionConfig(block_q=16, pack_gqa=True, num_splits=4)
    f = functools.partial(
        triton_attention.flash_attention, mask=None, score_mod=None, scale=0.125, config=config
    )
    program = lower_for_gpu(f, *qkv(q_len=1, kv_len=1000, heads=8, kv_heads=2)).as_text()
    assert len(verified_modules) == 2  # the split forward and the merge of its splits
    # The kernels read the caller's q, k, v (1,000 keys: not a tile multiple) and write its
    # output: nothing runs around them but free reshapes (no pad, transpose or slice).
    ops = set(re.findall(r"= (stablehlo\.\w+)", program))
    assert ops == {"stablehlo.reshape", "stablehlo.custom_call"}, ops


def test_grouped_matmul_kernels_lower(verified_modules):
    config = triton_gmm.TritonGroupedMatmulConfig()
    sizes = jnp.array([100, 0, 30], jnp.int32)
    lhs = jnp.ones((140, 96), jnp.bfloat16)
    rhs = jnp.ones((3, 96, 80), jnp.bfloat16)
    f = lambda a, b: triton_gmm.grouped_matmul(a, b, sizes, config=config)  # noqa: E731
    lower_for_gpu(value_and_grads(f, (0, 1)), lhs, rhs)
    assert len(verified_modules) == 3  # matmul, dLHS, transposed dRHS


def test_fused_gather_scatter_kernels_lower(verified_modules):
    config = triton_gmm.TritonGroupedMatmulConfig()
    tokens, top_k, experts = 40, 2, 3
    token_of = jnp.arange(tokens * top_k, dtype=jnp.int32) // top_k
    sizes = jnp.array([50, 0, 30], jnp.int32)

    def moe(x, w1, w2):
        lay = triton_gmm.layout(sizes, tokens * top_k, config.block_m)
        rows = lay.tokens(token_of, tokens)
        h = triton_gmm.gather_matmul(x, w1, lay, rows, config=config)
        scale = jnp.ones((lay.rows,), jnp.float32)
        return triton_gmm.matmul_scatter(h, w2, scale, lay, rows, tokens, config=config)

    x = jnp.ones((tokens, 64), jnp.bfloat16)
    w1 = jnp.ones((experts, 64, 32), jnp.bfloat16)
    w2 = jnp.ones((experts, 32, 64), jnp.bfloat16)
    lower_for_gpu(value_and_grads(moe, (0, 1, 2)), x, w1, w2)
    assert len(verified_modules) >= 5


def test_ssm_kernels_lower(verified_modules):
    seq, d, n = 100, 48, 16
    x, dt = jnp.ones((seq, d)), jnp.full((seq, d), 0.1)
    a, b, c = -jnp.ones((d, n)), jnp.ones((seq, n)), jnp.ones((seq, n))
    scan = functools.partial(triton_ssm.selective_scan, config=triton_ssm.SelectiveScanConfig())
    lower_for_gpu(value_and_grads(lambda *a: scan(*a)[0], (0, 1, 2, 3, 4)), x, dt, a, b, c,
                  jnp.zeros((d, n)))  # fmt: skip
    heads, kv_heads, dk, dv = 4, 2, 32, 32
    q, k = jnp.ones((seq, kv_heads, dk)), jnp.ones((seq, kv_heads, dk))
    v, decay = jnp.ones((seq, heads, dv)), -jnp.ones((seq, heads)) / 10
    linear = functools.partial(
        triton_ssm.chunked_linear_attention, config=triton_ssm.ChunkedLinearConfig()
    )
    lower_for_gpu(value_and_grads(lambda *a: linear(*a)[0], (0, 1, 2, 3)), q, k, v, decay,
                  jnp.zeros((heads, dk, dv)))  # fmt: skip
    for cfg in (
        triton_ssm.ChunkedLinearConfig(block_dv=16),
        triton_ssm.ChunkedLinearConfig(block_dv=16, chunk_parallel_backward=True),
    ):
        split = functools.partial(triton_ssm.chunked_linear_attention, config=cfg)
        lower_for_gpu(value_and_grads(lambda *a, f=split: f(*a)[0], (0, 1, 2, 3)), q, k, v,
                      decay, jnp.zeros((heads, dk, dv)))  # fmt: skip
    assert len(verified_modules) >= 9


@pytest.mark.parametrize(
    "mask, score_mod, d",
    [
        (masks.Causal() & masks.KVLengths(jnp.array([50, 129])), None, 128),
        (masks.LocalWindow(16, 16), biases.SoftCap(30.0), 64),
        (None, None, 256),
        (masks.Causal(), biases.ALiBi(jnp.asarray(biases.alibi_slopes(4))), 64),
    ],
    ids=["causal_kv_lengths_hd128", "window_softcap_hd64", "unmasked_hd256", "alibi_hd64"],
)
def test_tangent_kernel_lowers(verified_modules, mask, score_mod, d):
    """Forward mode's kernel at the launch an H200 would run (`tangent_config`); ALiBi's
    slopes with tangents (zeros: `t_score_mod` None)."""
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo

    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    q, k, v = qkv(d=d)
    call = AttentionCall.from_args(q.shape, k.shape, v.shape, q.dtype, mask, score_mod)
    config = triton_attention.tangent_config(
        triton_attention.default_config(call, h200), call, h200
    )
    assert not config.interpret

    def tangent(q, k, v, tq, tk, tv):
        return triton_attention.flash_tangent(
            q, k, v, tq, tk, tv, mask=mask, score_mod=score_mod, scale=0.125, config=config
        )

    lower_for_gpu(tangent, q, k, v, q, k, v)
    assert len(verified_modules) == 1
    # Keys and values of a fixed context: their tangents None, their products skipped.
    lower_for_gpu(lambda q, k, v, tq: tangent(q, k, v, tq, None, None), q, k, v, q)
    assert len(verified_modules) == 2
