r"""Attention: the functional ops `dot_product_attention` and `flex_attention`, and `Attention`.

For each query head $h$ (KV head $h // G$ with $G$ = query heads / KV heads):

$$o_i = \sum_{j \text{ valid}} \mathrm{softmax}_j\big(\mathrm{mod}(s\, q_i \cdot k_j)\big)\, v_j$$

where `mod` is the optional score modification and "valid" is the mask. A row with no
valid key gives $o_i = 0$ and zero gradients.

How peers differ: `jax.nn.dot_product_attention` takes a dense bias/mask plus a few
flags and picks no kernel for you; torch `flex_attention` takes `score_mod` /
`mask_mod` functions and needs a block mask built separately; here masks are values
(`probjax_eqx.masks`) whose tile bounds kernels read directly, and one call chooses the
fastest exact kernel and tells you why (`explain`).
"""

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, Real

from probjax_eqx._autodiff import kernel_then_reference
from probjax_eqx._inputs import check_width
from probjax_eqx.attention_call import AttentionCall
from probjax_eqx.backends import (
    Backend,
    Choice,
    UnsupportedError,
    register_op,
    register_regime,
    resolve,
)
from probjax_eqx.biases import AbstractBias, AbstractScoreMod, DenseBias, ScoreFn
from probjax_eqx.kernels.cudnn.attention import CudnnAttention
from probjax_eqx.kernels.mosaic.attention import MosaicAttention, cudnn_backward_pays
from probjax_eqx.kernels.reference.attention import XlaAttention, XlaAttentionConfig
from probjax_eqx.kernels.triton.attention import TritonAttention
from probjax_eqx.masks import AbstractMask, Causal, DenseMask, KVLengths, MaskFn, check_arrays

_IMPLEMENTATIONS = {
    "xla": XlaAttention(),
    "cudnn": CudnnAttention(),
    "triton": TritonAttention(),
    "mosaic": MosaicAttention(),
}
register_op("attention", lambda: _IMPLEMENTATIONS)

# Few queries over long KV (decoding, cross-attention to long contexts): query tiles
# alone leave the GPU idle, the split-KV forward does not. H200 run 13-14: at Lq 1 and
# 16 over 32k-131k keys it matches or beats jax.nn cudnn at every shape (B1, Lq 16,
# 131k: 0.41 vs 1.54 ms); the 4096-key floor is not measured yet. One KV head per query
# head with a full query tile goes to `cross` instead (`_mosaic_cross_mha`).
FEW_QUERIES = dict(max_query_rows=128, min_kv_len=4096)


def _few_queries(call) -> bool:
    rows = call.q_len * call.groups
    few = rows <= FEW_QUERIES["max_query_rows"] and call.kv_len >= FEW_QUERIES["min_kv_len"]
    return few and not _mosaic_cross_mha(call)


register_regime("attention", "few_queries", _few_queries)

# float32 has no regime of its own: cuDNN and Mosaic refuse it and Triton (TF32 tensor
# cores, as JAX's default float32 matmuls) comes before XLA (`HIGHEST`, exact). H200
# run 17 (B4, H8, T 1024, fwd / fwd+bwd ms): Triton 0.078 / 0.478 at head_dim 64 and
# 0.243 / 1.259 at 128, XLA 0.397 / 0.977 and 0.570 / 1.502.

# Heads of <= 32 dims (set transformers): the matmuls are too thin for cuDNN's and
# Mosaic's tiles to pay. H200 run 12, ISAB shapes (64 sets, 4 heads, 128 <-> 1024):
# Triton fwd+bwd 0.188 / 0.210 ms vs cuDNN 0.350 / 0.315, Mosaic 0.347 / 0.346.
SMALL_HEAD_DIM = 32


def _small_heads(call) -> bool:
    return max(call.qk_dim, call.v_dim) <= SMALL_HEAD_DIM


register_regime("attention", "small_heads", _small_heads)

# Per-batch KV or query lengths (padding masks): cuDNN's backward returned a dK of about
# zero for a full-length batch element, intermittently, on the H200 (jax 0.11.2; runs 3
# and 15 of tests/test_gpu_attention.py::test_triton_agrees_with_cudnn, causal & KV
# lengths [512, 300]; its output and dQ agreed;
# tests/test_gpu_attention.py::test_cudnn_padded_backward_repeats tracks it). Our kernels
# take these calls instead.
PADDING_TERMS = frozenset({"kv_lengths", "q_lengths"})


def _padded(call) -> bool:
    return any(term[0] in PADDING_TERMS for term in call.mask_terms)


register_regime("attention", "padded", _padded)

# Score mods: cuDNN takes none here; the sm_90 entry puts Mosaic (SoftCap) before Triton
# (every score mod, parameters' gradients included), as timed in H100 run 60.


