"""Mixture of experts: dropless top-k routing over SwiGLU experts, and the grouped matmul.

`MoE` routes every token to its `top_k` experts, always: there is no capacity factor,
so no token is dropped however skewed the routing. Dispatch is "sorted": the `N * K`
(token, slot) pairs are sorted by expert, gathered, run through grouped matmuls (one
weight matrix per expert, ragged row counts) and summed back into their tokens with
their router weights (gathers both ways, `probjax_eqx._rows`). The grouped matmul is its
own op with a backend registry:

| implementation | what runs                                                      |
|----------------|----------------------------------------------------------------|
| `"xla"`        | XLA: `jax.lax.ragged_dot`'s product over row tiles (reference) |
| `"triton"`     | our Pallas Triton grouped matmul, dLHS and transposed dRHS      |
| `"mosaic"`     | our Pallas Mosaic GPU (wgmma + TMA) kernels, 16-bit, sm_90      |

`dispatch=` picks the mode: `"auto"` (see below), `"sorted"` (the registry's grouped
matmul for the device), `"xla"`, `"triton"`, `"mosaic"`, `"pallas"` (Mosaic for 16-bit
compute on sm_90, else Triton), or `"fused_gsum"`, which never forms the `N * K x d_model`
copies: the first grouped matmul gathers token rows inside the kernel and the second adds
each row, scaled by its router weight, into its token's output (atomics), in the backward
as in the forward.

`"auto"` runs the first grouped matmul of its priority list that can compute the call,
like every automatic backend: on sm_90 Mosaic (16-bit compute) on the sorted rows, else
`AUTO_DISPATCH`'s mode (`"fused_gsum"` on GPUs, `"sorted"` elsewhere or where results
must repeat bit for bit). `moe.explain(x)` names the kernel and why the others were
passed over. H200, bf16 train step: Mosaic 1.16x / 1.19x / 1.35x `"fused_gsum"`'s at
16k / 131k / 1M tokens (runs 35, 37, 42), with twice its scratch memory then (3.5 vs
1.8 GiB at 131k tokens, before the copies were gathered again in the backward rather
than kept: `matmul_of_copies`): `dispatch="fused_gsum"` is the lean choice.

`inference_dispatch=` names a mode for the forward outside differentiation (inference,
evaluation) where it differs from the train step's; under `jax.grad` the dispatch runs
forward and backward.
"""

import dataclasses
import functools
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from probjax_eqx._autodiff import both_modes, jvp_of, kernel_then_reference
from probjax_eqx._inputs import check_width
from probjax_eqx._rows import (
    bin_counts,
    combine_rows,
    copy_to_rows,
    inverse_permutation,
    permute_rows,
    sum_copies,
)
from probjax_eqx.backends import (
    Backend,
    Choice,
    DeviceInfo,
    UnsupportedError,
    atomics_refusal,
    current_device,
    register_op,
    resolve,
)
from probjax_eqx.kernels import _flash
from probjax_eqx.kernels.mosaic import grouped_matmul as mosaic_gmm
from probjax_eqx.kernels.mosaic._common import smem_refusal
from probjax_eqx.kernels.mosaic.grouped_matmul import MosaicGroupedMatmulConfig
from probjax_eqx.kernels.triton import grouped_matmul as triton_gmm
from probjax_eqx.kernels.triton.grouped_matmul import TritonGroupedMatmulConfig


@dataclasses.dataclass(frozen=True)
class GroupedMatmulCall:
    """Static description of one grouped matmul `[rows, k] x [groups, k, n]`."""

    rows: int
    k: int
    n: int
    groups: int
    dtype: str


_FLOATS = frozenset({"float32", "bfloat16", "float16"})


@dataclasses.dataclass(frozen=True)
class XlaGroupedMatmul:
    """`jax.lax.ragged_dot`'s product in XLA, exact, accumulating in float32 (`_gmm`)."""

    name: str = "xla"

    def check(self, call: GroupedMatmulCall, device: DeviceInfo, config=None) -> str | None:
        if config is not None:
            raise TypeError(f"implementation='xla' takes no config, got {config!r}")
        return None if call.dtype in _FLOATS else f"dtype {call.dtype} not supported"

    def default_config(self, call, device):
        return None

    def __call__(self, lhs, rhs, group_sizes, *, config):
        return _xla_grouped_matmul(lhs, rhs, group_sizes)


# `jax.lax.ragged_dot` multiplies every row by every group's matrix and masks the result
# (`[groups, rows, k]` operands): 62x a dense matmul's time on the CPU at 8192 rows and
# 32 groups, and 128 GiB at 1M rows on the H200 (run 17, out of memory). The XLA products
# here are the same sums over row tiles of the padded layout, each tile one group's rows
# times that group's matrix (`_tiles`). They also batch (`jax.vmap`, which ragged_dot
# cannot over batched group sizes): the batch folds into one product over the examples'
# rows sorted by group (`_folded_order`).
def _tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: the largest power of two (8 to 4096) at most `rows / (4 groups)`.

    Padding (under a tile per group) then stays under a quarter of the rows, and the
    tiles, each gathering its group's matrix, are few.
    """
    return int(min(4096, max(8, 1 << max(0, (rows // (4 * groups)).bit_length() - 1))))


def _tiles(lhs, group_sizes):
    """`(layout, lhs in row tiles [tiles, m, k])`; tiles past the groups hold zeros."""
    rows, k = lhs.shape
    lay = triton_gmm.layout(group_sizes, rows, _tile_rows(rows, group_sizes.shape[0]))
    return lay, lay.to_padded(lhs).reshape(lay.tile_group.shape[0], -1, k)


def _exact(dtype):
    """float32 products at `HIGHEST` (no TF32 on GPUs); 16-bit ones are exact anyway."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


