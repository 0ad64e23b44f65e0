"""What every flash-attention kernel family shares.

Padding, tile ranges, the custom VJP and the config / interpret check.

A family builds a `FlashKernels` for a call: its `forward` and `backward` on padded
operands (or, `direct`, a forward on the caller's). `run_call` wires a family's two
halves into one `jax.custom_vjp` (`attend`), which slices the padding off and folds
`vmap`'s axis into the batch; `forward_lse` and `backward_given` expose the two halves
for callers that merge blocks themselves (ring attention).
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from probjax_eqx._autodiff import instantiate_zeros
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
    `tangent(qp, kp, vp, tqp, tkp, tvp, fwd_ranges, operands, t_params) -> to`: forward
    mode's kernel on padded operands and tangents (`t_params`: of the float operands,
    per head), where the family has one (`pack` 1).
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
    tangent: Callable | None = None

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

    def output_tangent(self, q, k, v, tq, tk, tv, t_params=()):
        """The output's tangent along `(tq, tk, tv)` and the float operands' `t_params`."""
        if self.tangent is None or self.pack != 1:
            raise ValueError("these kernels have no forward-mode kernel (packed rows?)")
        to = self.tangent(*self._pad(q, k, v), *self._pad(tq, tk, tv), self.ranges["fwd"],
                          self.operands, t_params)  # fmt: skip
        return self._rows_out(to, q.shape[1], v.shape[3])

    def output(self, q, k, v):
        """The output alone: nothing runs on the log-sum-exp (a call not differentiated)."""
        return self._forward(q, k, v, self.ranges["fwd"], self.operands)[0]

    def forward_rows(self, q, k, v):
        """The output and the rows' base-2 log-sum-exp `[batch, q_heads, q_seq]` (`rows_lse`)."""
        o, lse = self._forward(q, k, v, self.ranges["fwd"], self.operands)
        return o, rows_lse(lse, q.shape[1], self.pack)

    def backward_rows(self, q, k, v, o, lse, do):
        """`(dq, dk, dv, doperands)` given `forward_rows`' `lse`, of any call's kernels."""
        lse = kernel_lse(lse, self.q_pad, self.pack)
        return self._backward(q, k, v, o, lse, do, self.ranges, self.operands)

    def forward_lse(self, q, k, v):
        """The output and the natural-log log-sum-exp `[batch, heads, q_seq]` of each row.

        `-inf` where no key is valid. Not differentiable: pair it with `backward_given`
        (ring attention merges blocks by `lse`).
        """
        o, lse = self.forward_rows(q, k, v)
        return o, jnp.where(jnp.isposinf(lse), -jnp.inf, lse * LN2)

    def backward_given(self, q, k, v, o, lse, do):
        """`(dq, dk, dv)` through this call's keys, given the rows' statistics over all keys.

        `lse` (natural log) and `o` cover *every* key block: this is the flash backward of
        one block of a larger key set, exact once the blocks' gradients are summed.
        """
        lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse / LN2).astype(jnp.float32)
        return self.backward_rows(q, k, v, o, lse2, do)[:3]


def rows_lse(lse, q_len: int, pack: int):
    """Kernels' `lse` `[batch, heads, q_pad]` (packed rows when `pack > 1`) as rows.

    The call's rows `[batch, q_heads, q_len]`: base 2, `+inf` on rows without a valid key.
    """
    if pack == 1:
        return lse[:, :, :q_len]
    batch, kv_heads, _ = lse.shape
    lse = lse[:, :, : q_len * pack].reshape(batch, kv_heads, q_len, pack)
    return lse.transpose(0, 1, 3, 2).reshape(batch, kv_heads * pack, q_len)


