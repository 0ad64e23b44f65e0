"""Residual linear attention: windowed softmax attention plus linear attention beyond.

The linear branch covers the tokens that have left the window.

For query `t` with window `w`, the softmax branch attends to keys `[t - w + 1, t]` (our
attention backends with `causal_local_window(w)`); the linear branch covers every key
`s <= t - w` with the feature map `phi(x) = [softmax(x), softmax(-x)]` over the head dim:

    o_lin_t = phi(q_t)^T S_t,   S_t = sum_{s <= t - w} phi(k_s) v_s^T   (float32)

Each branch is RMS-normalised per head and the two are summed. The linear branch's
`implementation` (the registry's `"linear_attention"` entry): `"scan"` (one key enters
the state per step: the reference), `"chunked"` (chunks of `chunk` queries: the state
at the chunk start plus a masked intra-chunk product, which is causal linear attention
on keys delayed by `w`) or `"triton"` (the same chunking in our Pallas kernel,
`kernels/triton/ssm.py`; the default on a GPU).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from probjax_eqx import masks, recurrence
from probjax_eqx._autodiff import kernel_then_reference
from probjax_eqx._inputs import check_width
from probjax_eqx.attention import dot_product_attention
from probjax_eqx.backends import Backend, Choice, resolve
from probjax_eqx.kernels.triton import ssm as triton_ssm


def feature_map(x: Float[Array, "... d"]) -> Float[Array, "... two_d"]:
    """`[softmax(x), softmax(-x)]` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return jnp.concatenate([jax.nn.softmax(x, -1), jax.nn.softmax(-x, -1)], -1)


def _delayed(x, window):
    """`x` shifted `window` steps later along axis 0 (zeros first)."""
    return jnp.pad(x, [(window, 0)] + [(0, 0)] * (x.ndim - 1))[: x.shape[0]]


def linear_outside_window(
    q: Float[Array, "seq heads dk"],
    k: Float[Array, "seq heads dk"],
    v: Float[Array, "seq heads dv"],
    *,
    window: int,
    chunk: int = 128,
    implementation: str | Backend | None = None,
    config: object = None,
) -> Float[Array, "seq heads dv"]:
    """The linear branch `phi(q_t)^T sum_{s <= t - window} phi(k_s) v_s^T` (float32).

    `implementation`: `None`/`"auto"`, `"scan"`, `"chunked"`, `"triton"` (`config`: a
    `ChunkedLinearConfig`, whose `chunk` it uses) or a resolved `Backend`.
    """
    features = 2 * q.shape[2] + v.shape[2]
    choice = recurrence.select(
        "linear_attention", q.shape[0], q.dtype, implementation, config, features=features
    )
    if choice.kernel != "triton":
        return _linear_outside_window(q, k, v, window, chunk, choice.kernel, None)

    def kernel(q, k, v):
        return _linear_outside_window(q, k, v, window, chunk, "triton", choice.config)

    def reference(q, k, v):
        return _linear_outside_window(q, k, v, window, chunk, "chunked", None)

    return kernel_then_reference(kernel, reference, q, k, v)


def _linear_outside_window(q, k, v, window: int, chunk: int, implementation: str, config):
    """`linear_outside_window` by `implementation`, its Triton kernel's `config`."""
    seq, heads, _ = q.shape
    fq = feature_map(q)
    # Keys delayed by `window` make the branch causal linear attention; the first
    # `window` delayed rows are padding and carry zero features.
    present = (jnp.arange(seq) >= window)[:, None, None]
    fk = jnp.where(present, _delayed(feature_map(k), window), 0.0)
    vd = _delayed(v.astype(jnp.float32), window)
    state0 = jnp.zeros((heads, fq.shape[-1], v.shape[-1]), jnp.float32)
    if implementation == "triton":  # features in the input dtype: 16-bit tensor-core dots
        low = lambda t: t.astype(q.dtype)  # noqa: E731
        out, _ = triton_ssm.chunked_linear_attention(
            low(fq), low(fk), low(vd), None, state0, config=config
        )
        return out
    pad = -seq % chunk  # zero feature rows: they leave the state unchanged
    blocks = [jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (fq, fk, vd)]
    blocks = [a.reshape(-1, chunk, *a.shape[1:]) for a in blocks]
    if implementation == "scan":

        def step(state, inputs):
            fq_t, fk_t, v_t = inputs
            state = state + jnp.einsum("hf,hv->hfv", fk_t, v_t)
            return state, jnp.einsum("hf,hfv->hv", fq_t, state)

        # Still one key a step; the backward keeps the state only every `chunk` steps
        # and recomputes those between (B4, T 4096: 16 GB of per-step states was OOM).
        steps = jax.checkpoint(lambda state, xs: jax.lax.scan(step, state, xs))
        out = jax.lax.scan(steps, state0, tuple(blocks))[1]
        return out.reshape(-1, heads, v.shape[-1])[:seq]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    hp = jax.lax.Precision.HIGHEST

    def chunk_step(state, inputs):
        fq_c, fk_c, v_c = inputs
        inter = jnp.einsum("chf,hfv->chv", fq_c, state, precision=hp)
        scores = jnp.einsum("chf,shf->hcs", fq_c, fk_c, precision=hp)
        intra = jnp.einsum("hcs,shv->chv", jnp.where(causal, scores, 0.0), v_c, precision=hp)
        state = state + jnp.einsum("chf,chv->hfv", fk_c, v_c, precision=hp)
        return state, inter + intra

    out = jax.lax.scan(chunk_step, state0, tuple(blocks))[1]
    return out.reshape(-1, heads, v.shape[-1])[:seq]


