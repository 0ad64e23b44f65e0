"""Fingerprints of the optimized programs of a few first-order train steps.

Run it under two source trees (PYTHONPATH) with XLA_FLAGS=--xla_gpu_autotune_level=0
(autotuning picks GEMM tiles differently from run to run) and compare: equal SHA-1s mean
a change left what the GPU runs untouched (H100 run 131: the custom_jvp autodiff).

    python -m bench.program_fingerprints OUT_DIR > fingerprints.json

Writes each program's text to OUT_DIR for `diff`.
"""

import hashlib
import json
import re
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import probjax_eqx as pjx
from probjax_eqx import masks


def _stripped(text: str) -> str:  # source locations differ between trees
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r'fingerprint_before_lhs="[0-9a-f]*"', "", text)


def _train_step(fn, *args) -> str:
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)  # noqa: E731
    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    return _stripped(step.lower(*args).compile().as_text())


def programs() -> dict[str, str]:
    key = jax.random.key(0)
    out = {}
    q = jax.random.normal(key, (4, 2048, 8, 128), jnp.bfloat16)
    for impl, mask in [(None, None), ("mosaic", masks.Causal()), ("triton", masks.Causal()),
                       ("cudnn", None)]:  # fmt: skip
        attend = lambda q, k, v, impl=impl, mask=mask: pjx.dot_product_attention(  # noqa: E731
            q, k, v, mask=mask, implementation=impl
        )
        out[f"attention_{impl}_{type(mask).__name__}"] = _train_step(attend, q, q, q)
    x = jax.random.normal(key, (2, 512, 256), jnp.bfloat16)
    modules = {
        "moe": pjx.MoE(256, 512, num_experts=8, top_k=2, key=key),
        "mamba2": pjx.Mamba2(256, key=key),
        "attention_module": pjx.Attention(embed_dim=256, num_heads=8, key=key),
    }
    for name, module in modules.items():
        params, static = eqx.partition(module, eqx.is_inexact_array)
        run = lambda p, x, s=static: jax.tree.leaves(jax.vmap(eqx.combine(p, s))(x))[0]  # noqa: E731
        out[name] = _train_step(run, params, x)
    return out


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    found = programs()
    for name, text in found.items():
        (folder / f"{name}.hlo").write_text(text)
    digest = {k: [hashlib.sha1(v.encode()).hexdigest(), len(v)] for k, v in found.items()}
    json.dump(digest, sys.stdout, indent=1)
