"""Pallas Mosaic GPU flash attention for Hopper (`implementation="mosaic"`).

Forward (FlashAttention-3 layout): a program owns `2 * block_q` query rows; two compute
warpgroups each run the online softmax (base 2, float32) over 64-row halves with `wgmma`
on shared-memory operands, while a third warpgroup streams K and V tiles with TMA into a
`num_stages`-deep ring, released by per-slot "consumed" barriers (`overlap_softmax`: each
step's softmax runs while the previous step's P @ V is on the tensor cores). Backward: a
dK/dV kernel (one program per key tile, looping over query tiles; with `key_tiles_dkv`
several key tiles in turn, the next one's K / V loading while one computes) and a dQ
kernel (one program per query tile, looping over key tiles), each prefetching the next
tile's operands with TMA while it computes the current one; with `block_k_dkv=128` the
dK/dV program instead has two compute warpgroups of 64 keys sharing each query tile, fed
by a TMA warpgroup (and with `block_q_dq=128` the dQ program: 64 rows each, sharing
each key tile). Every backward step issues its two score-side products (S and dP)
together and computes P while dP runs. With `fused_dq` (FA3's backward) the dK/dV
program also computes dQ's share of each step and adds it by TMA reductions into a
float32 dQ^T: no dQ kernel, and no second pass over S and dP.

By default the wrapper passes the operands that appear transposed (K in QK^T, Q and dO
in the dK/dV kernel, K and V in the dQ kernel) as `[batch, heads, dim, seq]` copies (one
XLA transpose each), and P and dS reach `wgmma` through shared memory: jax 0.10's
interpreter (our CPU CI) runs neither transposed shared-memory views nor register
operands. FA3 holds them as views and in registers; `transposed_views` and
`p_in_registers` do so on the GPU, whose `default_config` takes both.

Masks run inside the kernels on the same tile ranges as the Triton kernels
(`_tiles.block_ranges`): tiles a mask empties are neither loaded nor computed, tiles it
leaves entirely valid skip mask evaluation, and a dK/dV program with no query tile stores
zeros without running its pipeline. Rows without a valid key give zeros (log-sum-exp
+inf). Mask arrays are per-batch or per-head scalars (KV/Q lengths, prefix lengths), read from
global memory, or segment ids, whose tiles TMA brings into shared memory beside the
operands (the program's own ids once, the looped axis' ids per step). Score mods: SoftCap
(and compositions of it) in the kernel, d(score)/d(q.k) from its JVP scaling dS; others
(with parameters, tables or arbitrary functions) are refused with that reason.

Exponentials use `exp2` on float32 scores; on the GPU by default the approximate `ex2`
(`approx_math`), which met the bf16 tolerances in the GPU tests of run 48 (causal rows
with one valid key, KV lengths, segment ids).
"""

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_eqx.attention_call import AttentionCall, AttentionCapabilities
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.kernels import _flash, _tiles
from probjax_eqx.kernels.cudnn._compat import BACKWARD_UNAVAILABLE as CUDNN_BACKWARD_UNAVAILABLE
from probjax_eqx.kernels.cudnn.attention import CudnnAttention, CudnnBackward
from probjax_eqx.kernels.mosaic._common import (
    MEMORY_REGISTERS,
    SMEM_LIMIT,
    accumulating_kernel,
    named_barrier,
    prefetching_loop,
    scratch_bytes,
    smem_refusal,
    swizzled,
    tma_ring,
    warp_specialized,
)
from probjax_eqx.kernels.mosaic._compat import (
    ACC,
    COMPILER_PARAMS,
    JAX_011,
    InterpretGPUParams,  # pyright: ignore[reportAttributeAccessIssue]
    reset_gpu_interpret_mode_state,
)
from probjax_eqx.kernels.triton.attention import (
    TritonAttention,
    TritonAttentionConfig,
    split_rule,
)
from probjax_eqx.masks import Causal, MaskContext, conjuncts

LOG2E = math.log2(math.e)
_WG_ROWS = 64  # wgmma's M per warpgroup; 128-byte swizzle rows are 64 16-bit elements
_TURN_BARRIERS = 8  # ping-pong's named barriers 8 and 9 (CUTLASS keeps 0-7 for itself)
_PAIR_BARRIER = 10  # `fused_dq`: both compute warpgroups' dS^T are in shared memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicAttentionConfig:
    """Tiles of the Mosaic GPU kernels (all multiples of 64).

    Attributes:
        block_q: query rows per compute warpgroup in the forward (a program has two).
        block_k: keys per forward step.
        block_q_dkv: query rows per step of the dK/dV kernel.
        block_k_dkv: keys per dK/dV program: 64 (one warpgroup, prefetching its next query
            tile) or 128 (two compute warpgroups of 64 keys sharing each query tile, fed by
            a TMA warpgroup, with FA3's register split). The field defaults to 64,
            which always fits; `default_config` takes 128 where shared memory allows.
        key_tiles_dkv: key tiles (of `block_k_dkv` keys) per dK/dV program, one after
            another. K and V sit in two slots, the next tile's loading while this one
            computes and the last one's dK/dV leave by TMA; where a program's query tiles
            (over every query head of its KV head) fit the ring (`num_stages`), its Q and
            dO tiles load once and serve every key tile. Each tile runs over the union of
            its program's query-tile ranges, masking what its own range leaves out: meant
            for unmasked calls, few query tiles over many keys, whose one-tile programs
            leave the loads unhidden (`default_config` takes it with dQ's own kernel).
        block_q_dq: query rows per dQ program: 64 (one warpgroup) or 128 (two compute
            warpgroups of 64 rows sharing each key tile, fed by a TMA warpgroup); as
            `block_k_dkv`, 64 here and 128 from `default_config` where it fits.
        block_k_dq: keys per step of the dQ kernel.
        num_stages: depth of the TMA ring of every kernel.
        memory_registers: registers per thread of the forward's TMA warpgroup (`setmaxnreg`,
            24..256, a multiple of 8); the two compute warpgroups share the rest of the
            64K-register file. None (default) leaves the even split, 168 each: on the
            H200 (run 15, B4 H8 T4096 hd128) the forward took 0.602 ms with it and
            0.633 ms with 40 for the TMA warpgroup (FA3's split).
        backward_memory_registers: the same for the TMA warpgroup of the two-warpgroup
            dK/dV and dQ programs: 40 (FA3's backward takes 24); `default_config` takes
            24 under causal-like masks on the GPU (`_backward_memory_registers`).
        pingpong: in the forward, FA3's ping-pong schedule: the two compute warpgroups
            take turns issuing their step's products (the scores' product; with
            `overlap_softmax` the previous step's P @ V too), so that one runs its
            softmax while the other's products are on the tensor cores. `default_config`
            turns it on for the GPU with `overlap_softmax` and 24 TMA registers, except
            at hd <= 64 or T >= 16384 (`_pingpong`): run 47
            (B4 H8 T4096 hd128, fwd) 0.530 ms, 0.565 with ping-pong alone (40 TMA
            registers), 0.571 with neither.
        named_turns: the ping-pong turns on two hardware named barriers (`bar.sync` /
            `bar.arrive`, as FA3) instead of mbarriers in shared memory. GPU only: the
            interpreter runs no inline PTX (set False to interpret `pingpong`).
        overlap_softmax: in the forward, FA3's intra-warpgroup overlap: step j's scores
            and softmax run while step j - 1's P @ V product is on the tensor cores.
            Staged in SMEM (without `p_in_registers`) that product is a float32 tile
            more per thread (pair it with `memory_registers`). With P in registers
            (run 47, B4 H8 T4096 hd128, 24 TMA registers) 0.536 ms alone, 0.530 with
            `pingpong`, 0.571 without either; staged, run 44 took 0.626 ms with it
            (1.074 with the even register split), 0.616 ms without.
        p_in_registers: FA3's register mode. The products' left operands computed in
            the kernel (P forward; P^T, dS^T and dS backward) feed `wgmma` from
            registers instead of being staged in shared memory (which they then no
            longer take), and the forward's output accumulates in place in wgmma's
            accumulator, rescaled there (no separate P @ V tile). GPU only: jax 0.10's
            Mosaic GPU interpreter takes neither register operands nor accumulator
            stores. `default_config` turns it on for the GPU: run 44 (B4 H8 T4096
            hd128, non-causal) fwd+bwd 2.650 ms with it, 2.970 without; 2.467 with
            `transposed_views` too.
        transposed_views: the products' transposed operands (K^T forward; Q^T, dO^T,
            K^T, V^T backward) are transposed views of the tiles TMA brings in, as in
            FA3, instead of `[batch, heads, dim, seq]` copies made by XLA: no transposes
            in HBM, and the backward rings carry half the tiles. GPU (or jax >= 0.11's
            interpreter) only: jax 0.10's interpreter cannot read transposed views.
            `default_config` turns it on for the GPU: run 44 fwd+bwd 2.602 ms with it,
            2.970 without.
        fused_dq: FA3's backward: dQ's products run in the dK/dV kernel, with no dQ
            kernel (5 products a step instead of 7). Each step the two compute
            warpgroups stage dS^T in shared memory, split dQ^T = K^T dS^T along the
            head dim and add their shares by TMA reductions into a float32 dQ^T in
            global memory (in no fixed order: dQ is not bitwise reproducible). With an
            odd count of 64-row head-dim blocks (head dim 64, 192) the warpgroups take
            the extra one in turns, a step each. Needs `block_k_dkv=128`.
            Interpreted, each program writes its shares to a buffer of its own, summed
            by XLA: jax 0.10's interpreter has no TMA reductions. `default_config` turns
            it on for the GPU up to `_FUSED_DQ_MAX_BYTES` of reductions a head. The
            accumulator laid out as dQ instead of dQ^T (so that XLA casts it rather than
            transposing it, 42.7 us of a 2.06 ms fwd+bwd, ncu run 66), its products
            taking dS^T transposed, 64 columns of K at a time, was slower on the H100
            (run 87-88, B4 H8 hd128 fwd+bwd, non-causal / causal): T4096 2.07 -> 2.10,
            1.15 -> 1.22 ms; T16384 30.4 -> 31.2, 15.4 -> 17.0 ms. Removed.
        launch_group: the order in which each kernel's programs launch (Mosaic GPU
            launches a grid's last axis fastest). None: tile by tile over every (batch,
            head) pair, so that a wave spans all heads and, under causal masks, every
            head's longest tiles go first. n: the pairs in groups of n, one group after
            another, tile by tile within a group; 1 runs each pair's tiles side by side,
            as FA3 and tokamax do, sharing its K / V (forward, dQ) or Q / dO and, with
            `fused_dq`, dQ^T (dK/dV) in the L2. Larger groups trade that reuse for the
            balance of longest-first. `default_config` picks 1 on the GPU, 4 for short
            causal calls (`_launch_group`). The dK/dV programs of a pair step through
            their query tiles in the same order: each starting at a tile of its own
            (so that their fused dQ^T reductions land apart) was slower, H100 run 75
            (non-causal fwd+bwd, T4096 hd128 / hd64, T16384 hd128 / hd64): 2.06 -> 2.18,
            1.20 -> 1.24, 29.96 -> 32.58, 17.37 -> 18.20 ms.
        approx_math: the compiler's approximate `exp2` and `tanh` (`approx_math` of
            `plgpu.CompilerParams`: `ex2.approx.ftz`, `tanh.approx`), as tokamax compiles
            its kernels. `default_config` turns it on for the GPU without score mods
            (H100 run 49: 2.39 -> 2.30 ms fwd+bwd at B4 H8 T4096 hd128).
        split_kv_forward: the forward from our split-KV Triton kernel with this config
            (`implementation="triton"`), the backward from these kernels, joined by the
            forward's log-sum-exp (`_flash.attend`). For calls whose forward grid
            leaves SMs idle, few query tiles over many keys, where the Triton forward
            splits the keys over programs and this one does not. Unmasked calls without
            score mods only. Automatic selection (`auto_config`) sets it on the GPU where
            this forward's grid fills at most one wave and the Triton plan splits
            (`_split_kv_forward`); `implementation="mosaic"` by name leaves it None.
        cudnn_backward: the forward from these kernels, the backward from cuDNN's
            (`CudnnBackward`), joined by the forward's output and log-sum-exp. Unmasked
            or causal calls without score mods that cuDNN computes
            (`_cudnn_backward_rule`). Automatic selection (`auto_config`) sets it for
            long self-attention at hd 128, where our forward and cuDNN's backward are
            each the fastest (`cudnn_backward_pays`); `implementation="mosaic"` by name
            leaves it False.
        interpret: run under the Mosaic GPU interpreter (CPU tests).
    """

    block_q: int = 64
    block_k: int = 128
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    key_tiles_dkv: int = 1
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_stages: int = 2
    memory_registers: int | None = None
    backward_memory_registers: int = MEMORY_REGISTERS
    pingpong: bool = False
    named_turns: bool = True
    overlap_softmax: bool = False
    p_in_registers: bool = False
    transposed_views: bool = False
    fused_dq: bool = False
    launch_group: int | None = None
    approx_math: bool = False
    split_kv_forward: TritonAttentionConfig | None = None
    cudnn_backward: bool = False
    interpret: bool = False

    @property
    def halves(self) -> tuple[str, str]:
        """The kernel families of the forward half and of the backward half."""
        forward = "triton" if self.split_kv_forward is not None else "mosaic"
        return forward, "cudnn" if self.cudnn_backward else "mosaic"

    def __post_init__(self):
        for field in ("block_k_dkv", "block_q_dq"):
            if getattr(self, field) not in (_WG_ROWS, 2 * _WG_ROWS):
                raise ValueError(f"{field}={getattr(self, field)} must be 64 or 128")
        for field in ("block_q_dkv", "block_k_dq", "block_k"):
            value = getattr(self, field)
            if value < _WG_ROWS or value % _WG_ROWS:
                raise ValueError(f"{field}={value} must be a positive multiple of {_WG_ROWS}")
        for field in ("block_q", "block_q_dkv"):
            if getattr(self, field) != _WG_ROWS:
                raise ValueError(f"{field} must be {_WG_ROWS} (one warpgroup's wgmma rows)")
        if self.fused_dq and self.block_k_dkv != 2 * _WG_ROWS:
            raise ValueError(
                "fused_dq needs block_k_dkv=128: the dK/dV program's two compute "
                "warpgroups split dQ's products"
            )
        if self.split_kv_forward is not None and self.cudnn_backward:
            raise ValueError(
                "split_kv_forward and cudnn_backward would leave no half to these kernels"
            )
        if self.key_tiles_dkv < 1:
            raise ValueError(f"key_tiles_dkv={self.key_tiles_dkv} must be >= 1")
        if self.key_tiles_dkv > 1 and self.fused_dq:
            raise ValueError(
                "key_tiles_dkv > 1 runs without fused_dq: its dK/dV programs hold no dQ^T "
                "buffers across key tiles"
            )
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if self.pingpong and self.named_turns and self.interpret:
            raise ValueError(
                "named_turns needs the GPU: the Mosaic GPU interpreter runs no inline PTX "
                "(named_turns=False takes ping-pong turns on mbarriers)"
            )
        if self.p_in_registers and self.interpret:
            raise ValueError(
                "p_in_registers needs the GPU: the Mosaic GPU interpreter takes wgmma "
                "operands only from shared memory and no accumulator stores"
            )
        if self.transposed_views and self.interpret and not JAX_011:
            raise ValueError(
                "transposed_views needs the GPU or jax >= 0.11: jax 0.10's Mosaic GPU "
                "interpreter cannot read transposed shared-memory views"
            )
        if self.launch_group is not None and self.launch_group < 1:
            raise ValueError(f"launch_group={self.launch_group} must be None or >= 1")
        for field in ("memory_registers", "backward_memory_registers"):
            regs = getattr(self, field)
            if regs is not None and not (24 <= regs <= 256 and regs % 8 == 0):
                raise ValueError(f"{field}={regs} must be a multiple of 8 in [24, 256]")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _dims(call: AttentionCall) -> tuple[int, int]:
    return _round_up(call.qk_dim, _WG_ROWS), _round_up(call.v_dim, _WG_ROWS)


