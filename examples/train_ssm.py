"""Mamba and RLA sequence models on selective copying, with their loss curves compared.

Task (Gu & Dao, 2023): a sequence of noise tokens (0) with `--copy` data tokens at random
positions, then `--copy` query tokens; the model must emit the data tokens, in order, at
the query positions. It needs content-dependent memory: a fixed-size state must select
what to keep. Both models are embeddings -> residual blocks -> a linear head.

    python examples/train_ssm.py                # small CPU run, about a minute
    python examples/train_ssm.py --size large   # longer sequences for the GPU
"""

import argparse
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import check_round_trip, plot, resume, train

import probjax_eqx as pjx

SIZES = {
    "small": dict(seq=32, copy=4, vocab=8, dim=32, depth=2, batch=32, window=8),
    "large": dict(seq=512, copy=16, vocab=16, dim=256, depth=4, batch=64, window=64),
}


def make_batch(key, cfg):
    k1, k2 = jax.random.split(key)
    batch, seq, copy, vocab = cfg["batch"], cfg["seq"], cfg["copy"], cfg["vocab"]
    data = jax.random.randint(k1, (batch, copy), 1, vocab)
    # Random sorted positions for the data tokens in the first `seq` steps.
    scores = jax.random.uniform(k2, (batch, seq))
    positions = jnp.sort(jnp.argsort(scores, axis=1)[:, :copy], axis=1)
    body = jnp.zeros((batch, seq), jnp.int32).at[jnp.arange(batch)[:, None], positions].set(data)
    queries = jnp.full((batch, copy), vocab, jnp.int32)  # a dedicated query token
    return jnp.concatenate([body, queries], axis=1), data


class SequenceModel(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: tuple
    norms: tuple
    head: eqx.nn.Linear

    def __init__(self, kind, cfg, *, key):
        keys = jax.random.split(key, cfg["depth"] + 2)
        dim = cfg["dim"]
        self.embed = eqx.nn.Embedding(cfg["vocab"] + 1, dim, key=keys[0])
        if kind == "mamba":
            make = lambda k: pjx.Mamba(dim, d_state=16, key=k)  # noqa: E731
        else:
            make = lambda k: pjx.RLA(dim, 4, window=cfg["window"], chunk=16, key=k)  # noqa: E731
        self.blocks = tuple(make(k) for k in keys[2:])
        self.norms = tuple(eqx.nn.RMSNorm(dim) for _ in keys[2:])
        self.head = eqx.nn.Linear(dim, cfg["vocab"], key=keys[1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(jax.vmap(norm)(x))
        return jax.vmap(self.head)(x)


def loss_and_accuracy(model, tokens, data):
    copy = data.shape[1]
    logits = jax.vmap(model)(tokens)[:, -copy:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, data).mean()
    return loss, (jnp.argmax(logits, -1) == data).mean()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("ssm_curves.png"))
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=pathlib.Path("/tmp"))
    parser.add_argument("--resume", type=pathlib.Path, nargs=2, default=None,
                        metavar=("MAMBA", "RLA"), help="checkpoints to continue from")  # fmt: skip
    args = parser.parse_args(argv)
    cfg = SIZES[args.size]
    curves = {}
    for n, kind in enumerate(("mamba", "rla")):
        key = jax.random.key(args.seed + n)
        model = SequenceModel(kind, cfg, key=key)
        optimiser = optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps), weight_decay=1e-4),
        )
        state = (model, optimiser.init(eqx.filter(model, eqx.is_array)))
        state = resume(args.resume[n] if args.resume else None, state)

        @eqx.filter_jit
        def step(state, key, optimiser=optimiser):
            model, opt_state = state
            tokens, data = make_batch(key, cfg)
            (loss, acc), grads = eqx.filter_value_and_grad(loss_and_accuracy, has_aux=True)(
                model, tokens, data
            )
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimiser.update(grads, opt_state, params)
            return (eqx.apply_updates(model, updates), opt_state), {"loss": loss, "acc": acc}

        start = time.perf_counter()
        state, history = train(step, state, args.steps, jax.random.key(100 + n), desc=kind)
        eval_tokens, eval_data = make_batch(jax.random.key(999), dict(cfg, batch=256))
        loss, acc = loss_and_accuracy(state[0], eval_tokens, eval_data)
        chance, elapsed = 1 / (cfg["vocab"] - 1), time.perf_counter() - start
        print(f"{kind}: eval loss {float(loss):.3f}, copy accuracy {float(acc):.3f} "
              f"(chance {chance:.3f}) in {elapsed:.1f} s")  # fmt: skip
        curves[kind] = history["loss"]
        check_round_trip(args.checkpoint_dir / f"ssm_{kind}.eqx", state)
    plot(args.plot, {"selective copying: training loss": curves})


if __name__ == "__main__":
    main()
