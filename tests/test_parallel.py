"""Sharded layouts on 8 CPU devices (conftest sets them): each must match one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _check import check_against_oracle, check_higher_derivatives, float_row_scatters
from _parallel import mesh_of, ring
from _tolerance import assert_close
from probjax_eqx import Attention, MoE, UnsupportedError, dot_product_attention, masks
from probjax_eqx import expert_parallel as ep
from probjax_eqx import moe as moe_module
from probjax_eqx.expert_parallel import expert_parallel_moe
from probjax_eqx.kernels.mosaic.attention import MosaicAttentionConfig
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig
from probjax_eqx.kernels.triton.grouped_matmul import TritonGroupedMatmulConfig
from probjax_eqx.ring_attention import zigzag_permutation
from probjax_eqx.sharding import data_parallel, fsdp_specs, replicated_specs, shard, value_and_grad


def _qkv(getkey, batch, seq, heads, kv_heads, dim, dtype):
    shapes = [(batch, seq, heads, dim), (batch, seq, kv_heads, dim), (batch, seq, kv_heads, dim)]
    q, k, v = (jax.random.normal(getkey(), s).astype(dtype) for s in shapes)
    return q, k, v, jax.random.normal(getkey(), (batch, seq, heads, dim))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_matches_one_device(getkey, layout, causal):
    mesh = mesh_of(context=4)
    q, k, v, ct = _qkv(getkey, 2, 40, 4, 2, 16, jnp.float32)  # GQA, 10 positions a device
    mask = masks.Causal() if causal else None
    f = ring(mesh, layout, causal, implementation="xla")
    check_against_oracle(f, q, k, v, ct, mask=mask)


def test_ring_attention_batch_and_context_axes(getkey):
    mesh = mesh_of(data=2, context=4)
    q, k, v, ct = _qkv(getkey, 2, 32, 2, 2, 8, jnp.float32)
    f = ring(mesh, "zigzag", True, batch_axis="data", implementation="xla")
    check_against_oracle(f, q, k, v, ct, mask=masks.Causal())


# The Mosaic GPU interpreter keeps global per-device state that two devices of one
# program trip over ("Barrier remains allocated", then a hang), so its ring runs on one
# device: one step, whose lax.switch still builds every step's kernels. More devices
# run on GPUs (`test_gpu_parallel.py`).
@pytest.mark.parametrize(
    "impl, config, dtype, devices",
    [
        ("triton", TritonAttentionConfig(interpret=True), jnp.float32, 2),
        ("mosaic", MosaicAttentionConfig(interpret=True), jnp.bfloat16, 1),
    ],
)
def test_ring_attention_on_our_kernels(getkey, impl, config, dtype, devices):
    """The kernels' block halves (forward with lse, backward given lse) in the ring; the
    slices are off the kernels' tiles (24 positions a device with 2 devices)."""
    mesh = mesh_of(context=devices)
    q, k, v, ct = _qkv(getkey, 1, 48, 2, 1, 16, dtype)
    f = ring(mesh, "zigzag", True, implementation=impl, config=config)
    check_against_oracle(f, q, k, v, ct, mask=masks.Causal())


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_higher_derivatives(getkey, layout):
    """Beyond the ring's first-order VJP (forward mode, a gradient penalty, Hessian-vector
    products either way round): one device's, through the gathered-key reference."""
    mesh = mesh_of(context=4)
    q, k, v, _ = _qkv(getkey, 1, 16, 2, 1, 8, jnp.float32)
    f = ring(
        mesh, layout, True, implementation="triton", config=TritonAttentionConfig(interpret=True)
    )
    one = lambda q, k, v: dot_product_attention(q, k, v, mask=masks.Causal(), implementation="xla")  # noqa: E731
    check_higher_derivatives(f, one, q, k, v)


def test_ring_attention_refuses_cudnn_by_name(getkey):
    q, k, v, _ = _qkv(getkey, 1, 16, 2, 2, 8, jnp.bfloat16)
    with pytest.raises(UnsupportedError, match="forward-with-lse"):
        ring(mesh_of(context=2), "contiguous", False, implementation="cudnn")(q, k, v)


