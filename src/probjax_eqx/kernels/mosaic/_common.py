"""Building blocks shared by our Mosaic GPU kernels."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import custom_batching, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from probjax_eqx.kernels.mosaic._compat import (
    COMPILER_PARAMS,
    arith,
    ir,  # pyright: ignore[reportPrivateImportUsage]
    llvm,
    mgpu_utils,
    run_state,
)

_REGISTER_FILE = 65536  # 32-bit registers per SM (and per block) on sm_90
_WG_THREADS = 128
MEMORY_REGISTERS = 40  # per thread of a warpgroup that only issues TMA copies
SMEM_LIMIT = 227 * 1024  # sm_90 per-block opt-in maximum of shared memory
_SMEM_ALIGNMENT = 1024  # Pallas Mosaic GPU starts every scratch buffer on a 1 KiB boundary
_BARRIER_BYTES = 8  # one mbarrier
_SWIZZLE_BYTES = 128


def scratch_bytes(scratch) -> int:
    """Shared memory of a `plgpu.kernel`'s scratch list, laid out as Pallas lays it out."""
    total = 0
    for ref in scratch:
        if isinstance(ref, plgpu.Barrier):
            n = ref.num_barriers  # a shape tuple in jax 0.10, an int in later versions
            total += _BARRIER_BYTES * (n if isinstance(n, int) else math.prod(n))
        else:
            size = math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
            total += -(-size // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT
    return total


def smem_refusal(need: dict[str, int]) -> str | None:
    """Why a config cannot run: the kernels (of `need`, bytes each) over `SMEM_LIMIT`."""
    over = {kernel: n for kernel, n in need.items() if n > SMEM_LIMIT}
    return f"config needs {over} bytes of shared memory, over {SMEM_LIMIT}" if over else None


def compute_registers(memory_registers: int, compute_warpgroups: int = 2) -> int:
    """Registers per thread of each compute warpgroup (`setmaxnreg`, FA3's split).

    The TMA warpgroup keeps `memory_registers`; the compute warpgroups share the rest of
    the register file (a multiple of 8, at most 256). Without the split each of three
    warpgroups gets an equal 168.
    """
    share = (_REGISTER_FILE // _WG_THREADS - memory_registers) // compute_warpgroups
    return min(256, share // 8 * 8)


def warp_specialized(compute, feed, memory_registers: int | None = MEMORY_REGISTERS):
    """Run `compute(wg)` on warpgroups 0 and 1 and `feed()` on warpgroup 2 (TMA copies).

    With `memory_registers`, FA3's register split (`compute_registers`); None keeps the
    even split.
    """
    wg = lax.axis_index("wg")

    @pl.when(wg < 2)
    def _compute():
        if memory_registers is not None:
            plgpu.set_max_registers(compute_registers(memory_registers), action="increase")
        compute(wg)

    @pl.when(wg == 2)
    def _feed():
        if memory_registers is not None:
            plgpu.set_max_registers(memory_registers, action="decrease")
        feed()


def named_barrier(
    instruction: str, first_id: int, other: bool = False, shared: bool = False
) -> None:
    """`bar.sync` / `bar.arrive` of the two compute warpgroups on a hardware named barrier.

    Warpgroup w (0 or 1) names barrier `first_id + w`, or its partner's with `other`;
    with `shared` both name `first_id`. The barrier completes once both warpgroups (256
    threads) reached it. GPU only: the interpreter runs no inline PTX. Mosaic GPU takes
    barrier 0 and 1 + w for its own.
    """

    @plgpu.inline_mgpu()
    def emit(ctx):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        barrier = mgpu_utils.c(first_id, i32)
        if not shared:
            wg = mgpu_utils.warpgroup_idx(sync=True)
            if other:
                wg = arith.xori(wg, mgpu_utils.c(1, i32))
            barrier = arith.addi(wg, barrier)
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [barrier],
            f"bar.{instruction} $0, {2 * _WG_THREADS};",
            "r",
            has_side_effects=True,
        )

    emit()  # pyright: ignore[reportCallIssue] - inline_mgpu passes the context


def swizzled(shape, dtype):
    """A shared-memory buffer in the 128-byte-swizzled tiling that TMA and wgmma share."""
    row = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize  # elements in one swizzled row
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(plgpu.TilingTransform((8, row)), plgpu.SwizzleTransform(_SWIZZLE_BYTES)),
    )


def prefetching_loop(count, issue, wait, stages: int):
    """Issue step 0's copies now; `prefetch(n)` issues step n + 1's, then waits for step n.

    `issue(n)` starts step n's TMA copies into slot `n % stages`; `wait(n)` waits on them.
    A step's slot is reused two steps later, after that step's wgmma has completed. With
    one slot nothing is prefetched: `prefetch(n)` issues step n's own copies once step n
    - 1's wgmma has completed, then waits for them (step n + 1's copies would overwrite
    the slot step n reads).
    """

    @pl.when(count > 0)
    def _():
        issue(0)

    def prefetch(n):
        if stages == 1:

            @pl.when(n > 0)
            def _():
                issue(n)

        else:

            @pl.when(n + 1 < count)
            def _():
                issue(n + 1)

        wait(n)

    return prefetch


def tma_ring(count, stages: int, parts):
    """A TMA warpgroup's loop feeding `count` steps through a ring of `stages` slots.

    `parts` are `(free, issue)` pairs: `issue(n, slot)` starts step n's copies of that
    part into `slot`; `free` holds the per-slot barriers its consumers arrive on once done
    with the slot. The first `stages` steps go out at once; each later part waits for its
    slot's release (a part released early refills early); the last releases are observed
    too, so every barrier completes its phases.
    """
    for n in range(stages):

        @pl.when(n < count)
        def _(n=n):
            for _, issue in parts:
                issue(n, n)

    @pl.loop(stages, jnp.maximum(count, stages))
    def _(n):
        slot = lax.rem(n, stages)
        for free, issue in parts:
            plgpu.barrier_wait(free.at[slot])
            issue(n, slot)

    @pl.loop(jnp.maximum(count - stages, 0), count)
    def _(n):
        for free, _ in parts:
            plgpu.barrier_wait(free.at[lax.rem(n, stages)])


def accumulating_kernel(
    body,
    *,
    out_type,
    accumulator: jax.ShapeDtypeStruct,
    scratch_types,
    grid,
    grid_names,
    num_threads=None,
    thread_name=None,
    compiler_params=COMPILER_PARAMS,
    interpret=None,
):
    """`plgpu.kernel` with a zero-initialised GMEM `accumulator` that programs add into.

    `body(*inputs, accumulator_ref, *outputs, *scratch)`; programs add their shares with
    `plgpu.copy_smem_to_gmem(..., reduction_op="add")` (TMA reductions in the L2). Returns
    `(*outputs, accumulator)`. On the GPU the accumulator is a mutable ref that the kernel
    call aliases, which `plgpu.kernel` does not take: `pl.kernel` on a `plgpu.Mesh`, the
    ref held by `run_state` (so that no effect leaves `custom_vmap`), batched as
    `plgpu.kernel` batches (a vmapped axis becomes a leading grid axis). Interpreted, a
    `plgpu.kernel` output that the interpreter starts at zero.
    """
    out_type = tuple(out_type)
    if interpret is not None:  # outputs start at zero: the accumulator is the first
        acc_first = plgpu.kernel(
            body, out_type=(accumulator, *out_type), scratch_types=scratch_types, grid=grid,
            grid_names=grid_names, num_threads=num_threads, thread_name=thread_name,
            compiler_params=compiler_params,
            interpret=dataclasses.replace(interpret, uninitialized_memory="zero"),
        )  # fmt: skip
        return lambda *inputs: (*(outs := acc_first(*inputs))[1:], outs[0])
    mesh = plgpu.Mesh(
        grid=grid, grid_names=grid_names, num_threads=num_threads, thread_name=thread_name
    )

    def kernel_body(*refs):
        pl.run_scoped(
            lambda *scratch: body(*refs, *scratch),
            *scratch_types,
            collective_axes=thread_name if thread_name is not None else (),
        )

    def launch(inputs, acc_ref):
        kernel = pl.kernel(
            kernel_body, out_type=out_type, mesh=mesh, compiler_params=compiler_params
        )
        return kernel(*inputs, acc_ref)  # pyright: ignore[reportCallIssue]

    zeros = lambda t: jnp.zeros(t.shape, t.dtype)  # noqa: E731

    @custom_batching.custom_vmap
    def run(*inputs):
        def stateful(refs):
            acc_ref, out_refs = refs
            for ref, value in zip(out_refs, launch(inputs, acc_ref)):
                ref[...] = value

        acc, outs = run_state(stateful)((zeros(accumulator), [zeros(t) for t in out_type]))
        return (*outs, acc)

    @run.def_vmap
    def _batched(axis_size, in_batched, *inputs):
        axis = object()  # a fresh grid axis name, as `plgpu.kernel` batches
        n_in = len(inputs)

        def batched_body(*refs):
            index = lax.axis_index(axis)
            ins = [ref.at[index] if b else ref for ref, b in zip(refs[:n_in], in_batched)]
            n_out = len(out_type) + 1  # the accumulator, then the outputs
            outs = [ref.at[index] for ref in refs[n_in : n_in + n_out]]
            body(*ins, *outs, *refs[n_in + n_out :])

        stacked = lambda t: jax.ShapeDtypeStruct((axis_size, *t.shape), t.dtype)  # noqa: E731
        outs = accumulating_kernel(
            batched_body,
            out_type=[stacked(t) for t in out_type],
            accumulator=stacked(accumulator),
            scratch_types=scratch_types,
            grid=(axis_size, *grid),
            grid_names=(axis, *grid_names),
            num_threads=num_threads,
            thread_name=thread_name,
        )(*inputs)
        return outs, (True,) * len(outs)

    return run