@jax.custom_batching.custom_vmap
def _gmm(lhs, rhs, group_sizes):
    lay, a = _tiles(lhs, group_sizes)
    out = jnp.einsum("tmk,tkn->tmn", a, rhs[lay.tile_group], precision=_exact(lhs.dtype),
                     preferred_element_type=jnp.float32)  # fmt: skip
    return lay.from_padded(out.reshape(-1, rhs.shape[2]), rhs.shape[2]).astype(lhs.dtype)


@jax.custom_batching.custom_vmap
def _tgmm(lhs, dout, group_sizes):
    """`out[g] = lhs_g^T @ dout_g` over each group's rows: `[groups, k, n]`, float32."""
    lay, a = _tiles(lhs, group_sizes)
    d = lay.to_padded(dout).reshape(a.shape[0], a.shape[1], -1)
    per_tile = jnp.einsum("tmk,tmn->tkn", a, d, precision=_exact(lhs.dtype),
                          preferred_element_type=jnp.float32)  # fmt: skip
    # Each group sums its tiles: a matmul with the tiles' one-hot groups, not a
    # scatter-add (tiles past the groups hold zeros; they count for none).
    groups = jnp.arange(group_sizes.shape[0])
    owner = ((lay.tile_group[:, None] == groups) & (lay.tile_live[:, None] > 0)).astype(jnp.float32)
    return jnp.einsum("tg,tkn->gkn", owner, per_tile, precision=jax.lax.Precision.HIGHEST)


def _folded_order(group_sizes, rows: int, per_example_groups: bool):
    """Order of the `[batch * rows]` flattened rows of a batch that sorts them by group.

    Rows keep their order within a group; rows past an example's groups go last. With
    `per_example_groups` the groups are (example, group) pairs, else the groups of all
    examples merge. Returns the permutation and the folded group sizes.
    """
    batch, groups = group_sizes.shape
    ends = jnp.cumsum(group_sizes, axis=1)
    row = jnp.arange(rows)
    gid = jax.vmap(lambda e: jnp.searchsorted(e, row, side="right"))(ends)  # [batch, rows]
    if per_example_groups:
        key = jnp.where(gid < groups, jnp.arange(batch)[:, None] * groups + gid, batch * groups)
        sizes = group_sizes.reshape(batch * groups)
    else:
        key, sizes = gid, group_sizes.sum(0)
    order = jnp.argsort(key.reshape(-1), stable=True)
    return order, sizes


def _batched(axis_size, in_batched, *args):
    return [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in
            zip(args, in_batched)]  # fmt: skip


@_gmm.def_vmap
def _gmm_vmap(axis_size, in_batched, lhs, rhs, group_sizes):
    rhs_batched = in_batched[1]
    lhs, group_sizes = _batched(axis_size, (in_batched[0], in_batched[2]), lhs, group_sizes)
    batch, rows, k = lhs.shape
    order, sizes = _folded_order(group_sizes, rows, per_example_groups=rhs_batched)
    if rhs_batched:
        rhs = rhs.reshape(-1, *rhs.shape[2:])
    out = _gmm(lhs.reshape(batch * rows, k)[order], rhs, sizes)
    out = permute_rows(out, inverse_permutation(order), order)  # back to the examples' order
    return out.reshape(batch, rows, -1), True


@_tgmm.def_vmap
def _tgmm_vmap(axis_size, in_batched, lhs, dout, group_sizes):
    lhs, dout, group_sizes = _batched(axis_size, in_batched, lhs, dout, group_sizes)
    batch, rows, k = lhs.shape
    order, sizes = _folded_order(group_sizes, rows, per_example_groups=True)
    out = _tgmm(lhs.reshape(batch * rows, k)[order], dout.reshape(batch * rows, -1)[order], sizes)
    return out.reshape(batch, group_sizes.shape[1], k, -1), True


# Both products are bilinear and each one's VJP and JVP are made of the two: derivatives
# of any order in either mode, under vmap too, never through `custom_vmap` (which has no
# reverse mode).
def _forward_rule(product):
    """The VJP's forward rule of `product`: its operands are the residuals."""
    return lambda *operands: (product(*operands), operands)


def _bilinear_tangent(product):
    """The JVP of the bilinear `product(a, b, group_sizes)`, through `product` itself."""

    def tangent(operands, tangents):
        a, b, sizes = operands
        ta, tb, _ = tangents
        return product(ta.astype(a.dtype), b, sizes) + product(a, tb.astype(b.dtype), sizes)

    return tangent


def _grouped_matmul_bwd(residuals, dout):
    lhs, rhs, group_sizes = residuals
    dlhs = _xla_grouped_matmul(dout, jnp.swapaxes(rhs, 1, 2), group_sizes)
    drhs = _xla_transposed_grouped_matmul(lhs, dout, group_sizes).astype(rhs.dtype)
    return dlhs, drhs, None


def _transposed_grouped_matmul_bwd(residuals, ct):
    lhs, dout, group_sizes = residuals
    dlhs = _xla_grouped_matmul(dout, jnp.swapaxes(ct, 1, 2).astype(dout.dtype), group_sizes)
    ddout = _xla_grouped_matmul(lhs, ct.astype(lhs.dtype), group_sizes)
    return dlhs.astype(lhs.dtype), ddout.astype(dout.dtype), None


_xla_grouped_matmul = both_modes(
    _gmm,
    _forward_rule(lambda *a: _xla_grouped_matmul(*a)),
    _grouped_matmul_bwd,
    _bilinear_tangent(lambda *a: _xla_grouped_matmul(*a)),
)
_xla_transposed_grouped_matmul = both_modes(
    _tgmm,
    _forward_rule(lambda *a: _xla_transposed_grouped_matmul(*a)),
    _transposed_grouped_matmul_bwd,
    _bilinear_tangent(lambda *a: _xla_transposed_grouped_matmul(*a)),
)


