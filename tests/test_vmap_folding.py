"""`vmap` over flash attention: its axis folds into the kernels' batch, planned for it.

Equinox modules are unbatched and vmapped, so a kernel traced under `vmap` sees one
example; `_flash.attend` folds the mapped axis into the call's batch and plans the
kernels for the whole batch, as the batched call would.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from _check import all_eqns
from _tolerance import assert_close
from probjax_eqx import biases, dot_product_attention, masks, resolve
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels.mosaic.attention import MosaicAttentionConfig
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

MAPPED, BATCH = 3, 2
CONFIGS = {
    "triton": TritonAttentionConfig(
        block_q=16, block_k=16, num_splits=2, pack_gqa=True, interpret=True
    ),
    "mosaic": MosaicAttentionConfig(block_k=64, interpret=True),
}
H100 = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", "sm_90")


def grids(fn, *args) -> list[tuple]:
    """The grid of every kernel in `fn`'s jaxpr, in order (Triton's pallas_call, Mosaic
    GPU's kernel meshes)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = []
    for eqn in all_eqns(jaxpr):
        if "grid_mapping" in eqn.params:
            found.append(tuple(eqn.params["grid_mapping"].grid))
        meshes = eqn.params.get("meshes") or [eqn.params.get("mesh")]
        found += [tuple(m.grid) for m in meshes if hasattr(m, "grid")]
    return found


