"""cuDNN fused flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

cuDNN expresses a fixed menu of masks; the capability record and `_mask_rule` accept a
call only when the menu can state our mask exactly: any `&` of at most one each of
top-left `Causal`, a left `LocalWindow` (on square calls), `KVLengths` and `QLengths`.

Automatic selection on sm_90 sends calls with lengths elsewhere (`attention.PADDING_TERMS`
says why); pinned by name, cuDNN still takes them. `CudnnBackward` is cuDNN's backward
alone, joined to another kernel's forward (the Mosaic config's `cudnn_backward`).
"""

import dataclasses

import jax
import jax.numpy as jnp

from probjax_eqx.attention_call import AttentionCall, AttentionCapabilities
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels._flash import LN2
from probjax_eqx.kernels.cudnn._compat import flash_backward
from probjax_eqx.masks import Causal, KVLengths, LocalWindow, QLengths, conjuncts


def _mask_rule(call: AttentionCall) -> str | None:
    names = [term[0] for term in call.mask_terms]
    for name in set(names):
        if names.count(name) > 1:
            return f"cuDNN takes at most one {name!r} mask term"
    square = call.q_len == call.kv_len
    for term in call.mask_terms:
        if term[0] == "causal" and term[1] != "top_left" and not square:
            return "cuDNN's causal mask is top-left aligned; bottom-right needs Lq == Lkv"
        if term[0] == "local_window":
            right = term[2]
            if not square:
                return "cuDNN's sliding window needs Lq == Lkv"
            if right != 0 and "causal" not in names:
                return f"cuDNN supports no right window (right={right}) without a causal mask"
    return None


# cuDNN's flash attention takes heads of up to 256 dims on Hopper and later, 128 before
# (JAX's `check_is_flash_attention` states the same). On the H200 at head_dim 256, T=4096,
# it ran fwd+bwd in 4.74 ms against our Triton kernel's 10.99 (run 18).
_HOPPER_MAX_HEAD_DIM = 256
_MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class CudnnAttention:
    """The `"cudnn"` implementation (bf16/fp16; heads of 8k dims, up to 256 on sm_90+)."""

    name: str = "cudnn"
    capabilities: AttentionCapabilities = AttentionCapabilities(
        dtypes=frozenset({"bfloat16", "float16"}),
        platforms=frozenset({"gpu"}),
        min_compute_capability="sm_80",
        max_head_dim=_HOPPER_MAX_HEAD_DIM,
        head_dim_multiple=8,
        same_qk_v_dim=True,
        mask_terms=frozenset({"causal", "local_window", "kv_lengths", "q_lengths"}),
        score_mods=frozenset(),
        extra=(_mask_rule,),
    )

    def check(self, call: AttentionCall, device: DeviceInfo, config=None) -> str | None:
        del config
        why = self.capabilities.check(call, device)
        if why is None and device.sm < 90:
            dim = max(call.qk_dim, call.v_dim)
            if dim > _MAX_HEAD_DIM:
                why = (
                    f"head dim {dim} exceeds the maximum {_MAX_HEAD_DIM} before sm_90 "
                    f"(device has {device.compute_capability})"
                )
        return why

    def default_config(self, call: AttentionCall, device: DeviceInfo) -> None:
        del call, device
        return None

    def __call__(self, q, k, v, *, mask, score_mod, scale, config):
        del score_mod, config
        batch, q_len = q.shape[:2]
        causal, window, kv_lengths, q_lengths = False, None, None, None
        for term in conjuncts(mask):
            if isinstance(term, Causal):
                causal = True
            elif isinstance(term, LocalWindow):
                # Accepted windows end at the query (right=0, or cut by Causal).
                causal = True
                if term.left is not None:
                    window = (term.left, 0)
            elif isinstance(term, KVLengths):
                kv_lengths = jnp.broadcast_to(term.lengths, (batch,)).astype(jnp.int32)
            elif isinstance(term, QLengths):
                q_lengths = jnp.broadcast_to(term.lengths, (batch,)).astype(jnp.int32)
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            is_causal=causal,
            query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths,
            local_window_size=window,
            implementation="cudnn",
        )
        # Rows without a valid key are zero by our contract; cuDNN leaves padded
        # query rows unspecified, and an empty key set gives no valid key to any row.
        empty = jnp.zeros((batch, q_len), bool)
        if q_lengths is not None:
            empty = empty | (jnp.arange(q_len)[None, :] >= q_lengths[:, None])
        if kv_lengths is not None:
            empty = empty | (kv_lengths[:, None] <= 0)
        return jnp.where(empty[:, :, None, None], jnp.zeros((), out.dtype), out)


@dataclasses.dataclass(frozen=True)
class CudnnBackward:
    """cuDNN's flash backward as the backward half of `_flash.attend`.

    Given another kernel family's forward: its output and its rows' base-2 log-sum-exp
    (`FlashKernels.forward_rows`), which cuDNN reads as natural-log softmax statistics.
    For masks without arrays: none, or a causal mask cuDNN states exactly.
    """

    scale: float
    causal: bool

    def backward_rows(self, q, k, v, o, lse, do):
        stats = (lse * LN2).astype(jnp.float32)
        dq, dk, dv = flash_backward(q, k, v, o.astype(q.dtype), stats, do.astype(q.dtype),
                                    scale=self.scale, causal=self.causal)  # fmt: skip
        return dq, dk, dv, ()  # the mask has no arrays
