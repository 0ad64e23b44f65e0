"""Our Mosaic GPU kernels lower for the GPU, on the CPU.

The Mosaic GPU interpreter (the CPU tests) runs a kernel's semantics, not its lowering:
a primitive or a memory view without a GPU lowering rule passes there and fails on the
GPU. Lowering for "cuda" builds each kernel's Mosaic GPU module here, without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from probjax_eqx import biases, masks
from probjax_eqx.kernels.mosaic import attention as mosaic_attention
from probjax_eqx.kernels.mosaic import grouped_matmul as mosaic_gmm


def lower_value_and_grads(f, argnums, *args):
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
    lowered = jax.jit(jax.value_and_grad(loss, argnums)).trace(*args)
    return lowered.lower(lowering_platforms=("cuda",)).as_text()


FA3_GPU = dict(p_in_registers=True, transposed_views=True, pingpong=True, overlap_softmax=True,
               memory_registers=24, block_q_dq=128)  # fmt: skip

CASES = {
    "plain": None,
    "causal": masks.Causal(),
    "kv_lengths": masks.KVLengths(jnp.array([50, 129])),
    "window": masks.LocalWindow(16, 16),
}


@pytest.mark.parametrize("mask", CASES.values(), ids=CASES.keys())
# FA3's forward register split with ping-pong or intra-warpgroup overlap; the backward's
# two compute warpgroups; FA3's register operands and transposed views.
@pytest.mark.parametrize(
    "tuned",
    [
        {},
        dict(memory_registers=40, pingpong=True),
        dict(memory_registers=24, overlap_softmax=True),
        dict(block_k_dkv=128, block_q_dq=128),
        # P, P^T, dS^T, dS from registers (GPU only: the interpreter cannot run it).
        dict(p_in_registers=True, pingpong=True, memory_registers=40),
        # FA3's whole forward (the GPU's default since run 47); ping-pong turns on
        # mbarriers instead of named barriers.
        dict(block_k_dkv=128, **FA3_GPU),
        dict(pingpong=True, named_turns=False, overlap_softmax=True, memory_registers=24),
        dict(p_in_registers=True, overlap_softmax=True, block_k_dkv=128, block_q_dq=128),
        # Transposed operands as SMEM views (GPU or jax >= 0.11's interpreter).
        dict(transposed_views=True),
        dict(transposed_views=True, p_in_registers=True, block_k_dkv=128, block_q_dq=128),
        # dQ in the dK/dV kernel: TMA reductions, named barriers, K^T from views.
        dict(fused_dq=True, block_k_dkv=128),
        dict(fused_dq=True, block_k_dkv=128, **FA3_GPU),
        # Every kernel's programs in groups of (batch, head) pairs (`launch_group`): 1, the
        # grid's own order; 3, remapped in the kernel.
        dict(launch_group=1, fused_dq=True, block_k_dkv=128, approx_math=True, **FA3_GPU),
        dict(launch_group=3, block_k_dkv=128),
        # FA3's backward register split: 24 registers for the TMA warpgroup.
        dict(fused_dq=True, block_k_dkv=128, backward_memory_registers=24, **FA3_GPU),
    ],
)
def test_attention_kernels_lower(mask, tuned):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 100, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, 129, 2, 64), jnp.bfloat16) for kk in keys[1:])
    config = mosaic_attention.MosaicAttentionConfig(**tuned)
    f = functools.partial(
        mosaic_attention.flash_attention, mask=mask, score_mod=None, scale=0.125, config=config
    )
    assert "mosaic_gpu" in lower_value_and_grads(f, (0, 1, 2), q, k, v)


@pytest.mark.parametrize("tuned", [{}, dict(p_in_registers=True, overlap_softmax=True)])
def test_softcap_lowers(tuned):
    """SoftCap's tanh and its derivative inside the forward and both backward kernels."""
    q = k = v = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    config = mosaic_attention.MosaicAttentionConfig(**tuned)
    f = functools.partial(
        mosaic_attention.flash_attention,
        mask=masks.Causal(),
        score_mod=biases.SoftCap(30.0),
        scale=0.125,
        config=config,
    )
    assert "mosaic_gpu" in lower_value_and_grads(f, (0, 1, 2), q, k, v)


