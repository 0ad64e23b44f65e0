"""Backend registry: device detection, env opt-outs, and inspectable kernel selection.

A `Backend` is a small frozen, hashable value that a module resolves **once, at
construction**, from the device, the `PROBJAX_*` opt-outs and the user's
`implementation=`. At call time `Backend.select(call)` walks its priority list and
returns a `Choice` naming the kernel, its config, why it was taken and why every
earlier candidate was rejected. Selection never traces a kernel: each
implementation declares what it supports as data and `check(call, device)` returns a
reason string or `None`.

Registry rules (in priority order, first supported wins):

| op        | `sm_90` (H100/H200)              | `generic` (other GPUs, CPU) |
|-----------|----------------------------------|-----------------------------|
| attention | cudnn, mosaic, triton, xla       | triton, xla                 |
| attention, few queries over long KV | triton (split-KV), cudnn, mosaic, xla | triton, xla |
| attention, head_dim <= 32 | triton, cudnn, mosaic, xla | triton, xla |
| attention, KV/Q lengths | triton, mosaic, xla | triton, xla |
| attention, score mods | mosaic, triton, xla  | triton, xla                 |
| attention, causal below T 16384, or hd <= 64 | mosaic, cudnn, triton, xla | triton, xla |
| attention, long self-attention at hd 128 | mosaic + cuDNN bwd, cudnn, triton, xla | triton, xla |
| attention, few query tiles over long KV, no mask | mosaic, cudnn, triton, xla | triton, xla |
| grouped_matmul | triton, mosaic, xla         | triton, xla                 |
| selective_scan | triton, scan                | triton, scan                |
| ssd, linear_attention | triton, chunked      | triton, chunked             |

A call can fall in a *regime* of its op (`REGIMES`, e.g. attention's `few_queries`):
then the entry `"<device>:<regime>"` gives its priority list, where one exists.

Environment opt-outs, read when a `Backend` is built (never at call time):

| variable                              | effect                                    |
|---------------------------------------|-------------------------------------------|
| `PROBJAX_ATTENTION_CUDNN=0`           | drop cudnn from automatic selection       |
| `PROBJAX_ATTENTION_MOSAIC=0`          | drop mosaic from automatic selection      |
| `PROBJAX_ATTENTION_DEVICE_DEFAULTS=0` | use the `generic` entry on every device   |

Opt-outs only prune automatic selection; an implementation pinned by name is kept.
"""

import dataclasses
import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import jax

Implementation = Literal[
    "auto", "xla", "triton", "cudnn", "mosaic", "scan", "associative", "chunked"
]

