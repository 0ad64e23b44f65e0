"""Expert parallelism for `MoE`: experts sharded over a mesh axis, dropless token exchange.

The `P` devices of `expert_axis` each hold `num_experts / P` experts (the expert
dimension of `w_gate`, `w_up`, `w_down`) and a slice of the tokens; the router and the
shared expert are replicated. Every (token, slot) pair runs on the device that owns its
expert, in one grouped matmul per expert matrix with our kernels, and comes back
weighted to its token. No capacity factor: each device's receive buffer holds the worst
case (every pair of the group for its experts), so no pair is ever dropped, and the
grouped-matmul kernels skip the row tiles that stay empty.

Two exchanges (`exchange=`):

| exchange       | tokens out                                      | results back               |
|----------------|-------------------------------------------------|----------------------------|
| `"all_to_all"` | each pair to its expert's device (ragged a2a)   | the reverse exchange       |
| `"gather"`     | every token to every device (`all_gather`)      | `psum_scatter` of the sums |

Per device, `all_to_all` moves `tokens * top_k * d_model * (P - 1) / P` values each
way and `gather` `tokens * d_model * (P - 1)`: the same at `top_k = P`, and `gather`
moves less above it. XLA:CPU has no ragged all-to-all, so `"all_to_all"` needs GPUs;
`"auto"` takes it there and `"gather"` elsewhere.
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from probjax_eqx._rows import (
    bin_counts,
    combine_rows,
    copy_to_rows,
    inverse_permutation,
    permute_rows,
)
from probjax_eqx.backends import UnsupportedError
from probjax_eqx.moe import MoE, MoEAux, swiglu

Exchange = Literal["auto", "all_to_all", "gather"]


def moe_partition_specs(moe: MoE, expert_axis: str):
    """`PartitionSpec`s of an `MoE`'s arrays: experts split over `expert_axis`.

    The rest is replicated. A pytree of `moe`'s structure, for `jax.shard_map` or `shard`.
    """
    split = {id(moe.w_gate), id(moe.w_up), id(moe.w_down)}
    return jax.tree.map(lambda a: P(expert_axis) if id(a) in split else P(), moe)


def expert_parallel_specs(tree, expert_axis: str):
    """Specs of a model holding `MoE`s: their experts split, every other array replicated.

    Non-array leaves get `None` (the convention of `probjax_eqx.sharding`).
    """

    def specs(node):
        if isinstance(node, MoE):
            return moe_partition_specs(node, expert_axis)
        return P() if eqx.is_array(node) else None

    return jax.tree.map(specs, tree, is_leaf=lambda node: isinstance(node, MoE))


def _ragged_all_to_all(x, out, in_offsets, send_sizes, out_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` (a module function so tests can emulate it on the CPU)."""
    return jax.lax.ragged_all_to_all(
        x, out, in_offsets, send_sizes, out_offsets, recv_sizes, axis_name=axis_name
    )


def _ragged_supported(platform: str) -> bool:
    return platform != "cpu"


def _local_experts(moe: MoE, axis: str):
    local = moe.w_gate.shape[0]
    first = jax.lax.axis_index(axis) * local
    return local, first


def _expert_ffn(moe: MoE, xs, group_sizes):
    """SwiGLU of sorted rows through this device's experts (rows past the groups: 0)."""
    h = swiglu(moe._gmm(xs, moe.gate_up_weights(xs.dtype), group_sizes), moe.w_gate.shape[2])
    return moe._gmm(h, moe.w_down.astype(xs.dtype), group_sizes)


def _sort_local(expert_of_row, first, local):
    """Order rows by local expert (rows of other devices' experts last), and group sizes."""
    mine = (expert_of_row >= first) & (expert_of_row < first + local)
    key = jnp.where(mine, expert_of_row - first, local)
    order = jnp.argsort(key, stable=True)
    sizes = bin_counts(key, local)  # rows of other devices' experts (key = local) count nowhere
    return order, sizes


def _gather_exchange(moe: MoE, x, experts, weights, axis: str):
    """Every token to every device; each adds its experts' share; `psum_scatter` back."""
    xg = jax.lax.all_gather(x, axis, tiled=True)
    eg = jax.lax.all_gather(experts, axis, tiled=True).reshape(-1)
    wg = jax.lax.all_gather(weights, axis, tiled=True).reshape(-1)
    local, first = _local_experts(moe, axis)
    order, sizes = _sort_local(eg, first, local)
    token_of = order // moe.top_k
    slots = inverse_permutation(order).reshape(-1, moe.top_k)
    xs = copy_to_rows(xg, token_of, slots)
    y = combine_rows(_expert_ffn(moe, xs, sizes), slots, token_of, wg[order])
    return jax.lax.psum_scatter(y, axis, tiled=True)


