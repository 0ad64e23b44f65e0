"""Attention masks as pytrees, combined with `&`, `|` and `~`.

A mask says which (query, key) pairs may attend. Every mask has

- `predicate(ctx, b, h, q, kv)`: an elementwise boolean over broadcastable integer
  index arrays (batch, query head, query position, key position). The reference
  evaluates it densely; kernels evaluate it on one tile at a time.
- `kv_range(ctx, b, q_lo, q_hi)` / `q_range(ctx, b, kv_lo, kv_hi)`: conservative
  half-open bounds of the key (query) positions that can be valid for a block of
  queries (keys). Kernels skip tiles outside them; they never exclude a valid pair.
- `spec()`: a hashable description of the static structure, which capability checks
  read (e.g. whether cuDNN can express the mask).

Positions are 0-based. For `Lq != Lkv`, `alignment="top_left"` compares positions
directly and `"bottom_right"` shifts queries by `Lkv - Lq`, so the last query sees the
last key (the decoding convention). Per-batch arrays have a leading batch dimension
of size `batch` or 1, or none at all (broadcast); a call refuses any other size
(`check_arrays`, over each class's `array_axes`).
"""

import abc
import dataclasses
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

Alignment = Literal["top_left", "bottom_right"]


@dataclasses.dataclass(frozen=True)
class MaskContext:
    """Static sizes a mask is evaluated against."""

    batch: int
    q_len: int
    kv_len: int

    def offset(self, alignment: Alignment) -> int:
        """Shift added to query positions so that they align with key positions."""
        return 0 if alignment == "top_left" else self.kv_len - self.q_len


def _per_batch(values: Array, b: Array) -> Array:
    """Index a `[batch]`, `[1]` or scalar array by batch indices `b`."""
    values = jnp.asarray(values)
    if values.ndim == 0:
        return jnp.broadcast_to(values, jnp.shape(b))
    return values[jnp.minimum(b, values.shape[0] - 1)]


def _per_batch_row(values: Array, b: Array, pos: Array) -> Array:
    """Index a `[batch, length]` or `[length]` array by batch and position."""
    values = jnp.asarray(values)
    if values.ndim == 1:
        return values[pos]
    return values[jnp.minimum(b, values.shape[0] - 1), pos]


# An array field's axes, outermost first, by the call size each must equal or be 1 for
# (broadcast); None: any size. Leading axes may be left out.
ArrayAxes = dict[str, tuple[Literal["batch", "heads", "q_len", "kv_len"] | None, ...]]


def check_arrays(tree, *, batch: int, heads: int, q_len: int, kv_len: int) -> None:
    """Raise `ValueError` where an array of a mask or score mod does not fit the call.

    Each array's axes (`array_axes`) must be 1 or the call's size: indexed by batch, head
    or position, a longer or shorter one would be clamped and read another's entry.
    """
    sizes = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len}
    holders = jax.tree.leaves(tree, is_leaf=lambda node: bool(getattr(node, "array_axes", None)))
    for node in holders:
        for field, axes in getattr(node, "array_axes", {}).items():
            shape = jnp.shape(getattr(node, field))
            named = axes[len(axes) - len(shape) :]
            if len(shape) > len(axes) or any(
                name is not None and n not in (1, sizes[name]) for name, n in zip(named, shape)
            ):
                call = ", ".join(f"{name}={sizes[name]}" for name in axes if name is not None)
                raise ValueError(
                    f"{type(node).__name__}.{field} has shape {shape}, axes {axes} (leading ones "
                    f"may be left out): each must be 1 or the call's size ({call})"
                )


