"""The one place for comparison tolerances, per input dtype and for TF32 matmuls.

Forward tolerances are for outputs whose magnitude is O(1); gradients get twice as much
(they accumulate over a sequence). The oracle is the float32 `HIGHEST` reference.
"""

import jax.numpy as jnp
import numpy as np

_FORWARD = {
    "float32": (2e-5, 2e-5),
    "tf32": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "float16": (2e-3, 2e-3),
}


def tolerance(dtype, *, grad: bool = False, tf32: bool = False) -> dict[str, float]:
    """`dict(atol=..., rtol=...)` for comparing results computed in `dtype`."""
    name = "tf32" if tf32 and jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype).name
    atol, rtol = _FORWARD[name]
    scale = 2.0 if grad else 1.0
    return {"atol": atol * scale, "rtol": rtol * scale}


def assert_close(actual, expected, dtype, *, grad: bool = False, tf32: bool = False, err_msg=""):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32),
        np.asarray(expected, np.float32),
        **tolerance(dtype, grad=grad, tf32=tf32),
        err_msg=err_msg,
    )
