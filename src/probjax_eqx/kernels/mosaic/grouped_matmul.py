"""Pallas Mosaic GPU grouped matmul for Hopper (16-bit operands, float32 accumulation).

The same group-aligned padded layout as the Triton kernels (`triton.grouped_matmul.layout`):
every row tile belongs to one group. Two kernels, both `wgmma` on TMA-fed shared memory
with the next step's tiles prefetched while the current step computes:

- grouped matmul `[rows, K] x [G, K, N]`: grid (row tile, column tile), K loop; dLHS is
  the same kernel on `rhs` transposed per group (an XLA transpose: wgmma reads its B
  operand untransposed, and jax 0.10's interpreter runs no transposed views). With
  `block_m=128` a program has two compute warpgroups (64 rows each, sharing each B tile)
  fed by a third that only issues TMA copies into a `num_stages`-deep ring, released by
  per-slot "consumed" barriers, as in our attention forward;
- transposed grouped matmul `out[g] = lhs_g^T @ dout_g` for dRHS: grid (group, K tile,
  N tile), looping over that group's row tiles only. One operand must be passed
  transposed (an XLA transpose): the narrower of `lhs` and `dout`, computing
  `(dout_g^T @ lhs_g)^T` when that is `dout`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_eqx.kernels.mosaic._common import (
    prefetching_loop,
    scratch_bytes,
    swizzled,
    tma_ring,
    warp_specialized,
)
from probjax_eqx.kernels.mosaic._compat import ACC, COMPILER_PARAMS, InterpretGPUParams  # pyright: ignore[reportAttributeAccessIssue]
from probjax_eqx.kernels.triton.grouped_matmul import Layout, PaddedKernels, padded_grouped_matmul

_TILE = 64  # wgmma rows per warpgroup; 64 16-bit elements per 128-byte swizzled row


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGroupedMatmulConfig:
    """Tiles of the Mosaic grouped matmul.

    Attributes:
        block_m: rows per tile and the alignment of every group: 64 (one warpgroup) or
            128 (two compute warpgroups and a TMA warpgroup).
        block_n: output columns per tile (a multiple of 64).
        block_k: contraction step (a multiple of 64).
        num_stages: depth of the TMA ring.
        interpret: run under the Mosaic GPU interpreter (CPU tests).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 2
    interpret: bool = False

    def __post_init__(self):
        if self.block_m not in (_TILE, 2 * _TILE):
            raise ValueError(f"block_m={self.block_m} must be {_TILE} or {2 * _TILE}")
        for field in ("block_n", "block_k"):
            value = getattr(self, field)
            if value < _TILE or value % _TILE:
                raise ValueError(f"{field}={value} must be a positive multiple of {_TILE}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be >= 2")


