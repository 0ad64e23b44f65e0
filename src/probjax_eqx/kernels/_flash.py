"""What every flash-attention kernel family shares.

Padding, tile ranges, the custom VJP and the config / interpret check.

A family builds a `FlashKernels` for a call: its `forward` and `backward` on padded
operands (or, `direct`, a forward on the caller's). Calling it wires them into one
`jax.custom_vjp` (`attend`) and slices the padding off; `forward_lse` and
`backward_given` expose the two halves for callers that merge blocks themselves (ring
attention).
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels import _tiles


def pad_seq(x, length: int, dim: int):
    """`[batch, seq, heads, c]` zero-padded to `length` rows and `dim` columns."""
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, dim - x.shape[3])))


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


def pack_rows(x, groups: int):
    """`[b, q, kv_heads * groups, d]` -> `[b, q * groups, kv_heads, d]`, row `q * groups + g`.

    GQA packing: the query heads sharing a KV head become rows of one tile.
    """
    if groups == 1:
        return x
    b, q, heads, d = x.shape
    x = x.reshape(b, q, heads // groups, groups, d).transpose(0, 1, 3, 2, 4)
    return x.reshape(b, q * groups, heads // groups, d)


def unpack_rows(x, groups: int):
    """The inverse of `pack_rows`."""
    if groups == 1:
        return x
    b, rows, kv_heads, d = x.shape
    x = x.reshape(b, rows // groups, groups, kv_heads, d).transpose(0, 1, 3, 2, 4)
    return x.reshape(b, rows // groups, kv_heads * groups, d)


@dataclasses.dataclass(frozen=True)
class FlashKernels:
    """One call's forward and backward kernels with the padding they need.

    `forward(q, k, v, fwd_ranges, operands) -> (o, lse)` and
    `backward(qp, kp, vp, o, lse, do, ranges, operands) -> (dq, dk, dv, doperands)`;
    `lse` is base 2 (scores times `log2(e)`), `[batch, heads, q_pad]` (packed rows when
    `pack > 1`), `+inf` on rows without a valid key. `ranges` and `operands` are arrays
    built for this call's mask. The backward takes padded (and packed) operands. The
    forward takes them too, unless `direct`: then it reads the caller's `q`, `k`, `v` as
    they are (masked tile loads) and writes `o` in the caller's shape, so a call runs no
    padding, packing or slicing around its kernels (at decode sizes each such launch
    costs more than its data).

    `pack`: the query heads of each KV head run as rows of one tile (`pack_rows`).
    """

    forward: Callable
    backward: Callable
    ranges: dict
    operands: tuple
    q_pad: int
    kv_pad: int
    d_pad: int
    dv_pad: int
    direct: bool = False
    pack: int = 1

    def _rows_in(self, x, width: int):
        """Caller's `[b, q, heads, c]` -> the kernels' packed, padded rows."""
        x = pack_rows(x, self.pack)
        return pad_seq(x, self.q_pad, width)

    def _rows_out(self, x, q_len: int, width: int):
        """The inverse of `_rows_in` for `q_len` caller rows and `width` columns."""
        return unpack_rows(x[:, : q_len * self.pack, :, :width], self.pack)

    def _pad(self, q, k, v):
        return (
            self._rows_in(q, self.d_pad),
            pad_seq(k, self.kv_pad, self.d_pad),
            pad_seq(v, self.kv_pad, self.dv_pad),
        )

    def _forward(self, q, k, v, fwd_ranges, operands):
        """The output in the caller's shape and the kernels' `lse`."""
        if self.direct:
            return self.forward(q, k, v, fwd_ranges, operands)
        o, lse = self.forward(*self._pad(q, k, v), fwd_ranges, operands)
        return self._rows_out(o, q.shape[1], v.shape[3]), lse

    def _backward(self, q, k, v, o, lse, do, ranges, operands):
        """`(dq, dk, dv, doperands)` of the caller's operands, given the forward's `lse`."""
        qp, kp, vp = self._pad(q, k, v)
        op = self._rows_in(o.astype(q.dtype), self.dv_pad)
        dop = self._rows_in(do.astype(q.dtype), self.dv_pad)
        dq, dk, dv, doperands = self.backward(qp, kp, vp, op, lse, dop, ranges, operands)
        d, lk = q.shape[3], k.shape[1]
        dq = self._rows_out(dq, q.shape[1], d)
        return dq, dk[:, :lk, :, :d], dv[:, :lk, :, : v.shape[3]], doperands

    def __call__(self, q, k, v):
        """The attention output, under one custom VJP whose backward is `backward`."""
        return attend(self, q, k, v, self.ranges, self.operands)

    def forward_lse(self, q, k, v):
        """The output and the natural-log log-sum-exp `[batch, heads, q_seq]` of each row.

        `-inf` where no key is valid. Not differentiable: pair it with `backward_given`
        (ring attention merges blocks by `lse`).
        """
        if self.pack != 1:
            raise ValueError("forward_lse needs unpacked query heads")
        o, lse = self._forward(q, k, v, self.ranges["fwd"], self.operands)
        lse = lse[:, :, : q.shape[1]]
        return o, jnp.where(jnp.isposinf(lse), -jnp.inf, lse * LN2)

    def backward_given(self, q, k, v, o, lse, do):
        """`(dq, dk, dv)` through this call's keys, given the rows' statistics over all keys.

        `lse` (natural log) and `o` cover *every* key block: this is the flash backward of
        one block of a larger key set, exact once the blocks' gradients are summed.
        """
        if self.pack != 1:
            raise ValueError("backward_given needs unpacked query heads")
        lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse / LN2).astype(jnp.float32)
        tail = ((0, 0), (0, 0), (0, self.q_pad - q.shape[1]))
        lse2 = jnp.pad(lse2, tail, constant_values=jnp.inf)
        return self._backward(q, k, v, o, lse2, do, self.ranges, self.operands)[:3]


def attend(kernels: FlashKernels, q, k, v, ranges, operands):
    """`kernels`' forward under a custom VJP whose backward is its backward."""

    # Ranges and operands are explicit (integer, non-differentiable) arguments: a
    # custom_vjp must not close over tracers, or `scan`/`jit` leak them into the bwd.
    @jax.custom_vjp
    def run(q, k, v, ranges, operands):
        return kernels._forward(q, k, v, ranges["fwd"], operands)[0]

    def run_fwd(q, k, v, ranges, operands):
        o, lse = kernels._forward(q, k, v, ranges["fwd"], operands)
        return o, (q, k, v, o, lse, ranges, operands)

    def run_bwd(residuals, do):
        q, k, v, o, lse, ranges, operands = residuals
        *grads, doperands = kernels._backward(q, k, v, o, lse, do, ranges, operands)
        return (*grads, None, doperands)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, ranges, operands)