class AbstractMask(eqx.Module):
    """Base of all masks. Combine masks with `&`, `|` and `~`."""

    array_axes: ClassVar[ArrayAxes] = {}

    @abc.abstractmethod
    def predicate(self, ctx: MaskContext, b: Array, h: Array, q: Array, kv: Array) -> Array:
        """Elementwise validity of (query, key) pairs over broadcastable indices."""

    @abc.abstractmethod
    def kv_range(self, ctx: MaskContext, b: Array, q_lo: Array, q_hi: Array) -> tuple[Array, Array]:
        """Bounds `[lo, hi)` of keys that may be valid for queries `[q_lo, q_hi)`."""

    @abc.abstractmethod
    def q_range(
        self, ctx: MaskContext, b: Array, kv_lo: Array, kv_hi: Array
    ) -> tuple[Array, Array]:
        """Bounds `[lo, hi)` of queries that may be valid for keys `[kv_lo, kv_hi)`."""

    @abc.abstractmethod
    def spec(self) -> tuple:
        """Hashable static structure, read by capability checks."""

    def kv_full_range(
        self, ctx: MaskContext, b: Array, q_lo: Array, q_hi: Array
    ) -> tuple[Array, Array]:
        """Bounds `[lo, hi)` of keys valid for every query in `[q_lo, q_hi)` (may be empty).

        Kernels skip evaluating the mask on tiles inside it. The default claims nothing.
        """
        return _nothing()

    def q_full_range(
        self, ctx: MaskContext, b: Array, kv_lo: Array, kv_hi: Array
    ) -> tuple[Array, Array]:
        """Bounds `[lo, hi)` of queries valid for every key in `[kv_lo, kv_hi)` (may be empty)."""
        return _nothing()

    def dense(self, batch: int, q_len: int, kv_len: int, num_heads: int = 1) -> Bool[Array, "..."]:
        """The mask as a `[batch, num_heads, q_len, kv_len]` boolean array."""
        ctx = MaskContext(batch, q_len, kv_len)
        b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
        h = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None, None]
        q = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
        kv = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
        out = self.predicate(ctx, b, h, q, kv)
        return jnp.broadcast_to(out, (batch, num_heads, q_len, kv_len))

    def __and__(self, other: "AbstractMask") -> "AbstractMask":
        return And(self, _as_mask(other))

    def __or__(self, other: "AbstractMask") -> "AbstractMask":
        return Or(self, _as_mask(other))

    def __invert__(self) -> "AbstractMask":
        return Not(self)


def _as_mask(mask: object) -> AbstractMask:
    if not isinstance(mask, AbstractMask):
        raise TypeError(f"masks combine with masks, got {type(mask).__name__}")
    return mask


def _all_keys(ctx: MaskContext) -> tuple[Array, Array]:
    return jnp.int32(0), jnp.int32(ctx.kv_len)


def _all_queries(ctx: MaskContext) -> tuple[Array, Array]:
    return jnp.int32(0), jnp.int32(ctx.q_len)


def _nothing() -> tuple[Array, Array]:
    return jnp.int32(0), jnp.int32(0)


def _clip(lo: Array, hi: Array, n: int) -> tuple[Array, Array]:
    lo = jnp.clip(jnp.asarray(lo, jnp.int32), 0, n)
    hi = jnp.clip(jnp.asarray(hi, jnp.int32), 0, n)
    return lo, jnp.maximum(hi, lo)


