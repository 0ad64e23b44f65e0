"""Masks and score mods inside kernels: their arrays as kernel operands, rebuilt per tile.

A kernel cannot gather from a mask's arrays; instead each array becomes an operand of a
known *kind*, delivered per program by a BlockSpec:

| kind     | array in the wrapper   | what the kernel sees                          |
|----------|------------------------|-----------------------------------------------|
| `batch`  | `[batch]`              | the scalar of this program's batch element    |
| `head`   | `[q_heads]`            | the scalar of this program's query head       |
| `q_pos`  | `[batch, q_len_pad]`   | the values of the current query tile          |
| `kv_pos` | `[batch, kv_len_pad]`  | the values of the current key tile            |

`split(tree, ...)` returns the operands, their kinds and a `rebuild(values)` that makes a
tile-local copy of the mask / score mod whose `predicate` / `__call__` evaluate on tile
index arrays. The same code therefore defines a mask in the reference and in every kernel.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from probjax_eqx import biases, masks

# Leaves without arrays, usable inside kernels as they are.
_PURE = (
    masks.Causal,
    masks.LocalWindow,
    masks.BlockDiagonal,
    masks.MaskFn,
    biases.SoftCap,
    biases.ScoreFn,
)
# Combinators: (class, field holding the children, whether the field is a tuple).
_COMBINATORS = {
    masks.And: (("left", "right"), False),
    masks.Or: (("left", "right"), False),
    masks.Not: (("mask",), False),
    biases.Compose: (("mods",), True),
    biases.BiasSum: (("terms",), True),
}
# Leaves the kernels take that hold one per-batch or per-head array (their `array_axes`):
# (field, kind).
_SCALAR_LEAVES = {
    cls: (field, "head" if axis == "heads" else "batch")
    for cls in (masks.KVLengths, masks.QLengths, masks.PrefixLM, biases.ALiBi, biases.HeadScale)
    for field, (axis,) in cls.array_axes.items()
}


class _TileSegments(masks.AbstractMask):
    """`Segments` restricted to one (query tile, key tile): ids are already the tiles'."""

    q_ids: Any
    kv_ids: Any

    def predicate(self, ctx, b, h, q, kv):
        if jnp.ndim(self.q_ids) == 2:  # ids already broadcast to the score tile (Mosaic)
            return self.q_ids == self.kv_ids
        return self.q_ids[:, None] == self.kv_ids[None, :]

    def kv_range(self, ctx, b, q_lo, q_hi):
        raise AssertionError("tile-local masks have no ranges")

    def q_range(self, ctx, b, kv_lo, kv_hi):
        raise AssertionError("tile-local masks have no ranges")

    def spec(self):
        return ("tile_segments",)


def spec_names(spec) -> list[str]:
    """Every mask / score-mod name in a (nested) `spec()` tuple."""
    if not isinstance(spec, tuple) or not spec:
        return []
    names = [spec[0]] if isinstance(spec[0], str) else []
    for item in spec[1:]:
        names += spec_names(item)
    return names


def unsupported_reason(tree: object) -> str | None:
    """Why `tree` (a mask or score mod) cannot run inside a kernel, or `None`."""
    if tree is None or isinstance(tree, _PURE):
        return None
    for cls, (fields, is_tuple) in _COMBINATORS.items():
        if isinstance(tree, cls):
            children = getattr(tree, fields[0]) if is_tuple else [getattr(tree, f) for f in fields]
            for child in children:
                why = unsupported_reason(child)
                if why is not None:
                    return why
            return None
    if type(tree) in _SCALAR_LEAVES or isinstance(tree, masks.Segments):
        return None
    return f"{type(tree).__name__} cannot be evaluated inside the kernel"


def _rebuild_combinator(node, fields, is_tuple, walk):
    """Rebuild a combinator from tile-local children."""
    names = fields[0] if is_tuple else fields
    children = getattr(node, names) if is_tuple else [getattr(node, f) for f in names]

    def where(n):
        return getattr(n, names) if is_tuple else tuple(getattr(n, f) for f in names)

    makers = [walk(child) for child in children]
    return lambda values: eqx.tree_at(where, node, tuple(m(values) for m in makers))


def _broadcast(values, shape):
    return jnp.broadcast_to(jnp.asarray(values), shape)


def split(tree, *, batch: int, heads: int, q_pad: int, kv_pad: int, local: bool = True):
    """Operands, kinds and `rebuild(values) -> tile-local tree` for a mask or score mod.

    `local=False`: `rebuild` makes the whole tree again instead, from operands of
    unpadded length (`q_pad`, `kv_pad` the call's lengths; `canonical`).
    """
    operands: list = []
    kinds: list[str] = []

    def walk(node) -> Callable[[list], Any]:
        if node is None or isinstance(node, _PURE):
            return lambda values: node
        for cls, (fields, is_tuple) in _COMBINATORS.items():
            if isinstance(node, cls):
                return _rebuild_combinator(node, fields, is_tuple, walk)
        if type(node) in _SCALAR_LEAVES:
            field, kind = _SCALAR_LEAVES[type(node)]
            size = batch if kind == "batch" else heads
            index = len(operands)
            array = getattr(node, field)
            operands.append(_broadcast(array, (size,)).astype(array.dtype))
            kinds.append(kind)
            return lambda values: eqx.tree_at(lambda n: getattr(n, field), node, values[index])
        if isinstance(node, masks.Segments):
            index = len(operands)
            for ids, length, pad_value in (
                (node.q_segment_ids, q_pad, -1),
                (node.kv_segment_ids, kv_pad, -2),
            ):
                ids = _broadcast(ids, (batch, ids.shape[-1])).astype(jnp.int32)
                operands.append(
                    jnp.pad(ids, ((0, 0), (0, length - ids.shape[-1])), constant_values=pad_value)
                )
            kinds.extend(["q_pos", "kv_pos"])
            if not local:
                return lambda values: masks.Segments(
                    values[index], values[index + 1], sorted=node.sorted
                )
            return lambda values: _TileSegments(values[index], values[index + 1])
        raise TypeError(unsupported_reason(node))

    rebuild = walk(tree)
    return operands, kinds, rebuild


