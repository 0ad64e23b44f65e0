"""Helpers of the sharding tests: meshes and ring attention on natural-order arrays."""

import jax
import numpy as np
from jax.sharding import Mesh

from probjax_eqx.ring_attention import context_parallel_attention, zigzag_permutation


def mesh_of(**axes):
    """A mesh of the first devices, `mesh_of(data=2, expert=4)`."""
    devices = np.array(jax.devices()[: int(np.prod(list(axes.values())))])
    return Mesh(devices.reshape(tuple(axes.values())), tuple(axes))


def ring(mesh, layout, causal, **kwargs):
    """Ring attention on natural-order arrays (zigzag permuted in and out)."""
    seq_shards = mesh.shape["context"]

    def f(q, k, v):
        seq = q.shape[1]
        perm = zigzag_permutation(seq, seq_shards) if layout == "zigzag" else np.arange(seq)
        inv = np.argsort(perm)
        o = context_parallel_attention(
            q[:, perm], k[:, perm], v[:, perm], mesh=mesh, causal=causal, layout=layout,
            **kwargs,
        )  # fmt: skip
        return o[:, inv]

    return f
