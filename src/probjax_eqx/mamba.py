"""Mamba (selective state-space) blocks: the selective scan and a recurrent decode step.

The selective scan, per channel `d` and state `n`:

    h_t = exp(dt_t[d] A[d, n]) h_{t-1} + dt_t[d] B_t[n] x_t[d]
    y_t[d] = C_t . h_t[d] + D[d] x_t[d]

Implementations (`implementation=`, resolved through the registry's `"selective_scan"`
entry): `"scan"` (sequential `lax.scan`, the reference, O(d n) memory), `"associative"`
(`lax.associative_scan` over the affine maps `h -> a h + b`, O(L d n) memory, log-depth)
and `"triton"` (our Pallas kernel, `kernels/triton/ssm.py`; the default on a GPU).
`None`/`"auto"` takes the first that runs. `Mamba` wraps it as in Gu & Dao (2023):
input projection to `x, z`, causal depthwise conv1d + SiLU on `x`, data-dependent `dt, B,
C`, the scan, gating by `SiLU(z)`, output projection; parameters are initialised as in
the official implementation (`A_log = log(1..N)`, `D = 1`, `dt` bias log-uniform in
`[dt_min, dt_max]` through the inverse softplus).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from probjax_eqx import recurrence
from probjax_eqx._autodiff import kernel_then_reference
from probjax_eqx._inputs import check_width
from probjax_eqx.backends import Backend, Choice, resolve
from probjax_eqx.kernels.triton import ssm as triton_ssm


def selective_scan(
    x: Float[Array, "seq d"],
    dt: Float[Array, "seq d"],
    a: Float[Array, "d n"],
    b: Float[Array, "seq n"],
    c: Float[Array, "seq n"],
    d_skip: Float[Array, " d"],
    *,
    h0: Float[Array, "d n"] | None = None,
    implementation: str | Backend | None = None,
    config: object = None,
) -> tuple[Float[Array, "seq d"], Float[Array, "d n"]]:
    """The selective scan (module docstring) in float32; returns `y` and the last state.

    `implementation`: `None`/`"auto"`, `"scan"`, `"associative"`, `"triton"` or a resolved
    `Backend`; `config` a `SelectiveScanConfig` for `"triton"`.
    """
    f32 = jnp.float32
    choice = recurrence.select("selective_scan", x.shape[0], x.dtype, implementation, config)
    h0 = jnp.zeros(a.shape, f32) if h0 is None else h0.astype(f32)
    if choice.kernel == "triton":

        def kernel(x, dt, a, b, c, d_skip, h0):
            y, h_last = triton_ssm.selective_scan(x, dt, a, b, c, h0, config=choice.config)
            return y + d_skip.astype(f32) * x.astype(f32), h_last

        def reference(x, dt, a, b, c, d_skip, h0):
            return selective_scan(x, dt, a, b, c, d_skip, h0=h0, implementation="scan")

        return kernel_then_reference(kernel, reference, x, dt, a, b, c, d_skip, h0)
    implementation = choice.kernel
    x, dt, a, b, c = (t.astype(f32) for t in (x, dt, a, b, c))
    decay = jnp.exp(dt[:, :, None] * a[None])  # [seq, d, n]
    drive = (dt * x)[:, :, None] * b[:, None, :]  # [seq, d, n]
    if implementation == "scan":

        def step(h, inputs):
            decay_t, drive_t, c_t = inputs
            h = decay_t * h + drive_t
            return h, h @ c_t

        h_last, y = jax.lax.scan(step, h0, (decay, drive, c))
    elif implementation == "associative":
        if x.shape[0] == 0:  # no steps: the state stays (h[-1] below needs one)
            return jnp.zeros(x.shape, f32), h0

        def combine(left, right):
            a1, b1 = left
            a2, b2 = right
            return a1 * a2, a2 * b1 + b2

        drive = drive.at[0].add(decay[0] * h0)
        _, h = jax.lax.associative_scan(combine, (decay, drive))
        y, h_last = jnp.einsum("ldn,ln->ld", h, c), h[-1]
    else:
        raise ValueError(f"implementation={implementation!r}: expected 'scan' or 'associative'")
    return y + d_skip.astype(f32) * x, h_last


class MambaCache(eqx.Module):
    """Recurrent state of one `Mamba` block: the conv window and the SSM state."""

    conv: Float[Array, "width d_inner"]
    ssm: Float[Array, "d_inner d_state"]


def _uniform(key, shape, bound, dtype):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _dt_bias(key, shape, dt_min, dt_max, floor, dtype):
    """softplus^-1 of a log-uniform `dt` in `[dt_min, dt_max]`, at least `floor`."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _causal_conv(x, window, weight, bias):
    """SiLU of the causal depthwise conv of `x` after `window`, and the next window.

    `window` holds the inputs before `x` (zeros at the start of a sequence).
    """
    seq, width = x.shape[0], weight.shape[0]
    padded = jnp.concatenate([window.astype(x.dtype), x], axis=0)
    # Tap k sees input t - (width - 1 - k).
    out = sum(padded[k : k + seq] * weight[k] for k in range(width))
    return jax.nn.silu(out + bias), padded[seq:]