@dataclasses.dataclass(frozen=True)
class TritonGroupedMatmul:
    """Our Pallas Triton grouped matmul (`kernels/triton/grouped_matmul.py`)."""

    name: str = "triton"

    def check(self, call: GroupedMatmulCall, device: DeviceInfo, config=None) -> str | None:
        if call.dtype not in _FLOATS:
            return f"dtype {call.dtype} not supported (supports {sorted(_FLOATS)})"
        return _flash.check_pallas(
            "triton", TritonGroupedMatmulConfig, config, device, "Pallas Triton needs a GPU"
        )

    def default_config(self, call, device):
        return TritonGroupedMatmulConfig(interpret=not device.is_gpu)

    def __call__(self, lhs, rhs, group_sizes, *, config):
        return triton_gmm.grouped_matmul(lhs, rhs, group_sizes, config=config)


@dataclasses.dataclass(frozen=True)
class MosaicGroupedMatmul:
    """Our Pallas Mosaic GPU grouped matmul (`kernels/mosaic/grouped_matmul.py`)."""

    name: str = "mosaic"

    def check(self, call: GroupedMatmulCall, device: DeviceInfo, config=None) -> str | None:
        if call.dtype not in ("bfloat16", "float16"):
            return f"dtype {call.dtype} not supported: wgmma here takes 16-bit operands"
        why = _flash.check_pallas(
            "mosaic", MosaicGroupedMatmulConfig, config, device, "Mosaic GPU needs an sm_90 GPU"
        )
        if why is None and device.is_gpu and device.compute_capability != "sm_90":
            why = f"wgmma and TMA need sm_90, device has {device.compute_capability}"
        if why is None and config is not None:
            why = smem_refusal(mosaic_gmm.smem_bytes(config))
        return why

    def default_config(self, call, device):
        return MosaicGroupedMatmulConfig(interpret=not device.is_gpu)

    def __call__(self, lhs, rhs, group_sizes, *, config):
        return mosaic_gmm.grouped_matmul(lhs, rhs, group_sizes, config=config)

    def kernels(self, config, groups: int) -> triton_gmm.PaddedKernels:
        return mosaic_gmm.kernels(config, groups)


_IMPLEMENTATIONS = {
    "xla": XlaGroupedMatmul(),
    "triton": TritonGroupedMatmul(),
    "mosaic": MosaicGroupedMatmul(),
}
register_op("grouped_matmul", lambda: _IMPLEMENTATIONS)


def _describe(lhs, rhs, group_sizes) -> GroupedMatmulCall:
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            "expected lhs [rows, k], rhs [groups, k, n], group_sizes [groups]; got "
            f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}"
        )
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"shapes do not chain: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
            f"{group_sizes.shape}"
        )
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must share a dtype, got {lhs.dtype} and {rhs.dtype}")
    return GroupedMatmulCall(
        lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], jnp.dtype(lhs.dtype).name
    )


def _select(lhs, rhs, group_sizes, implementation, config) -> Choice:
    call = _describe(lhs, rhs, group_sizes)
    if not isinstance(implementation, Backend):
        implementation = resolve("grouped_matmul", implementation)
    return implementation.select(call, config)


def grouped_matmul(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, " groups"],
    *,
    implementation: str | Backend | None = None,
    config: object = None,
) -> Float[Array, "rows n"]:
    """`out[r] = lhs[r] @ rhs[g(r)]` for rows sorted by group, `group_sizes[g]` rows each.

    Rows past `sum(group_sizes)` give zeros; groups that run past the last row end there.
    Differentiable in `lhs` and `rhs`.

    Args:
        lhs: `[rows, k]`, sorted by group.
        rhs: `[groups, k, n]`, one matrix per group.
        group_sizes: `[groups]` row counts (int32).
        implementation: `None`/`"auto"`, `"xla"` or `"triton"`, or a resolved `Backend`.
        config: the pinned implementation's config (e.g. `TritonGroupedMatmulConfig`).
    """
    choice = _select(lhs, rhs, group_sizes, implementation, config)
    if lhs.shape[0] == 0:  # no rows: nothing to multiply (the kernels' layouts need one)
        return jnp.zeros((0, rhs.shape[2]), lhs.dtype)
    impl = _IMPLEMENTATIONS[choice.kernel]
    group_sizes = group_sizes.astype(jnp.int32)
    if choice.kernel == "xla":
        return impl(lhs, rhs, group_sizes, config=choice.config)

    def kernel(lhs, rhs, group_sizes):
        return impl(lhs, rhs, group_sizes, config=choice.config)

    return kernel_then_reference(kernel, _xla_grouped_matmul, lhs, rhs, group_sizes)


def explain_grouped_matmul(lhs, rhs, group_sizes, *, implementation=None, config=None) -> Choice:
    """The `Choice` `grouped_matmul` would make for these operands (shapes suffice)."""
    return _select(lhs, rhs, group_sizes, implementation, config)


Dispatch = Literal["auto", "sorted", "xla", "triton", "pallas", "fused_gsum", "mosaic"]
# dispatch mode -> grouped-matmul implementation requested from the registry
_DISPATCH_TO_GMM = {
    "auto": None,
    "sorted": None,
    "xla": "xla",
    "triton": "triton",
    "mosaic": "mosaic",
    "pallas": "pallas",  # the registry's list without XLA: Mosaic for 16-bit on sm_90
    "fused_gsum": "triton",  # its gather / scatter live in the Triton kernels
}


