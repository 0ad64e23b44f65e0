r"""Context-parallel attention: the sequence split over a mesh axis, keys passed round a ring.

Each of the `P` devices on `axis_name` holds a slice of the queries, keys and values.
Keys and values travel round the ring (`jax.lax.ppermute`), one step per device; at each
step every device attends its queries to the visiting block with our attention kernels
and merges the block's output into its running output by log-sum-exp, exactly as a
flash kernel merges key tiles. The backward pass runs the ring again: each block's
dQ / dK / dV come from the kernels' backward with the rows' *global* statistics
(`FlashKernels.backward_given`), and dK / dV travel with their block back to its owner.
Outputs and gradients are therefore those of attention over the whole sequence.

**Causal load balance.** With a causal mask and contiguous slices, device `P - 1` attends
to every block and device 0 to one. `layout="zigzag"` splits the sequence into `2P`
chunks and gives device `i` chunks `i` and `2P - 1 - i` (`zigzag_permutation`), so every
ring step costs every device the same: half a block of pairs.

| layout       | step `j < i`                 | `j == i` | `j > i`                     |
|--------------|------------------------------|----------|-----------------------------|
| `contiguous` | all pairs                    | causal   | nothing                     |
| `zigzag`     | all queries, first key chunk | causal   | second query chunk, all keys |

Per-block kernels come from the attention registry (`implementation=`): those with a
forward that returns the log-sum-exp and a backward that takes it (`"triton"`,
`"mosaic"`, `"xla"`); cuDNN through JAX exposes neither and is skipped with that reason.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from probjax_eqx._autodiff import kernel_then_reference
from probjax_eqx.attention_call import AttentionCall
from probjax_eqx.backends import Backend, UnsupportedError, implementations, resolve
from probjax_eqx.kernels.reference.attention import XlaAttention, XlaAttentionConfig
from probjax_eqx.masks import Causal, DenseMask

Layout = Literal["contiguous", "zigzag"]
_NO_BLOCKS = "its kernels expose no forward-with-lse / backward-given-lse entry points"


def zigzag_permutation(seq_len: int, num_shards: int) -> np.ndarray:
    """`perm` with `x[:, perm]` in zigzag layout: shard `i` holds chunks `i`, `2P-1-i`.

    Invert with `np.argsort(perm)`. Positions (RoPE) must follow the same permutation.
    """
    if seq_len % (2 * num_shards):
        raise ValueError(
            f"zigzag layout needs seq_len={seq_len} divisible by 2 * num_shards={2 * num_shards}"
        )
    chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
    order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
    return chunks[order].reshape(-1)


# What each ring step computes, by its kind (`_Ring.kind`): `(query part, key part,
# causal)`, a part being "all" or a half ("first", "second"); `None` adds nothing.
_STEPS = {
    "contiguous": (("all", "all", False), ("all", "all", True), None),
    "zigzag": (("all", "first", False), ("all", "all", True), ("second", "all", False)),
}


def _part(x, part: str, axis: int = 1):
    if part == "all":
        return x
    half = x.shape[axis] // 2
    window = slice(None, half) if part == "first" else slice(half, None)
    return x[(slice(None),) * axis + (window,)]


def _place(x, part: str, length: int, *, axis: int = 1, fill=0.0):
    """`x`, computed for one part of a `length`-long axis, padded back to full length."""
    if part == "all":
        return x
    pad = [(0, 0)] * x.ndim
    missing = length - x.shape[axis]
    pad[axis] = (0, missing) if part == "first" else (missing, 0)
    return jnp.pad(x, pad, constant_values=fill)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static plan of one ring call."""

    axis_name: str
    size: int
    causal: bool
    layout: Layout
    scale: float
    impl: object
    config: object

    def kernels(self, q, k, v, causal: bool):
        mask = Causal() if causal else None
        return self.impl.blocks(q, k, v, mask=mask, scale=self.scale, config=self.config)  # pyright: ignore

    def rotate(self, tree):
        perm = [(r, (r + 1) % self.size) for r in range(self.size)]
        return jax.lax.ppermute(tree, self.axis_name, perm)

    def kind(self, step: int):
        """Index into `_STEPS`: 0 the block came from before us, 1 ours, 2 after us."""
        i = jax.lax.axis_index(self.axis_name)
        j = (i - step) % self.size
        return jnp.where(j < i, 0, jnp.where(j == i, 1, 2))

    def steps(self):
        """`_STEPS` of this call: every step computes all pairs when not causal."""
        return _STEPS[self.layout] if self.causal else (("all", "all", False),)

    # Each step returns full-size results: zeros / -inf where it adds nothing.
    def forward_step(self, step):
        def run(q, k, v):
            if step is None:
                # `*_like` of the (device-varying) inputs keeps shard_map's types equal.
                o = jnp.zeros_like(q, shape=(*q.shape[:3], v.shape[3]))
                rows = (q.shape[0], q.shape[2], q.shape[1])
                return o, jnp.full_like(q, -jnp.inf, jnp.float32, shape=rows)
            q_part, k_part, causal = step
            qs, ks, vs = _part(q, q_part), _part(k, k_part), _part(v, k_part)
            o, lse = self.kernels(qs, ks, vs, causal).forward_lse(qs, ks, vs)
            lq = q.shape[1]
            return _place(o, q_part, lq), _place(lse, q_part, lq, axis=2, fill=-jnp.inf)

        return run

    def backward_step(self, step):
        def run(q, k, v, o, lse, do):
            if step is None:
                return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
            q_part, k_part, causal = step
            qs, os_, dos = _part(q, q_part), _part(o, q_part), _part(do, q_part)
            ls, ks, vs = _part(lse, q_part, axis=2), _part(k, k_part), _part(v, k_part)
            dq, dk, dv = self.kernels(qs, ks, vs, causal).backward_given(qs, ks, vs, os_, ls, dos)
            lq, lk = q.shape[1], k.shape[1]
            return _place(dq, q_part, lq), _place(dk, k_part, lk), _place(dv, k_part, lk)

        return run

    def run(self, branches, step: int, *args):
        """The step's computation: a `lax.switch` on its kind when there are several."""
        if len(branches) == 1:
            return branches[0](*args)
        return jax.lax.switch(self.kind(step), branches, *args)