def attend_halves(forward_blocks: Callable, backward_blocks: Callable, q, k, v):
    """Attention whose forward is one family's kernels and whose backward is another's.

    `forward_blocks(q, k, v)` and `backward_blocks(q, k, v)` build the `FlashKernels` of
    an unmasked call: the output and its log-sum-exp come from the first's `forward_lse`,
    the gradients from the second's `backward_given`. Both are built inside the custom
    VJP's halves, from the operands alone, so that no tracer is closed over.
    """

    @jax.custom_vjp
    def run(q, k, v):
        return forward_blocks(q, k, v).forward_lse(q, k, v)[0]

    def run_fwd(q, k, v):
        o, lse = forward_blocks(q, k, v).forward_lse(q, k, v)
        return o, (q, k, v, o, lse)

    def run_bwd(residuals, do):
        q, k, v, o, lse = residuals
        return backward_blocks(q, k, v).backward_given(q, k, v, o, lse, do)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v)


def check_pallas(name: str, config_type: type, config, device: DeviceInfo, needs: str):
    """The config's type, and where the kernel runs: the GPU, or the CPU in interpret mode."""
    if config is not None and not isinstance(config, config_type):
        raise TypeError(f"implementation={name!r} takes a {config_type.__name__}, got {config!r}")
    if not device.is_gpu and not (config is not None and config.interpret):
        return f"{needs}; on the CPU pass config={config_type.__name__}(interpret=True)"
    return None