class Mamba(eqx.Module):
    """A Mamba-1 block; unbatched `[seq, d_model]` (use `jax.vmap`)."""

    in_proj: Float[Array, "d_model two_inner"]
    conv_weight: Float[Array, "width d_inner"]
    conv_bias: Float[Array, " d_inner"]
    x_proj: Float[Array, "d_inner dt_bc"]
    dt_proj: Float[Array, "dt_rank d_inner"]
    dt_bias: Float[Array, " d_inner"]
    a_log: Float[Array, "d_inner d_state"]
    d_skip: Float[Array, " d_inner"]
    out_proj: Float[Array, "d_inner d_model"]
    d_state: int = eqx.field(static=True)
    dt_rank: int = eqx.field(static=True)
    backend: Backend = eqx.field(static=True)
    config: object = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | None = None,
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        implementation: str | None = None,
        config: object = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """Initialise as the official Mamba (see the module docstring).

        Args:
            d_model: token width.
            d_state: SSM state size N per channel.
            d_conv: causal conv1d width.
            expand: inner width `expand * d_model`.
            dt_rank: rank of the `dt` projection (default `ceil(d_model / 16)`).
            dt_min: lower end of the `dt` initialisation range.
            dt_max: upper end of the `dt` initialisation range.
            dt_init_floor: smallest initial `dt`.
            implementation: the selective scan's backend: `None`/`"auto"`, `"scan"`,
                `"associative"` or `"triton"`.
            config: the pinned implementation's config (a `SelectiveScanConfig`).
            dtype: parameter dtype.
            key: PRNG key.
        """
        dtype = jnp.float32 if dtype is None else dtype
        d_inner = expand * d_model
        dt_rank = math.ceil(d_model / 16) if dt_rank is None else dt_rank
        keys = jax.random.split(key, 6)
        self.in_proj = _uniform(keys[0], (d_model, 2 * d_inner), d_model**-0.5, dtype)
        self.conv_weight = _uniform(keys[1], (d_conv, d_inner), d_conv**-0.5, dtype)
        self.conv_bias = jnp.zeros((d_inner,), dtype)
        self.x_proj = _uniform(keys[2], (d_inner, dt_rank + 2 * d_state), d_inner**-0.5, dtype)
        self.dt_proj = _uniform(keys[3], (dt_rank, d_inner), dt_rank**-0.5, dtype)
        self.dt_bias = _dt_bias(keys[4], (d_inner,), dt_min, dt_max, dt_init_floor, dtype)
        a = jnp.broadcast_to(jnp.arange(1, d_state + 1, dtype=jnp.float32), (d_inner, d_state))
        self.a_log = jnp.log(a).astype(dtype)
        self.d_skip = jnp.ones((d_inner,), dtype)
        self.out_proj = _uniform(keys[5], (d_inner, d_model), d_inner**-0.5, dtype)
        self.d_state, self.dt_rank = d_state, dt_rank
        self.backend = resolve("selective_scan", implementation)
        self.config = config

    @property
    def d_inner(self) -> int:
        return self.d_skip.shape[0]

    def _ssm_inputs(self, x):
        proj = x @ self.x_proj
        dt_low = proj[:, : self.dt_rank]
        b = proj[:, self.dt_rank : self.dt_rank + self.d_state]
        c = proj[:, self.dt_rank + self.d_state :]
        dt = jax.nn.softplus(dt_low @ self.dt_proj + self.dt_bias)
        return dt, -jnp.exp(self.a_log.astype(jnp.float32)), b, c

    def _forward(self, x, cache: MambaCache):
        xz = x @ self.in_proj
        u, z = xz[:, : self.d_inner], xz[:, self.d_inner :]
        u, window = _causal_conv(u, cache.conv, self.conv_weight, self.conv_bias)
        dt, a, b, c = self._ssm_inputs(u)
        y, h = selective_scan(
            u, dt, a, b, c, self.d_skip, h0=cache.ssm, implementation=self.backend,
            config=self.config,
        )  # fmt: skip
        y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
        return y @ self.out_proj, MambaCache(window, h)

    def explain(self, x: Array | jax.ShapeDtypeStruct) -> Choice:
        """The selective scan's `Choice` for `x` `[seq, d_model]`."""
        return recurrence.select("selective_scan", x.shape[0], x.dtype, self.backend, self.config)

    def init_cache(self, dtype=None) -> MambaCache:
        """The state before the first token."""
        dtype = self.in_proj.dtype if dtype is None else dtype
        width = self.conv_weight.shape[0]
        return MambaCache(
            conv=jnp.zeros((width - 1, self.d_inner), dtype),
            ssm=jnp.zeros((self.d_inner, self.d_state), jnp.float32),
        )

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        """The block over a whole sequence (from the zero state)."""
        check_width("Mamba", "x", x, self.in_proj.shape[0])
        return self._forward(x, self.init_cache(x.dtype))[0]

    def decode_step(
        self, x: Float[Array, " d_model"], cache: MambaCache
    ) -> tuple[Float[Array, " d_model"], MambaCache]:
        """One token through the recurrence; equal to the matching row of `__call__`."""
        check_width("Mamba", "x", x, self.in_proj.shape[0], ranks=(1,))
        y, cache = self._forward(x[None], cache)
        return y[0], cache