# The dispatch mode `"auto"` falls back to, per platform, where no grouped matmul of
# `AUTO_FIRST` can compute a call: on GPUs the fused gather / scatter (no top-k copies;
# half the sorted dispatch's scratch memory), elsewhere the registry's grouped matmul.
AUTO_DISPATCH = {"gpu": "fused_gsum", "generic": "sorted"}
# Grouped matmuls `"auto"` tries first, on the sorted rows, per registry entry. H200, bf16
# train step at 16k / 131k / 1M tokens: Mosaic 1.397 / 10.02 / 67.96 ms vs fused_gsum
# 1.625 / 11.90 / 91.71 (runs 35, 37); its forward 3.80 vs 5.70 ms at 131k.
AUTO_FIRST = {"sm_90": ("mosaic",)}
# Explicit priority of `"pallas"` on sm_90: Mosaic for 16-bit compute, else Triton.
_PALLAS_PRIORITY = {"sm_90": ("mosaic", "triton"), "generic": ("triton",)}


def auto_dispatch(device: DeviceInfo | None = None) -> str:
    """The dispatch mode `"auto"` stands for on `device` (the current one by default).

    Where results must repeat bit for bit (`DeviceInfo.deterministic`), not
    `"fused_gsum"`: its atomic adds sum a token's rows in an order that varies.
    """
    device = current_device() if device is None else device
    if device.atomics_vary:
        return AUTO_DISPATCH["generic"]
    return AUTO_DISPATCH["gpu" if device.is_gpu else "generic"]


def resolve_dispatch(
    dispatch: str = "auto", *, device: DeviceInfo | None = None, environ=None
) -> Backend:
    """The grouped-matmul `Backend` a dispatch mode runs on (read once, at construction)."""
    if dispatch not in _DISPATCH_TO_GMM:
        raise ValueError(
            f"unknown dispatch={dispatch!r}; expected one of {sorted(_DISPATCH_TO_GMM)}"
        )
    device = current_device(environ, device)
    auto = dispatch == "auto"
    if auto:
        dispatch = auto_dispatch(device)
    if dispatch == "fused_gsum" and device.atomics_vary:
        raise UnsupportedError(
            "fused_gsum",
            atomics_refusal(
                "its sum of each token's rows",
                "dispatch='sorted' (the same products, rows combined by gathers)",
            ),
        )
    requested = _DISPATCH_TO_GMM[dispatch]
    first = AUTO_FIRST.get(device.registry_key, ()) if auto else ()
    if requested != "pallas" and not first:
        return resolve("grouped_matmul", requested, device=device, environ=environ)
    registry = resolve("grouped_matmul", None, device=device, environ=environ)
    if requested == "pallas":
        own = _PALLAS_PRIORITY.get(device.registry_key, _PALLAS_PRIORITY["generic"])
    else:
        own = (requested,) if requested else registry.priority
    # Kernels opted out in the environment stay out, but for the mode's own pinned one.
    ahead = tuple(n for n in first + own if n in registry.priority or n == requested)
    priority = tuple(dict.fromkeys(ahead))
    return dataclasses.replace(registry, priority=priority)


def top_k_by_passes(scores: Array, k: int) -> tuple[Array, Array]:
    """`jax.lax.top_k(scores, k)` over the last axis as `k` argmax passes.

    For scores above -inf (a router's probabilities): a taken column is masked with -inf.
    For a router's few experts a pass is one fused reduction; ties go to the lower
    index as in `top_k`, and the values' gradient is a select, not a scatter. H200, 64
    experts, top-8 (run 29): 0.173 / 1.32 ms at 131k / 1M tokens vs `top_k`'s 0.373 /
    2.84; the values' gradient 0.167 / 1.30 vs 0.381 / 3.01.
    """
    cols = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    rest, indices = jax.lax.stop_gradient(scores), []
    for _ in range(k):
        index = jnp.argmax(rest, axis=-1).astype(jnp.int32)
        indices.append(index)
        rest = jnp.where(cols == index[..., None], -jnp.inf, rest)
    indices = jnp.stack(indices, axis=-1)
    return _columns(scores.shape[-1], scores, indices), indices


def _hits(num_columns: int, indices) -> list:
    """For each j, the mask of column `indices[..., j]` over `num_columns` columns."""
    cols = jnp.arange(num_columns, dtype=jnp.int32)
    return [cols == indices[..., j, None] for j in range(indices.shape[-1])]


def _select_columns(num_columns: int, x, indices):
    """`x[..., indices[..., j]]` for each j, as selects (no gather, no scatter)."""
    hits = _hits(num_columns, indices)
    return jnp.stack([jnp.sum(jnp.where(hit, x, 0), axis=-1) for hit in hits], axis=-1)


def _columns_fwd(num_columns: int, scores, indices):
    return _select_columns(num_columns, scores, indices), (num_columns, indices)


def _columns_bwd(residuals, d_values):
    num_columns, indices = residuals
    hits = _hits(num_columns, indices)
    d_scores = sum(jnp.where(hit, d_values[..., j, None], 0) for j, hit in enumerate(hits))
    return None, jnp.asarray(d_scores, d_values.dtype), None


# `_select_columns`, whose backward keeps the indices alone. Autodiff kept each pass's
# selected copy of the scores and its mask: 2.5 GiB at 1M tokens, 64 experts, top-8.
_columns = both_modes(
    _select_columns,
    _columns_fwd,
    _columns_bwd,
    lambda residuals, tangents: _columns(residuals[0], tangents[1], residuals[1]),
)


def resolve_inference_dispatch(request: str | None, dispatch_mode: str) -> str | None:
    """The mode a forward outside differentiation runs; `None`: the dispatch's own."""
    if request is None:
        return None
    if request not in _DISPATCH_TO_GMM or request == "auto":
        raise ValueError(
            f"unknown inference_dispatch={request!r}; expected None or one of "
            f"{sorted(set(_DISPATCH_TO_GMM) - {'auto'})}"
        )
    return None if request == dispatch_mode else request