def _merge(o, lse, o_new, lse_new):
    """Exact merge of two partial outputs by their log-sum-exp (-inf: no keys)."""
    top = jnp.maximum(lse, lse_new)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w, w_new = jnp.exp(lse - top), jnp.exp(lse_new - top)
    total = w + w_new
    safe = jnp.where(total > 0, total, 1.0)
    per_row = lambda x: jnp.swapaxes(x / safe, 1, 2)[..., None]  # noqa: E731 - [b, q, h, 1]
    o = per_row(w) * o + per_row(w_new) * o_new.astype(jnp.float32)
    return o, jnp.where(total > 0, top + jnp.log(safe), -jnp.inf)


def _ring_forward(ring: _Ring, q, k, v):
    b, lq, h, _ = q.shape
    o = jnp.zeros((b, lq, h, v.shape[3]), jnp.float32)
    lse = jnp.full((b, h, lq), -jnp.inf, jnp.float32)
    branches = [ring.forward_step(s) for s in ring.steps()]
    for step in range(ring.size):
        o_s, lse_s = ring.run(branches, step, q, k, v)
        o, lse = _merge(o, lse, o_s, lse_s)
        if step < ring.size - 1:
            k, v = ring.rotate((k, v))
    return o.astype(q.dtype), lse


def _ring_backward(ring: _Ring, q, k, v, o, lse, do):
    f32 = jnp.float32
    dq = jnp.zeros(q.shape, f32)
    dk, dv = jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    branches = [ring.backward_step(s) for s in ring.steps()]
    for step in range(ring.size):
        grads = ring.run(branches, step, q, k, v, o, lse, do)
        dq_s, dk_s, dv_s = (g.astype(f32) for g in grads)
        dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
        # dK/dV ride with their block: after `size` moves they are home.
        dk, dv = ring.rotate((dk, dv))
        if step < ring.size - 1:
            k, v = ring.rotate((k, v))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _blocks_backend(backend: Backend) -> tuple[Backend, Mapping[str, Any]]:
    """`backend` restricted to implementations with block entry points."""
    table = implementations("attention")
    if backend.pinned:
        if not hasattr(table[backend.requested], "blocks"):
            raise UnsupportedError(backend.requested, f"ring attention: {_NO_BLOCKS}")
        return backend, table
    keep = tuple(n for n in backend.priority if hasattr(table[n], "blocks"))
    dropped = tuple((n, _NO_BLOCKS) for n in backend.priority if n not in keep)
    auto = dataclasses.replace(backend, priority=keep, pruned=backend.pruned + dropped, regimes=())
    return auto, table


