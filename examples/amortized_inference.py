"""Neural posterior estimation with an ISAB set encoder, and its calibration.

Simulator (in JAX): theta = (mu, log sigma) from the prior N(0, 1) x U(-1, 1); then
`n ~ U{8..32}` observations `x_i ~ N(mu, sigma)`. Sets are padded to 32 and the encoder
(ISAB -> PMA) masks the padding with the per-set size, so padded entries never matter.
The network outputs a diagonal Gaussian q(theta | x), trained on -log q(theta | x) over
fresh simulations. Calibration: on held-out simulations, the fraction of true thetas
inside the 68% and 95% central intervals of q should be about 0.68 and 0.95.

    python examples/amortized_inference.py               # small CPU run, under a minute
    python examples/amortized_inference.py --size large  # wider encoder for the GPU
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import check_round_trip, plot, resume, train

import probjax_eqx as pjx

SIZES = {
    "small": dict(dim=32, heads=4, inducing=8, batch=64),
    "large": dict(dim=128, heads=8, inducing=32, batch=512),
}
MAX_N = 32


def simulate(key, batch):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    mu = jax.random.normal(k1, (batch,))
    log_sigma = jax.random.uniform(k2, (batch,), minval=-1.0, maxval=1.0)
    n = jax.random.randint(k3, (batch,), 8, MAX_N + 1)
    x = mu[:, None] + jnp.exp(log_sigma)[:, None] * jax.random.normal(k4, (batch, MAX_N))
    x = jnp.where(jnp.arange(MAX_N)[None] < n[:, None], x, 0.0)  # padding
    return jnp.stack([mu, log_sigma], -1), x[..., None], n


class PosteriorNet(eqx.Module):
    embed: eqx.nn.Linear
    isab: pjx.ISAB
    pool: pjx.PMA
    head: eqx.nn.MLP

    def __init__(self, cfg, *, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        dim = cfg["dim"]
        self.embed = eqx.nn.Linear(1, dim, key=k1)
        self.isab = pjx.ISAB(dim, cfg["heads"], cfg["inducing"], key=k2)
        self.pool = pjx.PMA(dim, cfg["heads"], 1, key=k3)
        self.head = eqx.nn.MLP(dim, 4, 2 * dim, 2, activation=jax.nn.gelu, key=k4)

    def __call__(self, x, n):
        h = self.isab(jax.vmap(self.embed)(x), size=n)
        out = self.head(self.pool(h, size=n)[0])
        return out[:2], out[2:]  # mean, log std of q(theta | x)


def nll(model, theta, x, n):
    mean, log_std = jax.vmap(model)(x, n)
    z = (theta - mean) / jnp.exp(log_std)
    return jnp.mean(jnp.sum(0.5 * z**2 + log_std, -1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("npe.png"))
    parser.add_argument("--checkpoint", type=pathlib.Path, default=pathlib.Path("/tmp/npe.eqx"))
    parser.add_argument("--resume", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    cfg = SIZES[args.size]
    model = PosteriorNet(cfg, key=jax.random.key(args.seed))
    optimiser = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps)),
    )
    state = resume(args.resume, (model, optimiser.init(eqx.filter(model, eqx.is_array))))

    @eqx.filter_jit
    def step(state, key):
        model, opt_state = state
        theta, x, n = simulate(key, cfg["batch"])
        loss, grads = eqx.filter_value_and_grad(nll)(model, theta, x, n)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt_state), {"nll": loss}

    state, history = train(step, state, args.steps, jax.random.key(args.seed + 1))
    model = state[0]
    theta, x, n = simulate(jax.random.key(12345), 2000)
    mean, log_std = eqx.filter_jit(lambda m, x, n: jax.vmap(m)(x, n))(model, x, n)
    z = np.abs(np.asarray((theta - mean) / jnp.exp(log_std)))
    coverage = {level: float((z < width).mean()) for level, width in ((0.68, 1.0), (0.95, 1.96))}
    print(f"held-out nll {float(nll(model, theta, x, n)):.3f}")
    print(f"coverage 68%: {coverage[0.68]:.3f}  95%: {coverage[0.95]:.3f}")
    check_round_trip(args.checkpoint, state)
    levels = np.linspace(0.05, 0.95, 10)
    widths = np.sqrt(2) * np.asarray(jax.scipy.special.erfinv(levels))
    observed = [float((z < w).mean()) for w in widths]
    plot(args.plot, {"training nll": {"nll": history["nll"]},
                     "calibration": {"observed": observed, "ideal": list(levels)}})  # fmt: skip


if __name__ == "__main__":
    main()