def _all_to_all_exchange(moe: MoE, x, experts, weights, axis: str):
    """Each (token, slot) pair to its expert's device and back (ragged all-to-all)."""
    tokens, d_model = x.shape
    size = jax.lax.axis_size(axis)
    local, first = _local_experts(moe, axis)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by destination device
    token_of = order // moe.top_k
    dest = flat // local
    send = bin_counts(dest, size)
    sent_by = jax.lax.all_gather(send, axis)  # [sender, receiver]: every count, once
    me = jax.lax.axis_index(axis)
    recv = sent_by[:, me]
    in_off = jnp.cumsum(send) - send
    # Where my rows land in each receiver: after those of the senders before me.
    out_off = (jnp.cumsum(sent_by, axis=0) - sent_by)[me]
    capacity = tokens * moe.top_k * size  # dropless: every pair of the group, worst case

    def exchange(values, fill):
        out = jnp.full((capacity,) + values.shape[1:], fill, values.dtype)
        return _ragged_all_to_all(values, out, in_off, send, out_off, recv, axis_name=axis)

    slots = inverse_permutation(order).reshape(tokens, moe.top_k)
    rows = exchange(copy_to_rows(x, token_of, slots), 0)
    row_expert = exchange(flat[order].astype(jnp.int32), -1)  # -1: unfilled rows
    local_order, sizes = _sort_local(row_expert, first, local)
    arrival = inverse_permutation(local_order)
    ys = _expert_ffn(moe, permute_rows(rows, local_order, arrival), sizes)
    ys = permute_rows(ys, arrival, local_order)  # back to arrival order
    # The reverse exchange: what I received from each sender goes back to it.
    recv_by = sent_by.T  # [receiver, sender]
    back_out_off = (jnp.cumsum(recv_by, axis=0) - recv_by)[me]
    back_in_off = jnp.cumsum(recv) - recv
    back = jnp.zeros((tokens * moe.top_k, d_model), ys.dtype)
    ys = _ragged_all_to_all(ys, back, back_in_off, recv, back_out_off, send, axis_name=axis)
    return combine_rows(ys, slots, token_of, weights.reshape(-1)[order])


def _refuse_fused(moe: MoE) -> None:
    # Shards run the sorted dispatch; "auto" (fused_gsum on GPUs) is free to.
    if moe.dispatch_request == "fused_gsum":
        raise UnsupportedError(
            "fused_gsum", "expert parallelism runs the sorted dispatch; build the MoE with "
            "dispatch='auto' (or a grouped-matmul name)"
        )  # fmt: skip


def _exchange_for(exchange: str, platform: str):
    """The exchange function `exchange=` names on `platform`."""
    if exchange == "auto":
        exchange = "all_to_all" if _ragged_supported(platform) else "gather"
    if exchange not in ("all_to_all", "gather"):
        raise ValueError(f"exchange={exchange!r}: expected 'auto', 'all_to_all' or 'gather'")
    if exchange == "all_to_all" and not _ragged_supported(platform):
        raise UnsupportedError(
            "all_to_all", "XLA:CPU has no ragged all-to-all; pass exchange='gather'"
        )
    return _all_to_all_exchange if exchange == "all_to_all" else _gather_exchange


def expert_parallel_moe_shard(
    moe: MoE,
    x: Float[Array, "shard_tokens d_model"],
    *,
    expert_axis: str,
    token_axes: tuple[str, ...],
    exchange: Exchange = "auto",
) -> tuple[Float[Array, "shard_tokens d_model"], MoEAux]:
    """`expert_parallel_moe` on one device's shard: call it inside `jax.shard_map`.

    `moe` holds this device's experts (split by `moe_partition_specs`), `x` its tokens.
    The `shard_map` needs `check_vma=False` (Pallas outputs carry no varying-axes type).
    """
    _refuse_fused(moe)
    run = _exchange_for(exchange, jax.default_backend())
    dtype = jnp.dtype(moe.compute_dtype or x.dtype)
    experts, weights, stats = moe.route_stats(x)
    y = run(moe, x.astype(dtype), experts, weights, expert_axis) + moe.shared_expert(x)
    stats = jax.tree.map(lambda s: jax.lax.psum(s, token_axes), stats)
    return y.astype(x.dtype), stats.aux(moe.top_k)


def expert_parallel_moe(
    moe: MoE,
    x: Float[Array, "tokens d_model"],
    *,
    mesh: Mesh,
    expert_axis: str = "expert",
    token_axes: tuple[str, ...] | None = None,
    exchange: Exchange = "auto",
) -> tuple[Float[Array, "tokens d_model"], MoEAux]:
    """Run `moe(x)` with its experts sharded over `mesh[expert_axis]`.

    Args:
        moe: the layer; `num_experts` must be a multiple of the expert axis' size.
        x: all tokens `[tokens, d_model]`, split over `token_axes`.
        mesh: the device mesh.
        expert_axis: the mesh axis experts are split over.
        token_axes: the mesh axes the tokens are split over (default: every axis of
            `mesh`, so each device holds distinct tokens); must include `expert_axis`.
        exchange: `"all_to_all"`, `"gather"` or `"auto"` (module docstring).

    Returns:
        `(y, aux)` equal to `moe(x)`: the router statistics are summed over all shards.
    """
    token_axes = tuple(mesh.axis_names) if token_axes is None else tuple(token_axes)
    if expert_axis not in token_axes:
        raise ValueError(f"token_axes={token_axes} must include expert_axis={expert_axis!r}")
    size = mesh.shape[expert_axis]
    if moe.num_experts % size:
        raise ValueError(
            f"num_experts={moe.num_experts} is not a multiple of the {expert_axis!r} axis "
            f"size {size}"
        )
    _refuse_fused(moe)
    _exchange_for(exchange, mesh.devices.flat[0].platform)  # refuse before tracing

    def body(moe: MoE, x):
        return expert_parallel_moe_shard(
            moe, x, expert_axis=expert_axis, token_axes=token_axes, exchange=exchange
        )

    tokens = P(token_axes)
    # Pallas outputs carry no varying-axes type: our kernels need `check_vma=False`.
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(moe_partition_specs(moe, expert_axis), tokens),
        out_specs=(tokens, P()),  # the router statistics: summed, replicated
        check_vma=False,
    )(moe, x)
