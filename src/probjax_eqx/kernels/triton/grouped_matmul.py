"""Pallas Triton grouped matmul: `out[rows of group g] = lhs[rows of g] @ rhs[g]`.

Rows arrive sorted by group with `group_sizes` rows each. The wrapper moves every
group's rows to a start that is a multiple of `block_m` (at most `groups * (block_m - 1)`
padding rows, zero), so each row tile belongs to one group and the kernels are plain
tiled matmuls that read their group's weight slice. Ragged counts, empty groups and
K / N off the tiles are therefore exact. Three kernels, one custom VJP:

- forward and dLHS (`dout @ rhs[g]^T`): grid (row tile, column tile), K loop;
- dRHS, the transposed grouped matmul (`lhs_g^T @ dout_g` for every group): grid
  (group, K tile, N tile), looping over that group's row tiles only.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

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

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False

    def __post_init__(self):
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            if value < _MIN_BLOCK or value & (value - 1):
                raise ValueError(f"{field}={value} must be a power of two >= {_MIN_BLOCK}")


def _round_up(n, m):
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each sorted row lives in the group-aligned padded buffer."""

    dest: jax.Array  # [M] padded row of each row (`rows`, out of bounds, past the groups)
    tile_group: jax.Array  # [tiles] group of each row tile (0 for tiles past the end)
    tile_used: jax.Array  # [tiles] whether the tile holds any group's rows
    group_tiles: tuple[jax.Array, jax.Array]  # per group: [first, end) row tiles
    rows: int  # static padded row count


def _layout(group_sizes, m: int, block: int) -> _Layout:
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // block) * block
    padded_starts = jnp.cumsum(padded) - padded
    rows = _round_up(m + groups * (block - 1), block) if m else block
    row = jnp.arange(m, dtype=jnp.int32)
    group_of_row = jnp.clip(jnp.searchsorted(starts + sizes, row, side="right"), 0, groups - 1)
    # Rows past the last group have no place: they scatter nowhere and gather zeros.
    dest = jnp.where(
        row < jnp.sum(sizes), padded_starts[group_of_row] + row - starts[group_of_row], rows
    )
    tile_start = jnp.arange(rows // block, dtype=jnp.int32) * block
    padded_ends = padded_starts + padded
    tile_group = jnp.searchsorted(padded_ends, tile_start, side="right").astype(jnp.int32)
    tile_used = tile_group < groups
    first, end = padded_starts // block, padded_ends // block
    return _Layout(dest, jnp.where(tile_used, tile_group, 0), tile_used, (first, end), rows)


def _matmul_kernel(group_ref, used_ref, lhs_ref, rhs_ref, out_ref, *, block_k, transpose_rhs):
    g = group_ref[()]
    k_total = lhs_ref.shape[1]

    def body(step, acc):
        ks = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        a = lhs_ref[:, ks]
        if transpose_rhs:
            return acc + plt.dot(a, rhs_ref[g, :, ks], trans_b=True)
        return acc + plt.dot(a, rhs_ref[g, ks, :])

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    acc = jax.lax.fori_loop(0, k_total // block_k, body, acc)
    out_ref[...] = jnp.where(used_ref[()], acc, 0.0).astype(out_ref.dtype)


def _matmul(lhs_p, rhs_p, layout: _Layout, cfg: TritonGroupedMatmulConfig, *, transpose_rhs):
    """Padded `[rows, K] x [G, K, N]` (or `[G, N, K]` transposed) -> `[rows, N]`."""
    rows, k = lhs_p.shape
    n = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    groups = rhs_p.shape[0]
    bm, bn = cfg.block_m, cfg.block_n
    rhs_block = (groups, bn, k) if transpose_rhs else (groups, k, bn)
    rhs_index = (lambda t, j: (0, j, 0)) if transpose_rhs else (lambda t, j: (0, 0, j))
    return pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=cfg.block_k, transpose_rhs=transpose_rhs),
        grid=(rows // bm, n // bn),
        in_specs=[
            pl.BlockSpec((None,), lambda t, j: (t,)),
            pl.BlockSpec((None,), lambda t, j: (t,)),
            pl.BlockSpec((bm, k), lambda t, j: (t, 0)),
            pl.BlockSpec(rhs_block, rhs_index),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), lhs_p.dtype),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="probjax_grouped_matmul_triton",
    )(layout.tile_group, layout.tile_used, lhs_p, rhs_p)


def _tgmm_kernel(first_ref, end_ref, lhs_ref, dout_ref, out_ref, *, block_m):
    def body(tile, acc):
        rows = pl.ds(pl.multiple_of(tile * block_m, block_m), block_m)
        return acc + plt.dot(lhs_ref[rows, :], dout_ref[rows, :], trans_a=True)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    out_ref[...] = jax.lax.fori_loop(first_ref[()], end_ref[()], body, acc)


def _transposed_matmul(lhs_p, dout_p, layout: _Layout, groups: int, cfg):
    """`[G, K, N]` with `out[g] = lhs_g^T @ dout_g` over the padded rows of group g."""
    rows, k = lhs_p.shape
    n = dout_p.shape[1]
    bk, bn = cfg.block_k, cfg.block_n
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=cfg.block_m),
        grid=(groups, k // bk, n // bn),
        in_specs=[
            pl.BlockSpec((None,), lambda g, i, j: (g,)),
            pl.BlockSpec((None,), lambda g, i, j: (g,)),
            pl.BlockSpec((rows, bk), lambda g, i, j: (0, i)),
            pl.BlockSpec((rows, bn), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="probjax_transposed_grouped_matmul_triton",
    )(*layout.group_tiles, lhs_p, dout_p)


def grouped_matmul(lhs, rhs, group_sizes, *, config: TritonGroupedMatmulConfig):
    """`[M, K] x [G, K, N] -> [M, N]` for rows sorted by group (see module docstring)."""
    m, k = lhs.shape
    groups, _, n = rhs.shape
    cfg = config
    # K and N are each a contraction axis in one kernel and a tiled axis in another.
    step = max(cfg.block_k, cfg.block_n)
    k_pad, n_pad = _round_up(k, step), _round_up(n, step)
    layout = _layout(group_sizes, m, cfg.block_m)

    def to_padded(x, cols):
        buf = jnp.zeros((layout.rows, cols), x.dtype)
        return buf.at[layout.dest, : x.shape[1]].set(x, mode="drop")

    def from_padded(x, cols):
        return jnp.take(x[:, :cols], layout.dest, axis=0, mode="fill", fill_value=0)

    rhs_p = jnp.pad(rhs, ((0, 0), (0, k_pad - k), (0, n_pad - n)))

    @jax.custom_vjp
    def run(lhs, rhs_p):
        out = _matmul(to_padded(lhs, k_pad), rhs_p, layout, cfg, transpose_rhs=False)
        return from_padded(out, n)

    def run_fwd(lhs, rhs_p):
        return run(lhs, rhs_p), (lhs, rhs_p)

    def run_bwd(residuals, dout):
        lhs, rhs_p = residuals
        dout_p = to_padded(dout.astype(lhs.dtype), n_pad)
        dlhs = from_padded(_matmul(dout_p, rhs_p, layout, cfg, transpose_rhs=True), k)
        drhs = _transposed_matmul(to_padded(lhs, k_pad), dout_p, layout, groups, cfg)
        return dlhs.astype(lhs.dtype), drhs.astype(rhs_p.dtype)

    run.defvjp(run_fwd, run_bwd)
    return run(lhs, rhs_p)