def kernel_lse(lse, q_pad: int, pack: int):
    """The inverse of `rows_lse`: padded rows are `+inf` (no valid key)."""
    batch, heads, q_len = lse.shape
    if pack > 1:
        lse = lse.reshape(batch, heads // pack, pack, q_len).transpose(0, 1, 3, 2)
        lse = lse.reshape(batch, heads // pack, q_len * pack)
    return jnp.pad(lse, ((0, 0), (0, 0), (0, q_pad - lse.shape[2])), constant_values=jnp.inf)


def run_call(forward_kernels: Callable, backward_kernels: Callable, q, k, v, mask, score_mod):
    """One call through a family's kernels (`attend`), its mask and score mod as operands.

    `forward_kernels(q, k, v, mask, score_mod)` and `backward_kernels(...)` build the
    `FlashKernels` of the halves for the arrays they are given (`vmap` may fold a batch
    into them).
    """
    batch, q_len, heads, _ = q.shape
    operands, kinds, restore = _tiles.canonical(
        mask, score_mod, batch=batch, heads=heads, q_len=q_len, kv_len=k.shape[1]
    )

    def of_operands(kernels_of):
        return lambda q, k, v, operands: kernels_of(q, k, v, *restore(operands))

    return attend(of_operands(forward_kernels), of_operands(backward_kernels), kinds, q, k, v,
                  operands)  # fmt: skip


def run_tangent(tangent_kernels: Callable, q, k, v, tq, tk, tv, mask, score_mod,
                t_score_mod=None):  # fmt: skip
    """The tangent of `run_call`'s output along `(tq, tk, tv)`, by a forward-mode kernel.

    `tangent_kernels(q, k, v, mask, score_mod)` builds `FlashKernels` with a `tangent`.
    `t_score_mod`: the tangent of the score mod's float arrays (per-head parameters),
    shaped as `eqx.filter(score_mod, eqx.is_inexact_array)` (None where one is zero);
    None: they are fixed.
    """
    batch, q_len, heads, _ = q.shape

    def canonical(score_mod):
        return _tiles.canonical(
            mask, score_mod, batch=batch, heads=heads, q_len=q_len, kv_len=k.shape[1]
        )

    operands, kinds, restore = canonical(score_mod)
    floats = [n for n, op in enumerate(operands) if jnp.issubdtype(op.dtype, jnp.floating)]
    t_params = ()
    if floats and t_score_mod is not None:
        diff, static = eqx.partition(score_mod, eqx.is_inexact_array)
        arrays = lambda diff: canonical(eqx.combine(diff, static))[0]  # noqa: E731
        t_score_mod = instantiate_zeros(diff, t_score_mod)  # None: a symbolic zero
        t_operands = jax.jvp(arrays, (diff,), (t_score_mod,))[1]
        t_params = tuple(t_operands[n] for n in floats)
    elif floats:
        t_params = tuple(jnp.zeros_like(operands[n]) for n in floats)
    n = len(operands)

    def tangent(q, k, v, tq, tk, tv, operands):
        kernels = tangent_kernels(q, k, v, *restore(operands[:n]))
        return kernels.output_tangent(q, k, v, tq, tk, tv, operands[n:])

    # The parameters' tangents are per head, as the parameters are.
    folded = _fold_vmap(tangent, (*kinds, *["head"] * len(t_params)), leading=6)
    return folded(q, k, v, tq, tk, tv, (*operands, *t_params))


def attend(forward_blocks: Callable, backward_blocks: Callable, kinds, q, k, v, operands):
    """Attention under one custom VJP: the forward's kernels, then the backward's.

    `forward_blocks(q, k, v, operands)` and `backward_blocks(...)` build the
    `FlashKernels` of a call from its arrays alone (so that no tracer is closed over),
    planned for their shapes; `operands` are the call's mask and score-mod arrays
    (`_tiles.canonical`, of `kinds`). The two halves meet at the output and its rows'
    log-sum-exp (`forward_rows`), so they may be planned apart or be different kernel
    families (Mosaic's split-KV Triton forward).

    Under `jax.vmap` each half runs once over the batch the map folds into the call's
    (`_fold_vmap`), planned for that batch: a module called unbatched and vmapped, as
    Equinox modules are, gets the split counts and kernels of its whole batch.
    """

    def output(q, k, v, operands):
        return forward_blocks(q, k, v, operands).output(q, k, v)

    def forward(q, k, v, operands):
        return forward_blocks(q, k, v, operands).forward_rows(q, k, v)

    def backward(q, k, v, o, lse, do, operands):
        return backward_blocks(q, k, v, operands).backward_rows(q, k, v, o, lse, do)

    folded_output = _fold_vmap(output, kinds, leading=3)
    folded_forward = _fold_vmap(forward, kinds, leading=3)
    folded_backward = _fold_vmap(backward, kinds, leading=6, with_gradients=True)

    @jax.custom_vjp
    def run(q, k, v, operands):
        return folded_output(q, k, v, operands)

    def run_fwd(q, k, v, operands):
        o, lse = folded_forward(q, k, v, operands)
        return o, (q, k, v, o, lse, operands)

    def run_bwd(residuals, do):
        q, k, v, o, lse, operands = residuals
        dq, dk, dv, doperands = folded_backward(q, k, v, o, lse, do, operands)
        return dq, dk, dv, tuple(doperands)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, tuple(operands))


def _fold_vmap(fn: Callable, kinds, *, leading: int, with_gradients: bool = False):
    """`fn(*arrays, operands)` whose `vmap` folds the mapped axis into the batch axis.

    `fn`'s first `leading` arguments and all its outputs lead with the call's batch, as
    do its operands but those of kind `head`. Mapped, it runs once over `axis_size *
    batch` rows, each half planning its kernels for that batch (pallas_call's own
    batching would run the plan made for one example `axis_size` times over). Folding
    needs q, k and v mapped (an unmapped K/V shared by all would be copied `axis_size`
    times; other unmapped arrays, a cotangent of ones, are) and head operands not
    mapped; with gradients, no floating head operand (their gradient sums over the
    batch, where each example needs its own). Otherwise `fn` is mapped as it is.
    """
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def rule(axis_size, in_batched, *args):
        arrays, operands = args[:leading], args[leading]
        mapped, mapped_ops = in_batched[:leading], in_batched[leading]
        heads = [(op, m) for op, m, kind in zip(operands, mapped_ops, kinds) if kind == "head"]
        fold = all(mapped[:3]) and not any(m for _, m in heads)
        if with_gradients:
            fold = fold and not any(jnp.issubdtype(op.dtype, jnp.floating) for op, _ in heads)
        if not fold:
            axes = ([0 if m else None for m in mapped], [0 if m else None for m in mapped_ops])
            out = jax.vmap(fn, in_axes=(*axes[0], tuple(axes[1])))(*arrays, tuple(operands))
            return out, jax.tree.map(lambda _: True, out)

        def merge(x, m=True):
            x = x if m else jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        operands = tuple(
            op if kind == "head" else merge(op, m)
            for op, m, kind in zip(operands, mapped_ops, kinds)
        )
        out = folded(*map(merge, arrays, mapped), operands)
        out = jax.tree.map(lambda x: x.reshape(axis_size, -1, *x.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return folded


def check_pallas(name: str, config_type: type, config, device: DeviceInfo, needs: str):
    """The config's type, and where the kernel runs: the GPU, or the CPU in interpret mode."""
    if config is not None and not isinstance(config, config_type):
        raise TypeError(f"implementation={name!r} takes a {config_type.__name__}, got {config!r}")
    if not device.is_gpu and not (config is not None and config.interpret):
        return f"{needs}; on the CPU pass config={config_type.__name__}(interpret=True)"
    return None