def ssd(
    x: Float[Array, "seq heads p"],
    dt: Float[Array, "seq heads"],
    a: Float[Array, " heads"],
    b: Float[Array, "seq n"],
    c: Float[Array, "seq n"],
    d_skip: Float[Array, " heads"],
    *,
    chunk: int = 64,
    h0: Float[Array, "heads p n"] | None = None,
    implementation: str | Backend | None = None,
    config: object = None,
) -> tuple[Float[Array, "seq heads p"], Float[Array, "heads p n"]]:
    """Mamba-2's scan with a scalar decay per head, in float32; returns `y` and the last state.

    `h_t = exp(dt_t a) h_{t-1} + dt_t x_t B_t^T`, `y_t = h_t C_t + D x_t` per head.
    `"chunked"` is the state-space duality: within a chunk a masked, decay-weighted
    `C B^T` matmul; across chunks the carried state. `"triton"` is the same on our Pallas
    kernel (`config`: a `ChunkedLinearConfig`, whose `chunk` it uses); `"scan"` the
    sequential reference. `None`/`"auto"` resolves through the registry's `"ssd"` entry.
    """
    f32 = jnp.float32
    seq, heads, p = x.shape
    n = b.shape[1]
    choice = recurrence.select("ssd", seq, x.dtype, implementation, config, features=n + p)
    h0 = jnp.zeros((heads, p, n), f32) if h0 is None else h0.astype(f32)
    skip = d_skip.astype(f32)[None, :, None] * x.astype(f32)
    if choice.kernel == "triton":

        def kernel(x, dt, a, b, c, skip, h0):
            # B and C are one group shared by every head: q = C, k = B, v = dt x.
            v = (dt[..., None].astype(f32) * x.astype(f32)).astype(x.dtype)
            y, h_last = triton_ssm.chunked_linear_attention(
                c[:, None], b[:, None], v, dt.astype(f32) * a.astype(f32),
                jnp.swapaxes(h0, 1, 2), config=choice.config,
            )  # fmt: skip
            return y + skip, jnp.swapaxes(h_last, 1, 2)

        def reference(x, dt, a, b, c, skip, h0):
            y, h_last = ssd(x, dt, a, b, c, jnp.zeros_like(d_skip), chunk=chunk, h0=h0,
                            implementation="chunked")  # fmt: skip
            return y + skip, h_last

        return kernel_then_reference(kernel, reference, x, dt, a, b, c, skip, h0)
    implementation = choice.kernel
    x, dt, a, b, c = (t.astype(f32) for t in (x, dt, a, b, c))
    if implementation == "scan":

        def step(h, inputs):
            x_t, dt_t, b_t, c_t = inputs
            h = jnp.exp(dt_t * a)[:, None, None] * h + (dt_t[:, None] * x_t)[..., None] * b_t
            return h, h @ c_t

        h_last, y = jax.lax.scan(step, h0, (x, dt, b, c))
        return y + skip, h_last
    pad = -seq % chunk
    padded = [jnp.pad(t, [(0, pad)] + [(0, 0)] * (t.ndim - 1)) for t in (x, dt, b, c)]
    xs, dts, bs, cs = (t.reshape(-1, chunk, *t.shape[1:]) for t in padded)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    hp = jax.lax.Precision.HIGHEST

    def chunk_step(h, inputs):
        x_c, dt_c, b_c, c_c = inputs  # [Q, H, P], [Q, H], [Q, N], [Q, N]
        log_decay = jnp.cumsum(dt_c * a, axis=0)  # [Q, H]: log prod_{k <= i} exp(dt_k a)
        # decay from j (exclusive) to i (inclusive): exp(cum_i - cum_j), i >= j
        seg = log_decay[:, None, :] - log_decay[None, :, :]  # [Q(i), Q(j), H]
        weights = jnp.where(causal[:, :, None], jnp.exp(jnp.where(causal[:, :, None], seg, 0)), 0)
        cb = jnp.einsum("in,jn->ij", c_c, b_c, precision=hp)
        intra = jnp.einsum("ij,ijh,jh,jhp->ihp", cb, weights, dt_c, x_c, precision=hp)
        inter = jnp.einsum("in,hpn,ih->ihp", c_c, h, jnp.exp(log_decay), precision=hp)
        to_end = jnp.exp(log_decay[-1][None] - log_decay)  # [Q, H]
        h = jnp.exp(log_decay[-1])[:, None, None] * h + jnp.einsum(
            "jh,jh,jhp,jn->hpn", to_end, dt_c, x_c, b_c, precision=hp
        )
        return h, intra + inter

    h_last, y = jax.lax.scan(chunk_step, h0, (xs, dts, bs, cs))
    # Padded steps have dt = 0: decay 1 and no input, so the final state is unchanged.
    return y.reshape(-1, heads, p)[:seq] + skip, h_last