def forward_or_vjp(forward, differentiable, *args):
    """`forward(*args)`; under differentiation `differentiable`'s forward and VJP instead.

    Both compute the same function: the first is the faster forward, the second the
    faster train step. Their values differ by rounding only.
    """

    def fwd(*args):
        out, vjp = jax.vjp(differentiable, *args)  # the VJP closure is a pytree
        return out, (vjp, args)

    def bwd(residuals, ct):
        return residuals[0](ct)

    def tangent(residuals, tangents):
        return jvp_of(differentiable)(residuals[1], tangents)

    return both_modes(forward, fwd, bwd, tangent)(*args)


class MoEAux(eqx.Module):
    """Router statistics of one MoE call.

    Attributes:
        load_balancing_loss: Switch-Transformer loss `E * sum_e f_e * P_e` (1 when even).
        router_z_loss: `mean(logsumexp(logits) ** 2)`.
        tokens_per_expert: `[E]` (token, slot) pairs routed to each expert.
        fraction_routed: `[E]` `tokens_per_expert / (tokens * top_k)`.
    """

    load_balancing_loss: Float[Array, ""]
    router_z_loss: Float[Array, ""]
    tokens_per_expert: Int[Array, " experts"]
    fraction_routed: Float[Array, " experts"]


class RouterStats(eqx.Module):
    """Router statistics as sums over tokens: shards of a batch add them (`jax.lax.psum`)."""

    tokens: Float[Array, ""]
    counts: Int[Array, " experts"]
    prob_sum: Float[Array, " experts"]
    z_sum: Float[Array, ""]

    def aux(self, top_k: int) -> MoEAux:
        tokens = jnp.maximum(self.tokens, 1.0)  # no tokens: every statistic is 0, not NaN
        fraction = self.counts.astype(jnp.float32) / (tokens * top_k)
        mean_prob = self.prob_sum / tokens
        return MoEAux(
            load_balancing_loss=self.counts.shape[0]
            * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob),
            router_z_loss=self.z_sum / tokens,
            tokens_per_expert=self.counts,
            fraction_routed=fraction,
        )


class SwiGLU(eqx.Module):
    """`down(silu(gate(x)) * up(x))`: the dense (shared) expert.

    One matmul for the gate and up projections, through `swiglu`: its backward keeps the
    two projections and the product alone (autodiff of the expression kept silu's
    intermediates too: 12 of the MoE layer's 25 GiB of residuals at 1M tokens, shared
    width 1024).
    """

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d_model: int, d_ff: int, *, dtype=None, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(d_model, d_ff, use_bias=False, dtype=dtype, key=k1)
        self.up = eqx.nn.Linear(d_model, d_ff, use_bias=False, dtype=dtype, key=k2)
        self.down = eqx.nn.Linear(d_ff, d_model, use_bias=False, dtype=dtype, key=k3)

    def __call__(self, x: Float[Array, " d_model"]) -> Float[Array, " d_model"]:
        w13 = jnp.concatenate([self.gate.weight, self.up.weight])  # [2 d_ff, d_model]
        return self.down(swiglu((w13 @ x)[None], self.gate.weight.shape[0])[0])


def _init(key, shape, fan_in, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype) / math.sqrt(fan_in)


@jax.checkpoint
def _router_logits(x, router):
    """Float32 logits of 16-bit tokens.

    The backward casts `x` again rather than keep its float32 copy (2 GiB at 1M tokens
    of 512).
    """
    return x.astype(jnp.float32) @ router.astype(jnp.float32)


def swiglu(h13: Array, d_ff: int) -> Array:
    """`silu(gate) * up` of rows holding the gate then the up projection (then padding).

    Its backward keeps `h13` alone and recomputes the sigmoid: autodiff of the expression
    kept five `[rows, d_ff]` arrays (the slices and silu's intermediates), 10 GB at 1M
    tokens x top-8 where `h13` is 4.
    """
    return _swiglu(h13, d_ff)


def _swiglu_value(h13, d_ff: int):
    return jax.nn.silu(h13[:, :d_ff]) * h13[:, d_ff : 2 * d_ff]


def _swiglu_fwd(h13, d_ff: int):
    return _swiglu_value(h13, d_ff), (h13, d_ff)


def _swiglu_bwd(residuals, dout):
    h13, d_ff = residuals
    gate = h13[:, :d_ff].astype(jnp.float32)
    up = h13[:, d_ff : 2 * d_ff].astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    dout = dout.astype(jnp.float32)
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))  # d silu(g) / dg
    dup = dout * gate * sig
    pad = jnp.zeros((h13.shape[0], h13.shape[1] - 2 * d_ff), jnp.float32)
    return jnp.concatenate([dgate, dup, pad], axis=1).astype(h13.dtype), None


def _swiglu_tangent(residuals, tangents):
    h13, d_ff = residuals
    return jax.jvp(lambda h: _swiglu_value(h, d_ff), (h13,), (tangents[0],))[1]


_swiglu = both_modes(_swiglu_value, _swiglu_fwd, _swiglu_bwd, _swiglu_tangent)


def gmm_product(gmm) -> triton_gmm.GroupedProduct:
    """`gmm(lhs, rhs, group_sizes)` (the grouped-matmul op) with VJPs from its own.

    Each VJP traces `gmm`'s forward again, unused: XLA drops it.
    """

    def lhs_vjp(lhs, rhs, sizes, dout):
        return jax.vjp(lambda a: gmm(a, rhs, sizes), lhs)[1](dout.astype(lhs.dtype))[0]

    def rhs_vjp(lhs, rhs, sizes, dout):
        return jax.vjp(lambda b: gmm(lhs, b, sizes), rhs)[1](dout.astype(lhs.dtype))[0]

    return triton_gmm.GroupedProduct(gmm, lhs_vjp, rhs_vjp)


