"""The canonical description of an attention call, and capability records checked against it.

`AttentionCall` is built once per call from the static shapes, dtype and mask/score-mod
structure. It is the only input to capability checks, tile heuristics, `explain()` and
benchmark metadata. `AttentionCapabilities` declares, as data, what an implementation
computes exactly; `check` returns the first reason it cannot, or `None`.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from probjax_eqx.backends import DeviceInfo, sm_number
from probjax_eqx.biases import AbstractScoreMod
from probjax_eqx.masks import AbstractMask, conjuncts


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Static description of one attention call (hashable)."""

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    dtype: str
    mask_terms: tuple[tuple, ...] = ()
    score_mod: tuple | None = None

    @property
    def groups(self) -> int:
        return self.q_heads // self.kv_heads

    @classmethod
    def from_args(
        cls,
        q_shape: tuple[int, ...],
        k_shape: tuple[int, ...],
        v_shape: tuple[int, ...],
        dtype: np.dtype,
        mask: AbstractMask | None,
        score_mod: AbstractScoreMod | None,
    ) -> "AttentionCall":
        batch, q_len, q_heads, qk_dim = q_shape
        _, kv_len, kv_heads, v_dim = v_shape
        return cls(
            batch=batch,
            q_len=q_len,
            kv_len=kv_len,
            q_heads=q_heads,
            kv_heads=kv_heads,
            qk_dim=qk_dim,
            v_dim=v_dim,
            dtype=np.dtype(dtype).name,
            mask_terms=tuple(m.spec() for m in conjuncts(mask)),
            score_mod=None if score_mod is None else score_mod.spec(),
        )

    def flops(self) -> float:
        """Forward matmul FLOPs, counting every (query, key) pair (masks ignored)."""
        pairs = self.batch * self.q_heads * self.q_len * self.kv_len
        return 2.0 * pairs * (self.qk_dim + self.v_dim)


@dataclasses.dataclass(frozen=True)
class AttentionCapabilities:
    """What an attention implementation computes exactly.

    Attributes:
        dtypes: input dtypes accepted.
        platforms: JAX platforms it runs on.
        min_compute_capability: lowest `sm_XY` on GPUs, or `None`.
        max_head_dim: largest qk / v head dim, or `None`.
        head_dim_multiple: head dims must be multiples of this.
        same_qk_v_dim: whether the value head dim must equal the query/key head dim.
        mask_terms: names (`spec()[0]`) of masks it accepts as `&`-terms, or `None`
            for any mask.
        score_mods: names of score mods it accepts, or `None` for any.
        extra: further checks `(call) -> reason | None`, for rules data cannot say.
        unavailable: why the implementation cannot run at all in this build, or `None`.
    """

    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    platforms: frozenset[str] = frozenset({"cpu", "gpu", "tpu"})
    min_compute_capability: str | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    same_qk_v_dim: bool = False
    mask_terms: frozenset[str] | None = None
    score_mods: frozenset[str] | None = None
    extra: tuple[Callable[[AttentionCall], str | None], ...] = ()
    unavailable: str | None = None

    def check(self, call: AttentionCall, device: DeviceInfo) -> str | None:
        """The first reason this implementation cannot compute `call`, or `None`."""
        if self.unavailable is not None:
            return self.unavailable
        if device.platform not in self.platforms:
            return f"runs on {sorted(self.platforms)}, not on platform {device.platform!r}"
        if self.min_compute_capability is not None and device.is_gpu:
            if device.sm < sm_number(self.min_compute_capability):
                return (
                    f"needs compute capability >= {self.min_compute_capability}, "
                    f"device has {device.compute_capability}"
                )
        if call.dtype not in self.dtypes:
            return f"dtype {call.dtype} not supported (supports {sorted(self.dtypes)})"
        for name, dim in (("qk_dim", call.qk_dim), ("v_dim", call.v_dim)):
            if self.max_head_dim is not None and dim > self.max_head_dim:
                return f"head dim {name}={dim} exceeds the maximum {self.max_head_dim}"
            if dim % self.head_dim_multiple:
                return f"head dim {name}={dim} is not a multiple of {self.head_dim_multiple}"
        if self.same_qk_v_dim and call.qk_dim != call.v_dim:
            return f"needs qk_dim == v_dim, got {call.qk_dim} and {call.v_dim}"
        if self.mask_terms is not None:
            for term in call.mask_terms:
                if term[0] not in self.mask_terms:
                    return f"mask {term[0]!r} not supported (supports {sorted(self.mask_terms)})"
        if self.score_mods is not None and call.score_mod is not None:
            if call.score_mod[0] not in self.score_mods:
                return f"score_mod {call.score_mod[0]!r} not supported"
        for rule in self.extra:
            why = rule(call)
            if why is not None:
                return why
        return None
