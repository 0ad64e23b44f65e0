"""Shared checks: an attention implementation against the float32 oracle; derivatives
beyond the first VJP against a reference; row scatters."""

import jax
import jax.numpy as jnp
import numpy as np

from _attention_cases import loss_and_grads
from _tolerance import assert_close
from probjax_eqx.kernels.reference import attention as reference


def oracle(q, k, v, mask=None, score_mod=None, scale=None):
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    return reference.attention(q, k, v, mask=mask, score_mod=score_mod, scale=float(scale))


def check_against_oracle(f, q, k, v, ct, *, mask=None, score_mod=None, tf32=False, primal=True):
    """Compare `f(q, k, v)` and its VJP with cotangent `ct` to the oracle; return both.

    `primal=False` checks only the value `jax.vjp` returns: for our Pallas kernels that
    is the very kernel an undifferentiated call runs (`_flash.attend`), and interpreted
    it costs as much as the backward. cuDNN's inference graph is another kernel. Every
    call is jitted, as programs run (op by op, the interpreter's surroundings would each
    compile alone).
    """
    dtype = q.dtype
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    g = lambda q, k, v: oracle(q, k, v, mask, score_mod)
    want = jax.jit(g)(*up)

    def value_and_grads(q, k, v):
        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(ct.astype(out.dtype))

    outs = [jax.jit(f)(q, k, v)] if primal else []
    out, grads = jax.jit(value_and_grads)(q, k, v)
    for value in (*outs, out):
        assert value.dtype == dtype and np.all(np.isfinite(np.asarray(value, np.float32)))
        assert_close(value, want, dtype, tf32=tf32)
    ref_grads = jax.jit(lambda *up: loss_and_grads(g, *up, ct)[1])(*up)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.dtype == dtype
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"d{name} not finite"
        assert_close(a, b, dtype, grad=True, tf32=tf32, err_msg=f"d{name}")
    return out, grads


def check_higher_derivatives(f, reference, *args, dtype=jnp.float32, tf32=False):
    """Beyond its first VJP, `f`'s derivatives equal `reference`'s: value and gradients.

    Reverse over reverse (a gradient penalty `|grad sin(f)|^2` with its gradient),
    forward mode (`jax.jvp`), forward over reverse (a Hessian-vector product) and
    reverse over forward (the gradient of a JVP's square), all jitted, each compared
    relative to the reference's largest entry at `dtype`'s gradient tolerance.
    """
    argnums = tuple(range(len(args)))
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(args))))

    def tangent_like(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.random.normal(next(keys), x.shape, x.dtype)
        return np.zeros(x.shape, jax.dtypes.float0)

    tangents = jax.tree.map(tangent_like, args)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))

    def penalty(fn):  # reverse over reverse
        def grad_norm(*args):
            grads = jax.grad(loss(fn), argnums=argnums)(*args)
            return sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads))

        return jax.value_and_grad(grad_norm, argnums=argnums)

    def hessian_vector(fn):  # forward over reverse
        return lambda *a: jax.jvp(jax.grad(loss(fn), argnums=argnums), a, tangents)[1]

    def forward_then_gradient(fn):  # forward mode's value and tangent, then reverse over it
        def square(*a):
            out, tangent = jax.jvp(fn, a, tangents)
            t_sum = sum(jnp.sum(t.astype(jnp.float32) ** 2) for t in jax.tree.leaves(tangent))
            return t_sum, (out, tangent)

        return jax.grad(square, argnums=argnums, has_aux=True)

    for transform in (penalty, hessian_vector, forward_then_gradient):
        got, want = (jax.jit(transform(fn))(*args) for fn in (f, reference))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            g, w = (np.asarray(a, np.float32) for a in (g, w))
            top = np.abs(w).max()
            assert_close(g / top, w / top, dtype, grad=True, tf32=tf32, err_msg=transform.__name__)


def all_eqns(jaxpr):
    """Every equation of `jaxpr`, those of its nested jaxprs (jit, custom VJPs...) too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def float_row_scatters(jaxpr, width: int) -> list[str]:
    """Scatters into float arrays of rows at least `width` wide anywhere in `jaxpr` (the
    router's top-k gradient scatters into `[tokens, experts]`: narrower)."""
    found = []
    for eqn in all_eqns(jaxpr):
        operand = eqn.invars[0].aval if eqn.invars else None
        if (eqn.primitive.name.startswith("scatter") and jnp.issubdtype(operand.dtype, jnp.floating)
                and operand.ndim >= 2 and operand.shape[-1] >= width):  # fmt: skip
            found.append(f"{eqn.primitive.name} {operand}")
    return found
