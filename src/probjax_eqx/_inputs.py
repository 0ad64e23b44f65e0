"""Clear errors where a module's input has the wrong shape.

The modules are unbatched (`jax.vmap` them over a batch): the usual mistake is a batch
axis in front, which otherwise surfaces deep inside as a matmul's or reshape's error.
The checks read static shapes, so they cost nothing at run time.
"""

import jax.numpy as jnp


def check_width(module: str, name: str, x, width: int, *, ranks: tuple[int, ...] = (2,)) -> None:
    """Raise unless `x` has one of `ranks` (1: `[width]`, 2: `[rows, width]`) and width.

    Args:
        module: the module's name, for the message (`"Attention"`).
        name: the argument's name (`"x"`).
        x: the argument.
        width: the size its last axis must have.
        ranks: the numbers of axes it may have.
    """
    shape = jnp.shape(x)
    if len(shape) in ranks and shape and shape[-1] == width:
        return
    forms = " or ".join(f"[rows, {width}]" if r == 2 else f"[{width}]" for r in ranks)
    hint = ""
    if len(shape) == max(ranks) + 1 and shape[-1] == width:
        hint = (
            f"; the leading axis looks like a batch: {module} is unbatched, map it over "
            f"the batch with jax.vmap"
        )
    raise ValueError(f"{module} takes {name} of shape {forms}, got {shape}{hint}")
