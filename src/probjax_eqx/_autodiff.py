"""Derivatives of our kernels in both modes and to any order.

A kernel's VJP runs Pallas or cuDNN calls, which JAX can neither differentiate again (a
gradient penalty, meta-learning) nor push tangents through: `jax.custom_vjp` has no
forward mode, so `jax.jvp`, `jax.jacfwd` and `jax.hessian` would fail. In
`kernel_then_reference` the kernel's value is a `jax.custom_jvp` whose tangent is one
linear primitive, `kernel_tangent`: transposed (reverse mode) it is the kernel's own VJP,
evaluated (forward mode) it is a tangent kernel where the op has one (attention's
Triton tangent) or else the reference's JVP, and every derivative of any of them is the
reference's, which computes the same function in XLA.
"""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad, batching, mlir


def _is_float_array(x) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _is_none(x) -> bool:
    return x is None


def _zeros_to_none(tangents):
    """A custom JVP's tangents (`symbolic_zeros=True`) with None for each symbolic zero."""
    is_zero = lambda t: isinstance(t, SymbolicZero)  # noqa: E731
    return jax.tree.map(lambda t: None if is_zero(t) else t, tangents, is_leaf=is_zero)


def instantiate_zeros(primals, tangents):
    """`tangents` (None where zero) as arrays shaped as `primals`."""
    return jax.tree.map(lambda p, t: jnp.zeros_like(p) if t is None else t, primals, tangents)


class _Linear:
    """One call's tangent map `t -> dF(x) t`, a static parameter of `kernel_tangent`.

    Operands are flat: `residual_count` residual arrays, then the tangents. `evaluate`
    maps them to the output's tangent; `transpose` maps the residuals and a cotangent of
    the output to the tangents' cotangents. Hashed by identity.
    """

    def __init__(self, evaluate: Callable, transpose: Callable, residual_count: int, out_avals):
        self.evaluate, self.transpose = evaluate, transpose
        self.residual_count, self.out_avals = residual_count, tuple(out_avals)

    def batched(self, size: int, axes: tuple) -> "_Linear":
        """The same map over a leading axis of `size` of every tangent and output.

        Residuals are mapped where `axes` says 0; None: shared by every example, not copied.
        """

        def mapped(fn):
            return lambda *ops: jax.vmap(fn, in_axes=(*axes, *[0] * (len(ops) - len(axes))))(*ops)

        avals = [a.update(shape=(size, *a.shape)) for a in self.out_avals]
        return _Linear(mapped(self.evaluate), mapped(self.transpose), self.residual_count, avals)


kernel_tangent = jax.extend.core.Primitive("probjax_kernel_tangent")
kernel_tangent.multiple_results = True
kernel_tangent.def_impl(lambda *operands, linear: linear.evaluate(*operands))
kernel_tangent.def_abstract_eval(lambda *avals, linear: linear.out_avals)
mlir.register_lowering(
    kernel_tangent,
    mlir.lower_fun(lambda *operands, linear: linear.evaluate(*operands), multiple_results=True),
)


def _tangent_transpose(cts, *operands, linear: _Linear):
    n = linear.residual_count
    if any(ad.is_undefined_primal(x) for x in operands[:n]):
        raise NotImplementedError("kernel_tangent is linear only in its tangents")
    cts = [ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct for ct in cts]
    return [None] * n + list(linear.transpose(*operands[:n], *cts))


def _tangent_jvp(primals, tangents, *, linear: _Linear):
    # A derivative of the first derivative: `evaluate`'s, by JAX (the reference's, for a
    # kernel), through the residuals too.
    out = kernel_tangent.bind(*primals, linear=linear)
    tangents = [ad.instantiate_zeros(t) if type(t) is ad.Zero else t for t in tangents]
    _, t_out = jax.jvp(linear.evaluate, tuple(primals), tuple(tangents))
    return out, t_out


def _tangent_batch(operands, dims, *, linear: _Linear):
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    n = linear.residual_count
    residuals = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands[:n], dims)]
    tangents = [  # the transpose's cotangents take their shape: every example's own
        jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(operands[n:], dims[n:])
    ]
    axes = tuple(None if d is None else 0 for d in dims[:n])
    out = kernel_tangent.bind(*residuals, *tangents, linear=linear.batched(size, axes))
    return out, [0] * len(out)


ad.primitive_transposes[kernel_tangent] = _tangent_transpose
ad.primitive_jvps[kernel_tangent] = _tangent_jvp
batching.primitive_batchers[kernel_tangent] = _tangent_batch