@pytest.mark.parametrize("approx_math", [False, True])
def test_approx_math_reaches_every_kernel(approx_math):
    """`approx_math` compiles exp2 and SoftCap's tanh to the approximate instructions in
    the forward, dK/dV and dQ kernels (three each); without it, to none."""
    q = k = v = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    config = mosaic_attention.MosaicAttentionConfig(approx_math=approx_math)
    f = functools.partial(
        mosaic_attention.flash_attention, mask=masks.Causal(), score_mod=biases.SoftCap(30.0),
        scale=0.125, config=config,
    )  # fmt: skip
    lowered = lower_value_and_grads(f, (0, 1, 2), q, k, v)
    expected = 3 if approx_math else 0
    assert lowered.count("ex2.approx") == lowered.count("tanh.approx") == expected


@pytest.mark.parametrize("block_m", [64, 128])  # 128: two compute warpgroups and a TMA one
def test_grouped_matmul_kernels_lower(block_m):
    config = mosaic_gmm.MosaicGroupedMatmulConfig(block_m=block_m)
    sizes = jnp.array([100, 0, 30], jnp.int32)
    f = lambda a, b: mosaic_gmm.grouped_matmul(a, b, sizes, config=config)  # noqa: E731
    lhs, rhs = jnp.ones((130, 64), jnp.bfloat16), jnp.ones((3, 64, 128), jnp.bfloat16)
    assert "mosaic_gpu" in lower_value_and_grads(f, (0, 1), lhs, rhs)


def test_a_config_that_just_fits_lowers():
    """Mosaic's own shared-memory check agrees with `smem_bytes` at the edge.

    At head_dim 128 three stages with P in registers leave the forward 1,928 bytes of the
    limit: the 2 KiB Pallas sets aside for cross-warp reductions by default (run 43 on the
    H200) would not fit.
    """
    tuned = dict(block_k_dkv=128, block_q_dq=128, transposed_views=True, p_in_registers=True,
                 num_stages=3)  # fmt: skip
    config = mosaic_attention.MosaicAttentionConfig(**tuned)
    need = mosaic_attention.smem_bytes(config, 128, 128)
    assert mosaic_attention.smem_refusal(need) is None and need["forward"] > 230_000
    q = k = v = jnp.ones((1, 256, 1, 128), jnp.bfloat16)
    f = functools.partial(
        mosaic_attention.flash_attention, mask=None, score_mod=None, scale=0.125, config=config
    )
    assert "mosaic_gpu" in lower_value_and_grads(f, (0, 1, 2), q, k, v)


def test_fused_dq_lowers_under_vmap_at_head_dim_128():
    """`fused_dq`'s kernel takes its float32 accumulator as an aliased ref, batched by
    a vmapped axis as a leading grid axis (`accumulating_kernel`), nested vmaps too."""
    config = mosaic_attention.MosaicAttentionConfig(fused_dq=True, block_k_dkv=128, **FA3_GPU)
    q = k = v = jnp.ones((3, 2, 1, 130, 2, 128), jnp.bfloat16)
    f = functools.partial(
        mosaic_attention.flash_attention, mask=masks.Causal(), score_mod=None, scale=0.125,
        config=config,
    )  # fmt: skip
    lowered = lower_value_and_grads(jax.vmap(jax.vmap(f)), (0, 1, 2), q, k, v)
    assert "mosaic_gpu" in lowered and "output_operand_alias" in lowered


def test_fused_dq_shared_memory_is_counted_as_mosaic_counts_it():
    """Mosaic's own count, from its refusal of a config over the limit: the staged
    `fused_dq` layout at head dim 128 (the interpreter's; the GPU's takes views)."""
    config = mosaic_attention.MosaicAttentionConfig(fused_dq=True, block_k_dkv=128)
    need = mosaic_attention.smem_bytes(config, 128, 128)["dkv"]
    q = k = v = jnp.ones((1, 128, 1, 128), jnp.bfloat16)
    f = functools.partial(
        mosaic_attention.flash_attention, mask=None, score_mod=None, scale=0.125, config=config
    )
    with pytest.raises(ValueError, match=f"smem_bytes={need} > "):
        lower_value_and_grads(f, (0, 1, 2), q, k, v)
