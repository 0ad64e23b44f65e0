"""Exact attention in plain JAX (the oracle, and the `"xla"` implementation).

Softmax is computed in float32 with the row maximum subtracted; a row without any valid
key gives output 0 and zero gradients (no NaN), because masked scores never reach
`exp` and the normaliser of an empty row is replaced by 1.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from probjax_eqx.attention_call import AttentionCall, AttentionCapabilities
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.biases import AbstractScoreMod
from probjax_eqx.masks import AbstractMask, MaskContext


def index_grids(batch: int, kv_heads: int, groups: int, q_len: int, kv_len: int):
    """Broadcastable (b, h, q, kv) index arrays for scores laid out `[B, Hkv, G, Lq, Lkv]`.

    Query head `h = kv_head * groups + g`: the query heads of one KV head are adjacent
    (the GQA convention of `jax.nn.dot_product_attention`).
    """
    i32 = jnp.int32
    b = jnp.arange(batch, dtype=i32).reshape(batch, 1, 1, 1, 1)
    h = jnp.arange(kv_heads * groups, dtype=i32).reshape(1, kv_heads, groups, 1, 1)
    q = jnp.arange(q_len, dtype=i32).reshape(1, 1, 1, q_len, 1)
    kv = jnp.arange(kv_len, dtype=i32).reshape(1, 1, 1, 1, kv_len)
    return b, h, q, kv


def attention(
    q: Float[Array, "batch q_seq q_heads qk_dim"],
    k: Float[Array, "batch kv_seq kv_heads qk_dim"],
    v: Float[Array, "batch kv_seq kv_heads v_dim"],
    *,
    mask: AbstractMask | None,
    score_mod: AbstractScoreMod | None,
    scale: float,
    oracle: bool = True,
    return_lse: bool = False,
):
    """Attention with an explicit score matrix.

    Args:
        q: queries `[batch, q_seq, q_heads, qk_dim]`.
        k: keys `[batch, kv_seq, kv_heads, qk_dim]`; `q_heads` is a multiple of `kv_heads`.
        v: values `[batch, kv_seq, kv_heads, v_dim]`.
        mask: which pairs may attend, or `None` for all.
        score_mod: modification of the scaled scores, or `None`.
        scale: multiplier of `q @ k.T`.
        oracle: upcast every operand to float32 and multiply at `HIGHEST` precision
            (the test oracle). Otherwise multiply in the input dtype with float32
            accumulation, at `HIGHEST` for float32 inputs (the `"xla"` backend).
        return_lse: also return the log-sum-exp per row `[batch, q_heads, q_seq]`
            (`-inf` for rows without a valid key).

    Returns:
        The output `[batch, q_seq, q_heads, v_dim]` in `q.dtype` (and the lse).
    """
    batch, q_len, q_heads, qk_dim = q.shape
    _, kv_len, kv_heads, v_dim = v.shape
    groups = q_heads // kv_heads
    f32 = jnp.float32
    if oracle:
        q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    # Products of 16-bit inputs are exact in float32 accumulation at any precision;
    # float32 inputs need HIGHEST to avoid TF32 rounding.
    precision = jax.lax.Precision.HIGHEST if q.dtype == f32 else jax.lax.Precision.DEFAULT
    qg = q.reshape(batch, q_len, kv_heads, groups, qk_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=precision, preferred_element_type=f32)
    s = s * jnp.asarray(scale, f32)
    b, h, qi, ki = index_grids(batch, kv_heads, groups, q_len, kv_len)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).astype(f32)
    if mask is None:
        row_max = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        p = jnp.exp(s - row_max)
    else:
        ctx = MaskContext(batch, q_len, kv_len)
        valid = jnp.broadcast_to(mask.predicate(ctx, b, h, qi, ki), s.shape)
        row_max = jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1, keepdims=True)
        row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
        # Masked scores never reach exp, so empty rows have no inf/NaN in any gradient.
        p = jnp.where(valid, jnp.exp(jnp.where(valid, s - row_max, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    p = p / safe_denom
    pv_dtype = f32 if oracle else v.dtype
    o = jnp.einsum(
        "bhgqk,bkhd->bqhgd", p.astype(pv_dtype), v, precision=precision, preferred_element_type=f32
    )
    o = o.reshape(batch, q_len, q_heads, v_dim).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(denom > 0, jnp.log(safe_denom) + row_max, -jnp.inf)
    return o, lse[..., 0].reshape(batch, q_heads, q_len)


@dataclasses.dataclass(frozen=True)
class XlaBlocks:
    """Forward-with-lse and backward-given-lse halves of exact attention in plain JAX.

    The interface of `_flash.FlashKernels`, for callers that merge key blocks.
    """

    mask: AbstractMask | None
    scale: float

    def forward_lse(self, q, k, v):
        return attention(
            q, k, v, mask=self.mask, score_mod=None, scale=self.scale, oracle=False,
            return_lse=True,
        )  # fmt: skip

    def backward_given(self, q, k, v, o, lse, do):
        """Gradients through this block's keys, given the rows' statistics over all keys.

        `p = exp(s - lse)`, `ds = p * (do . v - do . o)`.
        """
        batch, q_len, q_heads, qk_dim = q.shape
        _, kv_len, kv_heads, v_dim = v.shape
        groups = q_heads // kv_heads
        f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
        qg = q.astype(f32).reshape(batch, q_len, kv_heads, groups, qk_dim)
        kf, vf = k.astype(f32), v.astype(f32)
        dog = do.astype(f32).reshape(batch, q_len, kv_heads, groups, v_dim)
        og = o.astype(f32).reshape(batch, q_len, kv_heads, groups, v_dim)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kf, precision=hi) * self.scale
        lse = lse.reshape(batch, kv_heads, groups, q_len)[..., None]
        valid = jnp.isfinite(lse)
        if self.mask is not None:
            ctx = MaskContext(batch, q_len, kv_len)
            b, h, qi, ki = index_grids(batch, kv_heads, groups, q_len, kv_len)
            valid = valid & self.mask.predicate(ctx, b, h, qi, ki)
        p = jnp.where(valid, jnp.exp(jnp.where(valid, s - lse, 0.0)), 0.0)
        delta = jnp.einsum("bqhgd,bqhgd->bhgq", og, dog, precision=hi)[..., None]
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, vf, precision=hi)
        ds = p * (dp - delta) * self.scale
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kf, precision=hi)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=hi)
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog, precision=hi)
        return dq.reshape(q.shape), dk, dv


@dataclasses.dataclass(frozen=True)
class XlaAttentionConfig:
    """Config of the `"xla"` implementation.

    Attributes:
        oracle: upcast to float32 and multiply at `HIGHEST` (slower, the test oracle).
    """

    oracle: bool = False


@dataclasses.dataclass(frozen=True)
class XlaAttention:
    """The `"xla"` implementation: exact attention through XLA, any mask or score mod."""

    name: str = "xla"
    capabilities: AttentionCapabilities = AttentionCapabilities()

    def check(self, call: AttentionCall, device: DeviceInfo, config=None) -> str | None:
        del config
        return self.capabilities.check(call, device)

    def default_config(self, call: AttentionCall, device: DeviceInfo) -> XlaAttentionConfig:
        del call, device
        return XlaAttentionConfig()

    def __call__(self, q, k, v, *, mask, score_mod, scale, config: XlaAttentionConfig):
        return attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, oracle=config.oracle)

    def blocks(self, q, k, v, *, mask, scale, config: XlaAttentionConfig):
        del q, k, v, config
        return XlaBlocks(mask, scale)