def _score_mod(call) -> bool:
    return call.score_mod is not None


register_regime("attention", "score_mod", _score_mod)

# Causal masks: our Mosaic kernel, with cuDNN behind it, below T 16384 and at any length
# for heads of <= 64 dims. H100 (B4 H8 bf16, fwd+bwd ms, Mosaic / jax.nn cuDNN / torch
# SDPA cuDNN), run 82: T 1024 hd 64 0.095 / 0.125 / 0.169, hd 128 0.157 / 0.187 / 0.169;
# T 4096 hd 64 0.659 / 0.773 / 0.698, hd 128 1.138 / 1.202 / 1.104. Run 83: T 16384 hd 64
# 8.66 / 8.85 / 8.78; at hd 128 cuDNN wins, 15.03 / 14.63 / 14.04.
CAUSAL_MOSAIC_MAX_LEN = 16384  # exclusive
CAUSAL_MOSAIC_ANY_LEN_HEAD_DIM = 64  # heads this narrow take Mosaic at any length


def _mosaic_causal(call) -> bool:  # a plain causal mask, as timed (no windows, lengths)
    causal = bool(call.mask_terms) and all(term[0] == "causal" for term in call.mask_terms)
    short = max(call.q_len, call.kv_len) < CAUSAL_MOSAIC_MAX_LEN
    narrow = max(call.qk_dim, call.v_dim) <= CAUSAL_MOSAIC_ANY_LEN_HEAD_DIM
    return causal and (short or narrow)


register_regime("attention", "causal", _mosaic_causal)

# Long self-attention at hd 128, unmasked or causal: our Mosaic forward joined to cuDNN's
# backward (`mosaic.attention.cudnn_backward_pays` has the timings).
register_regime("attention", "long", cudnn_backward_pays)

# Few query tiles over long keys without a mask (cross-attention): our Mosaic kernels.
# Grouped query heads (GQA) up to 1024 queries: cuDNN's backward writes dK and dV per
# query head and then sums each group, where our Mosaic dK/dV kernel sums the group as it
# goes. H100 run 103, hd 128, 32 query heads over 8, fwd+bwd ms (Mosaic / our cuDNN route
# / torch SDPA cuDNN): batch 8, 128 queries over 8192 keys 1.202 / 2.256 / 1.778, over
# 32768 keys 4.68 / 8.77 / 6.75; 512 queries 4.14 / 4.76 / 4.25; 1024 queries 7.97 / 8.28
# / 7.68; run 114, 1024 over 4096 keys 4.08 / 4.29 / 3.94. Batch 2, 4096 over 4096: cuDNN
# wins, 4.06 / 3.92 / 3.68. Run 115, hd 64, batch 8, 128 over 8192 keys: 0.703 / 1.393 /
# 1.128. Shorter key sets are not timed: they stay on cuDNN. Where Mosaic's forward grid
# is short (batch 1-2), automatic selection joins it to the split-KV Triton forward (run
# 108: 1 x 128 over 32768 keys 0.671 ms vs torch 1.157; `mosaic.attention.auto_config`).
# One KV head per query head: at 65-128 queries both kernels' forwards run one 128-row
# query tile per head (the split-KV Triton kernel's `few_queries` tile) and Mosaic's
# backward is the faster. H100 run 109, hd 128, 32 heads, fwd / fwd+bwd ms (Mosaic /
# Triton / our cuDNN route in run 108 / torch SDPA cuDNN): batch 8, 128 over 8192 keys
# 0.368 / 1.927, 0.370 / 2.079, 0.379 / 1.961, 0.357 / 1.531; batch 1, 128 over 32768
# (joined) 0.189 / 0.940, 0.188 / 1.069, -, 0.369 / 0.921; batch 8 over 4096 keys (runs
# 114-115) 1.001 / 1.091 / - / 0.855, at hd 64 0.575 / 0.640 / - / 0.548. More queries are
# not timed.
CROSS_MOSAIC_MAX_Q_LEN = 1024
CROSS_MOSAIC_MIN_KV_LEN = 4096
CROSS_MOSAIC_HEAD_DIMS = (64, 128)  # as timed
CROSS_MOSAIC_MHA_Q_LENS = range(65, 129)  # one query tile per head, at least half full


def _mosaic_cross_mha(call) -> bool:
    """One KV head per query head in `cross` (`few_queries` would take it first)."""
    return call.groups == 1 and call.score_mod is None and _mosaic_cross(call)


