"""A small MoE language model on synthetic text, with its load-balancing loss and expert loads.

Text: sentences from a small stochastic grammar generated here (no downloads), byte-level
tokens. Each block is causal `Attention` followed by a dropless top-2 `MoE` of SwiGLU
experts; the loss adds the Switch load-balancing loss and the router z-loss. The script
prints the eval loss and each expert's share of the routed tokens, and plots the loss
curves and the per-expert load.

    python examples/train_moe_lm.py               # small CPU run, about a minute
    python examples/train_moe_lm.py --size large  # more experts and width, for the GPU
    python examples/train_moe_lm.py --mesh data=2,expert=4  # 8 devices (CPU: simulated)

With `--mesh`, the batch is split over every mesh axis (data parallel) and each MoE's
experts over the `expert` axis (`probjax_eqx.expert_parallel_moe`); the rest of the
model is replicated. On the CPU the script asks XLA for as many host devices as the mesh
needs.
"""

import argparse
import math
import os
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import check_round_trip, plot, resume, train

import probjax_eqx as pjx

SIZES = {
    "small": dict(dim=64, depth=2, heads=4, experts=4, d_ff=96, batch=16, seq=48),
    "large": dict(dim=512, depth=6, heads=8, experts=16, d_ff=1024, batch=64, seq=256),
}
WORDS = {
    "subject": ["the cat", "a dog", "my friend", "the robot", "an owl"],
    "verb": ["sees", "likes", "chases", "builds", "finds"],
    "object": ["a ball", "the moon", "some bread", "a red box", "the river"],
    "end": [".", "!", " today.", " again."],
}


