"""Sharded parameters and activations on JAX's own sharding (`Mesh`, `NamedSharding`).

Modules are pytrees, so a layout is a pytree of `PartitionSpec`s of the same structure
(`None` for leaves that are not arrays). Two ways to train on a mesh:

- `jax.jit` over sharded arrays (`shard`, `data_parallel`): XLA partitions every op it
  knows. Our Pallas kernels are custom calls it cannot split, so it replicates their
  operands and runs them whole on every device: correct, but not faster.
- `value_and_grad(loss, mesh, specs)`: the loss runs per device under `jax.shard_map`,
  so our kernels see each device's shard; parameters split by `specs` (FSDP, from
  `fsdp_specs`) are gathered for the forward and their gradients reduce-scattered, and
  replicated ones are averaged. Use this one with our kernels.

The algorithms that need their own communication live in `ring_attention` (context
parallelism) and `expert_parallel` (MoE experts).

Example:
    ```python
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    specs = fsdp_specs(model, mesh, axis="data")
    model = shard(model, mesh, specs)
    batch = jax.device_put(batch, data_parallel(mesh, "data"))
    loss, grads = eqx.filter_jit(value_and_grad(loss_fn, mesh, specs))(model, batch)
    ```
"""

import math
from collections.abc import Callable
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


def value_and_grad(
    loss: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    specs: Any,
    *,
    batch_axes: str | tuple[str, ...] = "data",
    local_axes: tuple[str, ...] = (),
    has_aux: bool = False,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Mean loss over a batch split on `batch_axes`, and its gradients, per device.

    Args:
        loss: `loss(model, batch) -> scalar`, the mean over the batch it is given.
        mesh: the device mesh.
        specs: the model's layout (`fsdp_specs` or `replicated_specs`): split arrays are
            gathered along their split dimension inside; one mesh axis per array.
        batch_axes: the mesh axes the batch's leading dimension is split over.
        local_axes: arrays split over these axes stay split inside: the loss computes
            with its device's part (MoE experts under `expert_parallel_moe_shard`).
        has_aux: `loss` returns `(loss, aux)`; `aux` is averaged over the batch axes.

    Returns:
        `f(model, batch) -> (loss, grads)` (`((loss, aux), grads)` with `has_aux`), equal
        to `eqx.filter_value_and_grad(loss)` on one device; gradients come laid out like
        the model.
    """
    axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    devices = math.prod(mesh.shape[a] for a in axes)

    def split_dim(spec):
        dims = [d for d, name in enumerate(spec) if name is not None]
        if len(dims) > 1:
            raise ValueError(f"value_and_grad gathers one split dimension per array, got {spec}")
        return (dims[0], spec[dims[0]]) if dims else None

    def f(model, batch):
        params, static = eqx.partition(model, eqx.is_array)
        param_specs = jax.tree.map(lambda p, s: s, params, specs)

        def per_device(params, batch):
            def gathered_loss(params):
                def gather(p, spec):
                    where = split_dim(spec)
                    if where is None or where[1] in local_axes:
                        return p
                    return jax.lax.all_gather(p, where[1], axis=where[0], tiled=True)

                full = jax.tree.map(gather, params, param_specs)
                return loss(eqx.combine(full, static), batch)

            value, grads = jax.value_and_grad(gathered_loss, has_aux=has_aux)(params)

            # The gather's transpose (a reduce-scatter) already summed over the split axis;
            # so did the exchanges that reach a local split (all tokens meet their experts).
            def reduce(g, spec):
                where = split_dim(spec)
                if where is None:
                    return jax.lax.psum(g, axes) / devices
                if where[1] not in axes:  # every device of that axis saw the same batch
                    return jax.lax.psum(g, axes) / (devices * mesh.shape[where[1]])
                rest = tuple(a for a in axes if a != where[1])
                return (jax.lax.psum(g, rest) if rest else g) / devices

            return jax.tree.map(lambda v: jax.lax.pmean(v, axes), value), jax.tree.map(
                reduce, grads, param_specs
            )

        # Pallas outputs carry no varying-axes type: our kernels need `check_vma=False`.
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(param_specs, P(axes)),
            out_specs=(P(), param_specs),
            check_vma=False,
        )(params, batch)

    return f