def canonical(mask, score_mod, *, batch: int, heads: int, q_len: int, kv_len: int):
    """A call's mask and score-mod arrays in the kernels' layout, unpadded (`split`).

    Returns `(operands, kinds, restore)`: `restore(operands) -> (mask, score_mod)` makes
    both again from operands of this layout, of any batch size: the batch of a call can
    change (`_flash.attend` folds `vmap`'s axis into it) while its operands keep their
    meaning by kind.
    """

    def whole(tree):
        return split(tree, batch=batch, heads=heads, q_pad=q_len, kv_pad=kv_len, local=False)

    mask_ops, mask_kinds, mask_of = whole(mask)
    mod_ops, mod_kinds, mod_of = whole(score_mod)
    n = len(mask_ops)

    def restore(values):
        values = list(values)
        return mask_of(values[:n]), mod_of(values[n:])

    return tuple(mask_ops + mod_ops), tuple(mask_kinds + mod_kinds), restore


def unmasked_kv_ranges(ctx: masks.MaskContext, tile, *, program_block: int, loop_block: int):
    """`block_ranges`' entries for query tile `tile` without a mask, computed in a kernel.

    Passed as arrays, these constants cost launches: XLA turns each uniform one into a
    broadcast fusion (two per decode step at batch 8, run 31).
    """
    hi = -(-ctx.kv_len // loop_block)
    full_hi = ctx.kv_len // loop_block
    full_lo, full_hi = (0, full_hi) if full_hi > 0 else (hi, hi)
    # A product, not `jnp.where`: Triton rejects the select of two literals (i1 vs i32).
    live = (tile * program_block < ctx.q_len).astype(jnp.int32)
    return tuple(live * v for v in (0, full_lo, full_hi, hi))


def block_ranges(
    ctx: masks.MaskContext,
    mask,
    q_pad: int,
    kv_pad: int,
    *,
    program_block: int,
    loop_block: int,
    kv_loop: bool = True,
):
    """Per (batch, program tile): loop tiles `lo <= full_lo <= full_hi <= hi`.

    `[lo, hi)` holds every tile the mask leaves non-empty, `[full_lo, full_hi)` the tiles
    it leaves entirely valid. Programs tile the queries (`kv_loop`, looping over key tiles)
    or the keys (looping over query tiles).
    """
    n_prog_real = ctx.q_len if kv_loop else ctx.kv_len
    n_loop_real = ctx.kv_len if kv_loop else ctx.q_len
    n_programs = (q_pad if kv_loop else kv_pad) // program_block
    # Without a mask every bound is static: numpy constants, which cost no launches (the
    # traced version is a broadcast fusion per array, at decode sizes a visible cost).
    xp = np if mask is None else jnp
    starts = xp.arange(n_programs, dtype=np.int32) * program_block
    ends = xp.minimum(starts + program_block, n_prog_real)
    shape = (ctx.batch, n_programs)
    if mask is None:
        lo, hi = np.zeros(shape, np.int32), np.full(shape, n_loop_real, np.int32)
        full_lo, full_hi = lo, hi
    else:
        bounds = mask.kv_range if kv_loop else mask.q_range
        full = mask.kv_full_range if kv_loop else mask.q_full_range

        def one(b, lo, hi):
            return bounds(ctx, b, lo, hi) + full(ctx, b, lo, hi)

        b = jnp.arange(ctx.batch, dtype=jnp.int32)
        out = jax.vmap(lambda b: jax.vmap(lambda s, e: one(b, s, e))(starts, ends))(b)
        lo, hi, full_lo, full_hi = (jnp.broadcast_to(x, shape).astype(jnp.int32) for x in out)
    empty = (hi <= lo) | (starts >= n_prog_real)[None, :]
    lo_blk = xp.where(empty, 0, lo // loop_block)
    hi_blk = xp.where(empty, 0, -(-hi // loop_block))
    # Padded keys of a partial program tile need the mask's length check.
    partial = ends < starts + program_block if not kv_loop else xp.zeros_like(starts, dtype=bool)
    full_lo_blk = xp.clip(-(-full_lo // loop_block), lo_blk, hi_blk)
    full_hi_blk = xp.clip(full_hi // loop_block, full_lo_blk, hi_blk)
    no_full = (full_hi_blk <= full_lo_blk) | partial[None, :]
    full_lo_blk = xp.where(no_full, hi_blk, full_lo_blk)
    full_hi_blk = xp.where(no_full, hi_blk, full_hi_blk)
    return tuple(x.astype(np.int32) for x in (lo_blk, full_lo_blk, full_hi_blk, hi_blk))