# One table per op family, keyed by device: the priority lists for "auto".
DEVICE_DEFAULTS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "attention": {
        "sm_90": ("cudnn", "mosaic", "triton", "xla"),
        # Few queries over long KV: our split-KV Triton forward fills the GPU (REGIMES).
        "sm_90:few_queries": ("triton", "cudnn", "mosaic", "xla"),
        # Heads of <= 32 dims: the Triton kernel is fastest (attention.SMALL_HEAD_DIM).
        "sm_90:small_heads": ("triton", "cudnn", "mosaic", "xla"),
        # Padding masks (KV/Q lengths): no cuDNN, whose padded backward was wrong on the
        # H200 at times (attention.PADDING_TERMS). Triton first: with its two-warpgroup
        # backward Mosaic trains faster at T4096 hd128 KV lengths (run 16: fwd+bwd 2.70
        # vs 2.92 ms, 1.43 vs 1.56 at half), but slower at T16384 hd128 (46.7 vs 44.0,
        # dense) and its hd 64 forward is slower (run 10); no one order wins everywhere.
        "sm_90:padded": ("triton", "mosaic", "xla"),
        # Score mods (the attention module's score_mod regime): Mosaic computes SoftCap
        # (H100 run 60, B4 H8 T4096 hd128 SoftCap(30), fwd+bwd 3.12 vs Triton's 3.92 ms,
        # causal 1.84 vs 2.28); Triton every other mod.
        "sm_90:score_mod": ("mosaic", "triton", "xla"),
        # Causal masks below T 16384, or at any length with heads of <= 64 dims
        # (attention.CAUSAL_MOSAIC_MAX_LEN): Mosaic trains faster than cuDNN there (H100
        # run 82: T 4096 hd 128 1.138 vs 1.202 ms; run 83: T 16384 hd 64 8.66 vs 8.85).
        "sm_90:causal": ("mosaic", "cudnn", "triton", "xla"),
        # Self-attention over >= 16384 keys at hd 128, unmasked or causal
        # (mosaic.attention.cudnn_backward_pays): Mosaic's forward, cuDNN's backward.
        "sm_90:long": ("mosaic", "cudnn", "triton", "xla"),
        # Few query tiles over >= 4096 keys without a mask (attention.CROSS_MOSAIC_*):
        # grouped query heads up to 1024 queries, where Mosaic sums dK/dV over each group in
        # its kernel and cuDNN in a pass of its own (H100 run 103: 128 queries over 8192
        # keys, 32 heads over 8, fwd+bwd 1.202 vs 2.256 ms), and one KV head per query
        # head at 65-128 queries (run 109: 1.927 vs Triton's 2.079).
        "sm_90:cross": ("mosaic", "cudnn", "triton", "xla"),
        "generic": ("triton", "xla"),
    },
    "grouped_matmul": {
        # The in-place Triton kernels beat the padded-layout Mosaic ones on the H200
        # (1M rows: 1.49 / 3.88 ms fwd / fwd+bwd vs 2.28 / 12.9; bench/results).
        "sm_90": ("triton", "mosaic", "xla"),
        "generic": ("triton", "xla"),
    },
    # Linear recurrences: our Triton kernels where they run, else the fastest pure-JAX path.
    "selective_scan": {"generic": ("triton", "scan")},
    "ssd": {"generic": ("triton", "chunked")},
    "linear_attention": {"generic": ("triton", "chunked")},
}
# The module that registers each op's implementation table on import.
_OP_MODULES = {
    "attention": "probjax_eqx.attention",
    "grouped_matmul": "probjax_eqx.moe",
    "selective_scan": "probjax_eqx.recurrence",
    "ssd": "probjax_eqx.recurrence",
    "linear_attention": "probjax_eqx.recurrence",
}

# Regimes of an op's calls, in order: name -> predicate on the op's call description.
# An op module registers them with `register_regime`.
REGIMES: dict[str, list[tuple[str, Callable[[Any], bool]]]] = {}

# Env variable -> (op, implementation it removes from auto selection).
ENV_OPT_OUTS: Mapping[str, tuple[str, str]] = {
    "PROBJAX_ATTENTION_CUDNN": ("attention", "cudnn"),
    "PROBJAX_ATTENTION_MOSAIC": ("attention", "mosaic"),
}
ENV_DEVICE_DEFAULTS = "PROBJAX_ATTENTION_DEVICE_DEFAULTS"
_FALSE_STRINGS = frozenset({"0", "false", "no", "off"})
# XLA's own switches for run-to-run identical results (its scatters, GEMMs and cuDNN
# attention follow them). When one is on, selection passes over our kernels that add
# floats with atomics in an order that varies between runs.
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")
DETERMINISTIC_FLAG = DETERMINISTIC_FLAGS[0]  # the one error messages suggest


def atomics_refusal(what: str, instead: str) -> str:
    """Why `what`, which adds floats with atomics, cannot run where results must repeat."""
    return (
        f"{what} adds floats with atomics in an order that varies between runs, and "
        f"XLA_FLAGS asks for deterministic ops ({DETERMINISTIC_FLAG}): use {instead}"
    )