class Causal(AbstractMask):
    """Each query sees keys at or before its own position."""

    alignment: Alignment = eqx.field(static=True, default="top_left")

    def predicate(self, ctx, b, h, q, kv):
        return kv <= q + ctx.offset(self.alignment)

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _clip(jnp.int32(0), q_hi + ctx.offset(self.alignment), ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        return _clip(kv_lo - ctx.offset(self.alignment), jnp.int32(ctx.q_len), ctx.q_len)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        return _clip(jnp.int32(0), q_lo + ctx.offset(self.alignment) + 1, ctx.kv_len)

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        return _clip(kv_hi - 1 - ctx.offset(self.alignment), jnp.int32(ctx.q_len), ctx.q_len)

    def spec(self):
        return ("causal", self.alignment)


class LocalWindow(AbstractMask):
    """Query at aligned position `p` sees keys in `[p - left, p + right]`.

    `None` leaves that side unbounded: `LocalWindow(left=w, right=0)` is a causal
    sliding window of `w + 1` keys.
    """

    left: int | None = eqx.field(static=True, default=None)
    right: int | None = eqx.field(static=True, default=None)
    alignment: Alignment = eqx.field(static=True, default="top_left")

    def __check_init__(self):
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"LocalWindow {name}={value} must be >= 0 or None")

    def predicate(self, ctx, b, h, q, kv):
        p = q + ctx.offset(self.alignment)
        ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(p), jnp.shape(kv)), bool)
        if self.left is not None:
            ok = ok & (kv >= p - self.left)
        if self.right is not None:
            ok = ok & (kv <= p + self.right)
        return ok

    def kv_range(self, ctx, b, q_lo, q_hi):
        off = ctx.offset(self.alignment)
        lo = jnp.int32(0) if self.left is None else q_lo + off - self.left
        hi = jnp.int32(ctx.kv_len) if self.right is None else q_hi + off + self.right
        return _clip(lo, hi, ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        off = ctx.offset(self.alignment)
        lo = jnp.int32(0) if self.right is None else kv_lo - off - self.right
        hi = jnp.int32(ctx.q_len) if self.left is None else kv_hi - off + self.left
        return _clip(lo, hi, ctx.q_len)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        off = ctx.offset(self.alignment)
        lo = jnp.int32(0) if self.left is None else q_hi - 1 + off - self.left
        hi = jnp.int32(ctx.kv_len) if self.right is None else q_lo + off + self.right + 1
        return _clip(lo, hi, ctx.kv_len)

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        off = ctx.offset(self.alignment)
        lo = jnp.int32(0) if self.right is None else kv_hi - 1 - self.right - off
        hi = jnp.int32(ctx.q_len) if self.left is None else kv_lo + self.left - off + 1
        return _clip(lo, hi, ctx.q_len)

    def spec(self):
        return ("local_window", self.left, self.right, self.alignment)


def causal_local_window(window: int, alignment: Alignment = "top_left") -> AbstractMask:
    """Causal sliding window: each query sees itself and the `window - 1` keys before."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    return LocalWindow(left=window - 1, right=0, alignment=alignment)


class PrefixLM(AbstractMask):
    """Bidirectional over the first `prefix_length` keys, causal after (top-left)."""

    prefix_length: Int[Array, "*batch"]
    array_axes: ClassVar[ArrayAxes] = {"prefix_length": ("batch",)}

    def __init__(self, prefix_length: int | Int[ArrayLike, "*batch"]):
        self.prefix_length = jnp.asarray(prefix_length, jnp.int32)

    def predicate(self, ctx, b, h, q, kv):
        return (kv <= q) | (kv < _per_batch(self.prefix_length, b))

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _clip(jnp.int32(0), jnp.maximum(q_hi, _per_batch(self.prefix_length, b)), ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        prefix = _per_batch(self.prefix_length, b)
        return _clip(jnp.where(kv_lo < prefix, 0, kv_lo), jnp.int32(ctx.q_len), ctx.q_len)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        prefix = _per_batch(self.prefix_length, b)
        return _clip(jnp.int32(0), jnp.maximum(q_lo + 1, prefix), ctx.kv_len)

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        prefix = _per_batch(self.prefix_length, b)
        lo = jnp.where(kv_hi <= prefix, 0, kv_hi - 1)
        return _clip(lo, jnp.int32(ctx.q_len), ctx.q_len)

    def spec(self):
        return ("prefix_lm",)


class BlockDiagonal(AbstractMask):
    """Queries in block `i` (of `q_block` rows) see only keys in block `i` (of `kv_block`)."""

    q_block: int = eqx.field(static=True)
    kv_block: int = eqx.field(static=True)

    def __init__(self, q_block: int, kv_block: int | None = None):
        self.q_block = q_block
        self.kv_block = q_block if kv_block is None else kv_block

    def __check_init__(self):
        if self.q_block < 1 or self.kv_block < 1:
            raise ValueError(f"block sizes must be >= 1, got {self.q_block=}, {self.kv_block=}")

    def predicate(self, ctx, b, h, q, kv):
        return q // self.q_block == kv // self.kv_block

    def kv_range(self, ctx, b, q_lo, q_hi):
        first = q_lo // self.q_block
        last = (jnp.maximum(q_hi, q_lo + 1) - 1) // self.q_block
        return _clip(first * self.kv_block, (last + 1) * self.kv_block, ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        first = kv_lo // self.kv_block
        last = (jnp.maximum(kv_hi, kv_lo + 1) - 1) // self.kv_block
        return _clip(first * self.q_block, (last + 1) * self.q_block, ctx.q_len)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        first, last = q_lo // self.q_block, (q_hi - 1) // self.q_block
        hi = jnp.where(first == last, (first + 1) * self.kv_block, 0)
        return _clip(first * self.kv_block, hi, ctx.kv_len)

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        first, last = kv_lo // self.kv_block, (kv_hi - 1) // self.kv_block
        hi = jnp.where(first == last, (first + 1) * self.q_block, 0)
        return _clip(first * self.q_block, hi, ctx.q_len)

    def spec(self):
        return ("block_diagonal", self.q_block, self.kv_block)


class KVLengths(AbstractMask):
    """Batch element `b` has `lengths[b]` valid keys (padding at the end)."""

    lengths: Int[Array, "*batch"]
    array_axes: ClassVar[ArrayAxes] = {"lengths": ("batch",)}

    def __init__(self, lengths: int | Int[ArrayLike, "*batch"]):
        self.lengths = jnp.asarray(lengths, jnp.int32)

    def predicate(self, ctx, b, h, q, kv):
        return kv < _per_batch(self.lengths, b)

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _clip(jnp.int32(0), _per_batch(self.lengths, b), ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        hi = jnp.where(kv_lo < _per_batch(self.lengths, b), ctx.q_len, 0)
        return _clip(jnp.int32(0), hi, ctx.q_len)

    kv_full_range = kv_range

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        hi = jnp.where(kv_hi <= _per_batch(self.lengths, b), ctx.q_len, 0)
        return _clip(jnp.int32(0), hi, ctx.q_len)

    def spec(self):
        return ("kv_lengths",)


class QLengths(AbstractMask):
    """Batch element `b` has `lengths[b]` valid queries; later rows attend to nothing."""

    lengths: Int[Array, "*batch"]
    array_axes: ClassVar[ArrayAxes] = {"lengths": ("batch",)}

    def __init__(self, lengths: int | Int[ArrayLike, "*batch"]):
        self.lengths = jnp.asarray(lengths, jnp.int32)

    def predicate(self, ctx, b, h, q, kv):
        return q < _per_batch(self.lengths, b)

    def kv_range(self, ctx, b, q_lo, q_hi):
        hi = jnp.where(q_lo < _per_batch(self.lengths, b), ctx.kv_len, 0)
        return _clip(jnp.int32(0), hi, ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        return _clip(jnp.int32(0), _per_batch(self.lengths, b), ctx.q_len)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        hi = jnp.where(q_hi <= _per_batch(self.lengths, b), ctx.kv_len, 0)
        return _clip(jnp.int32(0), hi, ctx.kv_len)

    q_full_range = q_range

    def spec(self):
        return ("q_lengths",)


class Segments(AbstractMask):
    """Queries attend only to keys with the same segment id (packed sequences).

    With `sorted=True` the ids must be non-decreasing along the sequence; kernels then
    skip key tiles outside the query tile's segments.
    """

    q_segment_ids: Int[Array, "*batch q_seq"]
    kv_segment_ids: Int[Array, "*batch kv_seq"]
    sorted: bool = eqx.field(static=True)
    array_axes: ClassVar[ArrayAxes] = {
        "q_segment_ids": ("batch", "q_len"),
        "kv_segment_ids": ("batch", "kv_len"),
    }

    def __init__(
        self,
        q_segment_ids: Int[ArrayLike, "*batch q_seq"],
        kv_segment_ids: Int[ArrayLike, "*batch kv_seq"] | None = None,
        *,
        sorted: bool = False,
    ):
        self.q_segment_ids = jnp.asarray(q_segment_ids, jnp.int32)
        kv = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        self.kv_segment_ids = jnp.asarray(kv, jnp.int32)
        self.sorted = sorted

    def predicate(self, ctx, b, h, q, kv):
        return _per_batch_row(self.q_segment_ids, b, q) == _per_batch_row(
            self.kv_segment_ids, b, kv
        )

    def _ids(self, ids: Array, b: Array) -> Array:
        return ids if ids.ndim == 1 else ids[jnp.minimum(b, ids.shape[0] - 1)]

    def kv_range(self, ctx, b, q_lo, q_hi):
        if not self.sorted:
            return _all_keys(ctx)
        q_ids, kv_ids = self._ids(self.q_segment_ids, b), self._ids(self.kv_segment_ids, b)
        last = jnp.clip(q_hi - 1, 0, ctx.q_len - 1)
        lo = jnp.searchsorted(kv_ids, q_ids[jnp.clip(q_lo, 0, ctx.q_len - 1)], side="left")
        hi = jnp.searchsorted(kv_ids, q_ids[last], side="right")
        return _clip(lo, hi, ctx.kv_len)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        if not self.sorted:
            return _all_queries(ctx)
        q_ids, kv_ids = self._ids(self.q_segment_ids, b), self._ids(self.kv_segment_ids, b)
        last = jnp.clip(kv_hi - 1, 0, ctx.kv_len - 1)
        lo = jnp.searchsorted(q_ids, kv_ids[jnp.clip(kv_lo, 0, ctx.kv_len - 1)], side="left")
        hi = jnp.searchsorted(q_ids, kv_ids[last], side="right")
        return _clip(lo, hi, ctx.q_len)

    def _one_segment(self, ids, other, lo, hi, n, n_other):
        """Where `ids[lo:hi]` is one segment: the positions of that id in `other`."""
        if not self.sorted:
            return _nothing()
        first, last = ids[jnp.clip(lo, 0, n - 1)], ids[jnp.clip(hi - 1, 0, n - 1)]
        start = jnp.searchsorted(other, first, side="left")
        end = jnp.where(first == last, jnp.searchsorted(other, first, side="right"), 0)
        return _clip(start, end, n_other)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        q_ids, kv_ids = self._ids(self.q_segment_ids, b), self._ids(self.kv_segment_ids, b)
        return self._one_segment(q_ids, kv_ids, q_lo, q_hi, ctx.q_len, ctx.kv_len)

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        q_ids, kv_ids = self._ids(self.q_segment_ids, b), self._ids(self.kv_segment_ids, b)
        return self._one_segment(kv_ids, q_ids, kv_lo, kv_hi, ctx.kv_len, ctx.q_len)

    def spec(self):
        return ("segments", self.sorted)


class DenseMask(AbstractMask):
    """An explicit boolean mask broadcastable to `[batch, heads, q_seq, kv_seq]`."""

    mask: Bool[Array, "_b _h q_seq kv_seq"]
    array_axes: ClassVar[ArrayAxes] = {"mask": ("batch", "heads", "q_len", "kv_len")}

    def __init__(self, mask: Bool[ArrayLike, "_b _h q_seq kv_seq"]):
        self.mask = jnp.asarray(mask, bool)

    def predicate(self, ctx, b, h, q, kv):
        nb, nh = self.mask.shape[:2]
        return self.mask[jnp.minimum(b, nb - 1), jnp.minimum(h, nh - 1), q, kv]

    def spec(self):
        return ("dense",)

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _all_keys(ctx)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        return _all_queries(ctx)


class MaskFn(AbstractMask):
    """A user function `fn(b, h, q_idx, kv_idx) -> bool` (torch flex `mask_mod` style).

    `fn` must be elementwise and broadcast over its index arguments.
    """

    fn: object = eqx.field(static=True)

    def predicate(self, ctx, b, h, q, kv):
        return jnp.asarray(self.fn(b, h, q, kv), bool)  # pyright: ignore[reportCallIssue]

    def spec(self):
        return ("mask_fn", self.fn)

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _all_keys(ctx)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        return _all_queries(ctx)


class And(AbstractMask):
    """Pairs valid under both masks."""

    left: AbstractMask
    right: AbstractMask

    def predicate(self, ctx, b, h, q, kv):
        return self.left.predicate(ctx, b, h, q, kv) & self.right.predicate(ctx, b, h, q, kv)

    def kv_range(self, ctx, b, q_lo, q_hi):
        lo1, hi1 = self.left.kv_range(ctx, b, q_lo, q_hi)
        lo2, hi2 = self.right.kv_range(ctx, b, q_lo, q_hi)
        lo = jnp.maximum(lo1, lo2)
        return lo, jnp.maximum(jnp.minimum(hi1, hi2), lo)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        lo1, hi1 = self.left.q_range(ctx, b, kv_lo, kv_hi)
        lo2, hi2 = self.right.q_range(ctx, b, kv_lo, kv_hi)
        lo = jnp.maximum(lo1, lo2)
        return lo, jnp.maximum(jnp.minimum(hi1, hi2), lo)

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        return _meet(
            self.left.kv_full_range(ctx, b, q_lo, q_hi),
            self.right.kv_full_range(ctx, b, q_lo, q_hi),
        )

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        return _meet(
            self.left.q_full_range(ctx, b, kv_lo, kv_hi),
            self.right.q_full_range(ctx, b, kv_lo, kv_hi),
        )

    def spec(self):
        return ("and", self.left.spec(), self.right.spec())


class Or(AbstractMask):
    """Pairs valid under either mask."""

    left: AbstractMask
    right: AbstractMask

    def predicate(self, ctx, b, h, q, kv):
        return self.left.predicate(ctx, b, h, q, kv) | self.right.predicate(ctx, b, h, q, kv)

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _hull(
            self.left.kv_range(ctx, b, q_lo, q_hi), self.right.kv_range(ctx, b, q_lo, q_hi)
        )

    def q_range(self, ctx, b, kv_lo, kv_hi):
        return _hull(
            self.left.q_range(ctx, b, kv_lo, kv_hi), self.right.q_range(ctx, b, kv_lo, kv_hi)
        )

    def kv_full_range(self, ctx, b, q_lo, q_hi):
        return _wider(
            self.left.kv_full_range(ctx, b, q_lo, q_hi),
            self.right.kv_full_range(ctx, b, q_lo, q_hi),
        )

    def q_full_range(self, ctx, b, kv_lo, kv_hi):
        return _wider(
            self.left.q_full_range(ctx, b, kv_lo, kv_hi),
            self.right.q_full_range(ctx, b, kv_lo, kv_hi),
        )

    def spec(self):
        return ("or", self.left.spec(), self.right.spec())


def _meet(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
    lo = jnp.maximum(a[0], b[0])
    return lo, jnp.maximum(jnp.minimum(a[1], b[1]), lo)


def _wider(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
    """Either interval is fully valid under a union; keep the wider (no hull: gaps)."""
    pick_a = a[1] - a[0] >= b[1] - b[0]
    return jnp.where(pick_a, a[0], b[0]), jnp.where(pick_a, a[1], b[1])


def _hull(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
    (lo1, hi1), (lo2, hi2) = a, b
    empty1, empty2 = hi1 <= lo1, hi2 <= lo2
    lo = jnp.where(empty1, lo2, jnp.where(empty2, lo1, jnp.minimum(lo1, lo2)))
    hi = jnp.where(empty1, hi2, jnp.where(empty2, hi1, jnp.maximum(hi1, hi2)))
    return lo, hi


class Not(AbstractMask):
    """Pairs invalid under `mask` (bounds stay conservative: the whole range)."""

    mask: AbstractMask

    def predicate(self, ctx, b, h, q, kv):
        return ~self.mask.predicate(ctx, b, h, q, kv)

    def spec(self):
        return ("not", self.mask.spec())

    def kv_range(self, ctx, b, q_lo, q_hi):
        return _all_keys(ctx)

    def q_range(self, ctx, b, kv_lo, kv_hi):
        return _all_queries(ctx)


def conjuncts(mask: AbstractMask | None) -> tuple[AbstractMask, ...]:
    """The masks that `mask` intersects (`a & (b & c)` -> `(a, b, c)`); `()` for no mask."""
    if mask is None:
        return ()
    if isinstance(mask, And):
        return conjuncts(mask.left) + conjuncts(mask.right)
    return (mask,)
