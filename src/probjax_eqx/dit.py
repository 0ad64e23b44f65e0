"""DiffusionTransformer (Peebles & Xie, 2023): transformer blocks with adaLN-Zero on `Attention`.

Each block is modulated by the conditioning vector `c` (time embedding, plus a class
embedding when labels are used): `shift, scale, gate = Linear(SiLU(c))` before attention
and before the MLP, with that linear zero-initialised so every block starts as the
identity. Time enters through Gaussian-Fourier features and an MLP. Without positional
embeddings the model is permutation-equivariant over tokens (sets, particles, points).
Optional cross-attention to a `context` sequence. Parameters stay in their dtype and the
blocks compute in `compute_dtype` (e.g. bfloat16); `scan_layers=True` runs the stacked
blocks under `lax.scan` (one compiled block).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from probjax_eqx._inputs import check_width
from probjax_eqx.attention import Attention


class GaussianFourierFeatures(eqx.Module):
    """`[sin(2 pi t w), cos(2 pi t w)]` with fixed random frequencies `w ~ N(0, scale^2)`."""

    frequencies: Float[Array, " half"]

    def __init__(self, dim: int, *, scale: float = 16.0, key: PRNGKeyArray):
        if dim % 2:
            raise ValueError(f"dim={dim} must be even")
        self.frequencies = jax.random.normal(key, (dim // 2,)) * scale

    def __call__(self, t: Float[Array, ""]) -> Float[Array, " dim"]:
        angles = 2 * math.pi * t * jax.lax.stop_gradient(self.frequencies)  # fixed, not trained
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)])


def _zero_linear(in_dim, out_dim, dtype):
    linear = eqx.nn.Linear(in_dim, out_dim, dtype=dtype, key=jax.random.key(0))
    zero = lambda a: jnp.zeros_like(a)  # noqa: E731
    return eqx.tree_at(
        lambda m: (m.weight, m.bias), linear, (zero(linear.weight), zero(linear.bias))
    )


def _layer_norm(x):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype)


class DiTBlock(eqx.Module):
    """One adaLN-Zero transformer block."""

    attention: Attention
    cross_attention: Attention | None
    mlp_up: eqx.nn.Linear
    mlp_down: eqx.nn.Linear
    modulation: eqx.nn.Linear

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mlp_ratio: float = 4.0,
        context_dim: int | None = None,
        implementation: str | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        attn = lambda k, ctx: Attention(  # noqa: E731
            dim, num_heads, context_dim=ctx, implementation=implementation, dtype=dtype, key=k
        )
        self.attention = attn(k1, None)
        self.cross_attention = None if context_dim is None else attn(k2, context_dim)
        hidden = int(dim * mlp_ratio)
        self.mlp_up = eqx.nn.Linear(dim, hidden, dtype=dtype, key=k3)
        self.mlp_down = eqx.nn.Linear(hidden, dim, dtype=dtype, key=k4)
        self.modulation = _zero_linear(dim, 6 * dim, dtype)  # adaLN-Zero: identity at init

    def __call__(
        self,
        x: Float[Array, "n dim"],
        c: Float[Array, " dim"],
        context: Float[Array, "m context"] | None = None,
    ) -> Float[Array, "n dim"]:
        mods = self.modulation(jax.nn.silu(c)).astype(x.dtype)
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mods, 6)
        h = _layer_norm(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attention(h)
        if self.cross_attention is not None and context is not None:
            x = x + self.cross_attention(_layer_norm(x), context.astype(x.dtype))
        h = _layer_norm(x) * (1 + scale2) + shift2
        mlp = jax.vmap(lambda r: self.mlp_down(jax.nn.gelu(self.mlp_up(r))))(h)
        return x + gate2 * mlp


class DiffusionTransformer(eqx.Module):
    """A DiT over `[tokens, in_dim]` inputs, conditioned on a time (and label / context)."""

    in_proj: eqx.nn.Linear
    time_features: GaussianFourierFeatures
    time_mlp: eqx.nn.MLP
    label_embedding: eqx.nn.Embedding | None
    positions: Float[Array, "max_tokens dim"] | None
    blocks: DiTBlock  # stacked: every array leaf has a leading layer axis
    final_modulation: eqx.nn.Linear
    out_proj: eqx.nn.Linear
    num_layers: int = eqx.field(static=True)
    scan_layers: bool = eqx.field(static=True)
    compute_dtype: str | None = eqx.field(static=True)

    def __init__(
        self,
        in_dim: int,
        out_dim: int | None = None,
        *,
        model_dim: int = 128,
        num_heads: int = 4,
        num_layers: int = 4,
        num_classes: int | None = None,
        context_dim: int | None = None,
        max_tokens: int | None = None,
        scan_layers: bool = True,
        compute_dtype: str | None = "bfloat16",
        implementation: str | None = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """Build the model.

        Args:
            in_dim: token width of the input.
            out_dim: token width of the output (default `in_dim`).
            model_dim: transformer width.
            num_heads: attention heads.
            num_layers: blocks.
            num_classes: class labels for conditioning (one more index: "no label").
            context_dim: width of a cross-attended context, or `None`.
            max_tokens: learned positional embeddings for up to this many tokens; `None`
                keeps the model permutation-equivariant.
            scan_layers: run the blocks under `lax.scan`.
            compute_dtype: dtype of the blocks' arithmetic (parameters keep `dtype`).
            implementation: attention backend.
            dtype: parameter dtype.
            key: PRNG key.
        """
        keys = jax.random.split(key, 7)
        out_dim = in_dim if out_dim is None else out_dim
        self.in_proj = eqx.nn.Linear(in_dim, model_dim, dtype=dtype, key=keys[0])
        self.time_features = GaussianFourierFeatures(model_dim, key=keys[1])
        self.time_mlp = eqx.nn.MLP(
            model_dim, model_dim, model_dim, 1, activation=jax.nn.silu, dtype=dtype, key=keys[2]
        )
        self.label_embedding = (
            None
            if num_classes is None
            else eqx.nn.Embedding(num_classes + 1, model_dim, dtype=dtype, key=keys[3])
        )
        self.positions = (
            None
            if max_tokens is None
            else jax.random.normal(keys[4], (max_tokens, model_dim), dtype or jnp.float32) * 0.02
        )
        make = lambda k: DiTBlock(  # noqa: E731
            model_dim,
            num_heads,
            context_dim=context_dim,
            implementation=implementation,
            dtype=dtype,
            key=k,
        )
        self.blocks = eqx.filter_vmap(make)(jax.random.split(keys[5], num_layers))
        self.final_modulation = _zero_linear(model_dim, 2 * model_dim, dtype)
        self.out_proj = _zero_linear(model_dim, out_dim, dtype)
        self.num_layers, self.scan_layers = num_layers, scan_layers
        self.compute_dtype = compute_dtype

    def __call__(
        self,
        x: Float[Array, "tokens in_dim"],
        t: float | Float[ArrayLike, ""],
        *,
        label: int | Int[ArrayLike, ""] | None = None,
        context: Float[Array, "m context"] | None = None,
    ) -> Float[Array, "tokens out_dim"]:
        """Predict (noise, velocity, ...) for tokens `x` at diffusion time `t`."""
        check_width("DiffusionTransformer", "x", x, self.in_proj.weight.shape[-1])
        dtype = jnp.dtype(self.compute_dtype or x.dtype)
        h = jax.vmap(self.in_proj)(x)
        if self.positions is not None:
            h = h + self.positions[: x.shape[0]]
        c = self.time_mlp(self.time_features(jnp.asarray(t, jnp.float32)))
        if self.label_embedding is not None and label is not None:
            c = c + self.label_embedding(jnp.asarray(label, jnp.int32))
        h, c = h.astype(dtype), c.astype(dtype)
        params, static = eqx.partition(self.blocks, eqx.is_array)
        cast = jax.tree.map(
            lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params
        )

        def layer(h, p):
            return eqx.combine(p, static)(h, c, context), None

        if self.scan_layers:
            h, _ = jax.lax.scan(layer, h, cast)
        else:
            for i in range(self.num_layers):
                h, _ = layer(h, jax.tree.map(lambda p, i=i: p[i], cast))
        shift, scale = jnp.split(self.final_modulation(jax.nn.silu(c.astype(jnp.float32))), 2)
        h = _layer_norm(h.astype(jnp.float32)) * (1 + scale) + shift
        return jax.vmap(self.out_proj)(h).astype(x.dtype)