def _mosaic_cross(call) -> bool:
    mha_tile = call.groups == 1 and call.q_len in CROSS_MOSAIC_MHA_Q_LENS
    return (
        (call.groups > 1 or mha_tile)
        and not call.mask_terms
        and call.q_len <= CROSS_MOSAIC_MAX_Q_LEN
        and call.kv_len >= CROSS_MOSAIC_MIN_KV_LEN
        and call.qk_dim == call.v_dim
        and call.qk_dim in CROSS_MOSAIC_HEAD_DIMS
    )


register_regime("attention", "cross", _mosaic_cross)

MaskLike = AbstractMask | Bool[ArrayLike, "_b _h q_seq kv_seq"] | None


def _as_mask(mask: object) -> AbstractMask | None:
    if mask is None or isinstance(mask, AbstractMask):
        return mask
    if callable(mask):
        return MaskFn(mask)
    array = jnp.asarray(mask)
    if array.dtype != jnp.bool_:
        raise TypeError(
            f"mask must be a boolean array or a probjax_eqx.masks mask, got dtype {array.dtype}; "
            "pass additive terms as `bias`"
        )
    if array.ndim != 4:
        raise ValueError(
            "a dense mask must be broadcastable to [batch, heads, q_seq, kv_seq], "
            f"got {array.shape}"
        )
    return DenseMask(array)


def _as_score_mod(score_mod: object) -> AbstractScoreMod | None:
    if score_mod is None or isinstance(score_mod, AbstractScoreMod):
        return score_mod
    if callable(score_mod):
        return ScoreFn(score_mod)
    raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")


