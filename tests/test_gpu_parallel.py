"""GPU tests (`pytest --gpu`): the parallel paths' GPU lowerings on the devices there are.

On one GPU the ring has one step (every branch is still compiled) and the expert
exchange is a ragged all-to-all with itself; several GPUs run the real thing.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _attention_cases import make_qkv
from _check import check_against_oracle
from _parallel import mesh_of, ring
from _tolerance import assert_close
from probjax_eqx import MoE, masks
from probjax_eqx.expert_parallel import expert_parallel_moe

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_ring_attention_on_gpu_kernels(getkey, impl):
    mesh = mesh_of(context=jax.device_count())
    seq = 512 * mesh.size
    q, k, v = make_qkv(
        getkey(), batch=2, q_len=seq, kv_len=seq, q_heads=8, kv_heads=2, qk_dim=128,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    ct = jax.random.normal(getkey(), q.shape)
    f = ring(mesh, "zigzag", True, implementation=impl)
    check_against_oracle(f, q, k, v, ct, mask=masks.Causal())


@pytest.mark.parametrize("exchange", ["all_to_all", "gather"])
def test_expert_parallel_on_gpu(getkey, exchange):
    mesh = mesh_of(expert=jax.device_count())
    moe = MoE(512, 256, num_experts=8 * mesh.size, top_k=4, compute_dtype="bfloat16",
              key=getkey())  # fmt: skip
    x = jax.random.normal(getkey(), (1024 * mesh.size, 512))
    y, aux = eqx.filter_jit(expert_parallel_moe)(moe, x, mesh=mesh, exchange=exchange)
    y_ref, aux_ref = eqx.filter_jit(moe)(x)
    assert_close(y, y_ref, jnp.bfloat16)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
