"""Pallas Triton grouped matmul: `out[rows of group g] = lhs[rows of g] @ rhs[g]`.

Rows arrive sorted by group with `group_sizes` rows each. Two kernel families:

**In place** (`grouped_matmul`, the `"triton"` implementation): the kernels read and
write the sorted rows where they are, so no copy of the rows is ever made. A row tile
that straddles groups runs its K loop once per group it touches and keeps each group's
rows of the result (at most `groups - 1` extra tiles); loads past the rows, K or N are
masked. Three kernels, one custom VJP:

- forward and dLHS (`dout @ rhs[g]^T`): grid (row tile, column tile), K loop per group;
- dRHS (`lhs_g^T @ dout_g` for every group): grid (group, K tile, N tile), looping over
  that group's rows from its first row, the last tile masked at its end.

**Padded layout** (`Layout`, for the MoE's fused gather / scatter and the Mosaic
kernels): every group's rows start at a multiple of `block_m` (at most
`groups * (block_m - 1)` padding rows, zero), so each row tile belongs to one group.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from probjax_eqx._rows import permute_rows

_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonGroupedMatmulConfig:
    """Tiles of the Triton grouped matmul (powers of two >= 16).

    Attributes:
        block_m: rows per tile (and the alignment of every group's rows).
        block_n: output columns per tile.
        block_k: contraction step.
        num_warps: warps per program.
        num_stages: software pipelining depth.
        interpret: run in Pallas interpret mode (CPU tests).
    """

    # Measured on the H200 (bench/results/h200_gmm_sweep.json, 1M rows, K 512, N 256):
    # 64x128x64 tiles, 3 stages ran fwd+bwd in 3.88 ms; the earlier 64x64x32 in 8.57.
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    interpret: bool = False

    def __post_init__(self):
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            if value < _MIN_BLOCK or value & (value - 1):
                raise ValueError(f"{field}={value} must be a power of two >= {_MIN_BLOCK}")


def _round_up(n, m):
    return -(-n // m) * m


class Layout(eqx.Module):
    """Where each sorted row lives in the group-aligned padded buffer.

    A pytree: custom VJPs take it as an explicit (integer, non-differentiable)
    argument, since closing over its tracers leaks them out of `jit` and `scan`.
    """

    dest: jax.Array  # [M] padded row of each row (`rows`, out of bounds, past the groups)
    src: jax.Array  # [rows] sorted row held by each padded row (`M`, out of bounds: none)
    tile_group: jax.Array  # [tiles] group of each row tile (0 for tiles past the end)
    tile_live: jax.Array  # [tiles] 1 where a tile holds rows (worst-case buffers: few do)
    row_valid: jax.Array  # [rows] whether the padded row holds a real row
    group_tiles: tuple[jax.Array, jax.Array]  # per group: [first, end) row tiles
    rows: int = eqx.field(static=True)  # padded row count

    # Both directions are gathers (`src` one way, `dest` the other), and so are their
    # gradients (`permute_rows`).
    def to_padded(self, x, cols: int | None = None):
        """`[M, c]` rows -> `[rows, cols]` in the padded layout (zeros elsewhere)."""
        cols = x.shape[1] if cols is None else cols
        if cols != x.shape[1]:
            x = jnp.pad(x, ((0, 0), (0, cols - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
        return permute_rows(x, self.src, self.dest)

    def tokens(self, token_of_row, n_tokens: int):
        """`[rows]` token of each padded row; padding rows get the spare row `n_tokens`."""
        rows = token_of_row.astype(jnp.int32)
        return jnp.take(rows, self.src, axis=0, mode="fill", fill_value=n_tokens)

    def from_padded(self, x, cols: int):
        """The rows of `x` in sorted order (zeros for rows past the groups)."""
        return permute_rows(x[:, :cols], self.dest, self.src)


def _group_of(group_ends, values):
    """Index of the group whose `[start, end)` holds each of `values` (G when past them).

    `compare_all`: one fused compare-and-count over `[values, groups]`, for the few
    groups of an MoE. The default binary search is a loop of gathers; at 1M rows the
    whole layout took 0.61 ms on the H200 (`bench/results/h200_gmm_sweep.json`), 40% of
    the grouped matmul's forward.
    """
    return jnp.searchsorted(group_ends, values, side="right", method="compare_all").astype(
        jnp.int32
    )


def layout(group_sizes, m: int, block: int) -> Layout:
    """The padded layout of `m` rows sorted into groups of `group_sizes` rows."""
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // block) * block
    padded_starts = jnp.cumsum(padded) - padded
    padded_ends = padded_starts + padded
    rows = _round_up(m + groups * (block - 1), block) if m else block
    row = jnp.arange(m, dtype=jnp.int32)
    group_of_row = jnp.clip(_group_of(starts + sizes, row), 0, groups - 1)
    # Rows past the last group have no place: they scatter nowhere and gather zeros.
    dest = jnp.where(
        row < jnp.sum(sizes), padded_starts[group_of_row] + row - starts[group_of_row], rows
    )
    tile_start = jnp.arange(rows // block, dtype=jnp.int32) * block
    tile_group = _group_of(padded_ends, tile_start)
    live = tile_group < groups
    tile_group = jnp.where(live, tile_group, 0)

    # Each tile's value on its `block` rows: a broadcast. (`jnp.repeat` with
    # `total_repeat_length` builds a scatter and a cumsum of constants, which XLA folded
    # for two minutes per compile at 8M rows on the H200, run 20.)
    def per_row(per_tile):
        return jnp.broadcast_to(per_tile[:, None], (rows // block, block)).reshape(rows)

    group_of_padded = per_row(tile_group)
    offset = jnp.arange(rows, dtype=jnp.int32) - padded_starts[group_of_padded]
    valid = per_row(live) & (offset < sizes[group_of_padded])
    src = jnp.where(valid, starts[group_of_padded] + offset, m)
    first, end = padded_starts // block, padded_ends // block
    live = live.astype(jnp.int32)  # int32 like tile_group
    return Layout(dest, src, tile_group, live, valid, (first, end), rows)


def _params(cfg):
    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _matmul_kernel(*refs, block_k, transpose_rhs, gather, scatter):
    group_ref, live_ref, valid_ref, token_ref, scale_ref, lhs_ref, rhs_ref = refs[:7]
    out_ref = refs[-1]
    g = group_ref[()]
    valid = valid_ref[...]
    tokens = token_ref[...]
    k_total = lhs_ref.shape[1]

    def body(step, acc):
        ks = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        a = lhs_ref[tokens, ks] if gather else lhs_ref[:, ks]
        if transpose_rhs:
            return acc + plt.dot(a, rhs_ref[g, :, ks], trans_b=True)
        return acc + plt.dot(a, rhs_ref[g, ks, :])

    bn = rhs_ref.shape[1] if transpose_rhs else rhs_ref.shape[2]
    acc = jnp.zeros((valid.shape[0], bn), jnp.float32)
    # Tiles past the groups hold no rows: skip their K loop (zeros are stored).
    # (A product, not `jnp.where`: the select of two literals lowers to a loop bound of
    # another integer type than the lower bound, which Triton rejects.)
    steps = live_ref[()] * (k_total // block_k)
    acc = jax.lax.fori_loop(0, steps, body, acc)
    acc = jnp.where(valid[:, None], acc * scale_ref[...][:, None], 0.0)
    if scatter:  # each row adds into its token's row (padding rows: the spare last row)
        cols = pl.program_id(1) * bn + jnp.arange(bn, dtype=jnp.int32)
        plt.atomic_add(out_ref, (tokens[:, None], cols[None, :]), acc)
    else:
        out_ref[...] = acc.astype(out_ref.dtype)


def _matmul(
    lhs,
    rhs,
    lay: Layout,
    cfg,
    *,
    transpose_rhs,
    tokens=None,
    gather=False,
    scale=None,
    scatter=None,
):
    """Padded-layout grouped matmul `[rows, K] x [G, K, N]` (`[G, N, K]` transposed).

    `tokens` ([rows], from `Layout.tokens`) maps padded rows to token rows: with `gather`
    the lhs rows come from a `[n_tokens + 1, K]` matrix (last row zero); with
    `scatter=n_tokens` each output row is added into its token's row of a float32
    `[n_tokens, N]` result. `scale` ([rows]) scales output rows. Within a tile the tokens
    are distinct (a token visits an expert once), so the atomic adds never collide there.
    """
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    groups = rhs.shape[0]
    bm, bn = cfg.block_m, cfg.block_n
    rhs_block = (groups, bn, k) if transpose_rhs else (groups, k, bn)
    rhs_index = (lambda t, j: (0, j, 0)) if transpose_rhs else (lambda t, j: (0, 0, j))
    tokens = jnp.zeros((lay.rows,), jnp.int32) if tokens is None else tokens
    scale = jnp.ones((lay.rows,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    row = pl.BlockSpec((bm,), lambda t, j: (t,))
    per_tile = pl.BlockSpec((None,), lambda t, j: (t,))
    in_specs = [
        per_tile,
        per_tile,
        row,
        row,
        row,
        pl.BlockSpec((lhs.shape[0], k), lambda t, j: (0, 0))
        if gather
        else pl.BlockSpec((bm, k), lambda t, j: (t, 0)),
        pl.BlockSpec(rhs_block, rhs_index),
    ]
    operands = [lay.tile_group, lay.tile_live, lay.row_valid, tokens, scale, lhs, rhs]
    if scatter is None:
        out_spec = pl.BlockSpec((bm, bn), lambda t, j: (t, j))
        out_shape = jax.ShapeDtypeStruct((lay.rows, n), lhs.dtype)
        aliases = {}
    else:
        out_spec = pl.BlockSpec((scatter + 1, n), lambda t, j: (0, 0))
        out_shape = jax.ShapeDtypeStruct((scatter + 1, n), jnp.float32)
        in_specs.append(out_spec)
        operands.append(jnp.zeros((scatter + 1, n), jnp.float32))
        aliases = {len(operands) - 1: 0}
    out = pl.pallas_call(
        functools.partial(
            _matmul_kernel,
            block_k=cfg.block_k,
            transpose_rhs=transpose_rhs,
            gather=gather,
            scatter=scatter is not None,
        ),
        grid=(lay.rows // bm, n // bn),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="probjax_grouped_matmul_triton",
    )(*operands)
    return out if scatter is None else out[:scatter]


def _tgmm_kernel(*refs, block_m, gather_a, gather_b):
    first_ref, end_ref, valid_ref, tokens_ref, scale_ref, a_ref, b_ref, out_ref = refs

    def body(tile, acc):
        rows = pl.ds(pl.multiple_of(tile * block_m, block_m), block_m)
        tokens = tokens_ref[rows]
        a = a_ref[tokens, :] if gather_a else a_ref[rows, :]
        b = b_ref[tokens, :] if gather_b else b_ref[rows, :]
        keep = valid_ref[rows][:, None]
        b = jnp.where(keep, b.astype(jnp.float32) * scale_ref[rows][:, None], 0.0)
        return acc + plt.dot(a, b.astype(a.dtype), trans_a=True)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    out_ref[...] = jax.lax.fori_loop(first_ref[()], end_ref[()], body, acc)


def _transposed_matmul(a, b, lay: Layout, groups: int, cfg, *, tokens=None, gather="", scale=None):
    """`[G, K, N]` with `out[g] = a_g^T @ (scale * b_g)` over the padded rows of group g.

    `gather` names the operands (`"a"`, `"b"`) whose rows come from a `[tokens, .]`
    matrix through `tokens` instead of the padded layout.
    """
    k, n = a.shape[1], b.shape[1]
    bk, bn = cfg.block_k, cfg.block_n
    tokens = jnp.zeros((lay.rows,), jnp.int32) if tokens is None else tokens
    scale = jnp.ones((lay.rows,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    whole = pl.BlockSpec((lay.rows,), lambda g, i, j: (0,))
    return pl.pallas_call(
        functools.partial(
            _tgmm_kernel, block_m=cfg.block_m, gather_a="a" in gather, gather_b="b" in gather
        ),
        grid=(groups, k // bk, n // bn),
        in_specs=[
            pl.BlockSpec((None,), lambda g, i, j: (g,)),
            pl.BlockSpec((None,), lambda g, i, j: (g,)),
            whole,
            whole,
            whole,
            pl.BlockSpec((a.shape[0], bk), lambda g, i, j: (0, i)),
            pl.BlockSpec((b.shape[0], bn), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="probjax_transposed_grouped_matmul_triton",
    )(*lay.group_tiles, lay.row_valid, tokens, scale, a, b)


def padded_rhs(rhs, cfg):
    """`rhs` zero-padded so K and N are multiples of both `block_k` and `block_n`.

    Each of K and N is tiled by one kernel and contracted by another.
    """
    _, k, n = rhs.shape
    step = max(cfg.block_k, cfg.block_n)
    k_pad, n_pad = _round_up(k, step), _round_up(n, step)
    return jnp.pad(rhs, ((0, 0), (0, k_pad - k), (0, n_pad - n))), k_pad, n_pad


def with_spare_row(x, cols):
    """`[n, c]` -> `[n + 1, cols]`: zero columns and the zero row padding rows gather."""
    return jnp.pad(x, ((0, 1), (0, cols - x.shape[1])))


@dataclasses.dataclass(frozen=True)
class PaddedKernels:
    """One kernel family's grouped matmuls on the padded layout `lay`.

    Attributes:
        config: its config (`block_m` is the layout's alignment; see `padded_rhs`).
        matmul: `(lhs_p, rhs_p, lay) -> [rows, N]`.
        matmul_t: `(dout_p, rhs_p, lay) -> [rows, K]`, `dout @ rhs[g]^T`.
        transposed: `(lhs_p, dout_p, lay) -> float32 [G, K, N]`, `lhs_g^T @ dout_g`.
    """

    config: Any
    matmul: Callable
    matmul_t: Callable
    transposed: Callable


def padded_matmul(lhs_p, rhs_p, lay: Layout, kernels: PaddedKernels):
    """`[rows, K] x [G, K, N] -> [rows, N]` on the padded layout, with a custom VJP.

    `lhs_p` and `rhs_p` are padded already (`Layout.to_padded`, `padded_rhs`): a caller
    that keeps its activations in the padded layout (the MoE) pays no copies per matmul.
    """
    product = padded_product(kernels)

    @jax.custom_vjp
    def run(lhs_p, rhs_p, lay):
        return product.call(lhs_p, rhs_p, lay)

    def run_fwd(lhs_p, rhs_p, lay):
        return run(lhs_p, rhs_p, lay), (lhs_p, rhs_p, lay)

    def run_bwd(residuals, dout_p):
        lhs_p, rhs_p, lay = residuals
        dlhs = product.lhs_vjp(lhs_p, rhs_p, lay, dout_p)
        return dlhs, product.rhs_vjp(lhs_p, rhs_p, lay, dout_p), None

    run.defvjp(run_fwd, run_bwd)
    return run(lhs_p, rhs_p, lay)


class GroupedProduct(NamedTuple):
    """A grouped matmul `call(lhs, rhs, aux)` and its VJPs, each `(lhs, rhs, aux, dout)`.

    `lhs_vjp` gives `dout @ rhs[g]^T` per row, `rhs_vjp` gives `lhs_g^T @ dout_g` per
    group; `aux` is what the call needs besides its operands (group sizes, a `Layout`).
    """

    call: Callable
    lhs_vjp: Callable
    rhs_vjp: Callable


def padded_product(kernels: PaddedKernels, cols: int | None = None) -> GroupedProduct:
    """`kernels` on the padded layout (`aux`: the `Layout`), outputs cut to `cols` columns.

    Cotangents of the cut outputs are padded back to the kernels' columns.
    """

    def call(lhs_p, rhs_p, lay):
        return kernels.matmul(lhs_p, rhs_p, lay)[:, :cols]

    def padded(dout, rhs_p):
        return jnp.pad(dout.astype(rhs_p.dtype), ((0, 0), (0, rhs_p.shape[2] - dout.shape[1])))

    def lhs_vjp(lhs_p, rhs_p, lay, dout):
        return kernels.matmul_t(padded(dout, rhs_p), rhs_p, lay).astype(lhs_p.dtype)

    def rhs_vjp(lhs_p, rhs_p, lay, dout):
        return kernels.transposed(lhs_p, padded(dout, rhs_p), lay).astype(rhs_p.dtype)

    return GroupedProduct(call, lhs_vjp, rhs_vjp)


def weighted_rows_vjp(lhs, u, scale):
    """`(d lhs, d scale)` of rows `scale[r] * (lhs[r] @ W)`, given `u[r] = dout[r] @ W^T`.

    The weights' gradient `<lhs[r] @ W, dout[r]>` is `<lhs[r], u[r]>`: no product rows.
    """
    u = u.astype(jnp.float32)
    dlhs = (u * scale.astype(jnp.float32)[:, None]).astype(lhs.dtype)
    return dlhs, jnp.sum(lhs.astype(jnp.float32) * u, axis=-1)


def padded_grouped_matmul(lhs, rhs, group_sizes, kernels: PaddedKernels):
    """`[M, K] x [G, K, N] -> [M, N]` for sorted rows, through the padded layout."""
    m, k = lhs.shape
    n = rhs.shape[2]
    lay = layout(group_sizes, m, kernels.config.block_m)
    rhs_p, k_pad, _ = padded_rhs(rhs, kernels.config)
    return lay.from_padded(padded_matmul(lay.to_padded(lhs, k_pad), rhs_p, lay, kernels), n)


def _group_ranges(group_sizes, m: int, block_m: int):
    """Group `[starts, ends)` and, per row tile, the first and last group it touches."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = jnp.arange(-(-m // block_m), dtype=jnp.int32) * block_m
    last = jnp.minimum(first + block_m, jnp.minimum(m, ends[-1])) - 1
    lo, hi = _group_of(ends, first), _group_of(ends, last)
    hi = jnp.where(last >= first, hi, lo - 1)  # a tile past the groups: no group
    return starts, ends, lo, hi


def _inplace_kernel(lo_ref, hi_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *,
                    cfg, transpose_rhs):  # fmt: skip
    t, j = pl.program_id(0), pl.program_id(1)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m, contract = lhs_ref.shape
    rows = t * bm + jnp.arange(bm, dtype=jnp.int32)
    k_steps = -(-contract // bk)

    def k_step(step, acc, g):
        ks = step * bk + jnp.arange(bk, dtype=jnp.int32)
        ok = (rows < m)[:, None] & (ks < contract)[None, :]
        a = plt.load(lhs_ref.at[pl.ds(t * bm, bm), pl.ds(step * bk, bk)], mask=ok, other=0)
        if transpose_rhs:
            return acc + plt.dot(a, rhs_ref[g, pl.ds(j * bn, bn), pl.ds(step * bk, bk)],
                                 trans_b=True)  # fmt: skip
        return acc + plt.dot(a, rhs_ref[g, pl.ds(step * bk, bk), pl.ds(j * bn, bn)])

    def group(g, out):
        start, end = starts_ref[g], ends_ref[g]
        zero = jnp.zeros((bm, bn), jnp.float32)
        acc = jax.lax.fori_loop(0, k_steps, functools.partial(k_step, g=g), zero)
        inside = (rows >= start) & (rows < end)
        return jnp.where(inside[:, None], acc, out)

    out = jax.lax.fori_loop(lo_ref[()], hi_ref[()] + 1, group, jnp.zeros((bm, bn), jnp.float32))
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    ok = (rows < m)[:, None] & (cols < out_ref.shape[1])[None, :]
    plt.store(out_ref.at[pl.ds(t * bm, bm), pl.ds(j * bn, bn)], out.astype(out_ref.dtype),
              mask=ok)  # fmt: skip


def _inplace_matmul(lhs, rhs_p, ranges, cfg, *, n: int, transpose_rhs: bool):
    """`[m, C] x [G, C, n] -> [m, n]` (`rhs_p` `[G, n, C]` transposed) on the sorted rows."""
    m = lhs.shape[0]
    starts, ends, lo, hi = ranges
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, j: (0,) * x.ndim)  # noqa: E731
    per_tile = pl.BlockSpec((None,), lambda t, j: (t,))
    return pl.pallas_call(
        functools.partial(_inplace_kernel, cfg=cfg, transpose_rhs=transpose_rhs),
        grid=(lo.shape[0], -(-n // cfg.block_n)),
        in_specs=[per_tile, per_tile, whole(starts), whole(ends), whole(lhs), whole(rhs_p)],
        out_specs=pl.BlockSpec((m, n), lambda t, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="probjax_grouped_matmul_inplace_triton",
    )(lo, hi, starts, ends, lhs, rhs_p)


def _inplace_tgmm_kernel(starts_ref, ends_ref, a_ref, b_ref, out_ref, *, cfg):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bk, bn = cfg.block_m, cfg.block_k, cfg.block_n
    start, end = starts_ref[g], ends_ref[g]
    ks = i * bk + jnp.arange(bk, dtype=jnp.int32)
    ns = j * bn + jnp.arange(bn, dtype=jnp.int32)

    def body(step, acc):
        first = start + step * bm
        ok = (first + jnp.arange(bm, dtype=jnp.int32) < end)[:, None]
        a_ok, b_ok = ok & (ks < a_ref.shape[1])[None, :], ok & (ns < b_ref.shape[1])[None, :]
        a = plt.load(a_ref.at[pl.ds(first, bm), pl.ds(i * bk, bk)], mask=a_ok, other=0)
        b = plt.load(b_ref.at[pl.ds(first, bm), pl.ds(j * bn, bn)], mask=b_ok, other=0)
        return acc + plt.dot(a, b, trans_a=True)

    steps = -(-(end - start) // bm)
    out_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros(out_ref.shape, jnp.float32))


def _inplace_transposed(a, b, ranges, groups: int, k_pad: int, n_pad: int, cfg):
    """float32 `[G, k_pad, n_pad]`, `out[g] = a_g^T @ b_g` over the sorted rows of group g."""
    starts, ends, _, _ = ranges
    whole = lambda x: pl.BlockSpec(x.shape, lambda g, i, j: (0,) * x.ndim)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_inplace_tgmm_kernel, cfg=cfg),
        grid=(groups, k_pad // cfg.block_k, n_pad // cfg.block_n),
        in_specs=[whole(starts), whole(ends), whole(a), whole(b)],
        out_specs=pl.BlockSpec((None, cfg.block_k, cfg.block_n), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, k_pad, n_pad), jnp.float32),
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="probjax_transposed_grouped_matmul_inplace_triton",
    )(starts, ends, a, b)


def grouped_matmul(lhs, rhs, group_sizes, *, config: TritonGroupedMatmulConfig):
    """`[M, K] x [G, K, N] -> [M, N]` for rows sorted by group, in place (module docstring)."""
    cfg = config
    groups, k, n = rhs.shape
    rhs_p, k_pad, n_pad = padded_rhs(rhs, cfg)  # the weights are small: pad them

    @jax.custom_vjp
    def run(lhs, rhs_p, ranges):
        return _inplace_matmul(lhs, rhs_p, ranges, cfg, n=n, transpose_rhs=False)

    def run_fwd(lhs, rhs_p, ranges):
        return run(lhs, rhs_p, ranges), (lhs, rhs_p, ranges)

    def run_bwd(residuals, dout):
        lhs, rhs_p, ranges = residuals
        dout = dout.astype(lhs.dtype)
        dlhs = _inplace_matmul(dout, rhs_p, ranges, cfg, n=k, transpose_rhs=True)
        drhs = _inplace_transposed(lhs, dout, ranges, groups, k_pad, n_pad, cfg)
        return dlhs, drhs.astype(rhs_p.dtype), None

    run.defvjp(run_fwd, run_bwd)
    ranges = _group_ranges(group_sizes, lhs.shape[0], cfg.block_m)
    return run(lhs, rhs_p, ranges)


def gather_matmul(x, rhs, lay: Layout, tokens, *, config: TritonGroupedMatmulConfig):
    """`out[r] = x[tokens[r]] @ rhs[g(r)]` in the padded layout, gathering inside the kernel.

    `x` is `[n_tokens, K]`; `tokens` comes from `Layout.tokens`. The
    backward adds each row's dX into its token (atomics) and never forms the gathered copy.
    """
    cfg = config
    n_tokens, k = x.shape
    groups, _, n = rhs.shape
    rhs_p, k_pad, n_pad = padded_rhs(rhs, cfg)

    @jax.custom_vjp
    def run(x_p, rhs_p, lay, tokens):
        return _matmul(x_p, rhs_p, lay, cfg, transpose_rhs=False, tokens=tokens, gather=True)

    def run_fwd(x_p, rhs_p, lay, tokens):
        return run(x_p, rhs_p, lay, tokens), (x_p, rhs_p, lay, tokens)

    def run_bwd(residuals, dout):
        x_p, rhs_p, lay, tokens = residuals
        dout = dout.astype(x_p.dtype)
        dx = _matmul(dout, rhs_p, lay, cfg, transpose_rhs=True, tokens=tokens, scatter=n_tokens)
        dx = jnp.pad(dx, ((0, 1), (0, 0)))  # the spare row's cotangent (dropped)
        dw = _transposed_matmul(x_p, dout, lay, groups, cfg, tokens=tokens, gather="a")
        return dx.astype(x_p.dtype), dw.astype(rhs_p.dtype), None, None

    run.defvjp(run_fwd, run_bwd)
    return run(with_spare_row(x, k_pad), rhs_p, lay, tokens)[:, :n]


def matmul_scatter(h, rhs, scale, lay: Layout, tokens, n_tokens: int, *, config):
    """`out[t] = sum_{r: tokens[r] = t} scale[r] * h[r] @ rhs[g(r)]`, float32 `[n_tokens, N]`.

    `h` is in the padded layout. The weighted sum over each token's rows happens in the
    kernel's output path (atomic adds); differentiable in `h`, `rhs` and `scale`.
    """
    cfg = config
    _, k = h.shape
    groups, _, n = rhs.shape
    rhs_p, k_pad, n_pad = padded_rhs(rhs, cfg)

    @jax.custom_vjp
    def run(h_p, rhs_p, scale, lay, tokens):
        return _matmul(
            h_p, rhs_p, lay, cfg, transpose_rhs=False, tokens=tokens, scale=scale, scatter=n_tokens
        )

    def run_fwd(h_p, rhs_p, scale, lay, tokens):
        return run(h_p, rhs_p, scale, lay, tokens), (h_p, rhs_p, scale, lay, tokens)

    def run_bwd(residuals, dout):
        h_p, rhs_p, scale, lay, tokens = residuals
        dout = with_spare_row(dout.astype(h_p.dtype), dout.shape[1])
        # g[r] = dout[tokens[r]] @ rhs[g]^T, gathered inside the kernel.
        g = _matmul(dout, rhs_p, lay, cfg, transpose_rhs=True, tokens=tokens, gather=True)
        dh, dscale = weighted_rows_vjp(h_p, g, scale)
        dscale = jnp.where(lay.row_valid, dscale, 0.0)
        dw = _transposed_matmul(h_p, dout, lay, groups, cfg, tokens=tokens, gather="b", scale=scale)
        return dh, dw.astype(rhs_p.dtype), dscale.astype(scale.dtype), None, None

    run.defvjp(run_fwd, run_bwd)
    h_p = jnp.pad(h, ((0, 0), (0, k_pad - k)))
    return run(h_p, rhs_p, scale.astype(jnp.float32), lay, tokens)[:, :n]
