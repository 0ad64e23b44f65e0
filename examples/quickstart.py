"""Quickstart: a tiny causal transformer LM of `probjax_eqx.Attention` blocks, trained with optax.

The task is synthetic and needs attention: each sequence is an arithmetic progression
modulo `vocab` with a random start and a random step, so predicting the next token means
inferring the step from the context. Chance level is log(vocab); a model that learned
the task gets close to zero after the first two tokens. After training, the model
continues 3-token prompts greedily from its KV caches (`prefill`, then `decode_step`
under one jitted `lax.scan`), and the continuations are checked against the progressions.

    python examples/quickstart.py            # ~1 minute on 2 CPU cores
    python examples/quickstart.py --steps 20 # smoke test
    python examples/quickstart.py --size large  # a bigger model for the GPU
"""

import argparse
import math
import pathlib
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import plot, resume
from jaxtyping import Array, Float, Int, PRNGKeyArray
from tqdm import tqdm

import probjax_eqx as pjx


class Block(eqx.Module):
    norm1: eqx.nn.RMSNorm
    attention: pjx.Attention
    norm2: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.RMSNorm(dim)
        self.attention = pjx.Attention(dim, heads, rope_theta=1e4, key=k1)
        self.norm2 = eqx.nn.RMSNorm(dim)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.down = eqx.nn.Linear(4 * dim, dim, key=k3)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return self._mlp(x + self.attention(jax.vmap(self.norm1)(x), mask=pjx.masks.Causal()))

    def prefill(
        self, x: Float[Array, "seq dim"], cache: pjx.KVCache
    ) -> tuple[Float[Array, "seq dim"], pjx.KVCache]:
        y, cache = self.attention.prefill(jax.vmap(self.norm1)(x), cache)
        return self._mlp(x + y), cache

    def decode_step(
        self, x: Float[Array, " dim"], cache: pjx.KVCache
    ) -> tuple[Float[Array, " dim"], pjx.KVCache]:
        y, cache = self.attention.decode_step(self.norm1(x), cache)
        return self._mlp((x + y)[None])[0], cache

    def _mlp(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.down)(h)


class TinyLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: tuple[Block, ...]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, *, key: PRNGKeyArray):
        keys = jax.random.split(key, depth + 2)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.blocks = tuple(Block(dim, heads, key=k) for k in keys[2:])
        self.norm = eqx.nn.RMSNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=keys[1])

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    def generate(self, prompt: Int[Array, " prompt"], new_tokens: int) -> Int[Array, " new"]:
        """Greedy continuation of `prompt`: one KV cache per block, a token a step."""
        caches = [block.attention.init_cache(prompt.shape[0] + new_tokens) for block in self.blocks]
        x = jax.vmap(self.embed)(prompt)
        for i, block in enumerate(self.blocks):
            x, caches[i] = block.prefill(x, caches[i])
        first = jnp.argmax(self.head(self.norm(x[-1])))

        def step(carry, _):
            token, caches = carry
            x = self.embed(token)
            caches = list(caches)
            for i, block in enumerate(self.blocks):
                x, caches[i] = block.decode_step(x, caches[i])
            return (jnp.argmax(self.head(self.norm(x))), caches), token

        return jax.lax.scan(step, (first, caches), length=new_tokens)[1]


# "small" is the CPU default (the flags' defaults); "large" is for a GPU.
SIZES = {
    "small": dict(dim=64, depth=2, heads=4, batch_size=32),
    "large": dict(dim=512, depth=8, heads=8, batch_size=128, seq_len=256, vocab=251),
}


def make_batch(key: PRNGKeyArray, batch: int, seq_len: int, vocab: int) -> Int[Array, "batch seq"]:
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (batch, 1), 0, vocab)
    step = jax.random.randint(k2, (batch, 1), 1, vocab)
    return (start + step * jnp.arange(seq_len)[None, :]) % vocab


def loss_fn(model: TinyLM, tokens: Int[Array, "batch seq"]) -> Array:
    logits = jax.vmap(model)(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return losses[:, 2:].mean()  # the first two targets cannot be inferred


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="small", help="sets dim, depth, heads, batch"
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=17)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint",
        type=pathlib.Path,
        default=None,
        help="where to save the trained model (default: a temporary file)",
    )
    parser.add_argument("--resume", type=pathlib.Path, default=None, help="checkpoint to continue")
    parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("quickstart_loss.png"))
    args = parser.parse_args(argv)
    if args.size != "small":
        for name, value in SIZES[args.size].items():
            setattr(args, name, value)

    key = jax.random.key(args.seed)
    model_key, data_key = jax.random.split(key)
    model = TinyLM(args.vocab, args.dim, args.depth, args.heads, key=model_key)
    print(
        "attention backend:",
        pjx.explain(model.blocks[0].attention, jnp.zeros((args.seq_len - 1, args.dim))).kernel,
    )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 10), decay_steps=args.steps
    )
    optimiser = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    model, opt_state = resume(args.resume, (model, opt_state))

    @eqx.filter_jit
    def train_step(model, opt_state, key):
        tokens = make_batch(key, args.batch_size, args.seq_len, args.vocab)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    eval_tokens = make_batch(jax.random.key(args.seed + 1), 256, args.seq_len, args.vocab)
    initial = float(loss_fn(model, eval_tokens))
    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc="train", mininterval=1.0)
    losses = []
    for step, step_key in zip(progress, jax.random.split(data_key, args.steps)):
        model, opt_state, loss = train_step(model, opt_state, step_key)
        losses.append(float(loss))
        if step % 50 == 0 or step == args.steps - 1:
            progress.set_postfix(loss=f"{float(loss):.3f}")
    final = float(loss_fn(model, eval_tokens))
    elapsed = time.perf_counter() - start
    print(
        f"eval loss {initial:.3f} -> {final:.3f} (chance {math.log(args.vocab):.3f}) "
        f"in {elapsed:.1f}s"
    )

    # Continue each eval progression from its first 3 tokens: one jitted program for all.
    prompt_len = 3
    generate = eqx.filter_jit(
        lambda model, prompts: jax.vmap(lambda p: model.generate(p, args.seq_len - prompt_len))(
            prompts
        )
    )
    continued = generate(model, eval_tokens[:, :prompt_len])
    accuracy = float(jnp.mean(continued == eval_tokens[:, prompt_len:]))
    print(f"greedy continuations from the KV caches: {accuracy:.1%} of tokens correct")

    plot(args.plot, {"training loss": {"loss": losses}})
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or pathlib.Path(tmp) / "tiny_lm.eqx"
        # The whole training state, so that --resume continues where this run stopped.
        eqx.tree_serialise_leaves(path, (model, opt_state))
        skeleton = TinyLM(args.vocab, args.dim, args.depth, args.heads, key=jax.random.key(123))
        skeleton_state = (skeleton, optimiser.init(eqx.filter(skeleton, eqx.is_array)))
        restored, _ = eqx.tree_deserialise_leaves(path, skeleton_state)
        reloaded = float(loss_fn(restored, eval_tokens))
    if reloaded != final:
        raise RuntimeError(f"checkpoint round trip changed the loss: {final} vs {reloaded}")
    print(f"checkpoint saved and reloaded: eval loss {reloaded:.3f}")
    return final


if __name__ == "__main__":
    main()
