import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _attention_cases import numpy_attention
from _tolerance import assert_close
from probjax_eqx import ISAB, MLA, RLA, SAB, Attention, Mamba, Mamba2, UnsupportedError, masks
from probjax_eqx.attention import rope


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_attention_module_matches_manual_projection(getkey, num_kv_heads):
    attn = Attention(32, 4, num_kv_heads=num_kv_heads, v_head_dim=6, output_dim=24, key=getkey())
    x = jax.random.normal(getkey(), (5, 32))
    out = attn(x, mask=masks.Causal())
    assert out.shape == (5, 24)
    q = (x @ attn.query_proj.weight.T).reshape(1, 5, 4, 8)
    k = (x @ attn.key_proj.weight.T).reshape(1, 5, num_kv_heads, 8)
    v = (x @ attn.value_proj.weight.T).reshape(1, 5, num_kv_heads, 6)
    o = numpy_attention(q, k, v, valid=np.tril(np.ones((5, 5), bool)))
    expected = o.reshape(5, 24) @ np.asarray(attn.output_proj.weight, np.float64).T
    np.testing.assert_allclose(out, expected, atol=1e-4, rtol=1e-4)


def test_cross_attention_rope_qk_norm_and_vmap(getkey):
    attn = Attention(
        16, 2, context_dim=12, rope_theta=1e4, qk_norm=True, use_bias=True, key=getkey()
    )
    x = jax.random.normal(getkey(), (3, 6, 16))
    ctx = jax.random.normal(getkey(), (3, 9, 12))
    lengths = jnp.array([9, 4, 1])
    out = jax.vmap(lambda x, c, n: attn(x, c, mask=masks.KVLengths(n)))(x, ctx, lengths)
    assert out.shape == (3, 6, 16) and np.all(np.isfinite(out))
    # Keys past a length never matter.
    poked = ctx.at[1, 4:].set(100.0)
    again = jax.vmap(lambda x, c, n: attn(x, c, mask=masks.KVLengths(n)))(x, poked, lengths)
    np.testing.assert_allclose(again[1], out[1], atol=1e-5)


def test_rope_is_a_rotation_with_relative_phase(getkey):
    x = jax.random.normal(getkey(), (6, 2, 8))
    y = rope(x)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    q, k = jax.random.normal(getkey(), (2, 1, 1, 8))

    def score(i, j):
        qs = rope(jnp.broadcast_to(q, (8, 1, 8)))[i]
        ks = rope(jnp.broadcast_to(k, (8, 1, 8)))[j]
        return jnp.sum(qs * ks)

    np.testing.assert_allclose(score(3, 1), score(6, 4), rtol=1e-4)


def test_grad_jit_and_scan_over_layers(getkey):
    keys = jax.random.split(getkey(), 3)
    layers = eqx.filter_vmap(lambda k: Attention(16, 4, num_kv_heads=2, key=k))(keys)
    params, static = eqx.partition(layers, eqx.is_array)
    x = jax.random.normal(getkey(), (7, 16))

    def forward(params, x):
        def body(h, p):
            layer = eqx.combine(p, static)
            return h + layer(h, mask=masks.Causal()), None

        return jax.lax.scan(body, x, params)[0]

    def loss(params):
        return jnp.mean(forward(params, x) ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
    unrolled = x
    for i in range(3):
        layer = eqx.combine(jax.tree.map(lambda p, i=i: p[i], params), static)
        unrolled = unrolled + layer(unrolled, mask=masks.Causal())
    np.testing.assert_allclose(forward(params, x), unrolled, atol=1e-5)
    grads2 = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2)))(
        Attention(16, 4, key=getkey())
    )
    assert np.all(np.isfinite(grads2.query_proj.weight))


def test_backend_resolved_at_construction(monkeypatch, getkey):
    monkeypatch.setenv("PROBJAX_ATTENTION_CUDNN", "0")
    attn = Attention(16, 2, key=getkey())
    monkeypatch.delenv("PROBJAX_ATTENTION_CUDNN")
    assert ("attention", "cudnn") in attn.backend.opt_outs.disabled
    choice = attn.explain(jnp.zeros((4, 16)), mask=masks.Causal())
    assert choice.kernel == "xla" or jax.devices()[0].platform == "gpu"
    pinned = Attention(16, 2, implementation="triton", key=getkey())
    with pytest.raises(UnsupportedError, match="triton"):
        pinned(jnp.zeros((4, 16)))


