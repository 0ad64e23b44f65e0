"""The one place that imports Mosaic GPU names that moved or are private across jax versions.

jax 0.10 has the interpreter only under `jax._src`; 0.11 exports it. Both keep
`reset_gpu_interpret_mode_state` private: it must run after a failed interpreted kernel,
or the next one trips over stale shared-memory state. Code inlined into a kernel through
`plgpu.inline_mgpu` builds MLIR with jaxlib's private `ir` and dialect modules.
`accumulating_kernel` holds a mutable ref in `run_state`.
"""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

try:  # public since jax 0.11
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # pyright: ignore
except ImportError:  # jax 0.10
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

try:
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        reset_gpu_interpret_mode_state,
    )
except ImportError:  # pragma: no cover - only matters after an interpreter failure

    def reset_gpu_interpret_mode_state():
        pass


try:  # public in jax 0.10; private fallbacks in case a later version drops them
    from jax.experimental.pallas import run_state
except ImportError:  # pragma: no cover
    from jax._src.state.discharge import run_state

from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]
from jax._src.lib.mlir.dialects import arith, llvm  # pyright: ignore[reportPrivateImportUsage]
from jax.experimental.mosaic.gpu import utils as mgpu_utils

JAX_011 = jax.__version_info__ >= (0, 11)
ACC = plgpu.ACC  # pyright: ignore[reportPrivateImportUsage] - public, but not in __all__
# The default lowering semantics changed between versions: always name it. Our reductions
# run along a wgmma accumulator's rows (lane shuffles within a warp), so no shared memory
# is set aside for cross-warp ones (2 KiB by default, which `scratch_bytes` cannot see).
COMPILER_PARAMS = plgpu.CompilerParams(
    lowering_semantics=plgpu.LoweringSemantics.Warpgroup, reduction_scratch_bytes=0
)

__all__ = [
    "ACC",
    "COMPILER_PARAMS",
    "JAX_011",
    "InterpretGPUParams",
    "arith",
    "ir",
    "llvm",
    "mgpu_utils",
    "reset_gpu_interpret_mode_state",
    "run_state",
]
