"""Sharded parameters and activations on JAX's own sharding (`Mesh`, `NamedSharding`).

Modules are pytrees, so a layout is a pytree of `PartitionSpec`s of the same structure
(`None` for leaves that are not arrays). `jax.jit` then partitions every op, our kernels'
custom VJPs included; the parallel algorithms that need explicit communication live in
`ring_attention` (context parallelism) and `expert_parallel` (MoE experts).

Example:
    ```python
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    model = shard(model, mesh, fsdp_specs(model, mesh, axis="data"))  # FSDP
    batch = jax.device_put(batch, data_parallel(mesh, "data"))        # data parallel
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, batch)        # XLA inserts the
    ```                                                                 # gathers / reductions
"""

from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def fsdp_specs(tree: Any, mesh: Mesh, *, axis: str = "data", min_size: int = 2**14) -> Any:
    """FSDP-style specs: large arrays split over `axis`, the rest replicated.

    Each array of at least `min_size` elements is split along its largest dimension that
    the axis size divides; smaller arrays and arrays with no such dimension get `P()`.
    Non-array leaves get `None`.
    """
    size = mesh.shape[axis]

    def spec(leaf):
        if not eqx.is_array(leaf):
            return None
        if leaf.size < min_size:
            return P()
        dims = [d for d in range(leaf.ndim) if leaf.shape[d] % size == 0]
        if not dims:
            return P()
        dim = max(dims, key=lambda d: leaf.shape[d])
        return P(*([None] * dim), axis)

    return jax.tree.map(spec, tree)


def replicated_specs(tree: Any) -> Any:
    """Every array replicated (plain data parallelism keeps parameters whole)."""
    return jax.tree.map(lambda leaf: P() if eqx.is_array(leaf) else None, tree)


def shard(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Place each array leaf of `tree` on `mesh` by its spec (`None`: left as it is)."""

    def place(leaf, spec):
        if spec is None or not eqx.is_array(leaf):
            return leaf
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree.map(place, tree, specs)


def data_parallel(mesh: Mesh, axes: str | tuple[str, ...] = "data") -> NamedSharding:
    """The sharding of a batch split on its leading axis over `axes`."""
    return NamedSharding(mesh, P(axes))