class Mamba2Cache(eqx.Module):
    """Recurrent state of one `Mamba2` block: the conv window and the SSM state."""

    conv: Float[Array, "width conv_dim"]
    ssm: Float[Array, "heads p n"]


class Mamba2(eqx.Module):
    """A Mamba-2 block (one B/C group); unbatched `[seq, d_model]`."""

    in_proj: Float[Array, "d_model proj"]
    conv_weight: Float[Array, "width conv_dim"]
    conv_bias: Float[Array, " conv_dim"]
    dt_bias: Float[Array, " heads"]
    a_log: Float[Array, " heads"]
    d_skip: Float[Array, " heads"]
    norm: Float[Array, " d_inner"]
    out_proj: Float[Array, "d_inner d_model"]
    head_dim: int = eqx.field(static=True)
    d_state: int = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    backend: Backend = eqx.field(static=True)
    config: object = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        d_state: int = 64,
        d_conv: int = 4,
        expand: int = 2,
        head_dim: int = 64,
        chunk: int = 64,
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        implementation: str | None = None,
        config: object = None,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """Initialise as the official Mamba-2 (`A` in [1, 16], log-uniform `dt`).

        Args:
            d_model: token width.
            d_state: state size N.
            d_conv: causal conv1d width.
            expand: inner width `expand * d_model` (a multiple of `head_dim`).
            head_dim: channels per head P.
            chunk: chunk length of the `"chunked"` scan (`"triton"` takes its config's).
            dt_min: lower end of the `dt` initialisation range.
            dt_max: upper end of the `dt` initialisation range.
            dt_init_floor: smallest initial `dt`.
            implementation: the SSD backend: `None`/`"auto"`, `"scan"`, `"chunked"` or
                `"triton"`.
            config: the pinned implementation's config (a `ChunkedLinearConfig`).
            dtype: parameter dtype.
            key: PRNG key.
        """
        dtype = jnp.float32 if dtype is None else dtype
        d_inner = expand * d_model
        if d_inner % head_dim:
            raise ValueError(f"expand * d_model = {d_inner} must be a multiple of {head_dim=}")
        heads = d_inner // head_dim
        conv_dim = d_inner + 2 * d_state
        keys = jax.random.split(key, 5)
        proj = 2 * d_inner + 2 * d_state + heads  # z, x, B, C, dt
        self.in_proj = _uniform(keys[0], (d_model, proj), d_model**-0.5, dtype)
        self.conv_weight = _uniform(keys[1], (d_conv, conv_dim), d_conv**-0.5, dtype)
        self.conv_bias = jnp.zeros((conv_dim,), dtype)
        self.dt_bias = _dt_bias(keys[2], (heads,), dt_min, dt_max, dt_init_floor, dtype)
        a = jax.random.uniform(keys[3], (heads,), jnp.float32, 1.0, 16.0)
        self.a_log = jnp.log(a).astype(dtype)
        self.d_skip = jnp.ones((heads,), dtype)
        self.norm = jnp.ones((d_inner,), dtype)
        self.out_proj = _uniform(keys[4], (d_inner, d_model), d_inner**-0.5, dtype)
        self.head_dim, self.d_state, self.chunk = head_dim, d_state, chunk
        self.backend = resolve("ssd", implementation)
        self.config = config

    @property
    def d_inner(self) -> int:
        return self.norm.shape[0]

    def explain(self, x: Array | jax.ShapeDtypeStruct) -> Choice:
        """The SSD's `Choice` for `x` `[seq, d_model]`."""
        features = self.d_state + self.head_dim
        return recurrence.select("ssd", x.shape[0], x.dtype, self.backend, self.config, features)

    def init_cache(self, dtype=None) -> Mamba2Cache:
        dtype = self.in_proj.dtype if dtype is None else dtype
        width, conv_dim = self.conv_weight.shape
        heads = self.d_skip.shape[0]
        return Mamba2Cache(
            conv=jnp.zeros((width - 1, conv_dim), dtype),
            ssm=jnp.zeros((heads, self.head_dim, self.d_state), jnp.float32),
        )

    def _forward(self, x, cache: Mamba2Cache):
        seq, di, n = x.shape[0], self.d_inner, self.d_state
        proj = x @ self.in_proj
        z, xbc, dt = proj[:, :di], proj[:, di : 2 * di + 2 * n], proj[:, 2 * di + 2 * n :]
        xbc, window = _causal_conv(xbc, cache.conv, self.conv_weight, self.conv_bias)
        u, b, c = xbc[:, :di], xbc[:, di : di + n], xbc[:, di + n :]
        dt = jax.nn.softplus(dt + self.dt_bias)
        a = -jnp.exp(self.a_log.astype(jnp.float32))
        y, h = ssd(
            u.reshape(seq, u.shape[1] // self.head_dim, self.head_dim), dt, a, b, c, self.d_skip,
            chunk=self.chunk, h0=cache.ssm, implementation=self.backend, config=self.config,
        )  # fmt: skip
        y = y.reshape(seq, di) * jax.nn.silu(z.astype(jnp.float32))
        y = y * jax.lax.rsqrt(jnp.mean(y**2, -1, keepdims=True) + 1e-6) * self.norm
        return y.astype(x.dtype) @ self.out_proj, Mamba2Cache(window, h)

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        check_width("Mamba2", "x", x, self.in_proj.shape[0])
        return self._forward(x, self.init_cache(x.dtype))[0]

    def decode_step(
        self, x: Float[Array, " d_model"], cache: Mamba2Cache
    ) -> tuple[Float[Array, " d_model"], Mamba2Cache]:
        """One token through the recurrence; equal to the matching row of `__call__`."""
        check_width("Mamba2", "x", x, self.in_proj.shape[0], ranks=(1,))
        y, cache = self._forward(x[None], cache)
        return y[0], cache