def _staging(cfg: MosaicAttentionConfig, shape, dtype, count=1) -> list:
    """SMEM staging of `count` in-kernel wgmma operands (last in a scratch list).

    Empty where `p_in_registers` keeps them in registers.
    """
    return [] if cfg.p_in_registers else [swizzled(shape, dtype)] * count


def _a_operand(value, dtype, staging):
    """`value` as wgmma's left operand: in registers, or staged in SMEM `staging`."""
    if staging is None:
        return value.astype(dtype)
    staging[...] = value.astype(dtype)
    plgpu.commit_smem()
    return staging


def _forward_scratch(cfg: MosaicAttentionConfig, d, dv, dtype, n_q_pos=0, n_kv_pos=0):
    """Shared-memory buffers of a forward program (`n_*_pos`: segment-id operands)."""
    stages, bq, bk = cfg.num_stages, cfg.block_q, cfg.block_k
    scratch = [
        swizzled((2, bq, d), dtype),
        swizzled((stages, bk, d) if cfg.transposed_views else (stages, d, bk), dtype),
        swizzled((stages, bk, dv), dtype),
        plgpu.SMEM((2, bq), jnp.float32),
        *([swizzled((2, bq, dv), dtype)] if dv != d else []),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # each warpgroup's ping-pong turn
    ]
    for _ in range(n_q_pos):
        scratch += [plgpu.SMEM((2, bq), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=2)]
    for _ in range(n_kv_pos):
        scratch += [
            plgpu.SMEM((stages, bk), jnp.int32),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        ]
    return scratch + _staging(cfg, (2, bq, bk), dtype)


def _dkv_scratch(cfg: MosaicAttentionConfig, d, dv, dtype, n_q_pos=0, n_kv_pos=0):
    """Shared-memory buffers of a dK/dV program.

    With `block_k_dkv=128` two compute warpgroups (64 keys each) share the query ring;
    with `fused_dq` they also hold `_fused_dq_scratch`. With `key_tiles_dkv > 1` the
    key tile's buffers (K, V, key ids) have two slots.
    """
    stages, bq, bk = cfg.num_stages, cfg.block_q_dkv, cfg.block_k_dkv
    wgs = bk // _WG_ROWS
    kv_slots = 2 if cfg.key_tiles_dkv > 1 else 1
    rows = (wgs, _WG_ROWS) if wgs > 1 else (bk,)  # each compute warpgroup's keys
    keys = (kv_slots, *rows) if kv_slots > 1 else rows
    views = cfg.transposed_views
    ring = [
        swizzled((stages, bq, d), dtype),
        *([] if views else [swizzled((stages, d, bq), dtype)]),
        swizzled((stages, bq, dv), dtype),
        *([] if views else [swizzled((stages, dv, bq), dtype)]),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
    ]
    own_tiles = 2 + n_kv_pos + int(cfg.fused_dq and not views)  # K, V, ids (and K^T)
    return [
        swizzled((*keys, d), dtype),
        swizzled((*keys, dv), dtype),
        *ring,
        plgpu.Barrier(num_arrivals=1, num_barriers=own_tiles * wgs * kv_slots),
        plgpu.Barrier(num_arrivals=1, num_barriers=(len(ring) + n_q_pos) * stages),
        *([plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)] if wgs > 1 else []),
        *[plgpu.SMEM(keys, jnp.int32)] * n_kv_pos,
        *[plgpu.SMEM((stages, bq), jnp.int32)] * n_q_pos,
        *(_fused_dq_scratch(cfg, d, dtype) if cfg.fused_dq else []),
        # P^T's and dS^T's staging (`fused_dq` stages dS^T for dQ anyway).
        *_staging(cfg, (*rows, bq), dtype, count=1 if cfg.fused_dq else 2),
    ]


def _fused_dq_scratch(cfg: MosaicAttentionConfig, d, dtype):
    """`fused_dq`'s buffers.

    dS^T of both warpgroups, double-buffered by step parity (a warpgroup writes step
    n + 1's while the other still reads step n's); dQ^T's float32 staging for the TMA
    reductions; without views, K^T; interpreted, the warpgroups' meeting point (on the
    GPU a named barrier).
    """
    bq = cfg.block_q_dkv
    return [
        swizzled((2, 2, _WG_ROWS, bq), dtype),
        swizzled((2, _fused_dq_rows(d), bq), jnp.float32),
        *([] if cfg.transposed_views else [swizzled((2, d, _WG_ROWS), dtype)]),
        *([plgpu.Barrier(num_arrivals=2, num_barriers=2)] if cfg.interpret else []),
    ]


def _dq_scratch(cfg: MosaicAttentionConfig, d, dv, dtype, n_q_pos=0, n_kv_pos=0):
    """Shared-memory buffers of a dQ program.

    With `block_q_dq=128` two compute warpgroups (64 rows each) share the key ring.
    """
    stages, bq, bk = cfg.num_stages, cfg.block_q_dq, cfg.block_k_dq
    wgs = bq // _WG_ROWS
    rows = (wgs, _WG_ROWS) if wgs > 1 else (bq,)
    if cfg.transposed_views:  # K, V
        ring = [swizzled((stages, bk, d), dtype), swizzled((stages, bk, dv), dtype)]
    else:  # K^T, K, V^T
        ring = [swizzled((stages, d, bk), dtype), swizzled((stages, bk, d), dtype),
                swizzled((stages, dv, bk), dtype)]  # fmt: skip
    return [
        swizzled((*rows, d), dtype),
        swizzled((*rows, dv), dtype),
        plgpu.SMEM(rows, jnp.float32),
        plgpu.SMEM(rows, jnp.float32),
        *ring,
        plgpu.Barrier(num_arrivals=1, num_barriers=(4 + n_q_pos) * wgs),
        plgpu.Barrier(num_arrivals=1, num_barriers=(len(ring) + n_kv_pos) * stages),
        *([plgpu.Barrier(num_arrivals=wgs, num_barriers=stages)] if wgs > 1 else []),
        *[plgpu.SMEM(rows, jnp.int32)] * n_q_pos,
        *[plgpu.SMEM((stages, bk), jnp.int32)] * n_kv_pos,
        *_staging(cfg, (*rows, bk), dtype),
    ]


def smem_bytes(
    cfg: MosaicAttentionConfig, d: int, dv: int, n_q_pos: int = 0, n_kv_pos: int = 0
) -> dict[str, int]:
    """Shared memory of each kernel's program, from the kernels' own buffer lists.

    For padded head dims `d`, `dv` (16-bit) and `n_q_pos` / `n_kv_pos` segment-id operands.
    """
    args = (cfg, d, dv, jnp.bfloat16, n_q_pos, n_kv_pos)
    return {
        "forward": scratch_bytes(_forward_scratch(*args)),
        "dkv": scratch_bytes(_dkv_scratch(*args)),
        "dq": scratch_bytes(_dq_scratch(*args)),
    }


def _segment_terms(call: AttentionCall) -> int:
    return sum(_tiles.spec_names(term).count("segments") for term in call.mask_terms)


def _smem_need(call: AttentionCall, cfg: MosaicAttentionConfig) -> dict[str, int]:
    """`smem_bytes` of `call` under `cfg`: its padded head dims and segment-id tiles."""
    segments = _segment_terms(call)
    return smem_bytes(cfg, *_dims(call), segments, segments)