def ring_attention(
    q: Float[Array, "batch q_shard q_heads qk_dim"],
    k: Float[Array, "batch kv_shard kv_heads qk_dim"],
    v: Float[Array, "batch kv_shard kv_heads v_dim"],
    *,
    axis_name: str,
    causal: bool = False,
    layout: Layout = "contiguous",
    scale: float | None = None,
    implementation: str | Backend | None = None,
    config: object = None,
) -> Float[Array, "batch q_shard q_heads v_dim"]:
    """Attention over a sequence sharded on `axis_name`; call it inside `jax.shard_map`.

    Args:
        q: this device's queries `[batch, seq / P, q_heads, qk_dim]`.
        k: this device's keys (same slice of the sequence).
        v: this device's values.
        axis_name: the mesh axis the sequence is split over.
        causal: causal mask over global positions (queries and keys share positions).
        layout: how the sequence is split: `"contiguous"` slices, or `"zigzag"`
            (`zigzag_permutation`), which balances causal work across devices.
        scale: multiplier of `q @ k.T`; default `1 / sqrt(qk_dim)`.
        implementation: per-block kernels, as in `dot_product_attention` (module docstring).
        config: the pinned implementation's config.

    Returns:
        This device's slice of the output, in the input dtype.
    """
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout={layout!r}: expected 'contiguous' or 'zigzag'")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"ring attention shards queries and keys alike: q has {q.shape[1]} positions "
            f"per device, k has {k.shape[1]}"
        )
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"zigzag layout needs an even slice length, got {q.shape[1]}")
    if not isinstance(implementation, Backend):
        implementation = resolve("attention", implementation)
    backend, table = _blocks_backend(implementation)
    # Choose on the diagonal block: the causal mask is the most any step asks for.
    call = AttentionCall.from_args(
        q.shape, k.shape, v.shape, q.dtype, Causal() if causal else None, None
    )
    choice = backend.select(call, config)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    ring = _Ring(
        axis_name, jax.lax.axis_size(axis_name), causal, layout, scale,
        table[choice.kernel], choice.config,
    )  # fmt: skip

    @jax.custom_vjp
    def run(q, k, v):
        return _ring_forward(ring, q, k, v)[0]

    def run_fwd(q, k, v):
        o, lse = _ring_forward(ring, q, k, v)
        return o, (q, k, v, o, lse)

    def run_bwd(residuals, do):
        q, k, v, o, lse = residuals
        return _ring_backward(ring, q, k, v, o, lse, do)

    run.defvjp(run_fwd, run_bwd)
    return kernel_then_reference(run, functools.partial(_gathered_reference, ring), q, k, v)


def _gathered_reference(ring: _Ring, q, k, v):
    """The ring's attention in XLA: every device's keys gathered, masked by global positions.

    Forward mode and derivatives beyond the first gradient come from it.
    """
    k, v = (jax.lax.all_gather(x, ring.axis_name, axis=1, tiled=True) for x in (k, v))
    mask = None
    if ring.causal:
        length = k.shape[1]
        order = zigzag_permutation(length, ring.size) if ring.layout == "zigzag" else None
        positions = jnp.arange(length) if order is None else jnp.asarray(order)
        shard = q.shape[1]
        start = jax.lax.axis_index(ring.axis_name) * shard
        mine = jax.lax.dynamic_slice_in_dim(positions, start, shard)
        mask = DenseMask((mine[:, None] >= positions[None, :])[None, None])
    return XlaAttention()(q, k, v, mask=mask, score_mod=None, scale=ring.scale,
                          config=XlaAttentionConfig())  # fmt: skip


def context_parallel_attention(
    q: Float[Array, "batch seq q_heads qk_dim"],
    k: Float[Array, "batch seq kv_heads qk_dim"],
    v: Float[Array, "batch seq kv_heads v_dim"],
    *,
    mesh: Mesh,
    seq_axis: str = "context",
    batch_axis: str | tuple[str, ...] | None = None,
    **kwargs,
) -> Float[Array, "batch seq q_heads v_dim"]:
    """`ring_attention` on global arrays, sharded by `jax.shard_map`.

    The sequence is split over `mesh[seq_axis]` and the batch over `batch_axis`.

    With `layout="zigzag"`, the arrays' sequence axis must already be in zigzag order
    (`x[:, zigzag_permutation(seq, mesh.shape[seq_axis])]`). Inside your own
    `jax.shard_map`, call `ring_attention` with `check_vma=False` there: Pallas kernel
    outputs carry no varying-axes type.
    """
    spec = P(batch_axis, seq_axis, None, None)

    def body(q, k, v):
        return ring_attention(q, k, v, axis_name=seq_axis, **kwargs)

    # Pallas outputs carry no varying-axes type: our kernels need `check_vma=False`.
    return jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )(q, k, v)
