"""Backends of the linear recurrences: Mamba's selective scan, Mamba-2's SSD, RLA's linear branch.

Each op has pure-JAX implementations (`"scan"`, the sequential reference; `"associative"`
or `"chunked"`) and our Pallas Triton kernel (`"triton"`, `kernels/triton/ssm.py`), the
default wherever it runs (a GPU, or the CPU with `config=...(interpret=True)`).
Modules resolve the backend once, at construction.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from probjax_eqx.backends import Backend, Choice, DeviceInfo, register_op, resolve
from probjax_eqx.kernels import _flash
from probjax_eqx.kernels.triton.ssm import ChunkedLinearConfig, SelectiveScanConfig

_FLOATS = frozenset({"float32", "bfloat16", "float16"})


@dataclasses.dataclass(frozen=True)
class RecurrenceCall:
    """Static description of one recurrence call (unbatched)."""

    seq: int
    dtype: str
    features: int = 0  # state width per step (dk + dv of chunked linear attention)


@dataclasses.dataclass(frozen=True)
class XlaRecurrence:
    """A pure-JAX implementation (`lax.scan`, `lax.associative_scan` or chunked einsums)."""

    name: str

    def check(self, call: RecurrenceCall, device: DeviceInfo, config=None) -> str | None:
        if config is not None:
            raise TypeError(f"implementation={self.name!r} takes no config, got {config!r}")
        return None if call.dtype in _FLOATS else f"dtype {call.dtype} not supported"

    def default_config(self, call, device):
        return None


@dataclasses.dataclass(frozen=True)
class TritonRecurrence:
    """Our Pallas Triton kernel of the op, configured by `config_type`."""

    config_type: type
    name: str = "triton"

    def check(self, call: RecurrenceCall, device: DeviceInfo, config=None) -> str | None:
        if call.dtype not in _FLOATS:
            return f"dtype {call.dtype} not supported (supports {sorted(_FLOATS)})"
        return _flash.check_pallas(
            "triton", self.config_type, config, device, "Pallas Triton needs a GPU"
        )

    def default_config(self, call, device):
        tiles: dict[str, Any] = {}
        if self.config_type is ChunkedLinearConfig and call.features <= 256:
            # Narrow states (Mamba-2's SSD, 64 x 64): one program per head, and the
            # chunk-parallel backward, 0.318 / 0.933 ms fwd / fwd+bwd at T=4096 vs 0.316 /
            # 1.30 for the single-kernel one (h200_ssm_sweep.json, run 24).
            tiles = dict(chunk_parallel_backward=True)
        elif self.config_type is ChunkedLinearConfig:
            # Wide states (RLA's 2 x 128 features + 128 values): without value blocks
            # 64-step chunks asked the H200 for 327,680 bytes of shared memory (run 6),
            # and one program per head left most SMs idle. 16-bit: of the sweep at
            # T=4096 (bench/results/h200_ssm_sweep.json, run 21) the fastest fwd+bwd,
            # 0.443 / 1.92 ms vs 0.523 / 5.73 for 32-step chunks of 32 columns with the
            # single-kernel backward. float32 keeps the latter: the former's forward
            # asked for 311,296 bytes (run 22).
            if jnp.dtype(call.dtype).itemsize > 2:
                tiles = dict(chunk=32, block_dv=32, num_stages=1)
            else:
                tiles = dict(chunk=64, block_dv=64, num_warps=8, num_stages=1,
                             chunk_parallel_backward=True)  # fmt: skip
        return self.config_type(**tiles, interpret=not device.is_gpu)


_TABLES = {
    "selective_scan": {
        "scan": XlaRecurrence("scan"),
        "associative": XlaRecurrence("associative"),
        "triton": TritonRecurrence(SelectiveScanConfig),
    },
    "ssd": {
        "scan": XlaRecurrence("scan"),
        "chunked": XlaRecurrence("chunked"),
        "triton": TritonRecurrence(ChunkedLinearConfig),
    },
    "linear_attention": {
        "scan": XlaRecurrence("scan"),
        "chunked": XlaRecurrence("chunked"),
        "triton": TritonRecurrence(ChunkedLinearConfig),
    },
}
for _op, _table in _TABLES.items():
    register_op(_op, lambda table=_table: table)


def select(
    op: str, seq: int, dtype, implementation: str | Backend | None, config, features: int = 0
) -> Choice:
    """The `Choice` of `op` for a call of `seq` steps in `dtype` (`features` per step)."""
    backend = implementation if isinstance(implementation, Backend) else resolve(op, implementation)
    if backend.op != op:
        raise ValueError(f"a {backend.op!r} backend cannot run {op!r}")
    return backend.select(RecurrenceCall(seq, jnp.dtype(dtype).name, features), config)