def _grid(
    cfg: MosaicAttentionConfig, tiles: int, heads: int, batch: int, tile_axis: str
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A kernel's grid and axis names: the axis that `launch_group` launches fastest last."""
    if cfg.launch_group is None:
        return (tiles, heads, batch), (tile_axis, "h", "b")
    return (batch, heads, tiles), ("b", "h", tile_axis)


def _program(cfg: MosaicAttentionConfig, tiles: int, heads: int, batch: int, tile_axis: str):
    """This program's `(tile rank, head, batch element)` in `launch_group`'s order.

    The rank counts tiles in launch order (the kernel maps it to its longest-first tile).
    A group of n pairs takes n * tiles consecutive programs of the launch order, the
    pair varying fastest; the last group may be short.
    """
    rank, h, b = lax.axis_index(tile_axis), lax.axis_index("h"), lax.axis_index("b")
    group = min(cfg.launch_group or 1, heads * batch)
    if group == 1:  # as the grid reads (`_grid`): None's order, or each pair's tiles together
        return rank, h, b
    pairs, span = heads * batch, jnp.int32(group * tiles)
    linear = (b * heads + h) * tiles + rank
    first = lax.div(linear, span) * group
    within = lax.rem(linear, span)
    size = jnp.int32(group) if pairs % group == 0 else jnp.minimum(group, pairs - first)
    pair = first + lax.rem(within, size)
    return lax.div(within, size), lax.rem(pair, jnp.int32(heads)), lax.div(pair, jnp.int32(heads))


def _compiler_params(cfg: MosaicAttentionConfig):
    return dataclasses.replace(COMPILER_PARAMS, approx_math=cfg.approx_math)


# `fused_dq` by default up to this many bytes of dQ^T reductions per head (each 128-key
# program adds a float32 [q_len, head dim]). H100, B4 H8 non-causal: in run 48 (launch
# order None) faster at T 4096 (128 MiB) and hd 64 T 16384 (512 MiB), slower at hd 128 T
# 16384 (1 GiB); in run 53 with `launch_group=1` faster there too (32.7 -> 30.0 ms).
# Other launch groups keep None's bound: none of them was timed at 1 GiB.
_FUSED_DQ_MAX_BYTES = {None: 512 * 2**20, 1: 2**30}


def _fused_dq_bytes(call: AttentionCall) -> int:
    return call.q_len * -(-call.kv_len // (2 * _WG_ROWS)) * call.qk_dim * 4


# One KV head per query head, one query tile a head, unmasked over many keys: dQ in its
# own kernel once that kernel's grid (a program a head) fills half a wave. H100 runs 109
# and 111, hd 128, 32 heads, 128 queries, fwd+bwd ms fused / own kernel: batch 4 over 8192
# keys (128 programs) 0.981 / 0.928, batch 8 1.927 / 1.828, batch 16 3.798 / 3.603, batch
# 8 over 32768 keys 7.472 / 7.233; batch 1 over 32768 (32 programs, joined) 0.940 / 1.276.
# Grouped heads keep it fused (batch 8: 1.183 / 1.219, batch 16: 2.382 / 2.476), as do
# self-attention (run 48) and hd 64 over 4096 keys (run 115, batch 8: 0.575 / 0.602).
# One-tile dK/dV programs leave their K/V loads unhidden behind two query tiles of work:
# 64-key programs on one warpgroup, two an SM, beat 128-key ones (H100 run 116, batch 8
# over 8192 keys: the dK/dV kernel 1.024 ms of 1.750, fwd+bwd 1.865 -> 1.731 ms; torch
# SDPA cuDNN 1.581). Programs over `OWN_DQ_KEY_TILES` tiles of 128 keys (`key_tiles_dkv`)
# load the next tile's K/V while one computes and Q/dO once, with FA3's 24 registers for
# their TMA warpgroup, and dQ steps over 128 keys. H100 runs 156-159, that shape, fwd+bwd
# ms: 64-key one-tile programs 1.708 / 1.712; 128-key over 1 / 2 / 4 / 8 / 16 tiles 1.827
# / 1.687 / 1.633 / 1.624 / 1.583, 24 registers over 8 / 16 / 32 / 64: 1.573 / 1.562 /
# 1.557 / 1.553, over 16 with dQ's 128 keys 1.543 (torch SDPA cuDNN 1.573, run 156).
# 64-key programs over 16 tiles, one an SM: 1.711.
OWN_DQ_KEY_TILES = 16
OWN_DQ_KERNEL_MIN_WAVES = 0.5
OWN_DQ_KERNEL_MIN_KV_LEN = 8192  # as timed
OWN_DQ_KERNEL_HEAD_DIM = 128  # as timed


def _own_dq_kernel(call: AttentionCall, device: DeviceInfo) -> bool:
    one_tile = call.groups == 1 and call.q_len <= 2 * _WG_ROWS
    unmasked = not call.mask_terms and call.score_mod is None
    timed = call.kv_len >= OWN_DQ_KERNEL_MIN_KV_LEN and call.qk_dim == OWN_DQ_KERNEL_HEAD_DIM
    if not (one_tile and unmasked and timed):
        return False
    return call.batch * call.q_heads >= OWN_DQ_KERNEL_MIN_WAVES * split_rule(device)["sms"]


# The split-KV Triton forward joined to these backward kernels pays while this forward's
# grid, one program per 128 query rows and head, fills at most `SPLIT_KV_FORWARD_MAX_WAVES`
# waves of the device's SMs. H100 run 108, hd 128, 32 query heads over 8, unmasked, fwd+bwd
# ms (these kernels / joined / torch SDPA cuDNN): 1 x 128 queries over 32,768 keys (32
# programs) 0.888 / 0.671 / 1.157; 1 x 256 over 16,384 (64) 0.653 / 0.629 / 0.858; 2 x 128
# over 32,768 (64) 1.331 / 1.292 / 1.901; 8 x 128 over 8192 (256, ~2 waves) 1.202 / 1.335.
SPLIT_KV_FORWARD_MAX_WAVES = 1


def _split_kv_forward(call: AttentionCall, device: DeviceInfo) -> TritonAttentionConfig | None:
    """The Triton config whose split-KV forward `auto_config` joins, or None."""
    programs = call.batch * call.q_heads * -(-call.q_len // (2 * _WG_ROWS))
    if not device.is_gpu or programs > SPLIT_KV_FORWARD_MAX_WAVES * split_rule(device)["sms"]:
        return None
    config = TritonAttention().default_config(call, device)
    # The join's forward runs each query head apart (`TritonAttention.blocks`): a plan
    # made for packed heads is not its plan.
    if config.pack_gqa or config.num_splits == 1 or _split_kv_rule(call, device, config):
        return None
    return config


def default_config(call: AttentionCall, device: DeviceInfo) -> MosaicAttentionConfig:
    """Tiles for `call`: each kernel steps down to 64 where shared memory is short.

    Forward 2x64 rows x 128 keys; dK/dV and dQ on two compute warpgroups (128 keys /
    rows a program).

    On the GPU FA3's register operands and transposed views (`p_in_registers`,
    `transposed_views`), which the interpreter of the CPU tests cannot run; FA3's
    forward schedule: ping-pong turns (`_pingpong`) around the intra-warpgroup overlap,
    24 registers for the TMA warpgroup; FA3's backward (`fused_dq`) up to
    `_FUSED_DQ_MAX_BYTES` of dQ reductions a head but where dQ's own kernel pays
    (`_own_dq_kernel`, with dK/dV programs over several key tiles); the compiler's
    approximate exp2 (`approx_math`) unless a score mod brings its tanh (SoftCap's GPU
    test passed exact in run 58, its approximated case not yet run); each (batch,
    head)'s tiles launched together (`_launch_group`).

    H200 run 44 (B4 H8 T4096 hd128 bf16, non-causal, fwd+bwd): 2.97 ms with 128/128 for
    dK/dV/dQ, 3.35 with 128/64, 3.34 with 64/128 and 3.77 with 64/64; 2.47 with 128/128
    and both GPU-only options. Run 47 (the same shape, forward): 0.571 ms with those,
    0.530 with FA3's forward schedule (0.536 with the overlap alone, 0.565 with
    ping-pong alone). H100 run 48 (fwd+bwd, hd 128 / 64): `fused_dq` 2.40 -> 2.20 ms /
    1.57 -> 1.33 at T 4096, 37.5 -> 43.6 / 23.7 -> 20.0 at T 16384 (causal: 1.29 ->
    1.25 / 0.86 -> 0.72, 18.0 -> 16.6 / 12.2 -> 9.9). Run 49 (hd 128): `approx_math`
    0.514 -> 0.487 ms forward and 2.39 -> 2.30 fwd+bwd at T 4096, 7.88 -> 7.60 and
    37.6 -> 35.4 at T 16384.
    """
    gpu = device.is_gpu
    cfg = MosaicAttentionConfig(
        block_k_dkv=128,
        block_q_dq=128,
        p_in_registers=gpu,
        transposed_views=gpu,
        pingpong=gpu and _pingpong(call),
        overlap_softmax=gpu,
        memory_registers=24 if gpu else None,
        backward_memory_registers=_backward_memory_registers(call) if gpu else MEMORY_REGISTERS,
        approx_math=gpu and call.score_mod is None,
        launch_group=_launch_group(call) if gpu else None,
        interpret=not gpu,
    )
    for kernel, field in (("forward", "block_k"), ("dkv", "block_k_dkv"), ("dq", "block_q_dq")):
        if _smem_need(call, cfg)[kernel] > SMEM_LIMIT:
            cfg = dataclasses.replace(cfg, **{field: _WG_ROWS})
    if gpu and _own_dq_kernel(call, device):
        own = dataclasses.replace(
            cfg, key_tiles_dkv=OWN_DQ_KEY_TILES, backward_memory_registers=24, block_k_dq=128
        )
        if max(_smem_need(call, own).values()) <= SMEM_LIMIT:
            return own
        return dataclasses.replace(cfg, block_k_dkv=_WG_ROWS)
    most = _FUSED_DQ_MAX_BYTES.get(cfg.launch_group, _FUSED_DQ_MAX_BYTES[None])
    if gpu and cfg.block_k_dkv == 2 * _WG_ROWS and _fused_dq_bytes(call) <= most:
        fused = dataclasses.replace(cfg, fused_dq=True)
        if _smem_need(call, fused)["dkv"] <= SMEM_LIMIT:
            cfg = fused
    return cfg


def _unmasked_or_causal(call: AttentionCall) -> bool:
    """No score mod, and no mask but causal ones: every row's statistics are cuDNN's."""
    return call.score_mod is None and all(term[0] == "causal" for term in call.mask_terms)


def _cudnn_backward_rule(call: AttentionCall, device: DeviceInfo) -> str | None:
    """Why a `cudnn_backward` config cannot run `call`, or None."""
    if CUDNN_BACKWARD_UNAVAILABLE is not None:
        return f"cudnn_backward: {CUDNN_BACKWARD_UNAVAILABLE}"
    if not _unmasked_or_causal(call):
        return (
            "cudnn_backward joins cuDNN's backward by the log-sum-exp of an unmasked or "
            "causal call: no other masks or score mods"
        )
    why = CudnnAttention().check(call, device)
    return None if why is None else f"cudnn_backward's cuDNN backward: {why}"


# Long self-attention at hd 128: our forward is faster than cuDNN's, cuDNN's backward
# than ours. H100, B4 H8 bf16, fwd / fwd+bwd ms (the join / Mosaic alone / JAX's cuDNN
# route / torch SDPA cuDNN), run 168: T 16384 6.89 / 27.71, 6.91 / 30.90, 7.19 / 27.89,
# 7.08 / 27.59; causal 3.47 / 14.26, 3.48 / 15.49, 3.79 / 14.73, 3.86 / 14.60. Run 169, T
# 32768 (no Mosaic alone): 26.85 / 107.7, -, 28.21 / 110.0, 28.00 / 109.4; causal 13.65 /
# 56.16, -, 14.74 / 57.32, 14.43 / 55.78. At T 4096 the forwards tie (run 93: 0.470 /
# 0.482 ms) and at hd 64 Mosaic's is the slower (run 54): no join there.
CUDNN_BACKWARD_MIN_LEN = 16384
CUDNN_BACKWARD_HEAD_DIM = 128


def cudnn_backward_pays(call: AttentionCall) -> bool:
    """Whether automatic selection joins our forward to cuDNN's backward: as timed."""
    timed = (
        call.q_len == call.kv_len >= CUDNN_BACKWARD_MIN_LEN
        and call.groups == 1
        and call.qk_dim == call.v_dim == CUDNN_BACKWARD_HEAD_DIM
    )
    return timed and _unmasked_or_causal(call) and CUDNN_BACKWARD_UNAVAILABLE is None


def auto_config(call: AttentionCall, device: DeviceInfo) -> MosaicAttentionConfig:
    """What automatic selection runs: `default_config`, joined to another family's half.

    The split-KV Triton forward joins where this forward's grid is short
    (`_split_kv_forward`), cuDNN's backward for long self-attention at hd 128
    (`cudnn_backward_pays`). By name, "mosaic" runs its own kernels (`default_config`).
    """
    split_kv = _split_kv_forward(call, device)
    cudnn = split_kv is None and device.is_gpu and cudnn_backward_pays(call)
    cudnn = cudnn and _cudnn_backward_rule(call, device) is None
    return dataclasses.replace(
        default_config(call, device), split_kv_forward=split_kv, cudnn_backward=cudnn
    )


# Masks under which a query tile's work grows with its index (`_flash.last_first`).
_UNEVEN_TILES = frozenset({"causal", "prefix_lm"})


def _mask_names(call: AttentionCall) -> set[str]:
    return {name for term in call.mask_terms for name in _tiles.spec_names(term)}


def _launch_group(call: AttentionCall) -> int:
    """The GPU's `launch_group`: 1, or 4 for causal-like masks below T 16384.

    Each (batch, head) pair's tiles together share its operands in the L2; under causal
    masks below T 16384, groups of 4 pairs keep most of that and balance the last wave
    with their longest tiles first.

    H100 run 53 (B4 H8 bf16, fwd+bwd, hd 128 / 64), None -> 1: non-causal 2.15 -> 2.06 ms /
    1.27 -> 1.21 at T 4096, 34.9 -> 32.7 / 19.0 -> 17.7 at T 16384. ncu (run 54, T 4096
    hd 128): the forward's DRAM throughput 41.6% -> 9.3% of peak, 433 -> 412 us. Causal,
    run 59 (fwd / fwd+bwd, groups None / 1 / 4 / 16): T 4096 hd 128 0.278 / 0.284 / 0.261 /
    0.272 and 1.28 / 1.30 / 1.21 / 1.22 ms, hd 64 0.199 / 0.218 / 0.194 / 0.197 and 0.697 /
    0.736 / 0.675 / 0.674; T 16384 hd 128 3.82 / 3.53 / 3.63 / 3.70 and 17.0 / 16.1 / 16.3 /
    16.8, hd 64 2.73 / 2.61 / 2.62 / 2.69 and 9.66 / 9.07 / 9.10 / 9.30. Run 86 (T 16384
    hd 128 causal, fwd+bwd, groups 1 / 2 / 4): 15.02 / 14.91 / 15.03.
    """
    if _mask_names(call) & _UNEVEN_TILES and call.q_len < 16384:
        return 4
    return 1


def _backward_memory_registers(call: AttentionCall) -> int:
    """The GPU's `backward_memory_registers`: 24 under causal-like masks, else 40.

    H100, B4 H8 T4096 bf16 fwd+bwd, 40 / 24. Causal hd 128: run 65 1.197 / 1.162 ms, run
    74 1.184 / 1.153 and 1.182 / 1.151; hd 64: 0.667 / 0.658 and 0.660 / 0.662.
    Non-causal hd 128 (run 65): 2.065 / 2.077.
    """
    return 24 if _mask_names(call) & _UNEVEN_TILES else MEMORY_REGISTERS


def _pingpong(call: AttentionCall) -> bool:
    """The GPU's `pingpong`: on for hd > 64 below T 16384, under every mask.

    There it was faster than the intra-warpgroup overlap alone. H100, B4 H8 bf16 forward,
    with / without. Non-causal (run 59, `launch_group=1`): hd 128 0.475 / 0.484 ms at T
    4096, 6.98 / 6.90 at T 16384 (run 63's sweep 7.18 / 6.83, run 54 7.02 / 6.83); hd 64
    0.359 / 0.350 at T 4096, 5.28 / 4.98 at T 16384. Causal (run 65, the default launch
    groups): hd 128 0.255 / 0.263 at T 4096, 3.489 / 3.486 at T 16384; hd 64 0.197 /
    0.194 and 2.58 / 2.51.
    """
    return call.qk_dim > 64 and call.q_len < 16384


@dataclasses.dataclass(frozen=True)
class _Static:
    call: AttentionCall
    config: MosaicAttentionConfig
    scale: float
    q_pad: int
    kv_pad: int
    d: int
    dv: int
    kinds: tuple[str, ...]
    score_mod: Any = None  # array-free (`_SCORE_MODS`): evaluated in the kernel as is

    @property
    def ctx(self) -> MaskContext:
        return MaskContext(self.call.batch, self.call.q_len, self.call.kv_len)


def _scalar_values(st: _Static, op_refs, b, h, kinds=("batch", "head")) -> dict:
    """The per-batch / per-head mask scalars (of `kinds`) for batch b, query head h."""
    return {
        k: ref[b] if kind == "batch" else ref[h]
        for k, (ref, kind) in enumerate(zip(op_refs, st.kinds))
        if kind in kinds
    }


def _mask_of(st: _Static, rebuild, scalars: dict, positional: dict):
    """The tile-local mask from the program's scalars and this tile's id tiles."""
    return rebuild([scalars[k] if k in scalars else positional[k] for k in range(len(st.kinds))])


def _id_tiles(shape, own, step, slot):
    """Segment-id tiles broadcast to the score tile, by operand index.

    `own`: `(k, buffer)` of the program's ids, along the tile's rows; `step`: `(k, ring)`
    of the looped axis' ids, whose `slot` runs along the columns.
    """
    tiles = {k: _rows(buf[...], shape) for k, buf in own}
    tiles.update({k: _cols(buf.at[slot][...], shape) for k, buf in step})
    return tiles


def _masked(st: _Static, rebuild, scalars: dict, s, q_idx, kv_idx, own, step, slot, h, b):
    """Scores `s` of query head h, the pairs the mask rejects at -inf.

    `own` / `step`: the segment-id buffers of `_id_tiles`.
    """
    mask = _mask_of(st, rebuild, scalars, _id_tiles(s.shape, own, step, slot))
    return jnp.where(_flash.valid_pairs(st.ctx, mask, b, h, q_idx, kv_idx), s, -jnp.inf)


def _log2_scores(st: _Static, raw, h, b, q_idx, kv_idx, with_slope=True):
    """A tile's scores in log2 units and d(score)/d(q.k) for the backward.

    With a score mod that slope is the mod's derivative at each score (a tile, from its
    JVP; not computed without `with_slope`); without one it is None, standing for the
    scale (`_times_slope`).
    """
    if st.score_mod is None:
        return raw * (st.scale * LOG2E), None

    def modded(x):
        return st.score_mod(x * st.scale, b, h, q_idx, kv_idx).astype(jnp.float32)

    if not with_slope:
        return modded(raw) * LOG2E, None
    scores, slope = jax.jvp(modded, (raw,), (jnp.ones_like(raw),))
    return scores * LOG2E, slope


def _backward_scores(st: _Static, rebuild, scalars, raw, h, b, positions, masked, ids, slot):
    """A backward tile's base-2 scores (score mod and mask applied) and their slope.

    `positions()` gives the tile's `(q_idx, kv_idx)`, built only where a mask or a score
    mod reads them; `ids`: the `(own, step)` segment-id buffers of `_id_tiles`.
    """
    q_idx = kv_idx = None
    if masked or st.score_mod is not None:
        q_idx, kv_idx = positions()
    scores, slope = _log2_scores(st, raw, h, b, q_idx, kv_idx)
    if masked:
        own, step = ids
        scores = _masked(st, rebuild, scalars, scores, q_idx, kv_idx, own, step, slot, h, b)
    return scores, slope


def _times_slope(st: _Static, x, slope):
    """`x` times `_log2_scores`' slope."""
    return x * (st.scale if slope is None else slope)


def _positional(st: _Static, kind: str) -> list[int]:
    return [k for k, x in enumerate(st.kinds) if x == kind]


def _dot(a, b_smem, shape, while_running=None):
    """`a @ b` into float32 registers (`a` in SMEM or registers, `b` in SMEM).

    `while_running()` runs between issuing the wgmma and waiting for its result.
    """

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
        if while_running is not None:
            while_running()
        return acc_ref[...]

    return pl.run_scoped(run, ACC(shape, jnp.float32))


def _overlapped(first, second, shapes, consume_first, left_running=0, after_issue=None):
    """Two products issued together; the first is consumed while the second runs.

    `first`, `second`: `(a, b)` operand pairs as `_dot` takes them, their products of
    `shapes`; `after_issue()` runs once both are issued.
    `consume_first(a @ b)` runs as soon as the first product is ready and may issue
    `left_running` further wgmmas, which stay in flight. Returns `(its result, the second
    product)`.
    """

    def run(first_acc, second_acc):
        plgpu.wgmma(first_acc, *first)
        plgpu.wgmma(second_acc, *second)
        if after_issue is not None:
            after_issue()
        result = consume_first(plgpu.wgmma_accumulator_load(first_acc, wait_n=1))
        return result, plgpu.wgmma_accumulator_load(second_acc, wait_n=left_running)

    return pl.run_scoped(run, *(ACC(shape, jnp.float32) for shape in shapes))


def _t_view(tile, views: bool):
    """X^T as wgmma's B operand, from X's tile (`views`) or from X^T's own tile.

    Without `transposed_views` TMA brings X^T's tiles in from an XLA-transposed copy.
    """
    return tile.T if views else tile


def _store(*outputs, wait: bool = True):
    """Write `(value, smem, gmem)` outputs: stage each value in SMEM, copy them by TMA.

    Without `wait` the copies may still be running: wait before reusing `smem`.
    """
    for value, smem, _ in outputs:
        smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for _, smem, gmem in outputs:
        plgpu.copy_smem_to_gmem(smem, gmem)
    if wait:
        plgpu.wait_smem_to_gmem(0)


def _rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _fwd_kernel(q_ref, k_ref, v_ref, lo_ref, flo_ref, fhi_ref, hi_ref, *refs, st, rebuild):
    # k_ref: K, or with the wrapper's transposed copy K^T `[batch, heads, dim, seq]`.
    n_ops = len(st.kinds)
    op_refs, (o_ref, lse_ref), scratch = refs[:n_ops], refs[n_ops : n_ops + 2], refs[n_ops + 2 :]
    cfg, dtype = st.config, q_ref.dtype
    # P's SMEM staging (`_staging`), unless it stays in registers.
    p_smem, scratch = (None, scratch) if cfg.p_in_registers else (scratch[-1], scratch[:-1])
    if st.d == st.dv:  # the output reuses the query buffer
        q_smem, k_smem, v_smem, lse_smem, *bars = scratch
        o_smem = q_smem
    else:
        q_smem, k_smem, v_smem, lse_smem, o_smem, *bars = scratch
    q_bar, k_bar, v_bar, k_free, v_free, turn, *pos = bars
    # Segment ids: per q_pos operand a [2, bq] buffer, per kv_pos operand a ring of [bk].
    q_pos, kv_pos = _positional(st, "q_pos"), _positional(st, "kv_pos")
    q_ids = {k: (pos[2 * n], pos[2 * n + 1]) for n, k in enumerate(q_pos)}
    kv_ids = {
        k: (pos[2 * (len(q_pos) + n)], pos[2 * (len(q_pos) + n) + 1]) for n, k in enumerate(kv_pos)
    }
    bq, bk, stages = cfg.block_q, cfg.block_k, cfg.num_stages
    views = cfg.transposed_views

    def kt_tile(slot):  # K^T of ring slot `slot`
        return _t_view(k_smem.at[slot], views)

    tiles = st.q_pad // (2 * bq)
    rank, h, b = _program(cfg, tiles, st.call.q_heads, st.call.batch, "q")
    t = _flash.last_first(rank, tiles)
    lo, full_lo, full_hi, hi = lo_ref[b, t], flo_ref[b, t], fhi_ref[b, t], hi_ref[b, t]

    def compute(wg):
        row0 = t * (2 * bq) + wg * bq
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], q_smem.at[wg], q_bar.at[wg])
        for k, (buf, bar) in q_ids.items():
            plgpu.copy_gmem_to_smem(op_refs[k].at[b, pl.ds(row0, bq)], buf.at[wg], bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        for _, bar in q_ids.values():
            plgpu.barrier_wait(bar.at[wg])
        shape = (bq, bk)
        scalars = _scalar_values(st, op_refs, b, h)
        c = st.scale * LOG2E

        # Ping-pong (FA3): a warpgroup issues a step's products between `begin_turn` and
        # `end_turn`, which hands the turn to the other. Turns strictly alternate, so no
        # barrier is ever two signals ahead; both warpgroups take one turn a step.
        def begin_turn():
            if not cfg.pingpong:
                return
            if cfg.named_turns:
                named_barrier("sync", _TURN_BARRIERS)
            else:
                plgpu.barrier_wait(turn.at[wg])

        def end_turn():
            if not cfg.pingpong:
                return
            if cfg.named_turns:
                named_barrier("arrive", _TURN_BARRIERS, other=True)
            else:
                plgpu.barrier_arrive(turn.at[1 - wg])

        pl.when(wg == 1)(end_turn)  # warpgroup 0 takes the first turn

        def scores(j, slot):
            """Step j's scores, issued in a turn; K's slot is released once they are read."""
            plgpu.barrier_wait(k_bar.at[slot])
            begin_turn()
            s = _dot(q_smem.at[wg], kt_tile(slot), shape, end_turn)
            plgpu.barrier_arrive(k_free.at[slot])
            return s

        def softmax(j, slot, s, m, denom, masked):
            """Step j's probabilities P (unnormalised), running max, rescale and sum."""
            for _, bar in kv_ids.values():  # every step: the barriers' phases must advance
                plgpu.barrier_wait(bar.at[slot])
            q_idx = kv_idx = None  # positions only where a mask or a score mod reads them
            if masked or st.score_mod is not None:
                q_idx = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
                kv_idx = j * bk + lax.broadcasted_iota(jnp.int32, shape, 1)
            # Without a score mod the scale rides in exp2's argument (one FMA an element,
            # no separate multiply); the running max `m` is kept in scaled base-2 units.
            if st.score_mod is None:
                scaled = lambda x: x * c  # noqa: E731
            else:  # the mod's scores are already in base-2 units
                s = _log2_scores(st, s, h, b, q_idx, kv_idx, with_slope=False)[0]
                scaled = lambda x: x  # noqa: E731
            if masked:
                own = [(k, buf.at[wg]) for k, (buf, _) in q_ids.items()]
                step = [(k, buf) for k, (buf, _) in kv_ids.items()]
                s = _masked(st, rebuild, scalars, s, q_idx, kv_idx, own, step, slot, h, b)
            m_new = jnp.maximum(m, scaled(s.max(axis=1)))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(scaled(s) - _rows(m_safe, shape))
            return p, m_new, alpha, denom * alpha + p.sum(axis=1)

        def overlapped(body, first_step, last_product, init):
            """Run `body(j, carry, masked)` with step j - 1's P @ V beside step j's softmax.

            Step lo (mask evaluated: exact on any tile) starts the pipeline
            (`first_step(carry)`); the loop's steps each finish the previous one; the last
            P @ V follows the loop (`last_product(carry, slot)`).
            """
            started = hi > lo
            carry = lax.cond(started, first_step, lambda c: c, init)
            after = lo + 1
            ranges = (after, jnp.maximum(full_lo, after), jnp.maximum(full_hi, after), hi)
            carry = _flash.tile_loop(ranges, body, carry)
            last = lax.rem(hi - 1 - lo, stages)
            return lax.cond(started, lambda c: last_product(c, last), lambda c: c, carry)

        def await_overlapped(j):
            """The slots of step j's K and of step j - 1's V, once both have arrived."""
            slot, prev = lax.rem(j - lo, stages), lax.rem(j - 1 - lo, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(v_bar.at[prev])
            return slot, prev

        m0, denom0 = jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32)

        def staged_loop(p_smem):
            """P staged in SMEM; each P @ V a fresh product added to the output in registers."""
            p_smem_wg = p_smem.at[wg]

            def stage(p):  # P into its SMEM staging: P @ V's left operand
                return _a_operand(p, dtype, p_smem_wg)

            def body(j, carry, masked):
                acc, m, denom = carry
                slot = lax.rem(j - lo, stages)
                s = scores(j, slot)
                p, m, alpha, denom = softmax(j, slot, s, m, denom, masked)
                acc = acc * _rows(alpha, acc.shape)
                p = stage(p)
                plgpu.barrier_wait(v_bar.at[slot])
                acc = acc + _dot(p, v_smem.at[slot], acc.shape)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, denom

            def overlapped_body(j, carry, masked):
                acc, m, denom = carry
                slot, prev = await_overlapped(j)

                def on_scores(s):
                    plgpu.barrier_arrive(k_free.at[slot])
                    return softmax(j, slot, s, m, denom, masked)

                begin_turn()
                (p, m, alpha, denom), pv = _overlapped(
                    (q_smem.at[wg], kt_tile(slot)),
                    (p_smem_wg, v_smem.at[prev]),
                    (shape, acc.shape),
                    on_scores,
                    after_issue=end_turn,
                )
                plgpu.barrier_arrive(v_free.at[prev])
                stage(p)  # after P @ V, which read the previous P
                return (acc + pv) * _rows(alpha, acc.shape), m, denom

            def first_step(carry):
                acc, m, denom = carry
                p, m, _, denom = softmax(lo, 0, scores(lo, 0), m, denom, True)
                stage(p)
                return acc, m, denom

            def last_product(carry, slot):
                acc, m, denom = carry
                plgpu.barrier_wait(v_bar.at[slot])
                acc = acc + _dot(p_smem_wg, v_smem.at[slot], acc.shape)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, denom

            init = (jnp.zeros((bq, st.dv), jnp.float32), m0, denom0)
            if cfg.overlap_softmax:
                return overlapped(overlapped_body, first_step, last_product, init)
            return _flash.tile_loop((lo, full_lo, full_hi, hi), body, init)

        def in_place_loop(o_acc):
            """FA3's register mode: P from registers, the output accumulated in place.

            The output stays in wgmma's accumulator `o_acc` and is rescaled there: no
            separate product tile to add.
            """

            def rescale(o, alpha):
                o_acc[...] = o * _rows(alpha, o.shape)

            def body(j, carry, masked):
                m, denom = carry
                slot = lax.rem(j - lo, stages)
                s = scores(j, slot)
                p, m, alpha, denom = softmax(j, slot, s, m, denom, masked)
                rescale(o_acc[...], alpha)
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.wgmma(o_acc, p.astype(dtype), v_smem.at[slot])
                plgpu.wgmma_wait(0)  # before V's slot is released
                plgpu.barrier_arrive(v_free.at[slot])
                return m, denom

            def overlapped_body(j, carry, masked):
                m, denom, held = carry
                slot, prev = await_overlapped(j)

                def run(s_acc):
                    begin_turn()
                    plgpu.wgmma(s_acc, q_smem.at[wg], kt_tile(slot))
                    plgpu.wgmma(o_acc, held, v_smem.at[prev])  # step j - 1's P @ V
                    end_turn()
                    s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
                    plgpu.barrier_arrive(k_free.at[slot])
                    p, m_new, alpha, denom_new = softmax(j, slot, s, m, denom, masked)
                    o = plgpu.wgmma_accumulator_load(o_acc, wait_n=0)
                    plgpu.barrier_arrive(v_free.at[prev])
                    rescale(o, alpha)
                    return p.astype(dtype), m_new, denom_new

                p, m, denom = pl.run_scoped(run, ACC(shape, jnp.float32))
                return m, denom, p

            def first_step(carry):
                m, denom, _ = carry
                p, m, _, denom = softmax(lo, 0, scores(lo, 0), m, denom, True)
                return m, denom, p.astype(dtype)

            def last_product(carry, slot):
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.wgmma(o_acc, carry[2], v_smem.at[slot])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            if cfg.overlap_softmax:
                init = (m0, denom0, jnp.zeros(shape, dtype))
                m, denom, _ = overlapped(overlapped_body, first_step, last_product, init)
            else:
                m, denom = _flash.tile_loop((lo, full_lo, full_hi, hi), body, (m0, denom0))
            return o_acc[...], m, denom

        if p_smem is None:
            acc, m, denom = pl.run_scoped(in_place_loop, ACC((bq, st.dv), jnp.float32))
        else:
            acc, m, denom = staged_loop(p_smem)
        pl.when(wg == 0)(begin_turn)  # warpgroup 1's last hand-over: each turn taken
        empty = denom == 0.0
        safe = jnp.where(empty, 1.0, denom)
        rows = pl.ds(row0, bq)
        _store(
            (acc / _rows(safe, acc.shape), o_smem.at[wg], o_ref.at[b, rows, h]),
            (
                jnp.where(empty, jnp.inf, m + jnp.log2(safe)),
                lse_smem.at[wg],
                lse_ref.at[b, h, rows],
            ),
        )

    def feed():
        kv_h = lax.div(h, jnp.int32(st.call.groups))
        count = hi - lo

        def issue_k(n, slot):
            tile = pl.ds((lo + n) * bk, bk)
            src = k_ref.at[b, tile, kv_h] if views else k_ref.at[b, kv_h, :, tile]
            plgpu.copy_gmem_to_smem(src, k_smem.at[slot], k_bar.at[slot])

        def issue_v(n, slot):
            tile = pl.ds((lo + n) * bk, bk)
            plgpu.copy_gmem_to_smem(v_ref.at[b, tile, kv_h], v_smem.at[slot], v_bar.at[slot])
            # Key ids ride with V: their slot is free once V's is (after the step's mask).
            for k, (buf, bar) in kv_ids.items():
                plgpu.copy_gmem_to_smem(op_refs[k].at[b, tile], buf.at[slot], bar.at[slot])

        # K is released after the scores, V after P @ V: each refills as soon as it can.
        tma_ring(count, stages, [(k_free, issue_k), (v_free, issue_v)])

    warp_specialized(compute, feed, cfg.memory_registers)


def _forward(st: _Static, rebuild, q, k, v, ranges, operands):
    cfg = st.config
    batch, _, heads, _ = q.shape
    dtype = q.dtype
    n_q_pos, n_kv_pos = len(_positional(st, "q_pos")), len(_positional(st, "kv_pos"))
    grid, grid_names = _grid(cfg, st.q_pad // (2 * cfg.block_q), heads, batch, "q")
    return plgpu.kernel(
        functools.partial(_fwd_kernel, st=st, rebuild=rebuild),
        out_type=(
            jax.ShapeDtypeStruct((batch, st.q_pad, heads, st.dv), dtype),
            jax.ShapeDtypeStruct((batch, heads, st.q_pad), jnp.float32),
        ),
        scratch_types=_forward_scratch(cfg, st.d, st.dv, dtype, n_q_pos, n_kv_pos),
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=_compiler_params(cfg),
        interpret=InterpretGPUParams() if cfg.interpret else None,
    )(q, _transposed_source(k, cfg), v, *ranges, *operands)


def _query_tile_views(refs, id_refs, b, h, rows, views: bool):
    """A dK/dV step's GMEM operands, in the order of the kernels' rings.

    Query tile `rows` of Q, Q^T, dO, dO^T, lse, delta and the query-side segment ids;
    with `views` (transposed views in SMEM) not Q^T and dO^T.
    """
    q_ref, qt_ref, do_ref, dot_ref, lse_ref, delta_ref = refs
    q, do = q_ref.at[b, rows, h], do_ref.at[b, rows, h]
    tiles = (q, do) if views else (q, qt_ref.at[b, h, :, rows], do, dot_ref.at[b, h, :, rows])
    return (*tiles, lse_ref.at[b, h, rows], delta_ref.at[b, h, rows],
            *(ref.at[b, rows] for ref in id_refs))  # fmt: skip


def _dkv_step(
    st, rebuild, scalars, h, b, i, key0, own, step, ring, slot, tiles, accs, masked, fused=None
):
    """Add query head h's tile `i` to a warpgroup's dK/dV accumulators (64 keys from key0).

    `b`: the batch element; `ring`: Q, Q^T, dO, dO^T, lse, delta buffers; `tiles`: the
    keys' K, V and the P^T, dS^T staging buffers; `own` / `step`: segment-id buffers of
    the keys / the ring; `fused`: the step's `_FusedDq` (`fused_dq`).
    """
    q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem = ring
    k_smem, v_smem, pt_smem, dst_smem = tiles
    dk_acc, dv_acc = accs
    bq, dtype = st.config.block_q_dkv, q_smem.dtype
    shape = (_WG_ROWS, bq)  # transposed scores: keys along rows

    def positions():  # keys along rows
        kv_idx = key0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        return i * bq + lax.broadcasted_iota(jnp.int32, shape, 1), kv_idx

    def probabilities_then_dv(raw_t):  # while dP^T runs; dV's product then runs on
        scores_t, slope = _backward_scores(
            st, rebuild, scalars, raw_t, h, b, positions, masked, (own, step), slot
        )
        pt = jnp.exp2(scores_t - _cols(lse_smem.at[slot][...], shape))
        plgpu.wgmma(dv_acc, _a_operand(pt, dtype, pt_smem), do_smem.at[slot])
        return pt, slope

    views = st.config.transposed_views
    (pt, slope), dpt = _overlapped(
        (k_smem, _t_view(qt_smem.at[slot], views)),
        (v_smem, _t_view(dot_smem.at[slot], views)),
        (shape, shape),
        probabilities_then_dv,
        left_running=1,
    )
    dst = _times_slope(st, pt * (dpt - _cols(delta_smem.at[slot][...], shape)), slope)
    if fused is None:
        plgpu.wgmma(dk_acc, _a_operand(dst, dtype, dst_smem), q_smem.at[slot])
    else:  # dS^T into SMEM for dQ's products, read from there by dK's too unless in registers
        ds_t = dst.astype(dtype)
        staged = fused.stage(ds_t)
        plgpu.wgmma(dk_acc, ds_t if st.config.p_in_registers else staged, q_smem.at[slot])
        fused.add_dq()  # while dK's product runs
    plgpu.wgmma_wait(0)  # before P^T / dS^T and this slot are overwritten


@dataclasses.dataclass(frozen=True)
class _FusedDq:
    """One dK/dV step's share of dQ (`fused_dq`), for compute warpgroup `wg` (0 or 1).

    dQ^T[rows] = K^T[rows] dS^T over the program's 128 keys: each warpgroup takes about
    half the head dim's rows (`add_dq`), both warpgroups' dS^T (`pair_ds_t.at[parity]`)
    and both halves of K^T (`kt_of(half, rows)`: `[rows, 64 keys]`), and adds its float32
    share to `dest(first row, rows)` by a TMA reduction (interpreted: a plain copy to the
    program's own buffer).
    """

    st: _Static
    wg: Any
    parity: Any
    pair_ds_t: Any
    dq_stage: Any
    kt_of: Any
    dest: Any
    pair_bar: Any

    def stage(self, ds_t):
        """This warpgroup's dS^T into the pair's SMEM: dQ's right operand."""
        part = self.pair_ds_t.at[self.parity, self.wg]
        part[...] = ds_t
        plgpu.commit_smem()
        return part

    def add_dq(self):
        _meet(self.pair_bar, self.parity)  # both warpgroups' dS^T are in SMEM
        d = self.st.d
        lead = _fused_dq_rows(d)
        if d == 2 * lead:
            self._add_rows(self.wg * lead, lead)
            return
        # An odd count of 64-row blocks: the extra one goes to the warpgroup whose turn
        # it is (step parity), so that over two steps both do the same work.
        leads = self.wg == self.parity
        pl.when(leads)(lambda: self._add_rows(0, lead))
        if d > lead:
            pl.when(jnp.logical_not(leads))(lambda: self._add_rows(lead, d - lead))

    def _add_rows(self, r0, m):
        """dQ^T's rows r0 .. r0 + m: their products, then their TMA reduction."""

        def product(acc):
            for half in range(2):
                kt = self.kt_of(half, pl.ds(r0, m))
                plgpu.wgmma(acc, kt, self.pair_ds_t.at[self.parity, half])
            plgpu.wgmma_wait(0)
            return acc[...]

        dq_t = pl.run_scoped(product, ACC((m, self.st.config.block_q_dkv), jnp.float32))
        stage = self.dq_stage.at[self.wg, pl.ds(0, m)]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's is read
        stage[...] = dq_t
        plgpu.commit_smem()
        reduce = None if self.st.config.interpret else "add"
        plgpu.copy_smem_to_gmem(stage, self.dest(r0, m), reduction_op=reduce)


def _meet(pair_bar, parity):
    """Both compute warpgroups got here: a named barrier, or (interpreted) `pair_bar`."""
    if pair_bar is None:
        named_barrier("sync", _PAIR_BARRIER, shared=True)
    else:
        plgpu.barrier_arrive(pair_bar.at[parity])
        plgpu.barrier_wait(pair_bar.at[parity])


def _fused_dq_rows(d: int) -> int:
    """dQ^T's rows that one warpgroup adds at most: half the 64-row blocks, rounded up."""
    return _WG_ROWS * -(-d // (2 * _WG_ROWS))


@dataclasses.dataclass(frozen=True)
class _Ring:
    """A backward kernel's per-step operand buffers.

    `buffers[k].at[slot]` is filled by TMA with completion barrier `bars.at[k * stages +
    slot]`. With `free` (two compute warpgroups) each compute warpgroup releases a slot on
    `free.at[slot]`.
    """

    buffers: tuple
    bars: Any
    stages: int
    free: Any = None

    def issue(self, views, slot):
        for k, (src, dst) in enumerate(zip(views, self.buffers)):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], self.bars.at[k * self.stages + slot])

    def wait(self, slot):
        for k in range(len(self.buffers)):
            plgpu.barrier_wait(self.bars.at[k * self.stages + slot])


def _step_views(views_of, lo, count, n):
    """Step n's operands, `views_of(member, tile)`, in a program over tiles lo + [0, count).

    It takes each member's tiles in turn: member n // count, tile lo + n % count.
    """
    per_member = jnp.maximum(count, 1)
    return views_of(lax.div(n, per_member), lo + lax.rem(n, per_member))


def _backward_program(
    ring: _Ring, ranges, views_of, compute, memory_registers: int, members: int = 1
):
    """Drive one backward program over the tiles of `ranges` (`_flash.tile_loop`).

    `compute(loop, wg)` holds the accumulators and calls `loop(step)`, which runs
    `step(g, i, n, slot, masked)` for every member g (of `members`, e.g. the query heads
    sharing a KV head) and tile i, the program's step n, with their operands
    (`views_of(g, i)`) in ring slot `slot`. Without `ring.free` one warpgroup (wg None)
    prefetches the next step's operands before computing the current one; with it,
    warpgroups 0 and 1 compute while warpgroup 2 streams the operands through the ring
    (`tma_ring`), `memory_registers` a thread for the latter (FA3's split).
    """
    lo, stages = ranges[0], ring.stages
    count = ranges[3] - lo
    steps = members * count

    def views_at(n):
        return _step_views(views_of, lo, count, n)

    def loop_with(before, after):
        def loop(step):
            def member(g, carry):
                def body(i, carry, masked):
                    n = g * count + i - lo
                    slot = lax.rem(n, stages)
                    before(n, slot)
                    step(g, i, n, slot, masked)
                    after(n, slot)
                    return carry

                return _flash.tile_loop(ranges, body, carry)

            if members == 1:
                member(0, None)
            else:
                lax.fori_loop(0, members, member, None)

        return loop

    def run(wg, before, after):
        compute(loop_with(before, after), wg)

    _fed(ring, steps, views_at, lambda n: lax.rem(n, stages), run, memory_registers)


def _fed(ring: _Ring, loads, views_at, slot_of, run, memory_registers: int, guarded=False):
    """`run(wg, before, after)` with the ring fed: steps 0 .. loads - 1 in turn.

    `run` calls `before(n, slot)` ahead of step n's products on ring slot `slot` (its
    operands, `views_at(n)`, went to `slot_of(n)`) and `after(n, slot)` once they are
    done. Without `ring.free` one warpgroup (wg None) prefetches step n + 1's operands in
    `before`; with it, warpgroups 0 and 1 run while warpgroup 2 streams the operands
    (`tma_ring`), `memory_registers` a thread (FA3's split). With `guarded`, steps from
    `loads` on reuse the slots already loaded, without waiting or releasing.
    """
    when = (lambda n, body: pl.when(n < loads)(body)) if guarded else (lambda n, body: body())
    if ring.free is None:
        prefetch = prefetching_loop(
            loads,
            lambda n: ring.issue(views_at(n), slot_of(n)),
            lambda n: ring.wait(slot_of(n)),
            ring.stages,
        )
        run(None, lambda n, slot: when(n, lambda: prefetch(n)), lambda n, slot: None)
        return
    warp_specialized(
        lambda wg: run(
            wg,
            lambda n, slot: when(n, lambda: ring.wait(slot)),
            lambda n, slot: when(n, lambda: plgpu.barrier_arrive(ring.free.at[slot])),
        ),
        lambda: tma_ring(
            loads, ring.stages, [(ring.free, lambda n, slot: ring.issue(views_at(n), slot))]
        ),
        memory_registers,
    )


def _own_part(wg):
    """A compute warpgroup's part of a program-wide buffer, and its index among barriers."""
    if wg is None:
        return (lambda buf: buf), (lambda n: n)
    return (lambda buf: buf.at[wg]), (lambda n: 2 * n + wg)


def _dkv_tiles(st: _Static) -> tuple[int, int]:
    """The dK/dV kernel's key tiles and its programs (`key_tiles_dkv` tiles each)."""
    key_tiles = st.kv_pad // st.config.block_k_dkv
    return key_tiles, -(-key_tiles // st.config.key_tiles_dkv)


def _dkv_kernel(*refs, st, rebuild):
    """One dK/dV program: `block_k_dkv` keys of a KV head against each query tile.

    Each query tile of the program's range, of every query head sharing the KV head (GQA:
    their shares add up in the float32 accumulators). 64 keys: one warpgroup; 128: two
    compute warpgroups of 64 keys sharing each query tile, fed by a TMA warpgroup
    (`_backward_program`); with `fused_dq` they also add each step's dQ (`_FusedDq`).
    """
    n_ops = len(st.kinds)
    k_ref, v_ref = refs[2:4]
    sources = (refs[0], refs[1], *refs[4:8])  # Q, Q^T, dO, dO^T, lse, delta
    op_refs = refs[12 : 12 + n_ops]
    cfg = st.config
    views, fused_dq = cfg.transposed_views, cfg.fused_dq
    rest = refs[12 + n_ops :]
    kt_ref: Any = None
    dq_t_ref: Any = None
    if fused_dq:  # K^T's source (`_transposed_source`), dQ^T's float32 accumulator
        kt_ref, dq_t_ref, *rest = rest
    dk_ref, dv_ref, *rest = rest
    if views:  # Q^T and dO^T are views of Q's and dO's tiles
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, bars, *rest = rest
        qt_smem, dot_smem = q_smem, do_smem
        loaded = (q_smem, do_smem, lse_smem, delta_smem)
    else:
        (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar,
         bars, *rest) = rest  # fmt: skip
        loaded = (q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem)
    # P^T's and dS^T's SMEM staging (`_staging`), unless they stay in registers.
    n_staged = 0 if cfg.p_in_registers else 1 if fused_dq else 2
    staging = [None, None]
    staging[:n_staged], rest = rest[len(rest) - n_staged :], rest[: len(rest) - n_staged]
    if fused_dq:
        n_fused = len(_fused_dq_scratch(cfg, st.d, k_smem.dtype))
        fused_bufs, rest = rest[len(rest) - n_fused :], rest[: len(rest) - n_fused]
        pair_ds_t, dq_stage, *fused_bufs = fused_bufs
        kt_smem: Any = None if views else fused_bufs.pop(0)
        pair_bar = fused_bufs[0] if fused_bufs else None
    free, pos = (rest[0], rest[1:]) if cfg.block_k_dkv > _WG_ROWS else (None, rest)
    # Segment ids: the program's own key ids, and a ring of query ids per step.
    kv_pos, q_pos = _positional(st, "kv_pos"), _positional(st, "q_pos")
    own_ids, step_ids = pos[: len(kv_pos)], pos[len(kv_pos) :]
    bq = cfg.block_q_dkv
    key_tiles, programs = _dkv_tiles(st)
    j, kv_h, b = _program(cfg, programs, st.call.kv_heads, st.call.batch, "k")
    groups = st.call.groups
    operands = (q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem)
    ring = _Ring((*loaded, *step_ids), bars, cfg.num_stages, free)
    id_refs = [op_refs[k] for k in q_pos]

    def query_head(g):
        return kv_h * groups + g

    def views_of(g, i):
        return _query_tile_views(sources, id_refs, b, query_head(g), pl.ds(i * bq, bq), views)

    if cfg.key_tiles_dkv > 1:
        _dkv_key_tiles(
            st, rebuild, j, kv_h, b, key_tiles, refs[8:12], (k_ref, v_ref), dk_ref, dv_ref,
            [op_refs[k] for k in kv_pos], (k_smem, v_smem, *own_ids), kv_bar, operands,
            ring, views_of, kv_pos, list(zip(q_pos, step_ids)), staging, op_refs,
        )  # fmt: skip
        return
    ranges = tuple(ref[b, j] for ref in refs[8:12])

    def fused_step(wg, n, i, h):
        if views:
            kt_of = lambda half, rows: k_smem.at[half, :, rows].T  # noqa: E731
        else:
            kt_of = lambda half, rows: kt_smem.at[half, rows]  # noqa: E731
        cols = pl.ds(i * bq, bq)
        if cfg.interpret:  # the program's own buffer (no TMA reductions to interpret)
            dest = lambda r0, m: dq_t_ref.at[b, j, h, pl.ds(r0, m), cols]  # noqa: E731
        else:
            dest = lambda r0, m: dq_t_ref.at[b, h, pl.ds(r0, m), cols]  # noqa: E731
        parity = lax.rem(n, 2)
        return _FusedDq(st, wg, parity, pair_ds_t, dq_stage, kt_of, dest, pair_bar)

    def compute(loop, wg):
        part, bar_of = _own_part(wg)
        key0 = j * cfg.block_k_dkv + (0 if wg is None else wg * _WG_ROWS)
        keys = pl.ds(key0, _WG_ROWS)
        batch_scalars = _scalar_values(st, op_refs, b, None, ("batch",))
        tiles = (
            part(k_smem),
            part(v_smem),
            *(buf if buf is None else part(buf) for buf in staging),
        )
        own = [(k, part(buf)) for k, buf in zip(kv_pos, own_ids)]

        @pl.when(ranges[3] > ranges[0])
        def _():
            copies = [(k_ref.at[b, keys, kv_h], tiles[0]), (v_ref.at[b, keys, kv_h], tiles[1])]
            copies += [(op_refs[k].at[b, keys], buf) for k, buf in own]
            if fused_dq and not views:
                copies.append((kt_ref.at[b, kv_h, :, keys], part(kt_smem)))
            for n, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, kv_bar.at[bar_of(n)])
            for n in range(len(copies)):
                plgpu.barrier_wait(kv_bar.at[bar_of(n)])

        step = list(zip(q_pos, step_ids))

        def accumulate(*accs):
            def member_step(g, i, n, slot, masked):
                h = query_head(g)
                scalars = {**batch_scalars, **_scalar_values(st, op_refs, b, h, ("head",))}
                fused = fused_step(wg, n, i, h) if fused_dq else None
                _dkv_step(st, rebuild, scalars, h, b, i, key0, own, step, operands, slot, tiles,
                          accs, masked, fused)  # fmt: skip

            loop(member_step)
            return tuple(acc[...] for acc in accs)

        accs = ACC((_WG_ROWS, st.d), jnp.float32), ACC((_WG_ROWS, st.dv), jnp.float32)
        dk, dv = pl.run_scoped(accumulate, *accs)
        if fused_dq:  # the other warpgroup's last dQ products have read this one's K
            _meet(pair_bar, lax.rem(groups * (ranges[3] - ranges[0]), 2))
        # K and V are no longer needed: their buffers stage the outputs.
        _store((dk, tiles[0], dk_ref.at[b, keys, kv_h]), (dv, tiles[1], dv_ref.at[b, keys, kv_h]))

    _backward_program(
        ring, ranges, views_of, compute, st.config.backward_memory_registers, members=groups
    )


def _dkv_key_tiles(
    st, rebuild, p, kv_h, b, key_tiles, range_refs, kv_refs, dk_ref, dv_ref, own_refs,
    own_bufs, kv_bar, operands, ring, views_of, kv_pos, step, staging, op_refs,
):  # fmt: skip
    """A dK/dV program over `key_tiles_dkv` key tiles in turn (`p`: its rank).

    Each compute warpgroup (one, or two of 64 keys each) loads K, V (and the keys'
    segment ids) of its part of tile t + 1 into the other slot of `own_bufs` while tile t
    computes, once tile t - 1's dK/dV, staged there, have been read out by TMA. Every
    tile loops over the same query tiles (`_over_key_tiles`), so that each step's Q / dO
    tile is the same in every key tile: where a key tile's steps fit the ring they load
    once (`resident`), otherwise the ring streams them on across key tiles (`_fed`).
    """
    cfg, n = st.config, st.config.key_tiles_dkv
    bk, stages, members = cfg.block_k_dkv, cfg.num_stages, st.call.groups
    first = p * n
    here = jnp.minimum(n, key_tiles - first)  # the last program may be short

    def tile_ranges(t):  # every tile's [lo, hi) is the program's (`_over_key_tiles`)
        return tuple(ref[b, first + t] for ref in range_refs)

    lo, _, _, hi = tile_ranges(0)
    count = hi - lo
    per_tile = members * count  # a key tile's steps
    steps = here * per_tile
    resident = per_tile <= stages
    loads = jnp.where(resident, per_tile, steps)

    def within(n_):  # step n_'s place in its key tile
        return lax.rem(n_, jnp.maximum(per_tile, 1))

    def slot_of(n_):
        return lax.rem(jnp.where(resident, within(n_), n_), stages)

    def views_at(n_):  # step n_: those of its place in its key tile
        return _step_views(views_of, lo, count, within(n_))

    n_own = len(own_bufs)
    batch_scalars = _scalar_values(st, op_refs, b, None, ("batch",))

    def compute(wg, before, after):
        part, bar_of = _own_part(wg)
        offset = 0 if wg is None else wg * _WG_ROWS

        def issue_kv(t, slot):
            keys = pl.ds((first + t) * bk + offset, _WG_ROWS)
            sources = (kv_refs[0].at[b, keys, kv_h], kv_refs[1].at[b, keys, kv_h],
                       *(ref.at[b, keys] for ref in own_refs))  # fmt: skip
            for c, (src, buf) in enumerate(zip(sources, own_bufs)):
                plgpu.copy_gmem_to_smem(
                    src, part(buf.at[slot]), kv_bar.at[bar_of(slot * n_own + c)]
                )

        pl.when(steps > 0)(lambda: issue_kv(0, 0))

        @pl.loop(0, here)
        def _(t):
            slot = lax.rem(t, 2)

            @pl.when(jnp.logical_and(steps > 0, t + 1 < here))
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile t - 1's dK/dV are out
                issue_kv(t + 1, 1 - slot)

            @pl.when(steps > 0)
            def _():
                for c in range(n_own):
                    plgpu.barrier_wait(kv_bar.at[bar_of(slot * n_own + c)])

            key0 = (first + t) * bk + offset
            k_tile, v_tile, *ids = (part(buf.at[slot]) for buf in own_bufs)
            tiles = (k_tile, v_tile, *(buf if buf is None else part(buf) for buf in staging))
            own = list(zip(kv_pos, ids))
            ranges = tile_ranges(t)

            def accumulate(*accs):
                def member(g, carry):
                    def body(i, carry, masked):
                        n_ = t * per_tile + g * count + i - lo
                        slot_n = slot_of(n_)
                        before(n_, slot_n)
                        h = kv_h * members + g
                        scalars = {**batch_scalars, **_scalar_values(st, op_refs, b, h, ("head",))}
                        _dkv_step(st, rebuild, scalars, h, b, i, key0, own, step, operands,
                                  slot_n, tiles, accs, masked)  # fmt: skip
                        after(n_, slot_n)
                        return carry

                    return _flash.tile_loop(ranges, body, carry)

                lax.fori_loop(0, members, member, None)
                return tuple(acc[...] for acc in accs)

            accs = ACC((_WG_ROWS, st.d), jnp.float32), ACC((_WG_ROWS, st.dv), jnp.float32)
            dk, dv = pl.run_scoped(accumulate, *accs)
            keys = pl.ds(key0, _WG_ROWS)  # K and V are spent: dK and dV leave from there
            _store((dk, k_tile, dk_ref.at[b, keys, kv_h]), (dv, v_tile, dv_ref.at[b, keys, kv_h]),
                   wait=False)  # fmt: skip

        plgpu.wait_smem_to_gmem(0)

    _fed(ring, loads, views_at, slot_of, compute, cfg.backward_memory_registers, guarded=True)


def _over_key_tiles(ranges, n: int):
    """dK/dV ranges (`[batch, key tile]` arrays) for programs of n key tiles in turn.

    Each tile's `[lo, hi)` becomes the union of its program's non-empty ranges, so that
    every tile of a program steps through the same query tiles (`_dkv_key_tiles`); its
    full range is clipped into it, the tiles it leaves out evaluating the mask. Numpy
    ranges (unmasked calls) stay numpy constants.
    """
    xp = np if all(isinstance(x, np.ndarray) for x in ranges) else jnp
    lo, full_lo, full_hi, hi = ranges
    batch, tiles = lo.shape
    pad = -(-tiles // n) * n - tiles
    big = np.iinfo(np.int32).max

    def per_program(x, fill, reduce):  # reduce over each program's tiles, for each tile
        x = xp.pad(x, ((0, 0), (0, pad)), constant_values=fill).reshape(batch, -1, n)
        return xp.repeat(reduce(x, axis=2), n, axis=1)[:, :tiles]

    some = hi > lo
    union_hi = per_program(xp.where(some, hi, 0), 0, xp.max)
    union_lo = xp.minimum(per_program(xp.where(some, lo, big), big, xp.min), union_hi)
    full_lo = xp.clip(full_lo, union_lo, union_hi)
    full_hi = xp.clip(full_hi, full_lo, union_hi)
    return tuple(x.astype(np.int32) for x in (union_lo, full_lo, full_hi, union_hi))


def _key_tile_views(refs, id_refs, b, kv_h, keys, views: bool):
    """A dQ step's GMEM operands, in the order of the kernels' rings.

    Key tile `keys` of K^T, K, V^T and the key-side segment ids; with `views` (transposed
    views in SMEM) of K and V, which `refs` then holds in K^T's and V^T's places.
    """
    kt_ref, k_ref, vt_ref = refs
    if views:
        tiles = (k_ref.at[b, keys, kv_h], vt_ref.at[b, keys, kv_h])
    else:
        tiles = (kt_ref.at[b, kv_h, :, keys], k_ref.at[b, keys, kv_h],
                 vt_ref.at[b, kv_h, :, keys])  # fmt: skip
    return (*tiles, *(ref.at[b, keys] for ref in id_refs))


def _row_tile_views(refs, id_refs, b, h, rows):
    """A dQ program's own GMEM operands: its rows of Q, dO, lse, delta and query ids."""
    q_ref, do_ref, lse_ref, delta_ref = refs
    return (q_ref.at[b, rows, h], do_ref.at[b, rows, h], lse_ref.at[b, h, rows],
            delta_ref.at[b, h, rows], *(ref.at[b, rows] for ref in id_refs))  # fmt: skip


def _dq_step(st, rebuild, scalars, h, b, j, row0, own, step, ring, slot, tiles, dq_acc, masked):
    """Add key tile `j`'s share to a warpgroup's dQ accumulator (64 rows from row0).

    `h`, `b`: the query head and batch element; `ring`: K^T, K, V^T buffers; `tiles`: the
    rows' Q, dO, lse, delta and dS staging buffers; `own` / `step`: segment-id buffers
    of the rows / the ring.
    """
    kt_smem, k_smem, vt_smem = ring
    q_smem, do_smem, lse_smem, delta_smem, ds_smem = tiles
    bk = st.config.block_k_dq
    shape = (_WG_ROWS, bk)

    def positions():
        q_idx = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        return q_idx, j * bk + lax.broadcasted_iota(jnp.int32, shape, 1)

    def probabilities(raw):  # while dP runs
        s, slope = _backward_scores(
            st, rebuild, scalars, raw, h, b, positions, masked, (own, step), slot
        )
        return jnp.exp2(s - _rows(lse_smem[...], shape)), slope

    views = st.config.transposed_views
    (p, slope), dp = _overlapped(
        (q_smem, _t_view(kt_smem.at[slot], views)),
        (do_smem, _t_view(vt_smem.at[slot], views)),
        (shape, shape),
        probabilities,
    )
    ds = _times_slope(st, p * (dp - _rows(delta_smem[...], shape)), slope)
    plgpu.wgmma(dq_acc, _a_operand(ds, k_smem.dtype, ds_smem), k_smem.at[slot])
    plgpu.wgmma_wait(0)


def _dq_kernel(*refs, st, rebuild):
    """One dQ program: `block_q_dq` query rows against each key tile of its range.

    64 rows: one warpgroup; 128: two compute warpgroups of 64 rows sharing each key tile,
    fed by a TMA warpgroup (`_backward_program`).
    """
    n_ops = len(st.kinds)
    sources = refs[4:7]  # K^T, K, V^T, or with views K, K, V (refs[:4]: Q, dO, lse, delta)
    op_refs = refs[11 : 11 + n_ops]
    dq_ref = refs[11 + n_ops]
    cfg = st.config
    views = cfg.transposed_views
    if views:  # K^T and V^T are views of K's and V's tiles
        (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_bar, bars,
         *rest) = refs[12 + n_ops :]  # fmt: skip
        kt_smem, vt_smem = k_smem, v_smem
        loaded = (k_smem, v_smem)
    else:
        (q_smem, do_smem, lse_smem, delta_smem, kt_smem, k_smem, vt_smem, q_bar, bars,
         *rest) = refs[12 + n_ops :]  # fmt: skip
        loaded = (kt_smem, k_smem, vt_smem)
    # dS's SMEM staging (`_staging`), unless it stays in registers.
    ds_smem, rest = (rest[-1], rest[:-1]) if not cfg.p_in_registers else (None, rest)
    free, pos = (rest[0], rest[1:]) if cfg.block_q_dq > _WG_ROWS else (None, rest)
    # Segment ids: the program's own query ids, and a ring of key ids per step.
    q_pos, kv_pos = _positional(st, "q_pos"), _positional(st, "kv_pos")
    own_ids, step_ids = pos[: len(q_pos)], pos[len(q_pos) :]
    bk = cfg.block_k_dq
    tiles = st.q_pad // cfg.block_q_dq
    rank, h, b = _program(cfg, tiles, st.call.q_heads, st.call.batch, "q")
    i = _flash.last_first(rank, tiles)
    kv_h = lax.div(h, jnp.int32(st.call.groups))
    ranges = tuple(ref[b, i] for ref in refs[7:11])
    operands = (kt_smem, k_smem, vt_smem)
    ring = _Ring((*loaded, *step_ids), bars, cfg.num_stages, free)
    id_refs = [op_refs[k] for k in kv_pos]

    def views_of(_, j):
        return _key_tile_views(sources, id_refs, b, kv_h, pl.ds(j * bk, bk), views)

    def compute(loop, wg):
        part, bar_of = _own_part(wg)
        row0 = i * cfg.block_q_dq + (0 if wg is None else wg * _WG_ROWS)
        rows = pl.ds(row0, _WG_ROWS)
        scalars = _scalar_values(st, op_refs, b, h)
        loaded = tuple(part(buf) for buf in (q_smem, do_smem, lse_smem, delta_smem))
        tiles = (*loaded, None if ds_smem is None else part(ds_smem))
        own = [(k, part(buf)) for k, buf in zip(q_pos, own_ids)]
        own_views = _row_tile_views(refs[:4], [op_refs[k] for k in q_pos], b, h, rows)
        copies = list(zip(own_views, (*loaded, *(buf for _, buf in own))))
        for n, (src, dst) in enumerate(copies):
            plgpu.copy_gmem_to_smem(src, dst, q_bar.at[bar_of(n)])
        for n in range(len(copies)):
            plgpu.barrier_wait(q_bar.at[bar_of(n)])
        step = list(zip(kv_pos, step_ids))

        def accumulate(dq_acc):
            loop(lambda _, j, n, slot, masked: _dq_step(
                st, rebuild, scalars, h, b, j, row0, own, step, operands, slot, tiles, dq_acc,
                masked,
            ))  # fmt: skip
            return dq_acc[...]

        dq = pl.run_scoped(accumulate, ACC((_WG_ROWS, st.d), jnp.float32))
        _store((dq, tiles[0], dq_ref.at[b, rows, h]))  # Q's buffer stages dQ

    _backward_program(ring, ranges, views_of, compute, st.config.backward_memory_registers)


def _transposed_source(x, cfg: MosaicAttentionConfig):
    """What a kernel reads X^T's tiles from.

    X itself, whose SMEM tiles it views transposed (`transposed_views`), or an XLA copy
    `[batch, heads, dim, seq]`.
    """
    return x if cfg.transposed_views else jnp.transpose(x, (0, 2, 3, 1))


def _backward(st: _Static, rebuild, q, k, v, o, lse, do, dq_ranges, dkv_ranges, operands):
    cfg = st.config
    batch, _, heads, _ = q.shape
    kv_heads, dtype = k.shape[2], q.dtype
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    t = functools.partial(_transposed_source, cfg=cfg)
    interpret = InterpretGPUParams() if cfg.interpret else None
    n_q_pos, n_kv_pos = len(_positional(st, "q_pos")), len(_positional(st, "kv_pos"))
    bk = cfg.block_k_dkv
    wgs = bk // _WG_ROWS
    out_type = (
        jax.ShapeDtypeStruct((batch, st.kv_pad, kv_heads, st.d), dtype),
        jax.ShapeDtypeStruct((batch, st.kv_pad, kv_heads, st.dv), dtype),
    )
    scratch = _dkv_scratch(cfg, st.d, st.dv, dtype, n_q_pos, n_kv_pos)
    grid, grid_names = _grid(cfg, _dkv_tiles(st)[1], kv_heads, batch, "k")
    num_threads, thread_name = (3, "wg") if wgs > 1 else (None, None)
    inputs = (q, t(q), k, v, do, t(do), lse, delta, *dkv_ranges, *operands)
    dkv_kernel = functools.partial(_dkv_kernel, st=st, rebuild=rebuild)
    if cfg.fused_dq:
        # dQ^T in float32, `[batch, heads, d, q]`; interpreted, one per dK/dV program.
        programs = (st.kv_pad // bk,) if cfg.interpret else ()
        accumulator = jax.ShapeDtypeStruct((batch, *programs, heads, st.d, st.q_pad), jnp.float32)
        dk, dv, dq_t = accumulating_kernel(
            dkv_kernel, out_type=out_type, accumulator=accumulator, scratch_types=scratch,
            grid=grid, grid_names=grid_names, num_threads=num_threads, thread_name=thread_name,
            compiler_params=_compiler_params(cfg), interpret=interpret,
        )(*inputs, t(k))  # fmt: skip
        if cfg.interpret:
            dq_t = dq_t.sum(axis=1)
        dq = jnp.transpose(dq_t, (0, 3, 1, 2)).astype(dtype)
    else:
        dk, dv = plgpu.kernel(
            dkv_kernel, out_type=out_type, scratch_types=scratch, grid=grid,
            grid_names=grid_names, num_threads=num_threads, thread_name=thread_name,
            compiler_params=_compiler_params(cfg), interpret=interpret,
        )(*inputs)  # fmt: skip
        bq = cfg.block_q_dq
        wgs = bq // _WG_ROWS
        grid, grid_names = _grid(cfg, st.q_pad // bq, heads, batch, "q")
        dq = plgpu.kernel(
            functools.partial(_dq_kernel, st=st, rebuild=rebuild),
            out_type=jax.ShapeDtypeStruct(q.shape, dtype),
            scratch_types=_dq_scratch(cfg, st.d, st.dv, dtype, n_q_pos, n_kv_pos),
            grid=grid,
            grid_names=grid_names,
            num_threads=3 if wgs > 1 else None,
            thread_name="wg" if wgs > 1 else None,
            compiler_params=_compiler_params(cfg),
            interpret=interpret,
        )(q, do, lse, delta, t(k), k, t(v), *dq_ranges, *operands)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def flash_attention(
    q, k, v, *, mask, score_mod, scale: float, config: MosaicAttentionConfig, plan=None
):
    """Mosaic GPU flash attention of `[batch, seq, heads, dim]` operands (module docstring).

    `plan(q, k, v, mask, score_mod) -> config`: the config at other shapes (a batch that
    `vmap` folds in, `_flash.attend`); without it, `config` at every shape. A config's
    `split_kv_forward` (unmasked calls, `_split_kv_rule`) runs the forward half, its
    `cudnn_backward` (`_cudnn_backward_rule`) the backward half.
    """

    def planned(q, k, v, mask, score_mod) -> MosaicAttentionConfig:
        return config if plan is None else plan(q, k, v, mask, score_mod)

    def forward(q, k, v, mask, score_mod):
        cfg = planned(q, k, v, mask, score_mod)
        if cfg.split_kv_forward is not None:
            return TritonAttention().blocks(q, k, v, mask=None, scale=scale,
                                            config=cfg.split_kv_forward)  # fmt: skip
        return kernels(q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=cfg)

    def backward(q, k, v, mask, score_mod):
        cfg = dataclasses.replace(planned(q, k, v, mask, score_mod), split_kv_forward=None)
        if cfg.cudnn_backward:
            return CudnnBackward(scale, any(isinstance(t, Causal) for t in conjuncts(mask)))
        return kernels(q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=cfg)

    return _flash.run_call(forward, backward, q, k, v, mask, score_mod)


def _split_kv_rule(call: AttentionCall, device: DeviceInfo, triton: TritonAttentionConfig):
    """Why a `split_kv_forward` of config `triton` cannot run `call`, or None."""
    if call.mask_terms or call.score_mod is not None:
        return (
            "split_kv_forward joins two kernel families by the log-sum-exp of an unmasked "
            "call: no masks or score mods"
        )
    why = TritonAttention().check(call, device, triton)
    return None if why is None else f"split_kv_forward's Triton forward: {why}"


def kernels(q, k, v, *, mask, score_mod, scale: float, config: MosaicAttentionConfig):
    """The `_flash.FlashKernels` of one call."""
    call = AttentionCall.from_args(q.shape, k.shape, v.shape, q.dtype, mask, score_mod)
    if score_mod is not None and (why := _score_mod_rule(call)):
        raise ValueError(why)
    cfg = config
    d, dv = _dims(call)
    q_pad = _round_up(call.q_len, max(2 * cfg.block_q, cfg.block_q_dkv, cfg.block_q_dq))
    kv_pad = _round_up(call.kv_len, max(cfg.block_k, cfg.block_k_dkv, cfg.block_k_dq))
    ops, kinds, rebuild = _tiles.split(
        mask, batch=call.batch, heads=call.q_heads, q_pad=q_pad, kv_pad=kv_pad
    )
    st = _Static(call, cfg, scale, q_pad, kv_pad, d, dv, tuple(kinds), score_mod)
    ranges = _flash.tile_ranges(
        st.ctx,
        mask,
        q_pad,
        kv_pad,
        fwd=(2 * cfg.block_q, cfg.block_k),
        dq=(cfg.block_q_dq, cfg.block_k_dq),
        dkv=(cfg.block_k_dkv, cfg.block_q_dkv),
    )
    if cfg.key_tiles_dkv > 1:
        ranges = {**ranges, "dkv": _over_key_tiles(ranges["dkv"], cfg.key_tiles_dkv)}

    def interpreted(fn):
        """After a failed interpreted kernel the interpreter's state must be reset."""

        def run(*args):
            try:
                return fn(*args)
            except Exception:
                if cfg.interpret:
                    reset_gpu_interpret_mode_state()
                raise

        return run

    @interpreted
    def forward(qp, kp, vp, fwd_ranges, operands):
        return _forward(st, rebuild, qp, kp, vp, fwd_ranges, operands)

    @interpreted
    def backward(qp, kp, vp, o, lse, do, ranges, operands):
        grads = _backward(
            st, rebuild, qp, kp, vp, o, lse, do, ranges["dq"], ranges["dkv"], operands
        )
        return (*grads, (None,) * len(operands))

    return _flash.FlashKernels(forward, backward, ranges, tuple(ops), q_pad, kv_pad, d, dv)


def _kernel_rule(call: AttentionCall) -> str | None:
    for term in call.mask_terms:
        for name in _tiles.spec_names(term):
            if name in _NOT_IN_KERNEL:
                return _NOT_IN_KERNEL[name]
    if call.score_mod is not None and (why := _score_mod_rule(call)):
        return why
    need = max(_smem_need(call, MosaicAttentionConfig(block_k=64)).values())
    if need > SMEM_LIMIT:
        return f"head dims {call.qk_dim}/{call.v_dim} need {need} bytes of shared memory"
    return None


_NOT_IN_KERNEL = {
    "dense": "a dense mask cannot be evaluated per tile",
    "mask_fn": "MaskFn is not in the Mosaic kernel yet; use implementation='triton'",
}
# Score mods the kernel evaluates: array-free ones whose JAX ops Mosaic GPU lowers
# (tanh). The kernel closes over them; it has no operands or gradients for parameters.
_SCORE_MODS = frozenset({"softcap", "compose"})


def _score_mod_rule(call: AttentionCall) -> str | None:
    others = sorted(set(_tiles.spec_names(call.score_mod)) - _SCORE_MODS)
    if others:
        return (
            f"score mods {others} are not in the Mosaic kernel (it takes SoftCap and "
            "compositions of it); use implementation='triton'"
        )
    return None


@dataclasses.dataclass(frozen=True)
class MosaicAttention:
    """The `"mosaic"` implementation: our Pallas Mosaic GPU kernels (Hopper, 16-bit)."""

    name: str = "mosaic"
    capabilities: AttentionCapabilities = AttentionCapabilities(
        dtypes=frozenset({"bfloat16", "float16"}),
        platforms=frozenset({"gpu", "cpu"}),
        min_compute_capability="sm_90",
        max_head_dim=256,
        extra=(_kernel_rule,),
    )

    # `__call__` takes `plan`: under `vmap` its kernels plan for the folded batch.
    plans_per_batch: ClassVar[bool] = True

    def check(self, call: AttentionCall, device: DeviceInfo, config=None) -> str | None:
        why = _flash.check_pallas(
            "mosaic", MosaicAttentionConfig, config, device, "Mosaic GPU needs an sm_90 GPU"
        )
        if why is None:
            why = self.capabilities.check(call, device)
        if why is None and device.is_gpu and device.compute_capability != "sm_90":
            why = f"wgmma and TMA need sm_90, device has {device.compute_capability}"
        if why is None and config is not None:
            why = smem_refusal(_smem_need(call, config))
        if why is None and config is not None and config.split_kv_forward is not None:
            why = _split_kv_rule(call, device, config.split_kv_forward)
        if why is None and config is not None and config.cudnn_backward:
            why = _cudnn_backward_rule(call, device)
        return why

    def default_config(self, call: AttentionCall, device: DeviceInfo) -> MosaicAttentionConfig:
        return default_config(call, device)

    def joined_halves(self, config: MosaicAttentionConfig) -> str:
        """The half `config` takes from another kernel family, for `Choice.reason`."""
        forward, backward = config.halves
        if forward != self.name:
            return "its forward from the split-KV Triton kernel (split_kv_forward)"
        if backward != self.name:
            return "its backward from cuDNN's, given this forward's output (cudnn_backward)"
        return ""

    def auto_config(self, call: AttentionCall, device: DeviceInfo) -> MosaicAttentionConfig:
        return auto_config(call, device)

    def __call__(self, q, k, v, *, mask, score_mod, scale, config: MosaicAttentionConfig,
                 plan=None):  # fmt: skip
        return flash_attention(
            q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=config, plan=plan
        )

    def blocks(self, q, k, v, *, mask, scale, config: MosaicAttentionConfig):
        """Forward-with-lse and backward-given-lse halves (`_flash.FlashKernels`)."""
        return kernels(q, k, v, mask=mask, score_mod=None, scale=scale, config=config)