def test_compute_dtype_and_invalid_config(getkey):
    attn = Attention(16, 2, compute_dtype="bfloat16", key=getkey())
    x = jax.random.normal(getkey(), (4, 16))
    out = attn(x)
    assert out.dtype == jnp.float32
    ref = Attention(16, 2, key=getkey())
    ref = eqx.tree_at(
        lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj),
        ref,
        (attn.query_proj, attn.key_proj, attn.value_proj, attn.output_proj),
    )
    np.testing.assert_allclose(out, ref(x), atol=5e-2)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        Attention(12, 3, num_kv_heads=2, key=getkey())
    with pytest.raises(ValueError, match="even"):
        Attention(12, 4, rope_theta=1e4, key=getkey())


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_kv_cache_decoding_equals_the_causal_forward(getkey, impl):
    from probjax_eqx import KVCache
    from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

    # On the CPU the Triton kernels run in interpret mode, here split-KV and GQA-packed.
    config = None
    if impl == "triton":
        config = TritonAttentionConfig(block_q=16, block_k=16, num_splits=3, pack_gqa=True,
                                       interpret=True)  # fmt: skip
    key = getkey()
    x = jax.random.normal(getkey(), (11, 32))
    full = Attention(32, 4, num_kv_heads=2, rope_theta=1e4, key=key)(x, mask=masks.Causal())
    m = Attention(32, 4, num_kv_heads=2, rope_theta=1e4, implementation=impl, config=config,
                  key=key)  # fmt: skip
    cache = m.init_cache(16)
    assert isinstance(cache, KVCache)
    if impl == "xla":
        first, cache = m.prefill(x[:4], cache)
        rows, start = [first], 4
    else:  # the prompt's causal mask is no packed call: decode from the first token
        rows, start = [], 0
    step = eqx.filter_jit(m.decode_step)
    for t in range(start, 11):
        y, cache = step(x[t], cache)
        rows.append(y[None])
    assert int(cache.length) == 11
    assert_close(jnp.concatenate(rows), full, jnp.float32)


def _modules():
    """Each module of the package, built small, by `name -> (key -> module)`."""
    from probjax_eqx import MLA, RLA, Mamba, Mamba2, MoE
    from probjax_eqx.kernels.triton.grouped_matmul import TritonGroupedMatmulConfig
    from probjax_eqx.kernels.triton.ssm import ChunkedLinearConfig, SelectiveScanConfig

    gmm = TritonGroupedMatmulConfig(block_m=16, block_n=16, block_k=16, interpret=True)
    linear = ChunkedLinearConfig(chunk=16, interpret=True)
    return {
        "attention": lambda k: Attention(16, 2, key=k),
        "mla": lambda k: MLA(16, 2, kv_lora_rank=8, nope_dim=8, rope_dim=8, v_dim=8, key=k),
        "moe xla": lambda k: MoE(16, 24, num_experts=4, dispatch="xla", key=k),
        "moe fused_gsum": lambda k: MoE(16, 24, num_experts=4, dispatch="fused_gsum",
                                        dispatch_config=gmm, key=k),
        **{f"mamba {i}": (lambda k, i=i: Mamba(16, implementation=i, config=(
            SelectiveScanConfig(interpret=True) if i == "triton" else None), key=k))
           for i in ("scan", "associative", "triton")},
        **{f"mamba2 {i}": (lambda k, i=i: Mamba2(64, implementation=i, config=(
            linear if i == "triton" else None), key=k)) for i in ("scan", "chunked", "triton")},
        **{f"rla {i}": (lambda k, i=i: RLA(16, 2, window=4, implementation=i, linear_config=(
            linear if i == "triton" else None), key=k)) for i in ("scan", "chunked", "triton")},
    }  # fmt: skip


def _apply(name, module, x):
    """The module's output on `x` `[seq, width]` (the MoE's, without its statistics)."""
    return module(x)[0] if name.startswith("moe") else module(x)


def _width(name):
    return 64 if name.startswith("mamba2") else 16


@pytest.mark.parametrize("name", list(_modules()))
def test_sequence_modules_on_an_empty_sequence(getkey, name):
    # No steps: an empty output and an empty gradient, as for any other length.
    module, d = _modules()[name](getkey()), _width(name)
    x = jnp.zeros((0, d))
    assert _apply(name, module, x).shape == (0, d)
    assert jax.grad(lambda x: jnp.sum(_apply(name, module, x)))(x).shape == (0, d)


@pytest.mark.parametrize("module", ["attention", "mla"])
def test_kv_cache_capacity(getkey, module):
    # A prompt longer than the cache is refused; decoding past it gives NaN, never a
    # silent overwrite of the last slot.
    layer = _modules()[module](getkey())
    x = jax.random.normal(getkey(), (5, 16))
    with pytest.raises(ValueError, match="a prompt of 5 tokens does not fit a cache of 4"):
        layer.prefill(x, layer.init_cache(4))
    y, cache = layer.prefill(x[:3], layer.init_cache(4))
    assert np.all(np.isfinite(y))
    step = eqx.filter_jit(layer.decode_step)
    y, cache = step(x[3], cache)  # the fourth token fills the cache
    assert np.all(np.isfinite(y)) and int(cache.length) == 4
    y, cache = step(x[4], cache)
    assert np.all(np.isnan(y)) and int(cache.length) == 5