def _gmm_scratch(cfg: MosaicGroupedMatmulConfig, dtype, out_dtype) -> list:
    """Shared-memory buffers of a grouped-matmul program.

    `block_m=128`: two compute warpgroups and a TMA one.
    """
    stages, bk, bn = cfg.num_stages, cfg.block_k, cfg.block_n
    if cfg.block_m == 2 * _TILE:
        return [
            swizzled((stages, 2, _TILE, bk), dtype),
            swizzled((stages, bk, bn), dtype),
            swizzled((2, _TILE, bn), out_dtype),
            plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ]
    return [
        swizzled((stages, cfg.block_m, bk), dtype),
        swizzled((stages, bk, bn), dtype),
        swizzled((cfg.block_m, bn), out_dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
    ]


def _tgmm_scratch(cfg: MosaicGroupedMatmulConfig, dtype) -> list:
    """Shared-memory buffers of a transposed grouped-matmul program (float32 staging)."""
    return [
        swizzled((cfg.num_stages, cfg.block_k, cfg.block_m), dtype),
        swizzled((cfg.num_stages, cfg.block_m, cfg.block_n), dtype),
        plgpu.SMEM((cfg.block_k, cfg.block_n), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * cfg.num_stages),
    ]


def smem_bytes(cfg: MosaicGroupedMatmulConfig) -> dict[str, int]:
    """Shared memory of each kernel's program (16-bit operands), from its buffer list."""
    return {
        "grouped_matmul": scratch_bytes(_gmm_scratch(cfg, jnp.bfloat16, jnp.bfloat16)),
        "transposed": scratch_bytes(_tgmm_scratch(cfg, jnp.bfloat16)),
    }


def _pipelined_matmul(steps, views, a_smem, b_smem, bars, stages, shape):
    """`sum_n A_n @ B_n` over `steps` tile pairs `views(n)`, TMA-prefetched one step ahead."""

    def issue(n):
        slot = lax.rem(n, stages)
        a_view, b_view = views(n)
        plgpu.copy_gmem_to_smem(a_view, a_smem.at[slot], bars.at[slot])
        plgpu.copy_gmem_to_smem(b_view, b_smem.at[slot], bars.at[stages + slot])

    def wait(n):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(bars.at[slot])
        plgpu.barrier_wait(bars.at[stages + slot])

    prefetch = prefetching_loop(steps, issue, wait, stages)

    def accumulate(acc):
        def body(n, carry):
            prefetch(n)
            slot = lax.rem(n, stages)
            plgpu.wgmma(acc, a_smem.at[slot], b_smem.at[slot])
            plgpu.wgmma_wait(0)  # before this slot is refilled
            return carry

        lax.fori_loop(0, steps, body, None)
        return acc[...]

    return pl.run_scoped(accumulate, ACC(shape, jnp.float32))


def _tile_of_program(column_tiles):
    """(row tile, column tile) of this program, column tiles adjacent in launch order.

    One flat grid axis: Mosaic launches a grid's second-to-last axis as CUDA's y, at most
    65535 blocks, which 8M rows of 64-row tiles overran (run 20); adjacent programs
    share their rows' tile in L2.
    """
    program = lax.axis_index("tile")
    return lax.div(program, column_tiles), lax.rem(program, column_tiles)


def _gmm_kernel(
    group_ref, live_ref, lhs_ref, rhs_ref, out_ref, a_smem, b_smem, o_smem, bars, *, cfg
):
    t, j = _tile_of_program(out_ref.shape[1] // cfg.block_n)
    g = group_ref[t]
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
    # Tiles past the groups hold no rows: no K loop (zeros are stored).
    steps = jnp.where(live_ref[t] > 0, lhs_ref.shape[1] // bk, 0)

    def views(n):
        ks = pl.ds(n * bk, bk)
        return lhs_ref.at[pl.ds(t * bm, bm), ks], rhs_ref.at[g, ks, pl.ds(j * bn, bn)]

    out = _pipelined_matmul(steps, views, a_smem, b_smem, bars, stages, (bm, bn))
    o_smem[...] = out.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(t * bm, bm), pl.ds(j * bn, bn)])
    plgpu.wait_smem_to_gmem(0)


def _gmm_specialized_kernel(group_ref, live_ref, lhs_ref, rhs_ref, out_ref, a_smem, b_smem,
                            o_smem, a_bar, b_bar, free, *, cfg):  # fmt: skip
    """`block_m = 128`: warpgroups 0 and 1 compute 64 rows each; warpgroup 2 feeds them."""
    t, j = _tile_of_program(out_ref.shape[1] // cfg.block_n)
    g = group_ref[t]
    bn, bk, stages = cfg.block_n, cfg.block_k, cfg.num_stages
    steps = jnp.where(live_ref[t] > 0, lhs_ref.shape[1] // bk, 0)

    def compute(wg):
        rows = pl.ds(t * 2 * _TILE + wg * _TILE, _TILE)

        def accumulate(acc):
            def body(n, carry):
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(a_bar.at[2 * slot + wg])
                plgpu.barrier_wait(b_bar.at[slot])
                plgpu.wgmma(acc, a_smem.at[slot, wg], b_smem.at[slot])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free.at[slot])
                return carry

            lax.fori_loop(0, steps, body, None)
            return acc[...]

        out = pl.run_scoped(accumulate, ACC((_TILE, bn), jnp.float32))
        o_smem.at[wg][...] = out.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[rows, pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    def feed():
        def issue(n, slot):
            ks = pl.ds(n * bk, bk)
            for half in range(2):
                rows = pl.ds(t * 2 * _TILE + half * _TILE, _TILE)
                plgpu.copy_gmem_to_smem(
                    lhs_ref.at[rows, ks], a_smem.at[slot, half], a_bar.at[2 * slot + half]
                )
            plgpu.copy_gmem_to_smem(
                rhs_ref.at[g, ks, pl.ds(j * bn, bn)], b_smem.at[slot], b_bar.at[slot]
            )

        tma_ring(steps, stages, [(free, issue)])

    warp_specialized(compute, feed)


def _gmm(lhs_p, rhs_p, lay: Layout, cfg: MosaicGroupedMatmulConfig, out_dtype):
    rows, _ = lhs_p.shape
    n = rhs_p.shape[2]
    if cfg.block_m == 2 * _TILE:
        kernel, threads, thread_name = _gmm_specialized_kernel, 3, "wg"
    else:
        kernel, threads, thread_name = _gmm_kernel, None, None
    return plgpu.kernel(
        functools.partial(kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
        scratch_types=_gmm_scratch(cfg, lhs_p.dtype, out_dtype),
        grid=((rows // cfg.block_m) * (n // cfg.block_n),),
        grid_names=("tile",),
        compiler_params=COMPILER_PARAMS,
        num_threads=threads,
        thread_name=thread_name,
        interpret=InterpretGPUParams() if cfg.interpret else None,
    )(lay.tile_group, lay.tile_live, lhs_p, rhs_p)


def _tgmm_kernel(first_ref, end_ref, lhst_ref, dout_ref, out_ref, a_smem, b_smem, o_smem, bars,
                 *, cfg):  # fmt: skip
    g, i, j = lax.axis_index("g"), lax.axis_index("k"), lax.axis_index("n")
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
    first = first_ref[g]
    count = end_ref[g] - first

    def views(n):
        rows = pl.ds((first + n) * bm, bm)
        return lhst_ref.at[pl.ds(i * bk, bk), rows], dout_ref.at[rows, pl.ds(j * bn, bn)]

    out = _pipelined_matmul(count, views, a_smem, b_smem, bars, stages, (bk, bn))
    o_smem[...] = out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)])
    plgpu.wait_smem_to_gmem(0)


def _tgmm(lhs_t, dout_p, lay: Layout, groups: int, cfg: MosaicGroupedMatmulConfig):
    k, n = lhs_t.shape[0], dout_p.shape[1]
    return plgpu.kernel(
        functools.partial(_tgmm_kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        scratch_types=_tgmm_scratch(cfg, lhs_t.dtype),
        grid=(groups, k // cfg.block_k, n // cfg.block_n),
        grid_names=("g", "k", "n"),
        compiler_params=COMPILER_PARAMS,
        interpret=InterpretGPUParams() if cfg.interpret else None,
    )(*lay.group_tiles, lhs_t, dout_p)


def _transposed(a, d, lay: Layout, groups: int, cfg: MosaicGroupedMatmulConfig):
    """`out[g] = a_g^T @ d_g`, transposing whichever of `a` and `d` has fewer columns."""
    if a.shape[1] <= d.shape[1]:
        return _tgmm(a.T, d, lay, groups, cfg)
    return jnp.swapaxes(_tgmm(d.T, a, lay, groups, cfg), 1, 2)


def kernels(config: MosaicGroupedMatmulConfig, groups: int) -> PaddedKernels:
    """The Mosaic grouped matmuls for `groups` groups (the output takes the lhs dtype)."""
    return PaddedKernels(
        config,
        matmul=lambda a, r, lay: _gmm(a, r, lay, config, a.dtype),
        matmul_t=lambda d, r, lay: _gmm(d, jnp.swapaxes(r, 1, 2), lay, config, d.dtype),
        transposed=lambda a, d, lay: _transposed(a, d, lay, groups, config),
    )


def grouped_matmul(lhs, rhs, group_sizes, *, config: MosaicGroupedMatmulConfig):
    """`[M, K] x [G, K, N] -> [M, N]` for rows sorted by group (see module docstring)."""
    return padded_grouped_matmul(lhs, rhs, group_sizes, kernels(config, rhs.shape[0]))
