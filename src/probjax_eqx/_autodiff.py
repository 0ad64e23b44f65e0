"""Derivatives of our kernels' gradients, through their pure-JAX references.

A kernel's VJP runs Pallas or cuDNN calls, which JAX cannot differentiate again: a
gradient penalty, meta-learning or a Hessian-vector product by reverse-over-reverse
would fail inside them (an `AssertionError` deep in Pallas). `kernel_then_reference`
keeps the kernel's value and first-order gradients and takes every derivative of that
gradient from the reference, which computes the same function in XLA.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp


def _is_float_array(x) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def kernel_then_reference(kernel: Callable, reference: Callable, *args):
    """`kernel(*args)`, differentiated once by its own VJP, beyond that via `reference`.

    Args:
        kernel: the function as our kernels compute it (a custom VJP of their own).
        reference: the same function in pure JAX (differentiable to any order).
        *args: pytrees; their floating-point arrays are differentiated, integer arrays
            (lengths, ids) and everything else pass through.

    Returns:
        `kernel(*args)`. Its gradient is the kernel's; the gradient of that gradient
        (with respect to `args` and to the cotangent) is the reference's, in XLA, at
        the reference's memory cost (the full score matrix).
    """
    diff, rest = eqx.partition(args, _is_float_array)
    fixed, static = eqx.partition(rest, eqx.is_array)

    def closed(fn):
        return lambda diff, fixed: fn(*eqx.combine(diff, fixed, static))

    kernel_fn, reference_fn = closed(kernel), closed(reference)

    @jax.custom_vjp
    def pull(pullback, diff, fixed, ct):  # the kernel's gradient
        return pullback(ct)[0]

    def pull_fwd(pullback, diff, fixed, ct):
        return pullback(ct)[0], (diff, fixed, ct)

    def pull_bwd(residuals, grads_ct):  # derivatives of the gradient: the reference's
        diff, fixed, ct = residuals

        def reference_pull(diff, ct):
            return jax.vjp(lambda d: reference_fn(d, fixed), diff)[1](ct)[0]

        d_diff, d_ct = jax.vjp(reference_pull, diff, ct)[1](grads_ct)
        return None, d_diff, None, d_ct

    pull.defvjp(pull_fwd, pull_bwd)

    # Integer arrays are explicit (non-differentiable) arguments: a custom_vjp must not
    # close over tracers, or `scan` / `jit` leak them into the backward.
    @jax.custom_vjp
    def run(diff, fixed):
        return kernel_fn(diff, fixed)

    @jax.custom_vjp
    def attach(out, pullback, diff, fixed):  # `out`, as a function of `diff` by `pullback`
        return out

    def attach_fwd(out, pullback, diff, fixed):
        return out, (pullback, diff, fixed)

    def attach_bwd(residuals, ct):
        pullback, diff, fixed = residuals
        return None, None, pull(pullback, diff, fixed, ct), None

    attach.defvjp(attach_fwd, attach_bwd)

    def run_fwd(diff, fixed):
        # Differentiated again (reverse over reverse), this rule must not put the kernels
        # under JAX's JVP: it runs them on inputs whose derivatives are cut, then gives
        # their output its derivatives back by `attach` (the kernel's VJP), and the
        # gradient's by `pull` (the reference's).
        out, pullback = jax.vjp(lambda d: kernel_fn(d, fixed), jax.lax.stop_gradient(diff))
        return attach(out, pullback, diff, fixed), (pullback, diff, fixed)

    def run_bwd(residuals, ct):
        pullback, diff, fixed = residuals
        return pull(pullback, diff, fixed, ct), None

    run.defvjp(run_fwd, run_bwd)
    return run(diff, fixed)
