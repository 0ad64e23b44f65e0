"""Train a DiffusionTransformer as a denoising diffusion model on a 2-D toy distribution.

Data: a mixture of 8 Gaussians on a ring, generated here. Each training example is a
*set* of `--points` samples (tokens); without positional embeddings the DiT is
permutation-equivariant, so it models the points exchangeably. Objective: v-prediction
on a cosine schedule (`x_t = cos(a) x + sin(a) eps`, `v = cos(a) eps - sin(a) x`).
Sampling: deterministic DDIM steps from noise. The script prints the samples' moments
next to the data's and plots both to a PNG.

    python examples/train_dit.py                 # small CPU run, about a minute
    python examples/train_dit.py --size large    # a bigger model for the GPU
"""

import argparse
import math
import pathlib
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import resume
from tqdm import tqdm

import probjax_eqx as pjx

SIZES = {
    "small": dict(model_dim=64, num_heads=4, num_layers=2, batch=32, points=16),
    "large": dict(model_dim=256, num_heads=8, num_layers=8, batch=256, points=64),
}


def sample_data(key, shape):
    """A ring of 8 Gaussians (radius 2, std 0.15)."""
    k1, k2 = jax.random.split(key)
    centre = jax.random.randint(k1, shape, 0, 8) * (2 * math.pi / 8)
    ring = 2.0 * jnp.stack([jnp.cos(centre), jnp.sin(centre)], -1)
    return ring + 0.15 * jax.random.normal(k2, (*shape, 2))


def diffuse(x, eps, t):
    angle = t * math.pi / 2
    return jnp.cos(angle) * x + jnp.sin(angle) * eps, jnp.cos(angle) * eps - jnp.sin(angle) * x


def loss_fn(model, x, key):
    k1, k2 = jax.random.split(key)
    t = jax.random.uniform(k1, (x.shape[0],))
    eps = jax.random.normal(k2, x.shape)
    x_t, v = jax.vmap(diffuse)(x, eps, t[:, None, None])
    pred = jax.vmap(model)(x_t, t)
    return jnp.mean((pred - v) ** 2)


def sample(model, key, shape, steps):
    """DDIM with v-prediction, from t = 1 (noise) to t = 0."""
    x = jax.random.normal(key, shape)
    times = jnp.linspace(1.0, 0.0, steps + 1)

    def step(x, ts):
        t, t_next = ts
        v = jax.vmap(lambda xi: model(xi, t))(x)
        a, a_next = t * math.pi / 2, t_next * math.pi / 2
        x0 = jnp.cos(a) * x - jnp.sin(a) * v
        eps = jnp.sin(a) * x + jnp.cos(a) * v
        return jnp.cos(a_next) * x0 + jnp.sin(a_next) * eps, None

    return jax.lax.scan(step, x, (times[:-1], times[1:]))[0]


def moments(x):
    flat = np.asarray(x).reshape(-1, 2)
    return {
        "mean": flat.mean(0).round(3).tolist(),
        "radius": float(np.linalg.norm(flat, axis=1).mean().round(3)),
        "radius_std": float(np.linalg.norm(flat, axis=1).std().round(3)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--sample-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("dit_samples.png"))
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None)
    parser.add_argument("--resume", type=pathlib.Path, default=None, help="checkpoint to continue")
    args = parser.parse_args(argv)
    cfg = SIZES[args.size]
    key = jax.random.key(args.seed)
    model_key, data_key, sample_key = jax.random.split(key, 3)
    model = pjx.DiffusionTransformer(
        2,
        model_dim=cfg["model_dim"],
        num_heads=cfg["num_heads"],
        num_layers=cfg["num_layers"],
        compute_dtype=None if jax.devices()[0].platform == "cpu" else "bfloat16",
        key=model_key,
    )
    warmup = min(100, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr * 0.05)
    optimiser = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4)
    )
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    model, opt_state = resume(args.resume, (model, opt_state))

    @eqx.filter_jit
    def train_step(model, opt_state, key):
        k1, k2 = jax.random.split(key)
        x = sample_data(k1, (cfg["batch"], cfg["points"]))
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, k2)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses, start = [], time.perf_counter()
    for step_key in tqdm(jax.random.split(data_key, args.steps), desc="train", mininterval=2):
        model, opt_state, loss = train_step(model, opt_state, step_key)
        losses.append(float(loss))
    print(f"loss {np.mean(losses[:50]):.4f} -> {np.mean(losses[-50:]):.4f} "
          f"in {time.perf_counter() - start:.1f} s")  # fmt: skip

    samples = eqx.filter_jit(sample)(model, sample_key, (64, cfg["points"], 2), args.sample_steps)
    data = sample_data(jax.random.key(args.seed + 1), (64, cfg["points"]))
    print("data moments   ", moments(data))
    print("sample moments ", moments(samples))

    path = args.checkpoint or pathlib.Path(tempfile.mkdtemp()) / "dit.eqx"
    eqx.tree_serialise_leaves(path, (model, opt_state))
    restored, _ = eqx.tree_deserialise_leaves(path, (model, opt_state))
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(restored, eqx.is_array))))  # fmt: skip
    print(f"checkpoint saved and reloaded: {path}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    for ax, pts, title in ((ax1, data, "data"), (ax2, samples, "DiT samples")):
        flat = np.asarray(pts).reshape(-1, 2)
        ax.scatter(flat[:, 0], flat[:, 1], s=2, alpha=0.5)
        ax.set(title=title, xlim=(-3, 3), ylim=(-3, 3), aspect="equal")
    fig.savefig(args.plot, dpi=100)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