def matmul_of_copies(x, rhs, rows, slots, aux, product: triton_gmm.GroupedProduct):
    """`product.call(copy_to_rows(x, rows, slots), rhs, aux)`: the first expert matmul.

    The tokens' top-k copies are gathered again in the backward instead of kept: they
    were a layer's largest training residual (8 of 14 GiB at 1M tokens x top-8, d_model
    512), and the gather is one pass over them.
    """

    def value(x, rhs, rows, slots, aux):
        return product.call(copy_to_rows(x, rows, slots), rhs, aux)

    def fwd(*args):
        return value(*args), args

    def bwd(residuals, dout):
        x, rhs, rows, slots, aux = residuals
        copies = copy_to_rows(x, rows, slots)
        dcopies = product.lhs_vjp(copies, rhs, aux, dout)
        dx = sum_copies(dcopies, rows, slots).astype(x.dtype)
        return dx, product.rhs_vjp(copies, rhs, aux, dout), None, None, None

    return both_modes(value, fwd, bwd, jvp_of(value))(x, rhs, rows, slots, aux)


def matmul_combine(lhs, rhs, aux, scale, slots, rows, product: triton_gmm.GroupedProduct):
    """`combine_rows(product.call(lhs, rhs, aux), slots, rows, scale)`: float32 `[tokens, N]`.

    An MoE's second grouped matmul and its router-weighted combine under one custom VJP.
    The backward gathers the cotangent's rows once, in the operands' dtype, and takes
    `u = dout_r @ rhs^T` unweighted: the weights' gradient is then `<lhs_r, u_r>`, so the
    `[rows, N]` products are neither kept nor read again (with them the Mosaic layer's
    backward at 1M tokens took 24 ms more than its matmuls, run 34).
    """

    def value(lhs, rhs, aux, scale, slots, rows):
        return combine_rows(product.call(lhs, rhs, aux), slots, rows, scale)

    def fwd(*args):
        return value(*args), args

    def bwd(residuals, dout):
        lhs, rhs, aux, scale, slots, rows = residuals
        per_row = copy_to_rows(dout.astype(lhs.dtype), rows, slots)  # padding rows: zeros
        u = product.lhs_vjp(lhs, rhs, aux, per_row)
        dlhs, dscale = triton_gmm.weighted_rows_vjp(lhs, u, scale)
        weighted = (lhs.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]).astype(lhs.dtype)
        drhs = product.rhs_vjp(weighted, rhs, aux, per_row)
        return dlhs, drhs, None, dscale.astype(scale.dtype), None, None

    return both_modes(value, fwd, bwd, jvp_of(value))(lhs, rhs, aux, scale, slots, rows)


def _padded_routing(group_sizes, token_of, sorted_weights, tokens: int, block_m: int):
    """`(layout, token, weight)` of the sorted (token, slot) pairs in the padded layout.

    Padding rows get the spare token row `tokens` and router weight 0.
    """
    lay = triton_gmm.layout(group_sizes, token_of.shape[0], block_m)
    rows = lay.tokens(token_of, tokens)
    scale = lay.to_padded(sorted_weights[:, None])[:, 0]
    return lay, rows, scale