def _describe(q, k, v, mask, score_mod) -> AttentionCall:
    """Validate the operands and canonicalise them into an `AttentionCall`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    dims = (("batch", 0, q, k), ("batch", 0, k, v), ("kv_seq", 1, k, v), ("kv_heads", 2, k, v))
    for dim, axis, a, b in dims:
        if a.shape[axis] != b.shape[axis]:
            raise ValueError(
                f"dimension {dim} (axis {axis}) differs: {a.shape[axis]} vs {b.shape[axis]} "
                f"(shapes {a.shape} and {b.shape})"
            )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"dimension qk_dim differs: q has {q.shape[3]}, k has {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"dimension q_heads={q.shape[2]} must be a multiple of kv_heads={k.shape[2]}"
        )
    batch, q_len, heads, _ = q.shape
    check_arrays((mask, score_mod), batch=batch, heads=heads, q_len=q_len, kv_len=k.shape[1])
    return AttentionCall.from_args(q.shape, k.shape, v.shape, q.dtype, mask, score_mod)


def _backend(implementation: str | Backend | None) -> Backend:
    if isinstance(implementation, Backend):
        return implementation
    return resolve("attention", implementation)


def _select(q, k, v, mask, score_mod, implementation, config):
    """Canonicalise a call and select its implementation: `(mask, score_mod, call, choice)`."""
    mask, score_mod = _as_mask(mask), _as_score_mod(score_mod)
    call = _describe(q, k, v, mask, score_mod)
    return mask, score_mod, call, _backend(implementation).select(call, config)


def _planner(choice: Choice, call: AttentionCall, backend: Backend, config):
    """`plan(q, k, v, mask, score_mod) -> config` for `choice`'s kernel.

    Where `vmap` folds a batch into the call (`_flash.attend`), the kernel is planned
    anew for it, as selection plans it.
    """

    def plan(q, k, v, mask, score_mod):
        if q.shape[0] == call.batch:
            return choice.config
        try:
            again = backend.select(_describe(q, k, v, mask, score_mod), config)
        except UnsupportedError:  # the example's config computes any batch of it
            return choice.config
        return again.config if again.kernel == choice.kernel else choice.config

    return plan


def _run(q, k, v, mask, score_mod, scale, implementation, config) -> Array:
    backend = _backend(implementation)
    mask, score_mod, call, choice = _select(q, k, v, mask, score_mod, backend, config)
    scale = 1.0 / math.sqrt(call.qk_dim) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        # The kernels take the running max of unscaled scores and scale it after.
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if call.q_len == 0 or call.kv_len == 0:  # no queries, or no key for any: zeros
        return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)
    impl = _IMPLEMENTATIONS[choice.kernel]
    # Flash kernels plan for the batch they run (`_flash.attend`).
    plans_per_batch = getattr(impl, "plans_per_batch", False)
    plans = {"plan": _planner(choice, call, backend, config)} if plans_per_batch else {}

    def kernel(q, k, v, mask, score_mod):
        return impl(q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=choice.config,
                    **plans)  # fmt: skip  # pyright: ignore

    if choice.kernel == "xla":
        return kernel(q, k, v, mask, score_mod)

    def reference(q, k, v, mask, score_mod):  # the "xla" backend: same math and dtype
        return _IMPLEMENTATIONS["xla"](
            q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=XlaAttentionConfig()
        )

    tangent = _forward_mode_kernel(call, choice, backend, mask, score_mod, scale)
    return kernel_then_reference(kernel, reference, q, k, v, mask, score_mod, tangent=tangent)


def _tangent_plan(call, choice: Choice, backend: Backend) -> tuple[object, str]:
    """Forward mode's kernel for a call: `(config, why)`, config None for XLA's JVP.

    Whichever kernel runs the call, its tangent is Triton's one pass (`flash_tangent`)
    where Triton computes the call, with the chosen config if Triton was chosen; else
    the reference's JVP, which holds the score matrix and its tangent.
    """
    if choice.kernel == "xla":
        return None, "XLA's JVP of the chosen XLA attention"
    triton = _IMPLEMENTATIONS["triton"]
    config = choice.config if choice.kernel == "triton" else None
    why = triton.check(call, backend.device, config)
    if why is not None:
        return None, (
            "XLA's JVP of the reference, with the full score matrix and its tangent: "
            f"Triton's tangent kernel cannot compute this call ({why})"
        )
    config = triton.default_config(call, backend.device) if config is None else config
    config = triton.tangent_config(config, call, backend.device)
    return config, (
        f"Triton's one-pass tangent kernel ({config.block_q}x{config.block_k} tiles, "
        f"{config.num_warps} warps, {config.num_stages} stages), no score matrix"
    )


def _forward_mode_kernel(call, choice: Choice, backend: Backend, mask, score_mod, scale):
    """`tangent(args, tangents)` for `kernel_then_reference` (None: the reference's JVP).

    Triton's forward-mode kernel, through the score mod's parameters too (ALiBi's slopes).
    """
    config, _ = _tangent_plan(call, choice, backend)
    if config is None:
        return None
    triton = _IMPLEMENTATIONS["triton"]

    def tangent(args, tangents):
        q, k, v, mask, score_mod = args
        return triton.tangent(q, k, v, *tangents[:3], mask=mask, score_mod=score_mod,
                              scale=scale, config=config, t_score_mod=tangents[4])  # fmt: skip

    return tangent


def _explain(q, k, v, mask, score_mod, implementation, config) -> Choice:
    backend = _backend(implementation)
    _, _, call, choice = _select(q, k, v, mask, score_mod, backend, config)
    return dataclasses.replace(choice, forward_mode=_tangent_plan(call, choice, backend)[1])


def _bias_to_score_mod(bias: object) -> AbstractScoreMod | None:
    if bias is None or isinstance(bias, AbstractBias):
        return bias
    array = jnp.asarray(bias)
    if array.ndim != 4:
        raise ValueError(
            "a dense bias must be broadcastable to [batch, heads, q_seq, kv_seq], "
            f"got {array.shape}"
        )
    return DenseBias(array)


def dot_product_attention(
    q: Float[Array, "batch q_seq q_heads qk_dim"],
    k: Float[Array, "batch kv_seq kv_heads qk_dim"],
    v: Float[Array, "batch kv_seq kv_heads v_dim"],
    *,
    mask: MaskLike = None,
    bias: AbstractBias | Float[ArrayLike, "_b _h q_seq kv_seq"] | None = None,
    scale: float | None = None,
    implementation: str | Backend | None = None,
    config: object = None,
) -> Float[Array, "batch q_seq q_heads v_dim"]:
    """Scaled dot-product attention with masks, biases and GQA.

    Args:
        q: queries `[batch, q_seq, q_heads, qk_dim]`.
        k: keys `[batch, kv_seq, kv_heads, qk_dim]`; `q_heads` is a multiple of
            `kv_heads` and query head `h` reads KV head `h // (q_heads // kv_heads)`.
        v: values `[batch, kv_seq, kv_heads, v_dim]` (`v_dim` may differ from `qk_dim`).
        mask: a `probjax_eqx.masks` mask (`Causal() & KVLengths(lengths)`, ...) or a
            boolean array broadcastable to `[batch, heads, q_seq, kv_seq]`.
        bias: an additive bias (`ALiBi`, `RelativePosition`, sums of them) or an array
            broadcastable to `[batch, heads, q_seq, kv_seq]`, added to the scaled scores.
        scale: multiplier of `q @ k.T`; default `1 / sqrt(qk_dim)`.
        implementation: `None`/`"auto"` (fastest exact kernel for this device),
            `"xla"`, `"cudnn"`, `"triton"`, `"mosaic"`, or a resolved `Backend`.
        config: an implementation's config (tiles etc.), used as given.

    Returns:
        `[batch, q_seq, q_heads, v_dim]` in the input dtype.

    Raises:
        UnsupportedError: a pinned implementation cannot compute this call exactly.
        ValueError, TypeError: inconsistent shapes or dtypes.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from probjax_eqx import dot_product_attention, masks
        >>> q = k = v = jnp.ones((1, 4, 2, 8))
        >>> dot_product_attention(q, k, v, mask=Causal()).shape
        (1, 4, 2, 8)
    """
    return _run(q, k, v, mask, _bias_to_score_mod(bias), scale, implementation, config)


def flex_attention(
    q: Float[Array, "batch q_seq q_heads qk_dim"],
    k: Float[Array, "batch kv_seq kv_heads qk_dim"],
    v: Float[Array, "batch kv_seq kv_heads v_dim"],
    *,
    score_mod: AbstractScoreMod | Callable | None = None,
    mask: AbstractMask | Callable | None = None,
    scale: float | None = None,
    implementation: str | Backend | None = None,
    config: object = None,
) -> Float[Array, "batch q_seq q_heads v_dim"]:
    """Attention with a score modification function, as torch `flex_attention`.

    Args:
        q: queries, as in `dot_product_attention`.
        k: keys, as in `dot_product_attention`.
        v: values, as in `dot_product_attention`.
        score_mod: `fn(score, b, h, q_idx, kv_idx) -> score` on the scaled scores
            (float32, index arrays broadcast), or a `probjax_eqx.biases` score mod.
        mask: a `probjax_eqx.masks` mask, or `fn(b, h, q_idx, kv_idx) -> bool`
            (a torch-style `mask_mod`; kernels cannot skip tiles for it).
        scale: as in `dot_product_attention`.
        implementation: as in `dot_product_attention`.
        config: as in `dot_product_attention`.

    Returns:
        `[batch, q_seq, q_heads, v_dim]` in the input dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from probjax_eqx import flex_attention
        >>> q = k = v = jnp.ones((1, 4, 2, 8))
        >>> soft_cap = lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)
        >>> flex_attention(q, k, v, score_mod=soft_cap).shape
        (1, 4, 2, 8)
    """
    return _run(q, k, v, mask, score_mod, scale, implementation, config)


def explain_attention(
    q: Array | jax.ShapeDtypeStruct,
    k: Array | jax.ShapeDtypeStruct,
    v: Array | jax.ShapeDtypeStruct,
    *,
    mask: object = None,
    bias: object = None,
    score_mod: object = None,
    implementation: str | Backend | None = None,
    config: object = None,
) -> Choice:
    """The `Choice` an attention call would make (kernel, config, reasons), without running it.

    Operands may be arrays or `jax.ShapeDtypeStruct`s; nothing is computed.
    """
    if bias is not None and score_mod is not None:
        raise ValueError("pass either bias or score_mod, not both")
    mod = _bias_to_score_mod(bias) if bias is not None else score_mod
    return _explain(q, k, v, mask, mod, implementation, config)


dot_product_attention.explain = explain_attention  # pyright: ignore[reportFunctionMemberAccess]
flex_attention.explain = explain_attention  # pyright: ignore[reportFunctionMemberAccess]


def rope(
    x: Float[Array, "seq heads dim"],
    positions: Real[Array, " seq"] | None = None,
    theta: float = 1e4,
) -> Float[Array, "seq heads dim"]:
    """Rotary position embedding (rotate-half convention) over the last axis."""
    seq, _, dim = x.shape
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    pos = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    angles = pos[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def check_prompt_fits(prompt_len: int, max_len: int) -> None:
    """A prompt longer than a cache is refused when traced (its length is static)."""
    if prompt_len > max_len:
        raise ValueError(
            f"a prompt of {prompt_len} tokens does not fit a cache of {max_len} positions: "
            "pass a larger max_len to init_cache"
        )


def nan_past_capacity(out: Array, length: Array, max_len: int) -> Array:
    """`out`, or NaN once a cache's `length` passed its `max_len` positions.

    A full cache cannot take a token (the write would land on its last slot): the outputs
    say so. A runtime error (`eqx.error_if`) would sync the GPU with the host every step.
    """
    return jnp.where(length > max_len, jnp.asarray(jnp.nan, out.dtype), out)


class KVCache(eqx.Module):
    """Keys and values of the positions decoded so far: preallocated buffers and a length.

    A pytree the caller carries (`Attention.init_cache`, `prefill`, `decode_step`); the
    module keeps no state. Positions past `length` hold stale or zero entries that the
    `KVLengths` mask hides. Decoding past `max_len` positions gives NaN outputs.
    """

    keys: Float[Array, "max_len kv_heads qk_dim"]
    values: Float[Array, "max_len kv_heads v_dim"]
    length: Int[Array, ""]


class Attention(eqx.Module):
    """Multi-head attention (MHA, GQA, MQA) with projections, optional RoPE and qk-norm.

    The op is `dot_product_attention`; see its docstring for the math and masks. The
    `backend` is resolved when the module is built (device, `PROBJAX_*` env opt-outs,
    `implementation=`), so calling the module never reads the environment.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    q_norm: eqx.nn.RMSNorm | None
    k_norm: eqx.nn.RMSNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    qk_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)
    compute_dtype: str | None = eqx.field(static=True)
    backend: Backend = eqx.field(static=True)
    config: object = eqx.field(static=True)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        context_dim: int | None = None,
        output_dim: int | None = None,
        use_bias: bool = False,
        rope_theta: float | None = None,
        qk_norm: bool = False,
        compute_dtype: jnp.dtype | str | None = None,
        implementation: str | None = None,
        config: object = None,
        dtype: jnp.dtype | None = None,
        key: PRNGKeyArray,
    ):
        """Build the projections and resolve the backend.

        Args:
            embed_dim: width of the query input `x`.
            num_heads: number of query heads.
            num_kv_heads: number of key/value heads (default `num_heads`; 1 is MQA).
            head_dim: query/key head dim (default `embed_dim // num_heads`).
            v_head_dim: value head dim (default `head_dim`).
            context_dim: width of `context` for cross-attention (default `embed_dim`).
            output_dim: output width (default `embed_dim`).
            use_bias: biases in the projections.
            rope_theta: apply RoPE to queries and keys with this base, or `None`.
            qk_norm: RMS-normalise queries and keys per head before attention.
            compute_dtype: dtype the attention op runs in (e.g. `"bfloat16"`); default
                the input dtype.
            implementation: `None`/`"auto"`, `"xla"`, `"cudnn"`, `"triton"`, `"mosaic"`.
            config: the pinned implementation's config (e.g. `TritonAttentionConfig`).
            dtype: parameter dtype.
            key: PRNG key for initialisation.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = embed_dim // num_heads if head_dim is None else head_dim
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        context_dim = embed_dim if context_dim is None else context_dim
        output_dim = embed_dim if output_dim is None else output_dim
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
        if head_dim < 1:
            raise ValueError(f"{head_dim=} must be >= 1 (embed_dim // num_heads is 0?)")
        if rope_theta is not None and head_dim % 2:
            raise ValueError(f"RoPE needs an even {head_dim=}")
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        linear = lambda i, o, k: eqx.nn.Linear(i, o, use_bias=use_bias, dtype=dtype, key=k)  # noqa: E731
        self.query_proj = linear(embed_dim, num_heads * head_dim, qkey)
        self.key_proj = linear(context_dim, num_kv_heads * head_dim, kkey)
        self.value_proj = linear(context_dim, num_kv_heads * v_head_dim, vkey)
        self.output_proj = linear(num_heads * v_head_dim, output_dim, okey)
        self.q_norm = eqx.nn.RMSNorm(head_dim, dtype=dtype) if qk_norm else None
        self.k_norm = eqx.nn.RMSNorm(head_dim, dtype=dtype) if qk_norm else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.qk_head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.rope_theta = rope_theta
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
        self.backend = resolve("attention", implementation)
        self.config = config

    def _qkv(self, x, context, positions=None):
        context = x if context is None else context
        project = lambda lin, a: jax.vmap(lin)(a)  # noqa: E731
        q = project(self.query_proj, x).reshape(x.shape[0], self.num_heads, self.qk_head_dim)
        k = project(self.key_proj, context).reshape(
            context.shape[0], self.num_kv_heads, self.qk_head_dim
        )
        v = project(self.value_proj, context).reshape(
            context.shape[0], self.num_kv_heads, self.v_head_dim
        )
        if self.q_norm is not None and self.k_norm is not None:
            q = jax.vmap(jax.vmap(self.q_norm))(q)
            k = jax.vmap(jax.vmap(self.k_norm))(k)
        if self.rope_theta is not None:
            q = rope(q, positions, theta=self.rope_theta)
            k = rope(k, positions, theta=self.rope_theta)
        if self.compute_dtype is not None:
            q, k, v = (a.astype(self.compute_dtype) for a in (q, k, v))
        return q[None], k[None], v[None]

    @jax.named_scope("probjax.Attention")
    def __call__(
        self,
        x: Float[Array, "q_seq embed"],
        context: Float[Array, "kv_seq context"] | None = None,
        *,
        mask: MaskLike = None,
        score_mod: AbstractScoreMod | Callable | None = None,
    ) -> Float[Array, "q_seq out"]:
        """Attend from `x` to `context` (default: self-attention).

        !!! info
            Unbatched: `jax.vmap(attention)(xs)` for a batch. Per-example masks
            (`KVLengths(lengths)`) are vmapped along with `xs`. Our kernels plan for
            the vmapped batch (`_flash.attend`; `explain(..., batch=n)` shows it).

        Args:
            x: queries' input `[q_seq, embed_dim]`.
            context: keys'/values' input `[kv_seq, context_dim]`, or `None`.
            mask: a mask (see `probjax_eqx.masks`); its batch dimension is 1 here.
            score_mod: a score modification (see `flex_attention`).

        Returns:
            `[q_seq, output_dim]`.
        """
        check_width("Attention", "x", x, self.query_proj.weight.shape[-1])
        if context is not None:
            check_width("Attention", "context", context, self.key_proj.weight.shape[-1])
        q, k, v = self._qkv(x, context)
        o = _run(q, k, v, mask, score_mod, self._scale, self.backend, self.config)
        return self._output(o, x)

    def init_cache(self, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache of `max_len` positions for causal self-attention decoding."""
        dtype = self.compute_dtype or self.query_proj.weight.dtype if dtype is None else dtype
        return KVCache(
            keys=jnp.zeros((max_len, self.num_kv_heads, self.qk_head_dim), dtype),
            values=jnp.zeros((max_len, self.num_kv_heads, self.v_head_dim), dtype),
            length=jnp.zeros((), jnp.int32),
        )

    def prefill(
        self, x: Float[Array, "seq embed"], cache: KVCache
    ) -> tuple[Float[Array, "seq out"], KVCache]:
        """Causal self-attention over a prompt `x`, which starts the cache.

        Writes the prompt's keys and values at positions `[0, seq)` and sets the cache's
        length to `seq` (earlier contents are discarded). Equals `self(x, mask=Causal())`.
        """
        check_width("Attention", "x", x, self.query_proj.weight.shape[-1])
        check_prompt_fits(x.shape[0], cache.keys.shape[0])
        q, k, v = self._qkv(x, None)
        o = _run(q, k, v, Causal(), None, self._scale, self.backend, self.config)
        put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, new[0].astype(buf.dtype), 0, axis=0
        )
        cache = KVCache(put(cache.keys, k), put(cache.values, v), jnp.int32(x.shape[0]))
        return self._output(o, x), cache

    def decode_step(
        self, x: Float[Array, " embed"], cache: KVCache
    ) -> tuple[Float[Array, " out"], KVCache]:
        """One token at position `cache.length`, attending to the cache and itself.

        Its key and value enter the cache first. Token by token, this equals the
        matching rows of the causal forward. The attention call has one query over the
        cache buffer with `KVLengths`: on a GPU it runs the split-KV kernel. With the
        cache full (`max_len` tokens before this one) the output is NaN.
        """
        check_width("Attention", "x", x, self.query_proj.weight.shape[-1], ranks=(1,))
        position = cache.length
        q, k, v = self._qkv(x[None], None, positions=position[None])
        put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, new[0].astype(buf.dtype), position, axis=0
        )
        keys, values = put(cache.keys, k), put(cache.values, v)
        mask = KVLengths((position + 1)[None])
        o = _run(q, keys[None].astype(q.dtype), values[None].astype(q.dtype), mask, None,
                 self._scale, self.backend, self.config)  # fmt: skip
        out = nan_past_capacity(self._output(o, x[None])[0], position + 1, keys.shape[0])
        return out, KVCache(keys, values, position + 1)

    @property
    def _scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_head_dim)

    def _output(self, o, x):
        o = o[0].reshape(x.shape[0], self.num_heads * self.v_head_dim).astype(x.dtype)
        return jax.vmap(self.output_proj)(o)

    def explain(
        self,
        x: Array | jax.ShapeDtypeStruct,
        context: Array | jax.ShapeDtypeStruct | None = None,
        *,
        mask: MaskLike = None,
        score_mod: object = None,
        batch: int = 1,
    ) -> Choice:
        """The `Choice` this module's backend makes for these inputs, without running it.

        `batch`: the examples `jax.vmap` runs the module over; our kernels plan for all
        of them at once (`_flash.attend`), so their config depends on it.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        q, k, v = (
            jax.ShapeDtypeStruct((batch, *a.shape[1:]), a.dtype)
            for a in jax.eval_shape(self._qkv, x, context)
        )
        return _explain(q, k, v, mask, score_mod, self.backend, None)


class _FeedForward(eqx.Module):
    """`Linear -> GELU -> Linear` (the set-transformer rFF)."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, *, dtype=None, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(dim, hidden, dtype=dtype, key=k1)
        self.down = eqx.nn.Linear(hidden, dim, dtype=dtype, key=k2)

    def __call__(self, x: Float[Array, "n dim"]) -> Float[Array, "n dim"]:
        return jax.vmap(lambda r: self.down(jax.nn.gelu(self.up(r))))(x)


