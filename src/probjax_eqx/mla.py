"""Multi-head latent attention (DeepSeek-V2 style), with a latent KV cache for decoding.

Per token, keys and values come from one shared latent `c = RMSNorm(W_dkv x)` of width
`kv_lora_rank` plus a RoPE key `k_rope` of width `rope_dim` shared by all heads:

    k_h = [W_uk_h c, k_rope],   v_h = W_uv_h c,   q_h = [q_nope_h, rope(q_rope_h)]

Two exact paths over our attention backends:

- training (`__call__`): the per-head keys/values are materialised and attended with
  `flex_attention` (qk head dim `nope_dim + rope_dim` != v head dim);
- absorbed (`absorbed`, and `decode_step`): `W_uk` is folded into the queries
  (`q_abs_h = W_uk_h^T q_nope_h`) and `W_uv` applied after attention, so attention runs
  in latent space as MQA over one KV head (`[c, k_rope]` keys, `c` values) and the cache
  holds only `kv_lora_rank + rope_dim` numbers per token, for every head together.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from probjax_eqx import masks
from probjax_eqx._inputs import check_width
from probjax_eqx.attention import check_prompt_fits, flex_attention, nan_past_capacity, rope
from probjax_eqx.backends import Backend, resolve


class LatentCache(eqx.Module):
    """A preallocated latent KV cache: `latent [max_len, kv_lora]`, `k_rope [max_len, rope]`.

    Decoding past `max_len` tokens gives NaN outputs.
    """

    latent: Float[Array, "max_len kv_lora"]
    k_rope: Float[Array, "max_len rope"]
    length: Int[Array, ""]


def _linear(key, fan_in, fan_out, dtype):
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32).astype(dtype) / math.sqrt(fan_in)


def _rms(x, weight, eps=1e-6):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + eps)
    return (normed * weight).astype(x.dtype)


class MLA(eqx.Module):
    """Multi-head latent attention; unbatched `[seq, d_model]` (use `jax.vmap`)."""

    w_dq: Float[Array, "d_model q_lora"] | None
    q_norm: Float[Array, " q_lora"] | None
    w_q: Float[Array, "q_in heads_qk"]
    w_dkv: Float[Array, "d_model kv_lora_rope"]
    kv_norm: Float[Array, " kv_lora"]
    w_uk: Float[Array, "kv_lora heads_nope"]
    w_uv: Float[Array, "kv_lora heads_v"]
    w_o: Float[Array, "heads_v d_model"]
    num_heads: int = eqx.field(static=True)
    nope_dim: int = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    v_dim: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    backend: Backend = eqx.field(static=True)
    attention_config: object = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        q_lora_rank: int | None = None,
        nope_dim: int = 64,
        rope_dim: int = 32,
        v_dim: int = 64,
        rope_theta: float = 1e4,
        implementation: str | None = None,
        attention_config: object = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """Build the projections and resolve the attention backend.

        Args:
            d_model: token width.
            num_heads: query heads.
            kv_lora_rank: width of the shared KV latent.
            q_lora_rank: width of the query latent, or `None` for a direct query projection.
            nope_dim: per-head query/key dims without RoPE.
            rope_dim: RoPE dims (queries per head; keys shared by all heads). Even.
            v_dim: per-head value dim.
            rope_theta: RoPE base.
            implementation: attention backend (`None`/`"auto"`, `"xla"`, `"triton"`, ...).
            attention_config: the pinned attention kernel's config (e.g. tiles).
            dtype: parameter dtype.
            key: PRNG key.
        """
        if rope_dim % 2:
            raise ValueError(f"rope_dim={rope_dim} must be even")
        dtype = jnp.float32 if dtype is None else dtype
        keys = jax.random.split(key, 6)
        qk = nope_dim + rope_dim
        if q_lora_rank is None:
            self.w_dq, self.q_norm = None, None
            self.w_q = _linear(keys[0], d_model, num_heads * qk, dtype)
        else:
            self.w_dq = _linear(keys[0], d_model, q_lora_rank, dtype)
            self.q_norm = jnp.ones((q_lora_rank,), dtype)
            self.w_q = _linear(keys[1], q_lora_rank, num_heads * qk, dtype)
        self.w_dkv = _linear(keys[2], d_model, kv_lora_rank + rope_dim, dtype)
        self.kv_norm = jnp.ones((kv_lora_rank,), dtype)
        self.w_uk = _linear(keys[3], kv_lora_rank, num_heads * nope_dim, dtype)
        self.w_uv = _linear(keys[4], kv_lora_rank, num_heads * v_dim, dtype)
        self.w_o = _linear(keys[5], num_heads * v_dim, d_model, dtype)
        self.num_heads = num_heads
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.kv_lora_rank = kv_lora_rank
        self.rope_theta = rope_theta
        self.backend = resolve("attention", implementation)
        self.attention_config = attention_config

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.nope_dim + self.rope_dim)

    def _down(self, x):
        """The query input (`W_q x`, or the query latent `W_dq x`) and `W_dkv x`.

        One matmul for both: they read the same `x`, and the gradient of `x` is then one
        product too (H200, B4 x T1024 fwd+bwd: 0.400 vs 0.421 ms as two).
        """
        first = self.w_q if self.w_dq is None else self.w_dq
        down = x @ jnp.concatenate([first, self.w_dkv], axis=1)
        return down[:, : first.shape[1]], down[:, first.shape[1] :]

    def _queries(self, hq, positions):
        q = hq if self.w_dq is None else _rms(hq, self.q_norm) @ self.w_q
        q = q.reshape(hq.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim :]
        return q_nope, rope(q_rope, positions, self.rope_theta)

    def _latents(self, ckv, positions):
        latent = _rms(ckv[:, : self.kv_lora_rank], self.kv_norm)
        k_rope = rope(ckv[:, None, self.kv_lora_rank :], positions, self.rope_theta)[:, 0]
        return latent, k_rope

    def _attend(self, q, k, v, mask):
        return flex_attention(
            q[None],
            k[None],
            v[None],
            mask=mask,
            scale=self.scale,
            implementation=self.backend,
            config=self.attention_config,
        )[0]

    def __call__(
        self, x: Float[Array, "seq d_model"], *, mask: masks.AbstractMask | None = None
    ) -> Float[Array, "seq d_model"]:
        """Training path: per-head keys and values from the latent (causal by default)."""
        check_width("MLA", "x", x, self.w_o.shape[-1])
        seq = x.shape[0]
        mask = masks.Causal() if mask is None else mask
        positions = jnp.arange(seq)
        hq, ckv = self._down(x)
        q_nope, q_rope = self._queries(hq, positions)
        latent, k_rope = self._latents(ckv, positions)
        heads_nope = self.num_heads * self.nope_dim
        up = latent @ jnp.concatenate([self.w_uk, self.w_uv], axis=1)  # one matmul, as _down
        k_nope = up[:, :heads_nope].reshape(seq, self.num_heads, self.nope_dim)
        k_rope_h = jnp.broadcast_to(k_rope[:, None], (seq, self.num_heads, self.rope_dim))
        k = jnp.concatenate([k_nope, k_rope_h], axis=-1)
        v = up[:, heads_nope:].reshape(seq, self.num_heads, self.v_dim)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        o = self._attend(q, k, v, mask)
        return o.reshape(seq, o.shape[1] * o.shape[2]) @ self.w_o

    def _absorbed_attend(self, hq, positions, latent, k_rope, mask):
        q_nope, q_rope = self._queries(hq, positions)
        w_uk = self.w_uk.reshape(self.kv_lora_rank, self.num_heads, self.nope_dim)
        q_abs = jnp.einsum("shn,lhn->shl", q_nope, w_uk)  # W_uk folded into the queries
        q = jnp.concatenate([q_abs, q_rope], axis=-1)
        k = jnp.concatenate([latent, k_rope], axis=-1)[:, None]  # one KV head: MQA
        o_latent = self._attend(q, k, latent[:, None], mask)  # [seq, heads, kv_lora]
        w_uv = self.w_uv.reshape(self.kv_lora_rank, self.num_heads, self.v_dim)
        o = jnp.einsum("shl,lhv->shv", o_latent, w_uv)
        return o.reshape(hq.shape[0], o.shape[1] * o.shape[2]) @ self.w_o

    def absorbed(
        self, x: Float[Array, "seq d_model"], *, mask: masks.AbstractMask | None = None
    ) -> Float[Array, "seq d_model"]:
        """Inference path: attention in latent space (equal to `__call__`)."""
        positions = jnp.arange(x.shape[0])
        hq, ckv = self._down(x)
        latent, k_rope = self._latents(ckv, positions)
        mask = masks.Causal() if mask is None else mask
        return self._absorbed_attend(hq, positions, latent, k_rope, mask)

    def init_cache(self, max_len: int, dtype=None) -> LatentCache:
        """An empty cache for `max_len` tokens."""
        dtype = self.w_dkv.dtype if dtype is None else dtype
        return LatentCache(
            latent=jnp.zeros((max_len, self.kv_lora_rank), dtype),
            k_rope=jnp.zeros((max_len, self.rope_dim), dtype),
            length=jnp.zeros((), jnp.int32),
        )

    def _append(self, ckv, cache: LatentCache):
        positions = cache.length + jnp.arange(ckv.shape[0])
        latent, k_rope = self._latents(ckv, positions)
        start = (cache.length, 0)
        update = jax.lax.dynamic_update_slice
        cache = LatentCache(
            latent=update(cache.latent, latent.astype(cache.latent.dtype), start),
            k_rope=update(cache.k_rope, k_rope.astype(cache.k_rope.dtype), start),
            length=cache.length + ckv.shape[0],
        )
        return positions, cache

    def prefill(
        self, x: Float[Array, "seq d_model"], cache: LatentCache
    ) -> tuple[Float[Array, "seq d_model"], LatentCache]:
        """Fill an empty cache with a prompt; returns the causal outputs and the cache."""
        check_width("MLA", "x", x, self.w_o.shape[-1])
        max_len = cache.latent.shape[0]
        check_prompt_fits(x.shape[0], max_len)
        hq, ckv = self._down(x)
        positions, cache = self._append(ckv, cache)
        mask = masks.Causal() & masks.KVLengths(cache.length)
        out = self._absorbed_attend(hq, positions, cache.latent, cache.k_rope, mask)
        return nan_past_capacity(out, cache.length, max_len), cache

    def decode_step(
        self, x: Float[Array, " d_model"], cache: LatentCache
    ) -> tuple[Float[Array, " d_model"], LatentCache]:
        """One new token: append its latent, attend to every cached token (itself too).

        With the cache full (`max_len` tokens before this one) the output is NaN.
        """
        check_width("MLA", "x", x, self.w_o.shape[-1], ranks=(1,))
        hq, ckv = self._down(x[None])
        positions, cache = self._append(ckv, cache)
        mask = masks.KVLengths(cache.length)
        out = self._absorbed_attend(hq, positions, cache.latent, cache.k_rope, mask)
        return nan_past_capacity(out[0], cache.length, cache.latent.shape[0]), cache