def linear_tangent(evaluate: Callable, transpose: Callable, residuals, tangents, out):
    """The tangent `evaluate(residuals, tangents)` of `out`, transposed by `transpose`.

    `evaluate` is linear in `tangents` (a pytree of float arrays, None where a tangent is
    zero: `evaluate` gets the None); `transpose(residuals, ct)` maps a cotangent of `out`
    to one of `tangents`, whose entries where `tangents` holds None are dropped. Both are
    made of differentiable operations, whose derivatives serve beyond the first. A
    gradient keeps the arrays of `residuals` until the backward: what both need.
    """
    residuals, static = eqx.partition(residuals, eqx.is_array)
    res, res_tree = jax.tree.flatten(residuals)
    t_leaves, t_tree = jax.tree.flatten(tangents)
    present = jax.tree.unflatten(t_tree, [True] * len(t_leaves))  # None: a zero tangent
    out_leaves, out_tree = jax.tree.flatten(out)
    n = len(res)

    def evaluate_flat(*operands):
        residuals = eqx.combine(jax.tree.unflatten(res_tree, operands[:n]), static)
        t_out = evaluate(residuals, jax.tree.unflatten(t_tree, operands[n:]))
        return [t.astype(o.dtype) for t, o in zip(jax.tree.leaves(t_out), out_leaves, strict=True)]

    def transpose_flat(*operands):
        residuals = eqx.combine(jax.tree.unflatten(res_tree, operands[:n]), static)
        t_ct = transpose(residuals, jax.tree.unflatten(out_tree, operands[n:]))
        t_ct = jax.tree.map(
            lambda keep, c: None if keep is None else c, present, t_ct, is_leaf=_is_none
        )
        return [c.astype(t.dtype) for c, t in zip(jax.tree.leaves(t_ct), t_leaves, strict=True)]

    avals = [jax.typeof(o).update(weak_type=False) for o in out_leaves]
    linear = _Linear(evaluate_flat, transpose_flat, n, avals)
    return jax.tree.unflatten(out_tree, kernel_tangent.bind(*res, *t_leaves, linear=linear))


def _split_arrays(args):
    """`args` as (float arrays, other arrays, the rest), each a pytree of `args`' shape."""
    diff, rest = eqx.partition(args, _is_float_array)
    fixed, static = eqx.partition(rest, eqx.is_array)
    return diff, fixed, static


def jvp_of(fn: Callable) -> Callable:
    """`fn`'s JVP as a `both_modes` tangent rule whose residuals are `fn`'s arguments."""

    def tangent(args, tangents):
        diff, fixed, static = _split_arrays(args)
        return jax.jvp(lambda d: fn(*eqx.combine(d, fixed, static)), (diff,), (tangents,))[1]

    return tangent


def both_modes(fn: Callable, fwd: Callable, bwd: Callable, tangent: Callable):
    """`fn` with a custom VJP in reverse mode, and a forward mode.

    `fwd(*args) -> (out, residuals)` and `bwd(residuals, ct) -> cotangent per argument`
    (None where it has none) as `jax.custom_vjp` takes them. `tangent(residuals,
    tangents)` is the JVP from the same residuals (`jvp_of(fn)` where they are the
    arguments), `tangents` holding the float arrays' tangents and None elsewhere. All
    are made of differentiable operations: theirs are the derivatives beyond the first.
    Floating-point arrays of `args` are differentiated; integer arrays and everything
    else pass through.
    """

    @functools.wraps(fn)
    def call(*args):
        diff, fixed, static = _split_arrays(args)
        whole = lambda diff, fixed: eqx.combine(diff, fixed, static)  # noqa: E731

        def transpose(residuals, ct):
            cts = bwd(residuals, ct)
            # Integer arguments' cotangents (float0, None) drop out.
            return tuple(jax.tree.map(lambda d: jnp.zeros(d.shape, d.dtype), d) if c is None
                         else eqx.filter(c, eqx.is_inexact_array)
                         for d, c in zip(diff, cts, strict=True))  # fmt: skip

        @jax.custom_jvp
        def run(diff, fixed):
            return fn(*whole(diff, fixed))

        @run.defjvp
        def run_jvp(primals, tangents):
            out, residuals = fwd(*whole(*primals))
            return out, linear_tangent(tangent, transpose, residuals, tangents[0], out)

        return run(diff, fixed)

    return call


