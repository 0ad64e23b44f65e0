"""DiffusionTransformer: identity at init, equivariance, scan == loop, labels, bf16, grads."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from probjax_eqx.dit import DiffusionTransformer, DiTBlock


def randomize(model, key):
    """Give the zero-initialised (adaLN-Zero, output) layers random weights."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        jax.random.normal(k, x.shape, x.dtype) * 0.1
        if eqx.is_inexact_array(x) and not jnp.any(x)
        else x
        for k, x in zip(keys, leaves)
    ]
    return jax.tree.unflatten(treedef, leaves)


def test_blocks_start_as_identity(getkey):
    block = DiTBlock(16, 4, key=getkey())
    x, c = jax.random.normal(getkey(), (5, 16)), jax.random.normal(getkey(), (16,))
    np.testing.assert_array_equal(block(x, c), x)
    model = DiffusionTransformer(3, model_dim=16, num_heads=4, num_layers=2, key=getkey())
    np.testing.assert_array_equal(model(jnp.ones((7, 3)), 0.5), 0.0)  # zero output layer


def test_permutation_equivariance_without_positions(getkey):
    model = DiffusionTransformer(3, model_dim=16, num_heads=4, num_layers=2, compute_dtype=None,
                                 key=getkey())  # fmt: skip
    model = randomize(model, getkey())
    x = jax.random.normal(getkey(), (9, 3))
    perm = jax.random.permutation(getkey(), 9)
    np.testing.assert_allclose(model(x[perm], 0.3), model(x, 0.3)[perm], atol=1e-5)
    with_pos = randomize(
        DiffusionTransformer(3, model_dim=16, num_heads=4, num_layers=2, max_tokens=9,
                             compute_dtype=None, key=getkey()),
        getkey(),
    )  # fmt: skip
    assert not np.allclose(with_pos(x[perm], 0.3), with_pos(x, 0.3)[perm], atol=1e-3)


def test_scan_equals_loop_labels_context_and_bf16(getkey):
    key, rkey = getkey(), getkey()
    kwargs = dict(model_dim=16, num_heads=4, num_layers=3, num_classes=5, context_dim=6, key=key)

    def build(**extra):  # same key, same randomisation: the same parameters
        return randomize(DiffusionTransformer(3, **kwargs, **extra), rkey)

    scan, loop = build(compute_dtype=None), build(compute_dtype=None, scan_layers=False)
    x, ctx = jax.random.normal(getkey(), (8, 3)), jax.random.normal(getkey(), (4, 6))
    a = scan(x, 0.7, label=2, context=ctx)
    np.testing.assert_allclose(a, loop(x, 0.7, label=2, context=ctx), atol=1e-5)
    assert not np.allclose(a, scan(x, 0.7, label=3, context=ctx), atol=1e-4)
    b = build(compute_dtype="bfloat16")(x, 0.7, label=2, context=ctx)
    assert b.dtype == jnp.float32
    np.testing.assert_allclose(b, a, atol=5e-2, rtol=5e-2)


def test_jit_and_grad(getkey):
    model = DiffusionTransformer(2, model_dim=16, num_heads=4, num_layers=2, key=getkey())
    x = jax.random.normal(getkey(), (6, 2))

    @eqx.filter_jit
    def loss(m):
        return jnp.mean((m(x, 0.2) - x) ** 2)

    grads = eqx.filter_grad(loss)(model)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    # adaLN-Zero: at init only the output layer gets a gradient through the zero path.
    assert np.any(grads.out_proj.weight)