def _set_mask(size: Int[ArrayLike, ""] | None) -> AbstractMask | None:
    return None if size is None else KVLengths(jnp.asarray(size, jnp.int32))


class MAB(eqx.Module):
    """Pre-norm multihead attention block: `H = X + Att(LN X, LN Y)`, `H + FF(LN H)`.

    With `y_size`, only the first `y_size` rows of `Y` are attended to (padded sets).
    """

    attention: Attention
    norm_x: eqx.nn.LayerNorm
    norm_y: eqx.nn.LayerNorm
    norm_h: eqx.nn.LayerNorm
    feed_forward: _FeedForward

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        y_dim: int | None = None,
        hidden: int | None = None,
        implementation: str | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        k1, k2 = jax.random.split(key)
        y_dim = dim if y_dim is None else y_dim
        self.attention = Attention(
            dim, num_heads, context_dim=y_dim, implementation=implementation, dtype=dtype, key=k1
        )
        self.norm_x = eqx.nn.LayerNorm(dim, dtype=dtype)
        self.norm_y = eqx.nn.LayerNorm(y_dim, dtype=dtype)
        self.norm_h = eqx.nn.LayerNorm(dim, dtype=dtype)
        self.feed_forward = _FeedForward(dim, hidden or 2 * dim, dtype=dtype, key=k2)

    def __call__(
        self,
        x: Float[Array, "n dim"],
        y: Float[Array, "m y_dim"],
        *,
        y_size: Int[ArrayLike, ""] | None = None,
    ) -> Float[Array, "n dim"]:
        check_width("MAB", "x", x, self.norm_x.shape[-1])
        check_width("MAB", "y", y, self.norm_y.shape[-1])
        ln = lambda norm, a: jax.vmap(norm)(a)  # noqa: E731
        h = x + self.attention(ln(self.norm_x, x), ln(self.norm_y, y), mask=_set_mask(y_size))
        return h + self.feed_forward(ln(self.norm_h, h))