class MoE(eqx.Module):
    """Dropless top-k mixture of SwiGLU experts with an optional shared expert.

    Call it on all the tokens of a batch at once (`[tokens, d_model]`, e.g. the batch
    flattened): routing is per token, and one grouped matmul per expert matrix then
    serves the whole batch. `jax.vmap` over an MoE works with every dispatch (the XLA
    grouped matmul folds the batch into one ragged product).

    Example:
        ```python
        moe = MoE(256, 512, num_experts=8, top_k=2, key=jax.random.key(0))
        y, aux = moe(x)                      # x: [tokens, 256]
        loss = task_loss(y) + 0.01 * aux.load_balancing_loss + 1e-3 * aux.router_z_loss
        ```
    """

    router: Float[Array, "d_model experts"]
    w_gate: Float[Array, "experts d_model d_ff"]
    w_up: Float[Array, "experts d_model d_ff"]
    w_down: Float[Array, "experts d_ff d_model"]
    shared: SwiGLU | None
    top_k: int = eqx.field(static=True)
    router_type: Literal["softmax", "sigmoid"] = eqx.field(static=True)
    normalize_weights: bool = eqx.field(static=True)
    compute_dtype: str | None = eqx.field(static=True)
    dispatch: Backend = eqx.field(static=True)
    dispatch_mode: str = eqx.field(static=True)  # where `explain(x)` is not Mosaic
    dispatch_request: str = eqx.field(static=True)  # as passed: "auto" may become another
    dispatch_config: object = eqx.field(static=True)
    inference: Backend | None = eqx.field(static=True)
    inference_mode: str | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        num_experts: int,
        top_k: int = 2,
        shared_d_ff: int | None = None,
        router_type: Literal["softmax", "sigmoid"] = "softmax",
        normalize_weights: bool = True,
        compute_dtype: jnp.dtype | str | None = None,
        dispatch: Dispatch = "auto",
        dispatch_config: object = None,
        inference_dispatch: Dispatch | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """Build the router and experts and resolve the dispatch backend.

        Args:
            d_model: token width.
            d_ff: hidden width of each expert.
            num_experts: number of routed experts.
            top_k: experts per token.
            shared_d_ff: hidden width of an always-on shared expert, or `None`.
            router_type: `"softmax"` (probabilities, top-k) or `"sigmoid"` (scores).
            normalize_weights: rescale each token's top-k weights to sum to 1.
            compute_dtype: dtype of the routed and shared experts' matmuls (e.g.
                `"bfloat16"`); the router stays float32.
            dispatch: see the module docstring.
            dispatch_config: config of a pinned grouped-matmul kernel.
            inference_dispatch: the mode a forward outside differentiation runs: `None`
                (the dispatch's) or a mode by name (e.g. `"mosaic"` beside a
                `"fused_gsum"` train step).
            dtype: parameter dtype.
            key: PRNG key.
        """
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if router_type not in ("softmax", "sigmoid"):
            raise ValueError(f"router_type={router_type!r}: expected 'softmax' or 'sigmoid'")
        dtype = jnp.float32 if dtype is None else dtype
        kr, kg, ku, kd, ks = jax.random.split(key, 5)
        self.router = _init(kr, (d_model, num_experts), d_model, dtype)
        self.w_gate = _init(kg, (num_experts, d_model, d_ff), d_model, dtype)
        self.w_up = _init(ku, (num_experts, d_model, d_ff), d_model, dtype)
        self.w_down = _init(kd, (num_experts, d_ff, d_model), d_ff, dtype)
        self.shared = (
            None if shared_d_ff is None else SwiGLU(d_model, shared_d_ff, dtype=dtype, key=ks)
        )
        self.top_k = top_k
        self.router_type = router_type
        self.normalize_weights = normalize_weights
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
        self.dispatch = resolve_dispatch(dispatch)
        self.dispatch_mode = auto_dispatch(self.dispatch.device) if dispatch == "auto" else dispatch
        self.dispatch_request = dispatch
        self.dispatch_config = dispatch_config
        self.inference_mode = resolve_inference_dispatch(inference_dispatch, self.dispatch_mode)
        self.inference = (
            None if self.inference_mode is None else resolve_dispatch(self.inference_mode)
        )

    @property
    def num_experts(self) -> int:
        return self.router.shape[1]

    def route(self, x: Float[Array, "tokens d_model"]):
        """Top-k expert indices `[tokens, k]`, their weights, and the router statistics."""
        experts, weights, stats = self.route_stats(x)
        return experts, weights, stats.aux(self.top_k)

    def route_stats(self, x: Float[Array, "tokens d_model"]):
        """`route`, with the statistics as sums over tokens (`RouterStats`).

        Sums add up across shards of the tokens (expert parallelism).
        """
        logits = _router_logits(x, self.router)
        if self.router_type == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        weights, experts = top_k_by_passes(scores, self.top_k)
        if self.normalize_weights:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        stats = RouterStats(
            tokens=jnp.asarray(x.shape[0], jnp.float32),
            counts=bin_counts(experts, self.num_experts),
            prob_sum=jnp.sum(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=0),
            z_sum=jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
        )
        return experts, weights, stats

    def _gmm(self, lhs, rhs, group_sizes):
        return grouped_matmul(
            lhs, rhs, group_sizes, implementation=self.dispatch, config=self.dispatch_config
        )

    def sort_routing(self, experts, weights):
        """The (token, slot) pairs sorted by expert.

        Returns `(token_of, slots, group_sizes, sorted_weights)`, `slots[t, k]` the sorted
        row of token `t`'s `k`-th expert.
        """
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token_of = order // self.top_k
        slots = inverse_permutation(order).reshape(experts.shape)
        group_sizes = bin_counts(flat, self.num_experts)
        return token_of, slots, group_sizes, weights.reshape(-1)[order]

    def experts(self, x, experts, weights):
        """Sorted dropless dispatch: `sum_k weights[:, k] * expert_k(x)`."""
        dtype = jnp.dtype(self.compute_dtype or x.dtype)
        choice = self.explain(x)  # validates the call and fills the kernel's config
        inference = self.explain_inference(x)
        if x.shape[0] == 0:  # an empty batch: the kernels' layouts need a row
            return jnp.zeros(x.shape, jnp.float32)
        routing = self.sort_routing(experts, weights)
        x = x.astype(dtype)
        train = (self.dispatch_mode, self.dispatch, choice, self.dispatch_config)
        if inference is None:
            return self._dispatch(train, x, *routing)
        infer = (self.inference_mode, self.inference, inference, None)
        return forward_or_vjp(
            lambda m, *a: m._dispatch(infer, *a), lambda m, *a: m._dispatch(train, *a),
            self, x, *routing,
        )  # fmt: skip

    def _dispatch(self, how, x, token_of, slots, group_sizes, sorted_weights):
        """The routed experts' sum by `how`.

        `how` is (mode, grouped-matmul backend, its choice, the config asked for).
        """
        mode, backend, choice, config = how
        impl = _IMPLEMENTATIONS[choice.kernel]
        if isinstance(impl, MosaicGroupedMatmul):  # its kernels run on the padded layout
            kernels = impl.kernels(choice.config, self.num_experts)
            fused = lambda m, x, t, s, w, g: m._padded(x, t, s, w, g, kernels)  # noqa: E731
        elif mode == "fused_gsum":  # "auto" falls back to it where Mosaic cannot run
            fused = lambda m, x, t, s, w, g: m._fused_gsum(x, t, w, g, choice)  # noqa: E731
        else:  # `grouped_matmul` takes its gradients' derivatives to XLA itself
            gmm = functools.partial(grouped_matmul, implementation=backend, config=config)
            return self._sorted(x, token_of, slots, sorted_weights, group_sizes, gmm)
        xla = functools.partial(grouped_matmul, implementation="xla")
        reference = lambda m, x, t, s, w, g: m._sorted(x, t, s, w, g, xla)  # noqa: E731
        return kernel_then_reference(
            fused, reference, self, x, token_of, slots, sorted_weights, group_sizes
        )

    def gate_up_weights(self, dtype) -> Float[Array, "experts d_model two_d_ff"]:
        """The gate and up expert matrices side by side: one grouped matmul for both."""
        return jnp.concatenate([self.w_gate, self.w_up], axis=2).astype(dtype)

    def _sorted(self, x, token_of, slots, sorted_weights, group_sizes, gmm):
        """The top-k copies sorted by expert, through `gmm` (XLA, Triton in place)."""
        product = gmm_product(gmm)
        h13 = matmul_of_copies(x, self.gate_up_weights(x.dtype), token_of, slots, group_sizes,
                               product)  # fmt: skip
        h = swiglu(h13, self.w_gate.shape[2])
        w_down = self.w_down.astype(x.dtype)
        return matmul_combine(h, w_down, group_sizes, sorted_weights, slots, token_of, product)

    def _padded(self, x, token_of, slots, sorted_weights, group_sizes, kernels):
        """The sorted dispatch with the copies gathered into the kernels' padded layout.

        Both grouped matmuls and their gradients run on that layout: no re-padding and
        un-padding around each matmul, forward or backward. Padding rows take the token
        index `tokens` (past the last: zeros) and weight 0.
        """
        (tokens, d_model), d_ff = x.shape, self.w_gate.shape[2]
        lay, rows, scale = _padded_routing(
            group_sizes, token_of, sorted_weights, tokens, kernels.config.block_m
        )
        slots_p = lay.dest[slots]  # each (token, slot)'s padded row
        w13_p, k_pad, _ = triton_gmm.padded_rhs(self.gate_up_weights(x.dtype), kernels.config)
        x_cols = jnp.pad(x, ((0, 0), (0, k_pad - d_model)))
        first = triton_gmm.padded_product(kernels)
        h = swiglu(matmul_of_copies(x_cols, w13_p, rows, slots_p, lay, first), d_ff)
        w_down_p, k_pad, _ = triton_gmm.padded_rhs(self.w_down.astype(x.dtype), kernels.config)
        h_p = jnp.pad(h, ((0, 0), (0, k_pad - d_ff)))
        combine = triton_gmm.padded_product(kernels, cols=d_model)
        return matmul_combine(h_p, w_down_p, lay, scale, slots_p, rows, combine)

    def _fused_gsum(self, x, token_of, sorted_weights, group_sizes, choice):
        tokens, config = x.shape[0], choice.config
        lay, rows, scale = _padded_routing(
            group_sizes, token_of, sorted_weights, tokens, config.block_m
        )
        h13 = triton_gmm.gather_matmul(x, self.gate_up_weights(x.dtype), lay, rows, config=config)
        h = swiglu(h13, self.w_gate.shape[2])
        w_down = self.w_down.astype(x.dtype)
        return triton_gmm.matmul_scatter(h, w_down, scale, lay, rows, tokens, config=config)

    @jax.named_scope("probjax.MoE")
    def __call__(
        self, x: Float[Array, "*tokens d_model"]
    ) -> tuple[Float[Array, "*tokens d_model"], MoEAux]:
        """Route `x` (one token `[d_model]` or `[tokens, d_model]`) through the experts."""
        check_width("MoE", "x", x, self.router.shape[0], ranks=(1, 2))
        squeeze = x.ndim == 1
        xs = x[None] if squeeze else x
        experts, weights, aux = self.route(xs)
        y = self.experts(xs, experts, weights) + self.shared_expert(xs)
        y = y.astype(x.dtype)
        return (y[0] if squeeze else y), aux

    def shared_expert(self, x: Float[Array, "tokens d_model"]) -> Float[Array, "tokens d_model"]:
        """The shared expert's output in float32 (zeros without one).

        Its matmuls run in `compute_dtype` like the routed experts': mixing float32
        parameters with 16-bit tokens would otherwise promote them to float32.
        """
        if self.shared is None:
            return jnp.zeros(x.shape, jnp.float32)
        dtype = jnp.dtype(self.compute_dtype or x.dtype)
        shared = jax.tree.map(lambda w: w.astype(dtype), self.shared)
        return jax.vmap(shared)(x.astype(dtype)).astype(jnp.float32)

    def explain(self, x: Array | jax.ShapeDtypeStruct) -> Choice:
        """The grouped-matmul `Choice` for the expert matmuls of `x` `[tokens, d_model]`.

        A Mosaic choice runs the sorted rows in its padded layout; any other runs
        `dispatch_mode`. The reason says which.
        """
        choice = explain_grouped_matmul(
            *self._gmm_operands(x), implementation=self.dispatch, config=self.dispatch_config
        )
        if choice.kernel == "mosaic":
            how = "the sorted rows in Mosaic's padded layout"
        else:
            how = f"dispatch mode {self.dispatch_mode!r}"
        return dataclasses.replace(choice, reason=f"{choice.reason}; runs {how}")

    def _gmm_operands(self, x):
        """Shapes of the first expert matmul's operands for tokens `x`."""
        tokens = 1 if len(x.shape) == 1 else x.shape[0]
        dtype = self.compute_dtype or x.dtype
        lhs = jax.ShapeDtypeStruct((tokens * self.top_k, self.w_gate.shape[1]), dtype)
        rhs = jax.ShapeDtypeStruct(self.w_gate.shape, dtype)
        return lhs, rhs, jax.ShapeDtypeStruct((self.num_experts,), jnp.int32)

    def explain_inference(self, x: Array | jax.ShapeDtypeStruct) -> Choice | None:
        """The grouped-matmul `Choice` of a forward outside differentiation.

        `None` where that forward is the dispatch's own (no `inference_dispatch`).

        Raises:
            UnsupportedError: the named `inference_dispatch` cannot compute `x`.
        """
        if self.inference is None:
            return None
        return explain_grouped_matmul(*self._gmm_operands(x), implementation=self.inference)