class RLACache(eqx.Module):
    """Decode state: the last `window` keys/values (a ring), the linear state, the position."""

    keys: Float[Array, "window heads dk"]
    values: Float[Array, "window heads dv"]
    state: Float[Array, "heads features dv"]
    position: Int[Array, ""]


def _rms(x, weight, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + eps) * weight


class RLA(eqx.Module):
    """Residual linear attention (module docstring); unbatched `[seq, d_model]`."""

    w_q: Float[Array, "d_model hd"]
    w_k: Float[Array, "d_model hd"]
    w_v: Float[Array, "d_model hd"]
    w_o: Float[Array, "hd d_model"]
    norm_window: Float[Array, " head_dim"]
    norm_linear: Float[Array, " head_dim"]
    num_heads: int = eqx.field(static=True)
    window: int = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    linear_backend: Backend = eqx.field(static=True)
    linear_config: object = eqx.field(static=True)
    backend: Backend = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        window: int = 512,
        chunk: int = 128,
        implementation: str | None = None,
        linear_config: object = None,
        attention_implementation: str | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """Build the projections.

        Args:
            d_model: token width (a multiple of `num_heads`).
            num_heads: heads of both branches.
            window: keys per query in the softmax branch (itself included).
            chunk: queries per chunk of the chunked linear branch.
            implementation: the linear branch's backend: `None`/`"auto"`, `"scan"`,
                `"chunked"` or `"triton"`.
            linear_config: that backend's config (a `ChunkedLinearConfig`).
            attention_implementation: the softmax branch's attention backend.
            dtype: parameter dtype.
            key: PRNG key.
        """
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of num_heads={num_heads}")
        if window < 1 or chunk < 1:
            raise ValueError(f"window={window} and chunk={chunk} must be >= 1")
        dtype = jnp.float32 if dtype is None else dtype
        keys = jax.random.split(key, 4)
        init = lambda k: (  # noqa: E731
            jax.random.normal(k, (d_model, d_model), jnp.float32) / d_model**0.5
        ).astype(dtype)
        self.w_q, self.w_k, self.w_v, self.w_o = (init(k) for k in keys)
        head_dim = d_model // num_heads
        self.norm_window = jnp.ones((head_dim,), dtype)
        self.norm_linear = jnp.ones((head_dim,), dtype)
        self.num_heads, self.window, self.chunk = num_heads, window, chunk
        self.linear_backend = resolve("linear_attention", implementation)
        self.linear_config = linear_config
        self.backend = resolve("attention", attention_implementation)

    def _qkv(self, x):
        heads = self.num_heads
        return tuple(
            (x @ w).reshape(x.shape[0], heads, w.shape[1] // heads)
            for w in (self.w_q, self.w_k, self.w_v)
        )

    def _combine(self, o_window, o_linear, dtype):
        o = _rms(o_window, self.norm_window) + _rms(o_linear, self.norm_linear)
        return o.reshape(o.shape[0], o.shape[1] * o.shape[2]).astype(dtype) @ self.w_o

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        check_width("RLA", "x", x, self.w_q.shape[0])
        q, k, v = self._qkv(x)
        window_mask = masks.causal_local_window(self.window)
        o_window = dot_product_attention(
            q[None], k[None], v[None], mask=window_mask, implementation=self.backend
        )[0]
        o_linear = linear_outside_window(
            q, k, v, window=self.window, chunk=self.chunk, implementation=self.linear_backend,
            config=self.linear_config,
        )  # fmt: skip
        return self._combine(o_window, o_linear, x.dtype)

    def explain(self, x: Array | jax.ShapeDtypeStruct) -> Choice:
        """The linear branch's `Choice` for `x` `[seq, d_model]`."""
        features = 3 * self.norm_window.shape[0]  # 2 x head_dim features, head_dim values
        return recurrence.select(
            "linear_attention", x.shape[0], x.dtype, self.linear_backend, self.linear_config,
            features,
        )  # fmt: skip

    def init_cache(self, dtype=None) -> RLACache:
        dtype = self.w_q.dtype if dtype is None else dtype
        head_dim = self.norm_window.shape[0]
        ring = jnp.zeros((self.window, self.num_heads, head_dim), dtype)
        return RLACache(
            keys=ring,
            values=ring,
            state=jnp.zeros((self.num_heads, 2 * head_dim, head_dim), jnp.float32),
            position=jnp.zeros((), jnp.int32),
        )

    def decode_step(
        self, x: Float[Array, " d_model"], cache: RLACache
    ) -> tuple[Float[Array, " d_model"], RLACache]:
        """One token; equal to the matching row of `__call__`."""
        check_width("RLA", "x", x, self.w_q.shape[0], ranks=(1,))
        q, k, v = (a[0] for a in self._qkv(x[None]))
        t, slot = cache.position, cache.position % self.window
        # The key in this ring slot (position t - window) leaves the window now.
        leaving = t >= self.window
        update = jnp.einsum("hf,hv->hfv", feature_map(cache.keys[slot]), cache.values[slot])
        state = cache.state + jnp.where(leaving, update, 0.0)
        keys = cache.keys.at[slot].set(k.astype(cache.keys.dtype))
        values = cache.values.at[slot].set(v.astype(cache.values.dtype))
        visible = jnp.minimum(t + 1, self.window)  # ring order is irrelevant to softmax
        o_window = dot_product_attention(
            q[None, None],
            keys[None],
            values[None],
            mask=masks.KVLengths(visible),
            implementation=self.backend,
        )[0]
        o_linear = jnp.einsum("hf,hfv->hv", feature_map(q), state)[None]
        out = self._combine(o_window, o_linear, x.dtype)[0]
        return out, RLACache(keys, values, state, t + 1)
