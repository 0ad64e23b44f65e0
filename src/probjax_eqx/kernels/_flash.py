"""What every flash-attention kernel family shares.

Padding, tile ranges, the custom VJP and the config / interpret check.

A family builds a `FlashKernels` for a call: its `forward` and `backward` on padded
operands. Calling it wires them into one `jax.custom_vjp` (`attend`) and slices the
padding off; `forward_lse` and `backward_given` expose the two halves for callers that
merge blocks themselves (ring attention).
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels import _tiles


def pad_qkv(q, k, v, *, q_pad: int, kv_pad: int, d: int, dv: int):
    """Zero-pad sequence and head dims of `[batch, seq, heads, dim]` operands."""

    def pad(x, length, dim):
        return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, dim - x.shape[3])))

    return pad(q, q_pad, d), pad(k, kv_pad, d), pad(v, kv_pad, dv)


def tile_ranges(ctx, mask, q_pad: int, kv_pad: int, *, fwd, dq, dkv) -> dict:
    """`block_ranges` of the three kernels.

    Each of `fwd`, `dq`, `dkv` is `(program, loop)` tile sizes: queries per program for
    `fwd` and `dq`, keys per program for `dkv`.
    """

    def ranges(blocks, kv_loop):
        program, loop = blocks
        return _tiles.block_ranges(
            ctx, mask, q_pad, kv_pad, program_block=program, loop_block=loop, kv_loop=kv_loop
        )

    return {"fwd": ranges(fwd, True), "dq": ranges(dq, True), "dkv": ranges(dkv, False)}


def valid_pairs(ctx, mask, b, h, q_idx, kv_idx):
    """Which (query, key) pairs of a tile count: real keys the mask allows."""
    valid = kv_idx < ctx.kv_len
    if mask is not None:
        valid = valid & mask.predicate(ctx, b, h, q_idx, kv_idx)
    return valid


def last_first(t, tiles: int):
    """Query tile of program (or grid row) `t`: the last tile first.

    Under causal masks a query tile's work grows with its index; starting the long ones
    first leaves short ones for the grid's last wave instead of one long straggler.
    """
    return tiles - 1 - t


def tile_loop(ranges, body, init):
    """Run `body(step, carry, masked)` over the tiles `[lo, hi)` of `ranges`.

    `ranges` is `(lo, full_lo, full_hi, hi)`, one program's entries of `block_ranges`.

    The tiles in `[full_lo, full_hi)` are valid throughout and skip mask evaluation.
    """
    lo, full_lo, full_hi, hi = ranges
    carry = jax.lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), init)
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return jax.lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


LN2 = math.log(2.0)  # the kernels' log-sum-exp is base 2


@dataclasses.dataclass(frozen=True)
class FlashKernels:
    """One call's forward and backward kernels with the padding they need.

    `forward(qp, kp, vp, fwd_ranges, operands) -> (o, lse)` and
    `backward(qp, kp, vp, o, lse, do, ranges, operands) -> (dq, dk, dv, doperands)` take
    padded operands; `lse` is base 2 (scores times `log2(e)`), `+inf` on rows without a
    valid key. `ranges` and `operands` are arrays built for this call's mask.
    """

    forward: Callable
    backward: Callable
    ranges: dict
    operands: tuple
    q_pad: int
    kv_pad: int
    d_pad: int
    dv_pad: int

    def _pad(self, q, k, v):
        return pad_qkv(q, k, v, q_pad=self.q_pad, kv_pad=self.kv_pad, d=self.d_pad, dv=self.dv_pad)

    def __call__(self, q, k, v):
        """The attention output, under one custom VJP whose backward is `backward`."""
        return attend(
            self.forward, self.backward, *self._pad(q, k, v), self.ranges, self.operands,
            q_len=q.shape[1], v_dim=v.shape[3],
        )  # fmt: skip

    def forward_lse(self, q, k, v):
        """The output and the natural-log log-sum-exp `[batch, heads, q_seq]` of each row.

        `-inf` where no key is valid. Not differentiable: pair it with `backward_given`
        (ring attention merges blocks by `lse`).
        """
        o, lse = self.forward(*self._pad(q, k, v), self.ranges["fwd"], self.operands)
        lse = lse[:, :, : q.shape[1]]
        lse = jnp.where(jnp.isposinf(lse), -jnp.inf, lse * LN2)
        return o[:, : q.shape[1], :, : v.shape[3]], lse

    def backward_given(self, q, k, v, o, lse, do):
        """`(dq, dk, dv)` through this call's keys, given the rows' statistics over all keys.

        `lse` (natural log) and `o` cover *every* key block: this is the flash backward of
        one block of a larger key set, exact once the blocks' gradients are summed.
        """
        qp, kp, vp = self._pad(q, k, v)
        rows = ((0, 0), (0, self.q_pad - q.shape[1]), (0, 0), (0, self.dv_pad - v.shape[3]))
        op = jnp.pad(o.astype(q.dtype), rows)
        dop = jnp.pad(do.astype(q.dtype), rows)
        lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse / LN2).astype(jnp.float32)
        tail = ((0, 0), (0, 0), (0, self.q_pad - q.shape[1]))
        lse2 = jnp.pad(lse2, tail, constant_values=jnp.inf)
        dq, dk, dv, _ = self.backward(qp, kp, vp, op, lse2, dop, self.ranges, self.operands)
        d, lk = q.shape[3], k.shape[1]
        return dq[:, : q.shape[1], :, :d], dk[:, :lk, :, :d], dv[:, :lk, :, : v.shape[3]]


def attend(forward, backward, qp, kp, vp, ranges, operands, *, q_len: int, v_dim: int):
    """Run `forward` under a custom VJP whose backward is `backward` (module docstring)."""

    # Ranges and operands are explicit (integer, non-differentiable) arguments: a
    # custom_vjp must not close over tracers, or `scan`/`jit` leak them into the bwd.
    @jax.custom_vjp
    def run(qp, kp, vp, ranges, operands):
        return forward(qp, kp, vp, ranges["fwd"], operands)[0]

    def run_fwd(qp, kp, vp, ranges, operands):
        o, lse = forward(qp, kp, vp, ranges["fwd"], operands)
        return o, (qp, kp, vp, o, lse, ranges, operands)

    def run_bwd(residuals, do):
        qp, kp, vp, o, lse, ranges, operands = residuals
        *grads, doperands = backward(qp, kp, vp, o, lse, do, ranges, operands)
        return (*grads, None, doperands)

    run.defvjp(run_fwd, run_bwd)
    return run(qp, kp, vp, ranges, operands)[:, :q_len, :, :v_dim]


def check_pallas(name: str, config_type: type, config, device: DeviceInfo, needs: str):
    """The config's type, and where the kernel runs: the GPU, or the CPU in interpret mode."""
    if config is not None and not isinstance(config, config_type):
        raise TypeError(f"implementation={name!r} takes a {config_type.__name__}, got {config!r}")
    if not device.is_gpu and not (config is not None and config.interpret):
        return f"{needs}; on the CPU pass config={config_type.__name__}(interpret=True)"
    return None