class SAB(eqx.Module):
    """Set attention block `MAB(X, X)`: permutation-equivariant."""

    mab: MAB

    def __init__(self, dim: int, num_heads: int, *, implementation=None, dtype=None, key):
        self.mab = MAB(dim, num_heads, implementation=implementation, dtype=dtype, key=key)

    def __call__(
        self, x: Float[Array, "n dim"], *, size: Int[ArrayLike, ""] | None = None
    ) -> Float[Array, "n dim"]:
        return self.mab(x, x, y_size=size)


class ISAB(eqx.Module):
    """Induced set attention block `MAB(X, MAB(I, X))` with learned inducing points `I`.

    O(n m) instead of O(n^2) for `m` inducing points; permutation-equivariant.
    """

    inducing: Float[Array, "m dim"]
    to_inducing: MAB
    from_inducing: MAB

    def __init__(
        self, dim: int, num_heads: int, num_inducing: int, *, implementation=None, dtype=None, key
    ):
        k0, k1, k2 = jax.random.split(key, 3)
        self.inducing = jax.random.normal(k0, (num_inducing, dim), dtype or jnp.float32) * dim**-0.5
        self.to_inducing = MAB(dim, num_heads, implementation=implementation, dtype=dtype, key=k1)
        self.from_inducing = MAB(dim, num_heads, implementation=implementation, dtype=dtype, key=k2)

    def __call__(
        self, x: Float[Array, "n dim"], *, size: Int[ArrayLike, ""] | None = None
    ) -> Float[Array, "n dim"]:
        h = self.to_inducing(self.inducing.astype(x.dtype), x, y_size=size)
        return self.from_inducing(x, h)


class PMA(eqx.Module):
    """Pooling by multihead attention: `MAB(S, FF(X))` with learned seeds; invariant."""

    seeds: Float[Array, "k dim"]
    feed_forward: _FeedForward
    mab: MAB

    def __init__(
        self, dim: int, num_heads: int, num_seeds: int = 1, *, implementation=None, dtype=None,
        key,
    ):  # fmt: skip
        k0, k1, k2 = jax.random.split(key, 3)
        self.seeds = jax.random.normal(k0, (num_seeds, dim), dtype or jnp.float32) * dim**-0.5
        self.feed_forward = _FeedForward(dim, 2 * dim, dtype=dtype, key=k1)
        self.mab = MAB(dim, num_heads, implementation=implementation, dtype=dtype, key=k2)

    def __call__(
        self, x: Float[Array, "n dim"], *, size: Int[ArrayLike, ""] | None = None
    ) -> Float[Array, "k dim"]:
        return self.mab(self.seeds.astype(x.dtype), self.feed_forward(x), y_size=size)
