"""Score modifications: functions of `(score, b, h, q_idx, kv_idx)`, as in torch flex_attention.

A score mod is applied to the scaled logits `scale * q @ k.T` before masking and the
softmax. Additive biases (`ALiBi`, `RelativePosition`, `DenseBias`) add a term and sum
with `+`; `SoftCap` and `HeadScale` transform the score; `Compose` applies several in
order. Index arguments are broadcastable int32 arrays, so the same code runs densely in
the reference and per tile inside kernels.
"""

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .masks import ArrayAxes


class AbstractScoreMod(eqx.Module):
    """Base of all score modifications."""

    array_axes: ClassVar[ArrayAxes] = {}  # as masks': `masks.check_arrays`

    @abc.abstractmethod
    def __call__(self, score: Array, b: Array, h: Array, q: Array, kv: Array) -> Array:
        """Return the modified score (float32, broadcast over the index arrays)."""

    @abc.abstractmethod
    def spec(self) -> tuple:
        """Hashable static structure, read by capability checks."""


class AbstractBias(AbstractScoreMod):
    """An additive score modification: `score + bias(b, h, q, kv)`. Sum biases with `+`."""

    @abc.abstractmethod
    def bias(self, b: Array, h: Array, q: Array, kv: Array) -> Array:
        """The additive term."""

    def __call__(self, score, b, h, q, kv):
        return score + self.bias(b, h, q, kv).astype(score.dtype)

    def __add__(self, other: "AbstractBias") -> "AbstractBias":
        if not isinstance(other, AbstractBias):
            raise TypeError(f"only additive biases can be summed, got {type(other).__name__}")
        return BiasSum((self, other))


class BiasSum(AbstractBias):
    """The sum of several additive biases."""

    terms: tuple[AbstractBias, ...]

    def bias(self, b, h, q, kv):
        total = self.terms[0].bias(b, h, q, kv)
        for term in self.terms[1:]:
            total = total + term.bias(b, h, q, kv)
        return total

    def spec(self):
        return ("sum",) + tuple(t.spec() for t in self.terms)


def _head(values: Array, h: Array) -> Array:
    if values.ndim == 0:  # already this head's value (inside a kernel)
        return values
    return values[jnp.minimum(h, values.shape[0] - 1)]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Geometric ALiBi slopes (Press et al., 2022), incl. non-power-of-two head counts."""

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = powers(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = powers(closest) + powers(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)


class ALiBi(AbstractBias):
    """Linear distance penalty `-slope[h] * |q - kv|` (equals the causal ALiBi under a causal mask).

    Build with `ALiBi.from_num_heads(num_heads)` for the standard slopes.
    """

    slopes: Float[Array, " heads"]
    array_axes: ClassVar[ArrayAxes] = {"slopes": ("heads",)}

    def __init__(self, slopes: Float[ArrayLike, " heads"]):
        self.slopes = jnp.asarray(slopes, jnp.float32)

    @classmethod
    def from_num_heads(cls, num_heads: int) -> "ALiBi":
        return cls(alibi_slopes(num_heads))

    def bias(self, b, h, q, kv):
        return -_head(self.slopes, h) * jnp.abs(q - kv).astype(jnp.float32)

    def spec(self):
        return ("alibi",)


def relative_position_bucket(
    relative_position: ArrayLike, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Array:
    """T5's bucketing of `kv - q`: exact buckets near zero, logarithmic beyond."""
    relative_position = jnp.asarray(relative_position, jnp.int32)
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    scaled = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact
    )
    large = max_exact + (scaled * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, distance, large)


class RelativePosition(AbstractBias):
    """T5-style bucketed relative-position bias: `table[h, bucket(kv - q)]`."""

    table: Float[Array, "heads num_buckets"]
    array_axes: ClassVar[ArrayAxes] = {"table": ("heads", None)}
    bidirectional: bool = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)

    def __init__(
        self,
        table: Float[ArrayLike, "heads num_buckets"],
        *,
        bidirectional: bool = True,
        max_distance: int = 128,
    ):
        self.table = jnp.asarray(table, jnp.float32)
        self.bidirectional = bidirectional
        self.max_distance = max_distance

    def bias(self, b, h, q, kv):
        bucket = relative_position_bucket(
            kv - q,
            bidirectional=self.bidirectional,
            num_buckets=self.table.shape[1],
            max_distance=self.max_distance,
        )
        return self.table[jnp.minimum(h, self.table.shape[0] - 1), bucket]

    def spec(self):
        return ("relative_position", self.bidirectional, self.max_distance)


class DenseBias(AbstractBias):
    """An explicit bias broadcastable to `[batch, heads, q_seq, kv_seq]`."""

    values: Float[Array, "_b _h q_seq kv_seq"]
    array_axes: ClassVar[ArrayAxes] = {"values": ("batch", "heads", "q_len", "kv_len")}

    def __init__(self, values: Float[ArrayLike, "_b _h q_seq kv_seq"]):
        self.values = jnp.asarray(values)

    def bias(self, b, h, q, kv):
        nb, nh = self.values.shape[:2]
        return self.values[jnp.minimum(b, nb - 1), jnp.minimum(h, nh - 1), q, kv]

    def spec(self):
        return ("dense_bias",)


class SoftCap(AbstractScoreMod):
    """Soft-capping `cap * tanh(score / cap)` (Gemma 2)."""

    cap: float = eqx.field(static=True)

    def __check_init__(self):
        if not self.cap > 0:
            raise ValueError(f"SoftCap cap={self.cap} must be > 0")

    def __call__(self, score, b, h, q, kv):
        return self.cap * jnp.tanh(score / self.cap)

    def spec(self):
        return ("softcap", self.cap)


class HeadScale(AbstractScoreMod):
    """Per-head multiplicative scale of the score."""

    scales: Float[Array, " heads"]
    array_axes: ClassVar[ArrayAxes] = {"scales": ("heads",)}

    def __init__(self, scales: Float[ArrayLike, " heads"]):
        self.scales = jnp.asarray(scales, jnp.float32)

    def __call__(self, score, b, h, q, kv):
        return score * _head(self.scales, h)

    def spec(self):
        return ("head_scale",)


class Compose(AbstractScoreMod):
    """Apply score mods in order: `Compose((ALiBi(...), SoftCap(30.0)))`."""

    mods: tuple[AbstractScoreMod, ...]

    def __call__(self, score, b, h, q, kv):
        for mod in self.mods:
            score = mod(score, b, h, q, kv)
        return score

    def spec(self):
        return ("compose",) + tuple(m.spec() for m in self.mods)


class ScoreFn(AbstractScoreMod):
    """Wrap a user function `fn(score, b, h, q_idx, kv_idx) -> score` (torch flex style)."""

    fn: object = eqx.field(static=True)

    def __call__(self, score, b, h, q, kv):
        return self.fn(score, b, h, q, kv)  # pyright: ignore[reportCallIssue]

    def spec(self):
        return ("score_fn", self.fn)
