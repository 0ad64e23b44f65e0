"""The one place that reaches into JAX's private cuDNN attention.

`jax.nn.dot_product_attention(implementation="cudnn")` runs cuDNN's forward and backward
under one custom VJP of its own. Its backward alone, given another kernel's forward
output and log-sum-exp, is a private primitive whose operands have grown across jax
versions (jax 0.10 added sequence offsets and page tables). `flash_backward` binds it by
the parameter names of the primitive's implementation; `BACKWARD_UNAVAILABLE` says why
it cannot where this jax's primitive takes names we do not know.
"""

import inspect

import jax
import jax.numpy as jnp

try:
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - a jax without its cuDNN attention module
    _cudnn = None

# Operands we pass, and the unused ones (empty arrays, as jax's own wrapper passes them).
_GIVEN = ("query", "key", "value", "activation", "fwd_output", "grad_output")
_UNUSED = ("bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
           "page_table_v")  # fmt: skip
_PARAMS = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
           "sliding_window_length")  # fmt: skip
_NEEDED = ("_dot_product_attention_bwd_impl", "_dot_product_attention_bwd_p_wrapper",
           "MaskType", "AttentionLayout")  # fmt: skip


def _parameters() -> tuple[str, ...]:
    if _cudnn is None or not hasattr(_cudnn, _NEEDED[0]):
        return ()
    return tuple(inspect.signature(_cudnn._dot_product_attention_bwd_impl).parameters)


# The primitive's operands then its parameters, in its implementation's order.
_NAMES = _parameters()


def _backward_unavailable() -> str | None:
    if _cudnn is None:
        return f"jax {jax.__version__} has no cuDNN attention module"
    missing = [name for name in _NEEDED if not hasattr(_cudnn, name)]
    if missing:
        return f"jax {jax.__version__}'s private cuDNN attention lacks {missing}"
    unknown = [name for name in _NAMES if name not in _GIVEN + _UNUSED + _PARAMS]
    absent = [name for name in _GIVEN if name not in _NAMES]
    if unknown or absent:
        return (
            f"jax {jax.__version__}'s cuDNN backward primitive takes parameters we do not "
            f"bind (unknown {unknown}, absent {absent})"
        )
    return None


BACKWARD_UNAVAILABLE = _backward_unavailable()


def flash_backward(q, k, v, o, stats, do, *, scale: float, causal: bool):
    """`(dq, dk, dv)` by cuDNN's flash backward, given a forward's output and statistics.

    `[batch, seq, heads, dim]` operands (`o`, `do` in the inputs' dtype); `stats`: each
    row's natural-log log-sum-exp of the scaled scores, `[batch, q_heads, q_seq]` float32
    (cuDNN's softmax statistics). Unmasked, or causal from the top left.
    """
    if BACKWARD_UNAVAILABLE is not None:
        raise NotImplementedError(BACKWARD_UNAVAILABLE)
    assert _cudnn is not None
    given: dict[str, jax.Array] = dict(zip(_GIVEN, (q, k, v, stats, o, do)))
    unused = jnp.zeros(0, q.dtype)
    mask_type = _cudnn.MaskType.CAUSAL if causal else _cudnn.MaskType.NO_MASK
    params = dict(scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
                  mask_type=mask_type, layout=_cudnn.AttentionLayout.BTNH.value,
                  sliding_window_length=None)  # fmt: skip
    operands = [given.get(name, unused) for name in _NAMES if name not in _PARAMS]
    kwargs = {name: params[name] for name in _NAMES if name in _PARAMS}
    dq, dk, dv = _cudnn._dot_product_attention_bwd_p_wrapper.bind(*operands, **kwargs)
    return dq, dk, dv