def operands(key, shape, dtype, mapped=MAPPED):
    """`q, k, v` of `[mapped, batch, seq, heads, dim]` and per-example KV lengths."""
    batch, q_len, kv_len, heads, kv_heads, d = shape
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (mapped, batch, q_len, heads, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (mapped, batch, kv_len, kv_heads, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (mapped, batch, kv_len, kv_heads, d), jnp.float32).astype(dtype)
    lengths = jnp.arange(mapped * batch, dtype=jnp.int32).reshape(mapped, batch) * 7 % (kv_len + 1)
    return q, k, v, lengths  # one row without keys: length 0


def attend(q, k, v, lengths, *, implementation, config=None, mask=None):
    mask = masks.KVLengths(lengths) if mask is None else mask & masks.KVLengths(lengths)
    return dot_product_attention(q, k, v, mask=mask, implementation=implementation, config=config)


# Mosaic's interpreter runs every program of the grid: fewer of them.
@pytest.mark.parametrize("impl, mapped, batch", [("triton", MAPPED, BATCH), ("mosaic", 2, 1)])
def test_vmapped_kernels_run_once_over_the_folded_batch(getkey, impl, mapped, batch):
    dtype = jnp.float32 if impl == "triton" else jnp.bfloat16
    q, k, v, lengths = operands(getkey(), (batch, 5, 37, 4, 2, 32), dtype, mapped)
    mask = None if impl == "triton" else masks.Causal()  # GQA packing: masks of keys only
    ours = functools.partial(attend, implementation=impl, config=CONFIGS[impl], mask=mask)
    ref = functools.partial(attend, implementation="xla", mask=mask)

    def loss(f):
        return lambda q, k, v, lengths: jnp.sum(f(q, k, v, lengths).astype(jnp.float32) ** 2)

    # Jitted: op by op, the interpreted kernels' surroundings each compile alone.
    got = jax.jit(jax.vmap(ours))(q, k, v, lengths)
    assert_close(got, jax.jit(jax.vmap(ref))(q, k, v, lengths), dtype)
    grad = functools.partial(jax.grad, argnums=(0, 1, 2))
    expected = jax.jit(jax.vmap(grad(loss(ref))))(q, k, v, lengths)
    got_vmap_of_grad = jax.jit(jax.vmap(grad(loss(ours))))(q, k, v, lengths)
    grad_of_vmap = grad(lambda *a: jnp.sum(jax.vmap(loss(ours))(*a, lengths)))
    got_grad_of_vmap = jax.jit(grad_of_vmap)(q, k, v)
    for got in (got_vmap_of_grad, got_grad_of_vmap):
        for g, e in zip(got, expected):
            assert_close(g, e, dtype, grad=True)
    # Every kernel of the forward and the backward runs once over mapped x batch rows:
    # no grid axis of the map's own.
    for fn in (jax.vmap(ours), jax.vmap(grad(loss(ours)))):
        found = grids(fn, q, k, v, lengths)
        assert found and all(mapped * batch in (g[0], g[-1]) for g in found), found
        assert all(len(g) == 3 for g in found), found


def test_nested_vmaps_fold_into_one_batch(getkey):
    q, k, v, lengths = operands(getkey(), (1, 5, 21, 4, 2, 16), jnp.float32)
    cfg = CONFIGS["triton"]

    def one(q, k, v, length):  # unbatched, as a module calls it
        out = attend(q[None], k[None], v[None], length[None], implementation="triton", config=cfg)
        return out[0]

    nested = jax.vmap(jax.vmap(one))  # over [mapped, 1] examples
    expected = jax.vmap(functools.partial(attend, implementation="xla"))(q, k, v, lengths)
    assert_close(nested(q, k, v, lengths), expected, jnp.float32)
    assert all(len(g) == 3 for g in grids(nested, q, k, v, lengths))
    # Lengths shared by the mapped examples fold too (broadcast: they are small).
    shared = jax.vmap(functools.partial(attend, implementation="triton", config=cfg),
                      in_axes=(0, 0, 0, None))  # fmt: skip
    expected = jax.vmap(functools.partial(attend, implementation="xla"), in_axes=(0, 0, 0, None))
    assert_close(shared(q, k, v, lengths[1]), expected(q, k, v, lengths[1]), jnp.float32)
    assert all(len(g) == 3 for g in grids(shared, q, k, v, lengths[1]))


def test_unfoldable_maps_run_as_pallas_batches_them(getkey):
    # K/V shared by every mapped example (folding would copy them) and per-example ALiBi
    # slopes (a head operand): pallas_call's own batching, an extra grid axis.
    q, k, v, lengths = operands(getkey(), (BATCH, 5, 37, 4, 2, 16), jnp.float32)
    cfg = CONFIGS["triton"]
    ours = functools.partial(attend, implementation="triton", config=cfg)
    ref = functools.partial(attend, implementation="xla")
    shared = jax.vmap(ours, in_axes=(0, None, None, None))
    expected = jax.vmap(ref, in_axes=(0, None, None, None))(q, k[0], v[0], lengths[0])
    assert_close(jax.jit(shared)(q, k[0], v[0], lengths[0]), expected, jnp.float32)
    assert any(len(g) == 4 for g in grids(shared, q, k[0], v[0], lengths[0]))

    slopes = jnp.linspace(0.1, 0.8, MAPPED * 4).reshape(MAPPED, 4)

    def with_alibi(impl, config):
        def f(q, k, v, slopes):
            return dot_product_attention(
                q, k, v, bias=biases.ALiBi(slopes), implementation=impl, config=config
            )

        return f

    tri = TritonAttentionConfig(backward_pass_impl="triton_split", interpret=True)
    results = {}
    for impl, config in (("triton", tri), ("xla", None)):
        f = with_alibi(impl, config)
        grad = jax.grad(lambda *a, f=f: jnp.sum(f(*a) ** 2), (0, 3))
        results[impl] = (
            jax.jit(jax.vmap(f))(q, k, v, slopes),
            *jax.jit(jax.vmap(grad))(q, k, v, slopes),
        )
    for got, expected in zip(results["triton"], results["xla"]):
        assert_close(got, expected, jnp.float32, grad=True)


@pytest.mark.parametrize(
    "shape, mask",
    [
        # decoding: one query per example, 32 heads over 8, lengths per example
        ((1, 8192, 32, 8, 128), "kv_lengths"),
        # inducing points over a long set (ISAB): 128 queries over 4096 keys at hd 32
        ((128, 4096, 4, 4, 32), None),
    ],
)
def test_vmap_plans_as_the_batched_call(shape, mask):
    # On a (simulated) H100, vmapping a one-example call runs the kernels, split counts
    # and grids of the batched call, forward and backward.
    backend = resolve("attention", device=H100, environ={})
    q_len, kv_len, heads, kv_heads, d = shape
    batch = 8
    q = jax.ShapeDtypeStruct((batch, q_len, heads, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, d), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def call(q, k, v, lengths):
        m = masks.KVLengths(lengths) if mask else None
        return dot_product_attention(q, k, v, mask=m, implementation=backend)

    def one(q, k, v, length):
        return call(q[None], k[None], v[None], length[None])[0]

    def train(f):
        return jax.grad(lambda q, k, v, n: jnp.sum(f(q, k, v, n).astype(jnp.float32)), (0, 1, 2))

    for batched, mapped in ((call, jax.vmap(one)), (train(call), jax.vmap(train(one)))):
        expected = grids(batched, q, k, k, lengths)
        assert expected and grids(mapped, q, k, k, lengths) == expected


def test_module_explain_shows_the_vmapped_batch_plan(monkeypatch):
    # A cross-attention module built on a (simulated) H100, one query over 8192 keys:
    # vmapped over 8 examples its kernels split the keys as the plan for batch 8 says,
    # which `explain(..., batch=8)` reports.
    from probjax_eqx import Attention
    from probjax_eqx import attention as attention_module

    backend = resolve("attention", device=H100, environ={})
    monkeypatch.setattr(attention_module, "resolve", lambda *args, **kwargs: backend)
    attn = Attention(4096, 32, num_kv_heads=8, head_dim=128, compute_dtype="bfloat16",
                     key=jax.random.key(0))  # fmt: skip
    assert attn.backend is backend
    x = jax.ShapeDtypeStruct((1, 4096), jnp.float32)
    context = jax.ShapeDtypeStruct((8192, 4096), jnp.float32)
    one, eight = (attn.explain(x, context, batch=n).config for n in (1, 8))
    assert one.num_splits != eight.num_splits  # the plan depends on the batch
    xs = jax.ShapeDtypeStruct((8, *x.shape), x.dtype)
    contexts = jax.ShapeDtypeStruct((8, *context.shape), context.dtype)
    forward = grids(jax.vmap(attn), xs, contexts)[0]  # the split forward: (splits, heads, batch)
    assert forward == (eight.num_splits, 8, 8)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        attn.explain(x, context, batch=0)


def test_a_folded_batch_that_selection_refuses_keeps_the_examples_config():
    from probjax_eqx.attention import _describe, _planner
    from probjax_eqx.backends import Backend, UnsupportedError

    class Refusing(Backend):
        def select(self, call, config=None):
            raise UnsupportedError("triton", "refused for the test")

    q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16)
    backend = resolve("attention", device=H100, environ={})
    choice = backend.select(_describe(q, k, k, None, None))
    refusing = Refusing(**{f.name: getattr(backend, f.name) for f in dataclasses.fields(backend)})
    plan = _planner(choice, _describe(q, k, k, None, None), refusing, None)
    q8, k8 = (jax.ShapeDtypeStruct((8, *x.shape[1:]), x.dtype) for x in (q, k))
    assert plan(q8, k8, k8, None, None) is choice.config