def test_zigzag_permutation_balances_chunks():
    perm = zigzag_permutation(16, 2)
    np.testing.assert_array_equal(perm.reshape(4, 4)[:, 0], [0, 12, 4, 8])
    with pytest.raises(ValueError, match="divisible"):
        zigzag_permutation(10, 4)


def _moe(getkey, **kwargs):
    return MoE(16, 24, num_experts=8, top_k=3, shared_d_ff=8, key=getkey(), **kwargs)


def _emulated_ragged_all_to_all(x, out, in_off, send, out_off, recv, *, axis_name):
    """`ragged_all_to_all` from `all_gather`s, for XLA:CPU which lacks it."""
    del recv
    me = jax.lax.axis_index(axis_name)
    xs, ins, sends, outs = (jax.lax.all_gather(a, axis_name) for a in (x, in_off, send, out_off))
    rows = jnp.arange(x.shape[0])
    for sender in range(xs.shape[0]):
        start, count = ins[sender, me], sends[sender, me]
        dest = jnp.where(
            (rows >= start) & (rows < start + count), outs[sender, me] + rows - start, out.shape[0]
        )
        out = out.at[dest].set(xs[sender], mode="drop")
    return out


@pytest.mark.parametrize("exchange", ["gather", "all_to_all"])
@pytest.mark.parametrize("axes", [dict(expert=4), dict(data=2, expert=4)])
def test_expert_parallel_matches_one_device(getkey, monkeypatch, exchange, axes):
    if exchange == "all_to_all":
        monkeypatch.setattr(ep, "_ragged_all_to_all", _emulated_ragged_all_to_all)
        monkeypatch.setattr(ep, "_ragged_supported", lambda platform: True)
    moe = _moe(getkey)
    mesh = mesh_of(**axes)
    x = jax.random.normal(getkey(), (64, 16))
    ct = jax.random.normal(getkey(), (64, 16))

    def loss(run):
        def f(moe, x):
            y, aux = run(moe, x)
            return jnp.sum(y * ct) + aux.load_balancing_loss + aux.router_z_loss

        return f

    def sharded(moe, x):
        return expert_parallel_moe(moe, x, mesh=mesh, exchange=exchange)

    (y, aux), (y1, aux1) = eqx.filter_jit(sharded)(moe, x), eqx.filter_jit(moe)(x)
    assert_close(y, y1, jnp.float32)
    for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(aux1)):
        assert_close(a, b, jnp.float32)
    got = eqx.filter_jit(eqx.filter_grad(loss(sharded)))(moe, x)
    want = eqx.filter_jit(eqx.filter_grad(loss(lambda m, x: m(x))))(moe, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, jnp.float32, grad=True)
    if exchange == "gather":  # rows move by gathers both ways (the emulated a2a scatters)
        step = jax.make_jaxpr(eqx.filter_grad(loss(sharded)))(moe, x)
        assert float_row_scatters(step.jaxpr, width=16) == []


def test_expert_parallel_on_the_triton_grouped_matmul(getkey):
    """Our kernels per shard: worst-case buffers whose row tiles past the groups are
    skipped."""
    config = TritonGroupedMatmulConfig(block_m=16, block_n=16, block_k=16, interpret=True)
    moe = _moe(getkey, dispatch="triton", dispatch_config=config)
    x = jax.random.normal(getkey(), (32, 16))
    y, _ = eqx.filter_jit(expert_parallel_moe)(moe, x, mesh=mesh_of(expert=2), exchange="gather")
    assert_close(y, moe(x)[0], jnp.float32)


def test_expert_parallel_skewed_routing_is_dropless(getkey):
    """Every token to experts of one device: its buffer holds all of them."""
    moe = _moe(getkey)
    moe = eqx.tree_at(lambda m: m.router, moe, moe.router.at[:, :3].add(100.0))
    x = jnp.abs(jax.random.normal(getkey(), (32, 16))) + 0.1  # logits of experts 0-2 >> rest
    run = eqx.filter_jit(expert_parallel_moe)
    y, aux = run(moe, x, mesh=mesh_of(expert=4), exchange="gather")
    assert int(aux.tokens_per_expert[:3].sum()) == 32 * 3
    assert_close(y, eqx.filter_jit(moe)(x)[0], jnp.float32)


