"""`python -m probjax_eqx`: the device, its registry entry, opt-outs and sample choices."""

import jax
import jax.numpy as jnp

from probjax_eqx import masks
from probjax_eqx.attention import explain_attention
from probjax_eqx.backends import (
    DETERMINISTIC_FLAGS,
    DEVICE_DEFAULTS,
    OptOuts,
    UnsupportedError,
    current_device,
    resolve,
)


def _sample_calls():
    def qkv(b, lq, lkv, hq, hkv, d, dtype):
        q = jax.ShapeDtypeStruct((b, lq, hq, d), dtype)
        kv = jax.ShapeDtypeStruct((b, lkv, hkv, d), dtype)
        return q, kv, kv

    yield (
        "bf16 B4 T4096 H8 hd128, causal",
        qkv(4, 4096, 4096, 8, 8, 128, jnp.bfloat16),
        masks.Causal(),
    )
    yield (
        "bf16 GQA 32/8 heads, kv lengths",
        qkv(2, 1024, 1024, 32, 8, 64, jnp.bfloat16),
        (masks.KVLengths(jnp.array([1024, 512]))),
    )
    yield (
        "f32 B2 T512 hd64, local window",
        qkv(2, 512, 512, 4, 4, 64, jnp.float32),
        (masks.causal_local_window(128)),
    )
    yield (
        "bf16 segments (packed)",
        qkv(1, 256, 256, 4, 4, 64, jnp.bfloat16),
        masks.Segments(jnp.zeros((1, 256), jnp.int32)),
    )


def main() -> None:
    device = current_device()
    opt_outs = OptOuts.from_env()
    print(
        f"jax {jax.__version__}; device: {device.device_kind} (platform {device.platform}, "
        f"compute capability {device.compute_capability})"
    )
    key = device.registry_key if opt_outs.device_defaults else "generic"
    print(f"registry entry: {key!r}")
    for op, entries in DEVICE_DEFAULTS.items():
        print(f"  {op}: {' > '.join(entries.get(key, entries['generic']))}")
    print("env opt-outs in force: " + (", ".join(opt_outs.describe()) or "none"))
    print(
        "deterministic ops (XLA_FLAGS "
        + " or ".join(DETERMINISTIC_FLAGS)
        + f"): {'on: no float atomics' if device.deterministic else 'off'}"
    )
    backend = resolve("attention")
    for label, (q, k, v), mask in _sample_calls():
        print(f"\n{label}:")
        try:
            print(
                "  "
                + str(explain_attention(q, k, v, mask=mask, implementation=backend)).replace(
                    "\n", "\n  "
                )
            )
        except UnsupportedError as err:
            print(f"  no implementation: {err}")


if __name__ == "__main__":
    main()
