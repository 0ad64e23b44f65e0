"""Weak scaling over the devices there are: train steps at a fixed batch per device.

Models: the MoE LM of `examples/train_moe_lm.py` (data parallel: experts replicated;
expert parallel: experts split over every device, `expert_parallel_moe`) and a
DiffusionTransformer (data parallel). For 1, 2, 4, 8 ... devices up to
`jax.device_count()`, one row each: the median train-step time (forward, gradients,
AdamW update) and `efficiency = t(1 device) / t(n devices)` (1.0 is perfect weak
scaling). On one GPU the rows are the single-device baselines the multi-GPU run
compares against.
"""

import functools
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.harness import classify, time_fn
from probjax_eqx import DiffusionTransformer, expert_parallel_specs, sharding

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import train_moe_lm  # noqa: E402

FULL = dict(
    moe_lm=dict(dim=512, depth=4, heads=8, experts=16, d_ff=1024, batch=8, seq=1024),
    dit=dict(tokens=256, dim=512, heads=8, layers=8, batch=64),
)
QUICK = dict(
    moe_lm=dict(dim=32, depth=1, heads=2, experts=8, d_ff=32, batch=2, seq=16),
    dit=dict(tokens=8, dim=32, heads=2, layers=1, batch=2),
)


def _mesh(n: int, axis: str) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), (axis,))


def _step(value_and_grad, optimiser):
    @eqx.filter_jit
    def step(model, opt_state, batch):
        _, grads = value_and_grad(model, batch)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    return step


def _moe_lm_case(cfg, n: int, mode: str):
    """`(model, batch, value_and_grad)` for `n` devices; `mode` is "data" or "expert".

    Both run the loss per device (`sharding.value_and_grad`); expert parallel keeps each
    device's experts local and exchanges tokens (`expert_parallel_moe_shard`).
    """
    batch_size = cfg["batch"] * n  # weak scaling: the batch grows with n

    def loss(m, b):
        return train_moe_lm.loss_fn(m, b)[0]

    tokens = jax.random.randint(jax.random.key(1), (batch_size, cfg["seq"] + 1), 0, 256)
    if mode == "expert":
        mesh = _mesh(n, "expert")
        model = train_moe_lm.MoELM(cfg, token_axes=("expert",), key=jax.random.key(0))
        specs = expert_parallel_specs(model, "expert")
        model = sharding.shard(model, mesh, specs)
        value_and_grad = sharding.value_and_grad(
            loss, mesh, specs, batch_axes="expert", local_axes=("expert",)
        )
    else:
        mesh = _mesh(n, "data")
        model = train_moe_lm.MoELM(cfg, key=jax.random.key(0))
        specs = sharding.replicated_specs(model)
        model = sharding.shard(model, mesh, specs)
        value_and_grad = sharding.value_and_grad(loss, mesh, specs)
    batch = jax.device_put(tokens, sharding.data_parallel(mesh, mesh.axis_names[0]))
    return model, batch, value_and_grad


def _dit_case(cfg, n: int, mode: str):
    del mode
    mesh = _mesh(n, "data")
    model = DiffusionTransformer(
        cfg["dim"], model_dim=cfg["dim"], num_heads=cfg["heads"], num_layers=cfg["layers"],
        key=jax.random.key(0),
    )  # fmt: skip
    specs = sharding.replicated_specs(model)
    model = sharding.shard(model, mesh, specs)
    batch_size = cfg["batch"] * n
    x = jax.random.normal(jax.random.key(1), (batch_size, cfg["tokens"], cfg["dim"]))
    t = jax.random.uniform(jax.random.key(2), (batch_size,))
    batch = jax.device_put((x, t), sharding.data_parallel(mesh, "data"))

    def loss(model, batch):
        x, t = batch
        noise = jax.random.normal(jax.random.key(3), x.shape)
        noisy = jnp.sqrt(1 - t)[:, None, None] * x + jnp.sqrt(t)[:, None, None] * noise
        pred = jax.vmap(model)(noisy, t)
        return jnp.mean((pred.astype(jnp.float32) - noise) ** 2)

    return model, batch, sharding.value_and_grad(loss, mesh, specs)


CASES = {
    "moe_lm data": (_moe_lm_case, "moe_lm", "data"),
    "moe_lm expert": (_moe_lm_case, "moe_lm", "expert"),
    "dit data": (_dit_case, "dit", "data"),
}


def run(writer, base_row, *, quick, repeats, only=None, seqs=None, overrides=None):
    if overrides:
        raise ValueError(f"--set is not supported by this suite (got {sorted(overrides)})")
    del seqs
    grid = QUICK if quick else FULL
    counts = [n for n in (1, 2, 4, 8, 16) if n <= jax.device_count()]
    for name, (build, model_name, mode) in CASES.items():
        if only is not None and name not in only:
            continue
        baseline = None
        for n in counts:
            cfg = grid[model_name]
            row = dict(base_row, suite="scaling", implementation=name, peer=False,
                       shape=dict(devices=n, **cfg), dtype="float32", status="ok",
                       message="")  # fmt: skip
            try:
                model, batch, value_and_grad = build(cfg, n, mode)
                optimiser = optax.adamw(1e-4)
                opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
                step = _step(value_and_grad, optimiser)
                ms = time_fn(functools.partial(step, model, opt_state, batch),
                             jax.block_until_ready, repeats=repeats)  # fmt: skip
                baseline = ms if n == 1 else baseline
                row.update(step_ms=ms, fwd_bwd_ms=ms)
                if baseline is not None:
                    row["efficiency"] = baseline / ms
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row["status"], row["message"] = classify(exc)
            writer.add(row)
            yield row