def deterministic_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `XLA_FLAGS` turns on one of `DETERMINISTIC_FLAGS` (the last mention wins)."""
    env = os.environ if environ is None else environ
    settings = {}
    for flag in env.get("XLA_FLAGS", "").split():
        name, _, setting = flag.partition("=")
        if name in DETERMINISTIC_FLAGS:
            settings[name] = setting.strip().lower() not in _FALSE_STRINGS
    return any(settings.values())


class UnsupportedError(NotImplementedError):
    """An implementation cannot compute this call exactly.

    Raised when an implementation was asked for by name; automatic selection records
    the same reason and moves on to the next candidate.
    """

    def __init__(self, implementation: str, reason: str):
        self.implementation = implementation
        self.reason = reason
        super().__init__(f"implementation={implementation!r} cannot compute this call: {reason}")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What selection needs to know about the device.

    Attributes:
        platform: `"cpu"`, `"gpu"` or `"tpu"`.
        device_kind: the driver's name for the device, e.g. `"NVIDIA H200"`.
        compute_capability: `"sm_90"` style for CUDA GPUs, else `None`.
        deterministic: results must repeat bit for bit (`deterministic_requested`): float
            atomics, whose order varies between runs on a GPU, are refused.
    """

    platform: str
    device_kind: str
    compute_capability: str | None = None
    deterministic: bool = False

    @property
    def atomics_vary(self) -> bool:
        """Float atomics would make results vary between runs, which must not happen."""
        return self.deterministic and self.is_gpu

    @property
    def registry_key(self) -> str:
        """The registry entry this device uses by default (`"sm_90"` or `"generic"`)."""
        if self.compute_capability in ("sm_90",):
            return self.compute_capability
        return "generic"

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def sm(self) -> int:
        """The compute capability as a number (`"sm_90"` -> 90; 0 without one)."""
        return sm_number(self.compute_capability)


def sm_number(compute_capability: str | None) -> int:
    """`"sm_90"` -> 90; `None` -> 0."""
    return int(compute_capability[3:]) if compute_capability else 0


def current_device(
    environ: Mapping[str, str] | None = None, device: DeviceInfo | None = None
) -> DeviceInfo:
    """`device` (default: JAX's default device), deterministic if `XLA_FLAGS` asks."""
    device = detect_device() if device is None else device
    if deterministic_requested(environ):
        return dataclasses.replace(device, deterministic=True)
    return device


def detect_device(device: Any = None) -> DeviceInfo:
    """Describe a `jax.Device` (default: JAX's first default device)."""
    device = jax.devices()[0] if device is None else device
    platform = device.platform
    kind = getattr(device, "device_kind", platform)
    capability = None
    raw = getattr(device, "compute_capability", None)
    if platform == "gpu" and raw:
        major, _, minor = str(raw).partition(".")
        capability = f"sm_{major}{minor or '0'}"
    return DeviceInfo(platform=platform, device_kind=str(kind), compute_capability=capability)


@dataclasses.dataclass(frozen=True)
class OptOuts:
    """The env opt-outs in force when a backend was built."""

    disabled: frozenset[tuple[str, str]] = frozenset()
    device_defaults: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "OptOuts":
        env = os.environ if environ is None else environ
        disabled = frozenset(
            target
            for var, target in ENV_OPT_OUTS.items()
            if env.get(var, "1").strip().lower() in _FALSE_STRINGS
        )
        defaults = env.get(ENV_DEVICE_DEFAULTS, "1").strip().lower() not in _FALSE_STRINGS
        return cls(disabled=disabled, device_defaults=defaults)

    def describe(self) -> list[str]:
        lines = [f"{op}: {impl} disabled" for op, impl in sorted(self.disabled)]
        if not self.device_defaults:
            lines.append(f"{ENV_DEVICE_DEFAULTS}=0: generic registry entry on every device")
        return lines


