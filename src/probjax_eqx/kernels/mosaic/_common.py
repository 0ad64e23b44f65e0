"""Building blocks shared by our Mosaic GPU kernels."""

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled(shape, dtype):
    """A shared-memory buffer in the 128-byte-swizzled tiling that TMA and wgmma share."""
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    )


def prefetching_loop(count, issue, wait):
    """Issue step 0's copies now; `prefetch(n)` issues step n + 1's, then waits for step n.

    `issue(n)` starts step n's TMA copies into slot `n % stages`; `wait(n)` waits on them.
    A step's slot is reused two steps later, after that step's wgmma has completed.
    """

    @pl.when(count > 0)
    def _():
        issue(0)

    def prefetch(n):
        @pl.when(n + 1 < count)
        def _():
            issue(n + 1)

        wait(n)

    return prefetch