def test_expert_parallel_runs_auto_dispatch_that_resolved_to_fused(getkey, monkeypatch):
    """On GPUs "auto" is fused_gsum on one device; expert parallelism runs it sorted."""
    monkeypatch.setitem(moe_module.AUTO_DISPATCH, "generic", "fused_gsum")
    config = TritonGroupedMatmulConfig(block_m=16, block_n=16, block_k=16, interpret=True)
    moe = _moe(getkey, dispatch_config=config)
    assert moe.dispatch_mode == "fused_gsum" and moe.dispatch_request == "auto"
    x = jax.random.normal(getkey(), (32, 16))
    y, _ = eqx.filter_jit(expert_parallel_moe)(moe, x, mesh=mesh_of(expert=2), exchange="gather")
    assert_close(y, eqx.filter_jit(moe)(x)[0], jnp.float32)


def test_expert_parallel_refusals(getkey):
    x = jnp.ones((16, 16))
    with pytest.raises(UnsupportedError, match="ragged all-to-all"):
        expert_parallel_moe(_moe(getkey), x, mesh=mesh_of(expert=4), exchange="all_to_all")
    with pytest.raises(ValueError, match="multiple of"):
        expert_parallel_moe(_moe(getkey), x, mesh=mesh_of(expert=3))
    with pytest.raises(UnsupportedError, match="sorted dispatch"):
        expert_parallel_moe(_moe(getkey, dispatch="fused_gsum"), x, mesh=mesh_of(expert=4))


def test_fsdp_specs_shard_large_params_and_match_one_device(getkey):
    model = eqx.nn.MLP(16, 4, 64, 2, key=getkey())
    mesh = mesh_of(data=8)
    specs = fsdp_specs(model, mesh, axis="data", min_size=256)
    layers = specs.layers
    assert [layer.weight for layer in layers] == [P("data"), P("data"), P(None, "data")]
    assert [layer.bias for layer in layers] == [P(), P(), P()]  # under min_size
    sharded = shard(model, mesh, specs)
    weight = sharded.layers[1].weight
    assert isinstance(weight.sharding, NamedSharding) and weight.sharding.spec != P()
    x = jax.random.normal(getkey(), (32, 16))
    x = jax.device_put(x, data_parallel(mesh, "data"))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(sharded, x)
    want = eqx.filter_value_and_grad(loss)(model, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, jnp.float32)


@pytest.mark.parametrize("layout", ["fsdp", "replicated"])
def test_shard_map_value_and_grad_matches_one_device(getkey, layout):
    """Per-device losses under `shard_map` (our kernels see local shapes): FSDP gathers
    and reduce-scatters, replicated parameters average."""
    model = eqx.nn.MLP(16, 4, 64, 2, key=getkey())
    mesh = mesh_of(data=4, model=2)
    if layout == "fsdp":
        specs = fsdp_specs(model, mesh, axis="data", min_size=256)
    else:
        specs = replicated_specs(model)
    x = jax.random.normal(getkey(), (32, 16))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    f = value_and_grad(loss, mesh, specs, batch_axes=("data", "model"))
    got = eqx.filter_jit(f)(shard(model, mesh, specs), x)
    want = eqx.filter_value_and_grad(loss)(model, x)
    assert_close(got[0], want[0], jnp.float32)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert_close(a, b, jnp.float32, grad=True)


def test_shard_map_value_and_grad_runs_our_kernels_per_device(getkey):
    attention = Attention(16, 2, implementation="triton", config=TritonAttentionConfig(
        interpret=True), key=getkey())  # fmt: skip
    mesh = mesh_of(data=2)
    x = jax.random.normal(getkey(), (4, 24, 16))

    def loss(m, x):
        return jnp.mean(jax.vmap(lambda s: m(s, mask=masks.Causal()))(x) ** 2)

    specs = replicated_specs(attention)
    got = eqx.filter_jit(value_and_grad(loss, mesh, specs))(attention, x)
    want = eqx.filter_value_and_grad(loss)(attention, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, jnp.float32, grad=True)