def corpus(n_sentences: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts = [" ".join([rng.choice(WORDS[k]) for k in ("subject", "verb", "object")])
             + rng.choice(WORDS["end"]) + " " for _ in range(n_sentences)]  # fmt: skip
    return np.frombuffer("".join(parts).encode(), np.uint8).astype(np.int32)


class Block(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attention: pjx.Attention
    norm2: eqx.nn.RMSNorm
    moe: pjx.MoE
    token_axes: tuple[str, ...] | None = eqx.field(static=True)

    def __init__(self, cfg, *, token_axes=None, key):
        k1, k2 = jax.random.split(key)
        self.token_axes = token_axes
        self.norm1, self.norm2 = eqx.nn.RMSNorm(cfg["dim"]), eqx.nn.RMSNorm(cfg["dim"])
        self.attention = pjx.Attention(cfg["dim"], cfg["heads"], rope_theta=1e4, key=k1)
        self.moe = pjx.MoE(cfg["dim"], cfg["d_ff"], num_experts=cfg["experts"], top_k=2, key=k2)

    def __call__(self, x):  # [batch, seq, dim]
        attend = lambda s: self.attention(jax.vmap(self.norm1)(s), mask=pjx.masks.Causal())  # noqa: E731
        x = x + jax.vmap(attend)(x)
        # The MoE routes every token of the batch together: one grouped matmul per expert
        # matrix for the whole batch.
        flat = x.reshape(-1, x.shape[-1])
        h = jax.vmap(self.norm2)(flat)
        if self.token_axes is None:
            y, aux = self.moe(h)
        else:  # one device's shard: its experts, its tokens (inside shard_map)
            y, aux = pjx.expert_parallel_moe_shard(
                self.moe, h, expert_axis="expert", token_axes=self.token_axes
            )
        return x + y.reshape(x.shape), aux


class MoELM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: tuple
    head: eqx.nn.Linear

    def __init__(self, cfg, *, token_axes=None, key):
        keys = jax.random.split(key, cfg["depth"] + 2)
        self.embed = eqx.nn.Embedding(256, cfg["dim"], key=keys[0])
        self.blocks = tuple(Block(cfg, token_axes=token_axes, key=k) for k in keys[2:])
        self.head = eqx.nn.Linear(cfg["dim"], 256, key=keys[1])

    def __call__(self, tokens):  # [batch, seq]
        x, auxes = jax.vmap(jax.vmap(self.embed))(tokens), []
        for block in self.blocks:
            x, aux = block(x)
            auxes.append(aux)
        return jax.vmap(jax.vmap(self.head))(x), auxes


def loss_fn(model, tokens, lb_weight=0.01, z_weight=1e-3):
    logits, auxes = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    lb = sum(a.load_balancing_loss for a in auxes) / len(auxes)
    z = sum(a.router_z_loss for a in auxes) / len(auxes)
    load = sum(a.fraction_routed for a in auxes) / len(auxes)
    return ce + lb_weight * lb + z_weight * z, (ce, lb, load)


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,expert=4"` -> `{"data": 2, "expert": 4}`."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit():
            raise SystemExit(f"--mesh takes name=size pairs like data=2,expert=4, got {text!r}")
        axes[name] = int(size)
    if "expert" not in axes:
        raise SystemExit("--mesh needs an 'expert' axis")
    return axes


def make_mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    count = math.prod(axes.values())
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"  # before JAX starts
    devices = jax.devices()
    if len(devices) < count:
        raise SystemExit(f"--mesh needs {count} devices, found {len(devices)}")
    grid = np.array(devices[:count]).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(grid, tuple(axes))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("moe_lm.png"))
    parser.add_argument("--checkpoint", type=pathlib.Path, default=pathlib.Path("/tmp/moe.eqx"))
    parser.add_argument("--resume", type=pathlib.Path, default=None)
    parser.add_argument("--mesh", type=parse_mesh, default=None, help="e.g. data=2,expert=4")
    args = parser.parse_args(argv)
    cfg = SIZES[args.size]
    mesh = None if args.mesh is None else make_mesh(args.mesh)
    text = jnp.asarray(corpus(4000, args.seed))
    held_out = jnp.asarray(corpus(400, args.seed + 1))
    axes = None if mesh is None else tuple(mesh.axis_names)
    model = MoELM(cfg, token_axes=axes, key=jax.random.key(args.seed))
    value_and_grad = eqx.filter_value_and_grad(loss_fn, has_aux=True)
    if mesh is not None:
        specs = pjx.expert_parallel_specs(model, "expert")
        model = pjx.sharding.shard(model, mesh, specs)
        batch_sharding = pjx.sharding.data_parallel(mesh, axes)
        # The loss runs per device; each MoE exchanges tokens with the experts' devices.
        value_and_grad = pjx.sharding.value_and_grad(
            loss_fn, mesh, specs, batch_axes=axes, local_axes=("expert",), has_aux=True
        )
        print(f"mesh {dict(mesh.shape)}: experts split over 'expert', batch over all axes")
    tokens_per_batch = cfg["batch"] * cfg["seq"]
    print(
        "expert dispatch:", model.blocks[0].moe.explain(jnp.zeros((tokens_per_batch, cfg["dim"])))
    )
    optimiser = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps)),
    )
    state = resume(args.resume, (model, optimiser.init(eqx.filter(model, eqx.is_array))))

    def windows(key, source, batch):
        starts = jax.random.randint(key, (batch,), 0, source.shape[0] - cfg["seq"] - 1)
        out = jax.vmap(lambda s: jax.lax.dynamic_slice(source, (s,), (cfg["seq"] + 1,)))(starts)
        if mesh is not None:
            out = jax.lax.with_sharding_constraint(out, batch_sharding)
        return out

    @eqx.filter_jit
    def step(state, key):
        model, opt_state = state
        (_, (ce, lb, _)), grads = value_and_grad(model, windows(key, text, cfg["batch"]))
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt_state), {"ce": ce, "lb": lb}

    state, history = train(step, state, args.steps, jax.random.key(args.seed + 2))
    held_out_batch = windows(jax.random.key(7), held_out, 128)
    (_, (ce, lb, load)), _ = eqx.filter_jit(value_and_grad)(state[0], held_out_batch)
    print(f"eval cross-entropy {float(ce):.3f} nats/byte (uniform {np.log(256):.3f}), "
          f"load-balancing loss {float(lb):.3f} (1.0 = even)")  # fmt: skip
    print("expert load:", np.round(np.asarray(load), 3).tolist())
    check_round_trip(args.checkpoint, state)
    losses = {"cross-entropy": history["ce"], "load balancing": history["lb"]}
    plot(args.plot, {"loss": losses})
    load_panel = {"expert load (eval)": {"fraction routed": np.asarray(load).tolist()}}
    plot(args.plot.with_name(args.plot.stem + "_load.png"), load_panel, kind="bar")


if __name__ == "__main__":
    main()