@runtime_checkable
class KernelImplementation(Protocol):
    """What every backend's implementation of an op exposes to the registry.

    To add a backend: declare `name`, write `check(call, device, config)` returning the
    first reason it cannot compute `call` exactly (or `None`), `default_config(call, device)`,
    and a `__call__` taking the op's canonical arguments plus `config`, with forward
    and backward under one `jax.custom_vjp` (the op's `kernel_then_reference` adds
    forward mode and higher derivatives). Then list its name in `DEVICE_DEFAULTS`
    and in the op's implementation table. An optional `auto_config(call, device)` is
    the config automatic selection runs, where it may join another backend's kernels
    (Mosaic attention's split-KV Triton forward, cuDNN's backward); asked for by name, an
    implementation runs its `default_config`: its own kernels. An optional
    `joined_halves(config)` names such a joined half for the choice's reason ("" if none).
    """

    name: str

    def check(self, call: Any, device: DeviceInfo, config: Any = None) -> str | None: ...

    def default_config(self, call: Any, device: DeviceInfo) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of selection for one call.

    Attributes:
        kernel: name of the implementation that will run.
        config: its config (tiles etc.), or `None` where it has none.
        reason: why it was taken.
        rejected: `(name, reason)` for each candidate passed over, in priority order.
        forward_mode: what `jax.jvp` runs for the call's tangent, and why ("" where the
            op does not say).
    """

    kernel: str
    config: Any
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()
    forward_mode: str = ""

    def __str__(self) -> str:
        lines = [f"chose {self.kernel!r}: {self.reason}"]
        lines += [f"  rejected {name!r}: {why}" for name, why in self.rejected]
        if self.forward_mode:
            lines.append(f"  forward mode (jax.jvp): {self.forward_mode}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved backend: what to try, on which device, in which order.

    Build it with `resolve(op, implementation)`. It is hashable and lives in a module's
    static field, so `__call__` never reads the environment.
    """

    op: str
    requested: str
    priority: tuple[str, ...]
    device: DeviceInfo
    opt_outs: OptOuts = OptOuts()
    pruned: tuple[tuple[str, str], ...] = ()
    # (regime, priority, pruned) of the regimes with their own registry entry.
    regimes: tuple[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ...] = ()

    @property
    def pinned(self) -> bool:
        return self.requested != "auto"

    def _plan(self, call: Any) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
        """The entry name, priority list and pruned candidates that apply to `call`."""
        predicates = dict(REGIMES.get(self.op, ()))
        for regime, priority, pruned in self.regimes:
            if predicates[regime](call):
                return f"{self._entry()}:{regime}", priority, pruned
        return self._entry(), self.priority, self.pruned

    def select(self, call: Any, config: Any = None) -> Choice:
        """Pick the implementation for `call`.

        Args:
            call: the op's canonical call description (e.g. `AttentionCall`).
            config: an explicit config for a pinned implementation, used as given.

        Raises:
            UnsupportedError: a pinned implementation cannot compute `call`, or no
                candidate of an automatic backend can.
        """
        if config is not None and not self.pinned:
            raise ValueError("config= applies to one implementation: pass implementation= too")
        table = implementations(self.op)
        entry, priority, pruned = self._plan(call)
        rejected = list(pruned)
        for name in priority:
            impl = table[name]
            why = impl.check(call, self.device, config)
            if why is None:
                if config is None and not self.pinned and hasattr(impl, "auto_config"):
                    config = impl.auto_config(call, self.device)  # pyright: ignore
                elif config is None:
                    config = impl.default_config(call, self.device)
                elif hasattr(impl, "resolve_config"):  # fill an explicit config's "auto" fields
                    config = impl.resolve_config(config, call, self.device)  # pyright: ignore
                if self.pinned:
                    reason = "requested by name"
                else:
                    reason = f"first supported in the {entry!r} priority list"
                if joined := getattr(impl, "joined_halves", lambda _: "")(config):
                    reason = f"{reason}; {joined}"
                return Choice(name, config, reason, tuple(rejected))
            if self.pinned:
                raise UnsupportedError(name, why)
            rejected.append((name, why))
        details = "; ".join(f"{n}: {w}" for n, w in rejected)
        raise UnsupportedError(self.requested, f"no implementation supports this call ({details})")

    def _entry(self) -> str:
        return self.device.registry_key if self.opt_outs.device_defaults else "generic"


