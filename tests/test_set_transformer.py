"""Set-transformer blocks: permutation equivariance / invariance and padded sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_eqx.attention import ISAB, MAB, PMA, SAB


def blocks(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "sab": SAB(16, 4, key=k1),
        "isab": ISAB(16, 4, num_inducing=3, key=k2),
    }, PMA(16, 4, num_seeds=2, key=k3)


def test_equivariance_and_invariance(getkey):
    equivariant, pma = blocks(getkey())
    x = jax.random.normal(getkey(), (11, 16))
    perm = jax.random.permutation(getkey(), 11)
    for name, block in equivariant.items():
        np.testing.assert_allclose(block(x[perm]), block(x)[perm], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(pma(x[perm]), pma(x), atol=1e-5)


@pytest.mark.parametrize("name", ["sab", "isab", "pma"])
def test_padding_never_changes_valid_results(getkey, name):
    equivariant, pma = blocks(getkey())
    block = pma if name == "pma" else equivariant[name]
    x = jax.random.normal(getkey(), (12, 16))
    junk = x.at[7:].set(jax.random.normal(getkey(), (5, 16)) * 100)
    a, b = block(x, size=7), block(junk, size=7)
    rows = slice(None) if name == "pma" else slice(0, 7)
    np.testing.assert_allclose(a[rows], b[rows], atol=1e-5)
    # And equal to the unpadded set.
    np.testing.assert_allclose(a[rows], block(x[:7])[rows], atol=1e-5)


def test_mab_cross_attention_vmap_and_grad(getkey):
    mab = MAB(8, 2, y_dim=12, key=getkey())
    x, y = jax.random.normal(getkey(), (4, 5, 8)), jax.random.normal(getkey(), (4, 9, 12))
    sizes = jnp.array([9, 3, 1, 6])
    out = jax.jit(jax.vmap(lambda x, y, n: mab(x, y, y_size=n)))(x, y, sizes)
    assert out.shape == (4, 5, 8)
    np.testing.assert_allclose(out[1], mab(x[1], y[1, :3]), atol=1e-5)
    loss = lambda m: jnp.sum(jax.vmap(lambda a, b: m(a, b))(x, y) ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(loss))(mab)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