def kernel_then_reference(
    kernel: Callable, reference: Callable, *args, tangent: Callable | None = None
):
    """`kernel(*args)`, with the kernel's VJP for gradients and the reference for the rest.

    Args:
        kernel: the function as our kernels compute it (a custom VJP of their own).
        reference: the same function in pure JAX (differentiable to any order).
        *args: pytrees; their floating-point arrays are differentiated, integer arrays
            (lengths, ids) and everything else pass through.
        tangent: `tangent(args, tangents)`, forward mode's kernel: the output's tangent,
            `tangents` shaped as `args` (None where an array has none or its tangent is
            a symbolic zero: an argument that does not depend on what is differentiated,
            whose terms a kernel can skip). Without it, the reference's JVP.

    Returns:
        `kernel(*args)`. Reverse mode (`jax.grad`, `jax.vjp`) runs the kernel's own VJP;
        forward mode (`jax.jvp`, `jax.jacfwd`) runs `tangent`. Every derivative of a
        derivative (gradient penalties, Hessian-vector products either way round) is
        the reference's, in XLA, at the reference's memory cost (the full score matrix),
        and so is forward mode without `tangent`.
    """
    diff, fixed, static = _split_arrays(args)

    def closed(fn):
        return lambda diff, fixed: fn(*eqx.combine(diff, fixed, static))

    kernel_fn, reference_fn = closed(kernel), closed(reference)

    def reference_tangent(diff, fixed, t):
        t = instantiate_zeros(diff, t)
        return jax.jvp(lambda d: reference_fn(d, fixed), (diff,), (t,))[1]

    @jax.custom_jvp
    def kernel_tangent_of(diff, fixed, t):
        assert tangent is not None
        return tangent(eqx.combine(diff, fixed, static), t)

    @kernel_tangent_of.defjvp
    def kernel_tangent_jvp(primals, tangents):  # derivatives of the tangent: the reference's
        return kernel_tangent_of(*primals), jax.jvp(reference_tangent, primals, tangents)[1]

    @jax.custom_jvp
    def pull(pullback, diff, fixed, ct):  # the kernel's gradient
        return pullback(ct)[0]

    @pull.defjvp
    def pull_jvp(primals, tangents):  # derivatives of the gradient: the reference's
        pullback, diff, fixed, ct = primals
        _, t_diff, _, t_ct = tangents

        def reference_pull(diff, ct):
            return jax.vjp(lambda d: reference_fn(d, fixed), diff)[1](ct)[0]

        _, t_grads = jax.jvp(reference_pull, (diff, ct), (t_diff, t_ct))
        return pull(pullback, diff, fixed, ct), t_grads

    def evaluate(residuals, t):  # forward mode
        _, diff, fixed = residuals
        return (reference_tangent if tangent is None else kernel_tangent_of)(diff, fixed, t)

    def transpose(residuals, ct):  # reverse mode: the kernel's
        return pull(*residuals, ct)

    def out_tangent(pullback, out, diff, fixed, t_diff):
        """The tangent of `out` (the kernel's, which gave `pullback`) along `t_diff`.

        The arguments join the kernel's residuals for the reference's derivatives; a
        gradient keeps them, as the kernels' VJPs keep their operands anyway.
        """
        return linear_tangent(evaluate, transpose, (pullback, diff, fixed), t_diff, out)

    @jax.custom_jvp
    def attach(out, pullback, diff, fixed):  # `out`, as a function of `diff`
        return out

    @attach.defjvp
    def attach_jvp(primals, tangents):
        out, pullback, diff, fixed = primals
        return attach(*primals), out_tangent(pullback, out, diff, fixed, tangents[2])

    @jax.custom_jvp
    def run(diff, fixed):
        return kernel_fn(diff, fixed)

    def run_jvp(primals, tangents):
        # Differentiated again, this rule must not put the kernels under JAX's JVP: it
        # runs them on arguments whose derivatives are cut, then gives their output its
        # derivatives back by `attach`, and their gradient its own by `pull`.
        diff, fixed = primals
        t_diff = _zeros_to_none(tangents[0])
        out, pullback = jax.vjp(lambda d: kernel_fn(d, fixed), jax.lax.stop_gradient(diff))
        if not jax.tree.leaves(t_diff):
            return attach(out, pullback, diff, fixed), jax.tree.map(jnp.zeros_like, out)
        return attach(out, pullback, diff, fixed), out_tangent(pullback, out, diff, fixed, t_diff)

    # Symbolic zeros: an argument the caller does not differentiate (keys and values
    # from a fixed context) reaches `tangent` as None, not as an array of zeros.
    run.defjvp(run_jvp, symbolic_zeros=True)

    return run(diff, fixed)