_IMPLEMENTATION_TABLES: dict[str, Callable[[], Mapping[str, KernelImplementation]]] = {}


def register_op(op: str, table: Callable[[], Mapping[str, KernelImplementation]]) -> None:
    """Register the lazily built implementation table of an op family."""
    _IMPLEMENTATION_TABLES[op] = table


def register_regime(op: str, name: str, predicate: Callable[[Any], bool]) -> None:
    """Register a regime of `op`'s calls (see `REGIMES`)."""
    REGIMES.setdefault(op, []).append((name, predicate))


def implementations(op: str) -> Mapping[str, KernelImplementation]:
    """The implementation table of `op` (name -> implementation)."""
    if op not in _IMPLEMENTATION_TABLES:
        importlib.import_module(_OP_MODULES[op])
    return _IMPLEMENTATION_TABLES[op]()


def resolve(
    op: str,
    implementation: str | None = None,
    *,
    device: DeviceInfo | None = None,
    environ: Mapping[str, str] | None = None,
) -> Backend:
    """Resolve `implementation=` into a `Backend`, reading device and env opt-outs once.

    Args:
        op: the op family, e.g. `"attention"`.
        implementation: `None`/`"auto"` for the registry's priority list, or a name.
        device: the device to resolve for (default: JAX's default device).
        environ: environment to read the opt-outs from (default: `os.environ`).

    Raises:
        ValueError: `implementation` is not a known name.
    """
    if op not in DEVICE_DEFAULTS:
        raise ValueError(f"unknown op {op!r}; known ops: {sorted(DEVICE_DEFAULTS)}")
    requested = "auto" if implementation is None else implementation
    if requested != "auto" and requested not in implementations(op):
        raise ValueError(
            f"unknown implementation={implementation!r} for {op}; "
            f"expected None, 'auto' or one of {sorted(implementations(op))}"
        )
    device = current_device(environ, device)
    opt_outs = OptOuts.from_env(environ)
    if requested != "auto":
        return Backend(op, requested, (requested,), device, opt_outs)
    entries = DEVICE_DEFAULTS[op]
    key = device.registry_key if opt_outs.device_defaults else "generic"
    implementations(op)  # the op module registers its regimes on import

    def prune(priority):
        pruned = tuple(
            (name, f"disabled by the environment ({_env_var_for(op, name)}=0)")
            for name in priority
            if (op, name) in opt_outs.disabled
        )
        return tuple(n for n in priority if (op, n) not in opt_outs.disabled), pruned

    kept, pruned = prune(entries.get(key, entries["generic"]))
    regimes = tuple(
        (regime, *prune(entries[f"{key}:{regime}"]))
        for regime, _ in REGIMES.get(op, ())
        if f"{key}:{regime}" in entries
    )
    return Backend(op, "auto", kept, device, opt_outs, pruned, regimes)


def _env_var_for(op: str, name: str) -> str:
    return next(var for var, target in ENV_OPT_OUTS.items() if target == (op, name))


def explain(target: Any, *args: Any, **kwargs: Any) -> Choice:
    """Return the `Choice` that `target(*args, **kwargs)` would make, without running it.

    `target` is a module or functional op of this package, e.g.
    `explain(attention_module, x)` or `explain(dot_product_attention, q, k, v)`.
    """
    explainer = getattr(target, "explain", None)
    if explainer is None:
        raise TypeError(f"{target!r} has no backend to explain")
    return explainer(*args, **kwargs)