@pytest.mark.parametrize("name", list(_modules()))
def test_train_step_reruns_are_bitwise_identical(getkey, name):
    module = _modules()[name](getkey())
    x = jax.random.normal(getkey(), (20, _width(name)))
    step = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(_apply(name, m, x) ** 2)))
    first, second = (jax.tree.leaves(step(module, x)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


# Every sequence block as a user stacks it: layers built under eqx.filter_vmap, run by
# jax.lax.scan over their parameters, differentiated under jax.jit.
# Small blocks over 16-wide tokens, by class name.
BLOCKS = {
    "Attention": lambda k: Attention(16, 4, key=k),
    "MLA": lambda k: MLA(16, 2, kv_lora_rank=8, nope_dim=8, rope_dim=4, v_dim=8, key=k),
    "RLA": lambda k: RLA(16, 2, window=3, chunk=4, key=k),
    "Mamba": lambda k: Mamba(16, d_state=4, key=k),
    "Mamba2": lambda k: Mamba2(16, d_state=8, head_dim=8, chunk=4, key=k),
    "SAB": lambda k: SAB(16, 2, key=k),
    "ISAB": lambda k: ISAB(16, 2, 3, key=k),
}
STACKABLE = ["MLA", "RLA", "Mamba2", "SAB", "ISAB"]  # Attention, Mamba: tests of their own


@pytest.mark.parametrize("name", STACKABLE)
def test_scan_over_layers_equals_the_loop(getkey, name):
    """Forward and parameter gradients of three scanned layers equal the unrolled loop's."""
    layers = eqx.filter_vmap(BLOCKS[name])(jax.random.split(getkey(), 3))
    params, static = eqx.partition(layers, eqx.is_array)
    x = jax.random.normal(getkey(), (7, 16))

    def scanned(params):
        def body(h, p):
            return h + eqx.combine(p, static)(h), None

        return jax.lax.scan(body, x, params)[0]

    def unrolled(params):
        h = x
        for i in range(3):
            h = h + eqx.combine(jax.tree.map(lambda p, i=i: p[i], params), static)(h)
        return h

    loss = lambda f: lambda p: jnp.mean(f(p) ** 2)  # noqa: E731
    assert_close(jax.jit(scanned)(params), jax.jit(unrolled)(params), jnp.float32)
    got = jax.jit(jax.grad(loss(scanned)))(params)
    want = jax.jit(jax.grad(loss(unrolled)))(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, jnp.float32, grad=True)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_rematerialised_layers_give_the_same_gradients(getkey, implementation):
    """Layers under eqx.filter_checkpoint (recomputed in the backward, as users train deep
    stacks) give the gradients of the plain stack, our kernels' custom VJPs included."""
    from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

    config = TritonAttentionConfig(interpret=True) if implementation == "triton" else None
    layers = eqx.filter_vmap(
        lambda k: Attention(
            16, 4, num_kv_heads=2, implementation=implementation, config=config, key=k
        )
    )(jax.random.split(getkey(), 2))
    params, static = eqx.partition(layers, eqx.is_array)
    x = jax.random.normal(getkey(), (9, 16))

    def loss(params, remat):
        def layer(h, p):
            return h + eqx.combine(p, static)(h, mask=masks.Causal())

        body = eqx.filter_checkpoint(layer) if remat else layer
        return jnp.mean(jax.lax.scan(lambda h, p: (body(h, p), None), x, params)[0] ** 2)

    got = jax.jit(jax.grad(loss), static_argnums=1)(params, True)
    want = jax.jit(jax.grad(loss), static_argnums=1)(params, False)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, jnp.float32, grad=True)


# The name an input error gives -> the block that raises it (SAB's MAB checks its input).
INPUT_CHECKED = {"Attention": "Attention", "MLA": "MLA", "RLA": "RLA", "Mamba": "Mamba",
                 "Mamba2": "Mamba2", "MAB": "SAB"}  # fmt: skip


@pytest.fixture
def without_boundary_checks():
    """As in production: the jaxtyping / beartype boundary checks of the tests off."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.mark.parametrize("name", INPUT_CHECKED)
def test_a_batched_or_misshaped_input_is_refused_with_the_fix(
    getkey, name, without_boundary_checks
):
    """The unbatched modules name the shape they take, and for a leading batch axis
    point to jax.vmap, instead of failing deep inside on a matmul or reshape."""
    module = BLOCKS[INPUT_CHECKED[name]](getkey())
    takes = rf"^{name} takes x of shape "
    batch = r"; the leading axis looks like a batch: .* jax.vmap$"
    with pytest.raises(ValueError, match=takes + r"\[rows, 16\], got \(2, 9, 16\)" + batch):
        module(jnp.zeros((2, 9, 16)))
    with pytest.raises(ValueError, match=takes + r"\[rows, 16\], got \(9, 8\)$"):
        module(jnp.zeros((9, 8)))
    if hasattr(module, "decode_step"):
        cache = module.init_cache(4) if name in ("Attention", "MLA") else module.init_cache()
        with pytest.raises(ValueError, match=takes + r"\[16\], got \(1, 16\)" + batch):
            module.decode_step(jnp.zeros((1, 16)), cache)
