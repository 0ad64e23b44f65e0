"""Pallas Triton kernels for linear recurrences: the selective scan and chunked linear attention.

Both are unbatched (`jax.vmap` adds a grid axis), compute in float32 and have one
`jax.custom_vjp` each.

- `selective_scan` (Mamba-1): `h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t`, `y_t = C_t . h_t`,
  per channel `d` and state `n`. One program owns `block_d` channels and walks the
  sequence with its `[N, block_d]` state in registers, loading the inputs of `steps`
  steps at once (one memory round trip per `steps` steps, not per step) and unrolling
  the steps over them. The decay differs per (d, n), so
  there is no matmul form; the win over `lax.scan` is one kernel instead of a loop of
  XLA launches. For the backward, the forward stores every step's state (float32
  `[seq, N, d]`, the same residual memory as differentiating the `lax.scan` reference);
  the backward walks the sequence in reverse.
- `chunked_linear_attention` (Mamba-2 SSD, the RLA linear branch):
  `o_t = q_t^T S_t`, `S_t = exp(g_t) S_{t-1} + k_t v_t^T` with a scalar log-decay `g_t <= 0`
  per head and step (or none). One program per head walks chunks of `chunk` steps: within
  a chunk a causal, decay-weighted `q k^T` matmul; across chunks the carried `[dk, dv]`
  state. The decay enters only as `exp(G_i - G_j)` with `i >= j` and `exp(G)` for the
  chunk-local cumulative `G <= 0`, never as `exp(-G)`, so nothing overflows. The
  forward stores the state at each chunk start for the backward, which walks the
  chunks in reverse carrying the state's cotangent; the cotangent of the cumulative log
  decay is `q . dq - k . dk` per step plus `sum(dS * S)` at each chunk end.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

f32 = jnp.float32


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectiveScanConfig:
    """Tiles of the Triton selective scan.

    Attributes:
        block_d: channels per program (a power of two).
        steps: time steps whose inputs one load brings (a power of two; unrolled). Each
            step depends on the last, so a load a step put a memory round trip on the
            critical path of every step. H200 run 15 (B4, T4096, 2048 channels, state
            16): fwd / fwd+bwd 5.27 / 11.3 ms at 1 step, 1.51 / 5.52 at 8, 2.14 / 24.2
            at 16 (the backward's unrolled body outgrows the registers).
        num_warps: warps per program.
        num_stages: software pipelining depth of the time loop.
        interpret: run in Pallas interpret mode (CPU tests).
    """

    block_d: int = 32
    steps: int = 8
    num_warps: int = 2
    num_stages: int = 2
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_d", "steps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLinearConfig:
    """Tiles of the Triton chunked linear attention.

    Attributes:
        chunk: steps per chunk (a power of two >= 16).
        block_dv: value columns per program (a power of two >= 16), or None for all of a
            head's. Columns of the state are independent, so splitting them multiplies
            the programs (a head's chunk loop is sequential) and divides each one's
            state; every program recomputes its chunks' q.k scores, and the backward's
            dq/dk/decay gradients are per-block partials summed afterwards.
        num_warps: warps per program.
        num_stages: software pipelining depth of the chunk loop.
        chunk_parallel_backward: the backward in two kernels: a sequential pass that
            carries only the state's gradient back over the chunks and stores it per
            chunk, then one program per (head, value block, chunk) for dq, dk, dv and
            the decay's gradient. The single-kernel backward walks all of that
            sequentially per head, its program holding every operand at once.
        interpret: run in Pallas interpret mode (CPU tests).
    """

    chunk: int = 64
    block_dv: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    chunk_parallel_backward: bool = False
    interpret: bool = False

    def __post_init__(self):
        for name in ("chunk", "block_dv"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name}={value} must be a power of two >= 16")


def _params(cfg):
    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# float32 operands multiply exactly (no TF32): sums over thousands of steps would carry
# TF32's 1e-3 error; 16-bit operands are unaffected.
_dot = functools.partial(plt.dot, allow_tf32=False)


# --- selective scan ---------------------------------------------------------------------
# Layout in the kernels: the state is [N, block_d] (states down, channels across), so a
# step's x/dt rows are [1, block_d] loads and its B/C columns [N, 1] loads of B^T/C^T.


def _parts(x, n: int, axis: int):
    """`x` cut into `n` equal parts along `axis` (in registers)."""
    return jnp.split(x, n, axis=axis) if n > 1 else [x]


def _block_inputs(t0, steps, x_ref, dt_ref, bt_ref, ct_ref):
    """Per step of `[t0, t0 + steps)`: x and dt rows `[1, block_d]`, B and C columns `[N, 1]`."""
    rows = pl.ds(t0, steps)
    load = lambda ref, index, axis: _parts(ref[index].astype(f32), steps, axis)  # noqa: E731
    return (load(x_ref, (rows, slice(None)), 0), load(dt_ref, (rows, slice(None)), 0),
            load(bt_ref, (slice(None), rows), 1), load(ct_ref, (slice(None), rows), 1))  # fmt: skip


def _scan_fwd_kernel(x_ref, dt_ref, at_ref, bt_ref, ct_ref, h0_ref, y_ref, ht_ref, *states,
                     n_state: int, steps: int):  # fmt: skip
    a_t = at_ref[...]

    def block(i, h):
        t0 = pl.multiple_of(i * steps, steps)
        xs, dts, bs, cs = _block_inputs(t0, steps, x_ref, dt_ref, bt_ref, ct_ref)
        for r in range(steps):
            h = jnp.exp(dts[r] * a_t) * h + (dts[r] * xs[r]) * bs[r]
            y_ref[pl.ds(t0 + r, 1), :] = jnp.sum(h * cs[r], axis=0, keepdims=True)
            if states:
                states[0][pl.ds((t0 + r) * n_state, n_state), :] = h
        return h

    ht_ref[...] = jax.lax.fori_loop(0, x_ref.shape[0] // steps, block, h0_ref[...])


def _scan_bwd_kernel(*refs, n_state: int, steps: int):
    x_ref, dt_ref, at_ref, bt_ref, ct_ref, h0_ref, states_ref, dy_ref, dht_ref = refs[:9]
    dx_ref, ddt_ref, dat_ref, dbt_ref, dct_ref, dh0_ref = refs[9:]
    a_t = at_ref[...]
    h0 = h0_ref[...]
    n_blocks = x_ref.shape[0] // steps

    def block(i, carry):
        dh, da = carry
        t0 = pl.multiple_of((n_blocks - 1 - i) * steps, steps)
        xs, dts, bs, cs = _block_inputs(t0, steps, x_ref, dt_ref, bt_ref, ct_ref)
        dys = _parts(dy_ref[pl.ds(t0, steps), :].astype(f32), steps, 0)
        hs = _parts(states_ref[pl.ds(t0 * n_state, steps * n_state), :], steps, 0)
        before = states_ref[pl.ds(jnp.maximum(t0 - 1, 0) * n_state, n_state), :]
        first_prev = jnp.where(t0 > 0, before, h0)  # the state before the block
        for r in reversed(range(steps)):
            t, h, dt, x, b, c = t0 + r, hs[r], dts[r], xs[r], bs[r], cs[r]
            h_prev = hs[r - 1] if r else first_prev
            dh = dh + c * dys[r]
            dct_ref[:, pl.ds(t, 1)] = jnp.sum(h * dys[r], axis=1, keepdims=True)
            decay = jnp.exp(dt * a_t)
            through_decay = dh * decay * h_prev  # dL/d(dt A)
            ddt_ref[pl.ds(t, 1), :] = jnp.sum(
                through_decay * a_t + dh * x * b, axis=0, keepdims=True
            )
            dx_ref[pl.ds(t, 1), :] = dt * jnp.sum(dh * b, axis=0, keepdims=True)
            dbt_ref[:, pl.ds(t, 1)] = jnp.sum(dh * (dt * x), axis=1, keepdims=True)
            dh, da = decay * dh, da + through_decay * dt
        return dh, da

    zeros = jnp.zeros(a_t.shape, f32)
    dh, da = jax.lax.fori_loop(0, n_blocks, block, (dht_ref[...], zeros))
    dh0_ref[...] = dh
    dat_ref[...] = da


def _scan_specs(seq, n, bd):
    rows = pl.BlockSpec((seq, bd), lambda j: (0, j))
    state = pl.BlockSpec((n, bd), lambda j: (0, j))
    cols = pl.BlockSpec((n, seq), lambda j: (0, 0))
    return rows, state, cols


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, name):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name=name,
    )


def _scan_forward(x, dt, a_t, b_t, c_t, h0_t, cfg, *, keep_states: bool):
    seq, d = x.shape
    n, bd = a_t.shape[0], cfg.block_d
    blocks = d // bd
    rows, state, cols = _scan_specs(seq, n, bd)
    out_specs = [rows, state]
    out_shape = [jax.ShapeDtypeStruct((seq, d), f32), jax.ShapeDtypeStruct((n, d), f32)]
    if keep_states:
        out_specs.append(pl.BlockSpec((seq * n, bd), lambda j: (0, j)))
        out_shape.append(jax.ShapeDtypeStruct((seq * n, d), f32))
    outs = _call(
        functools.partial(_scan_fwd_kernel, n_state=n, steps=cfg.steps), cfg, (blocks,),
        [rows, rows, state, cols, cols, state], out_specs, out_shape,
        "probjax_selective_scan_fwd_triton",
    )(x, dt, a_t, b_t, c_t, h0_t)  # fmt: skip
    return outs


def _scan_backward(ops, states, dy, dht, cfg):
    x, dt, a_t, b_t, c_t, h0_t = ops
    seq, d = x.shape
    n, bd = a_t.shape[0], cfg.block_d
    blocks = d // bd
    rows, state, cols = _scan_specs(seq, n, bd)
    partial = pl.BlockSpec((None, n, seq), lambda j: (j, 0, 0))  # per program: summed after
    dx, ddt, da_t, db_t, dc_t, dh0_t = _call(
        functools.partial(_scan_bwd_kernel, n_state=n, steps=cfg.steps), cfg, (blocks,),
        [rows, rows, state, cols, cols, state, pl.BlockSpec((seq * n, bd), lambda j: (0, j)),
         rows, state],
        [rows, rows, state, partial, partial, state],
        [jax.ShapeDtypeStruct((seq, d), f32), jax.ShapeDtypeStruct((seq, d), f32),
         jax.ShapeDtypeStruct((n, d), f32), jax.ShapeDtypeStruct((blocks, n, seq), f32),
         jax.ShapeDtypeStruct((blocks, n, seq), f32), jax.ShapeDtypeStruct((n, d), f32)],
        "probjax_selective_scan_bwd_triton",
    )(x, dt, a_t, b_t, c_t, h0_t, states, dy, dht)  # fmt: skip
    return dx, ddt, da_t, db_t.sum(0), dc_t.sum(0), dh0_t


def selective_scan(x, dt, a, b, c, h0, *, config: SelectiveScanConfig):
    """`(y, h_last)` of the selective scan without the `D x` skip (module docstring).

    Shapes: `x, dt` `[seq, d]`, `a` `[d, n]`, `b, c` `[seq, n]`, `h0` `[d, n]`; float32 out.
    """
    cfg = config
    seq, d = x.shape
    n = a.shape[1]
    if seq == 0:  # no steps: the state stays (the kernel needs a step)
        return jnp.zeros((0, d), f32), h0.astype(f32)
    seq_pad, n_pad, d_pad = _round_up(seq, cfg.steps), _next_pow2(n), _round_up(d, cfg.block_d)
    # Padded channels and steps have dt = 0 and padded states B = C = 0: the state stays
    # zero in padded channels and passes padded steps unchanged.
    pad_d = lambda t: jnp.pad(t, ((0, seq_pad - t.shape[0]), (0, d_pad - d)))  # noqa: E731
    pad_n = lambda t: jnp.pad(t, ((0, n_pad - n), (0, seq_pad - t.shape[1])))  # noqa: E731
    # [d, n] -> [n_pad, d_pad]
    state_t = lambda s: jnp.pad(s.astype(f32).T, ((0, n_pad - n), (0, d_pad - d)))  # noqa: E731

    @jax.custom_vjp
    def run(x, dt, a, b, c, h0):
        y, h_last = _scan_forward(pad_d(x), pad_d(dt), state_t(a), pad_n(b.T), pad_n(c.T),
                                  state_t(h0), cfg, keep_states=False)  # fmt: skip
        return y[:seq, :d], h_last[:n, :d].T

    def run_fwd(x, dt, a, b, c, h0):
        ops = (pad_d(x), pad_d(dt), state_t(a), pad_n(b.T), pad_n(c.T), state_t(h0))
        y, h_last, states = _scan_forward(*ops, cfg, keep_states=True)
        return (y[:seq, :d], h_last[:n, :d].T), (ops, states, (x, dt, a, b, c, h0))

    def run_bwd(residuals, cotangents):
        ops, states, primals = residuals
        dy, dh_last = cotangents
        dx, ddt, da_t, db_t, dc_t, dh0_t = _scan_backward(
            ops, states, pad_d(dy.astype(f32)), state_t(dh_last), cfg
        )
        grads = (dx[:seq, :d], ddt[:seq, :d], da_t[:n, :d].T, db_t[:n, :seq].T,
                 dc_t[:n, :seq].T, dh0_t[:n, :d].T)  # fmt: skip
        return tuple(g.astype(p.dtype) for g, p in zip(grads, primals))

    run.defvjp(run_fwd, run_bwd)
    return run(x, dt, a, b, c, h0)


# --- chunked linear attention -------------------------------------------------------------


class _Decay(NamedTuple):
    """A chunk's decay factors, all <= 1.

    From the chunk start to each step (inclusive), from each step to the chunk end, and
    over the whole chunk.
    """

    from_start: jax.Array  # [chunk, 1]
    to_end: jax.Array  # [chunk, 1]
    whole: jax.Array  # scalar


def _scaled(x, factor):
    x = x.astype(f32)
    return x if factor is None else x * factor


def _chunk_rows(c, chunk):
    """Rows of chunk `c` (a loop index, or a Python int within one chunk's block)."""
    return pl.ds(c * chunk if isinstance(c, int) else pl.multiple_of(c * chunk, chunk), chunk)


def _chunk_decay(g_ref, c, chunk):
    """A chunk's cumulative log decay `g` (chunk-local, non-increasing) and `_Decay`."""
    g = g_ref[_chunk_rows(c, chunk)]
    g_last = jnp.sum(jnp.where(jnp.arange(chunk, dtype=jnp.int32) == chunk - 1, g, 0.0))
    return g, _Decay(jnp.exp(g)[:, None], jnp.exp(g_last - g)[:, None], jnp.exp(g_last))


def _chunk_operands(q_ref, k_ref, v_ref, g_ref, c, chunk, decay):
    """A chunk's q, k, v, its causal decay-weighted pair matrix, and its `_Decay`."""
    rows = _chunk_rows(c, chunk)
    q, k, v = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
    idx = jnp.arange(chunk, dtype=jnp.int32)
    causal = idx[:, None] >= idx[None, :]
    if not decay:
        return q, k, v, causal.astype(f32), None
    g, factors = _chunk_decay(g_ref, c, chunk)
    pair = jnp.exp(jnp.where(causal, g[:, None] - g[None, :], -jnp.inf))
    return q, k, v, pair, factors


def _linear_fwd_kernel(q_ref, k_ref, v_ref, g_ref, h0_ref, o_ref, ht_ref, *states,
                       chunk: int, decay: bool):  # fmt: skip
    dk = q_ref.shape[1]

    def body(c, state):
        q, k, v, pair, dec = _chunk_operands(q_ref, k_ref, v_ref, g_ref, c, chunk, decay)
        if states:
            states[0][pl.ds(c * dk, dk), :] = state
        dtype = v.dtype
        scores = _dot(q, k, trans_b=True) * pair
        o = _dot(scores.astype(dtype), v)
        q_in = _scaled(q, None if dec is None else dec.from_start)
        o = o + _dot(q_in.astype(dtype), state.astype(dtype))
        o_ref[_chunk_rows(c, chunk), :] = o.astype(o_ref.dtype)
        k_in = _scaled(k, None if dec is None else dec.to_end)
        update = _dot(k_in.astype(dtype), v, trans_a=True)
        return (state if dec is None else dec.whole * state) + update

    ht_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // chunk, body, h0_ref[...].astype(f32))


def _chunk_grads(q, k, v, pair, dec, do, state, ds, chunk: int):
    """A chunk's dq, dk, dv and decay gradient (`None` without decay).

    `state` is the state at the chunk's start, `ds` the gradient of the one after it.
    """
    lo = lambda t: t.astype(v.dtype)  # noqa: E731
    from_start = None if dec is None else dec.from_start
    to_end = None if dec is None else dec.to_end
    scores = _dot(q, k, trans_b=True) * pair
    dscores = _dot(do, v, trans_b=True) * pair
    dq = _scaled(_dot(lo(do), lo(state), trans_b=True), from_start) + _dot(lo(dscores), k)
    dk = _scaled(_dot(v, lo(ds), trans_b=True), to_end) + _dot(lo(dscores), q, trans_a=True)
    k_in = _scaled(k, to_end)
    dv = _dot(lo(k_in), lo(ds)) + _dot(lo(scores), do, trans_a=True)
    if dec is None:
        return dq, dk, dv, None
    after = dec.whole * state + _dot(lo(k_in), v, trans_a=True)
    idx = jnp.arange(chunk, dtype=jnp.int32)
    dg = jnp.sum(q.astype(f32) * dq, axis=1) - jnp.sum(k.astype(f32) * dk, axis=1)
    return dq, dk, dv, dg + jnp.where(idx == chunk - 1, jnp.sum(ds * after), 0.0)


def _state_grad_before(q, dec, do, ds):
    """The gradient of the state at a chunk's start from `ds`, that of the one after it."""
    q_in = _scaled(q, None if dec is None else dec.from_start)
    carried = ds if dec is None else dec.whole * ds
    return carried + _dot(q_in.astype(do.dtype), do, trans_a=True)


def _linear_bwd_kernel(*refs, chunk: int, decay: bool):
    q_ref, k_ref, v_ref, g_ref, states_ref, do_ref, dht_ref = refs[:7]
    dq_ref, dk_ref, dv_ref, dg_ref, dh0_ref = refs[7:]
    dk_dim = q_ref.shape[1]
    n_chunks = q_ref.shape[0] // chunk

    def body(i, ds):
        c = n_chunks - 1 - i
        q, k, v, pair, dec = _chunk_operands(q_ref, k_ref, v_ref, g_ref, c, chunk, decay)
        rows = _chunk_rows(c, chunk)
        do = do_ref[rows, :]
        state = states_ref[pl.ds(c * dk_dim, dk_dim), :]  # at the chunk start
        dq, dk, dv, dg = _chunk_grads(q, k, v, pair, dec, do, state, ds, chunk)
        dq_ref[rows, :] = dq
        dk_ref[rows, :] = dk
        dv_ref[rows, :] = dv
        if dg is not None:
            dg_ref[rows] = dg
        return _state_grad_before(q, dec, do, ds)

    dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, body, dht_ref[...].astype(f32))


def _linear_dstate_kernel(q_ref, g_ref, do_ref, dht_ref, dstates_ref, dh0_ref, *, chunk: int,
                          decay: bool):  # fmt: skip
    """Pass 1 of the chunk-parallel backward: each chunk's `ds`, walking back."""
    dk_dim = q_ref.shape[1]
    n_chunks = q_ref.shape[0] // chunk

    def body(i, ds):
        c = n_chunks - 1 - i
        dstates_ref[pl.ds(c * dk_dim, dk_dim), :] = ds
        rows = _chunk_rows(c, chunk)
        dec = _chunk_decay(g_ref, c, chunk)[1] if decay else None
        return _state_grad_before(q_ref[rows, :], dec, do_ref[rows, :], ds)

    dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, body, dht_ref[...].astype(f32))


def _linear_chunk_grads_kernel(q_ref, k_ref, v_ref, g_ref, state_ref, do_ref, ds_ref, dq_ref,
                               dk_ref, dv_ref, dg_ref, *, chunk: int, decay: bool):  # fmt: skip
    """Pass 2 of the chunk-parallel backward: one chunk (of one head and value block)."""
    q, k, v, pair, dec = _chunk_operands(q_ref, k_ref, v_ref, g_ref, 0, chunk, decay)
    dq, dk, dv, dg = _chunk_grads(q, k, v, pair, dec, do_ref[...], state_ref[...], ds_ref[...],
                                  chunk)  # fmt: skip
    dq_ref[...], dk_ref[...], dv_ref[...] = dq, dk, dv
    dg_ref[...] = jnp.zeros((chunk,), f32) if dg is None else dg


def _linear_specs(seq, dk, block_dv, group, n_chunks):
    """Specs for a grid (head, value block): q/k/g whole per head, the rest per block."""
    qk = pl.BlockSpec((seq, None, dk), lambda h, j: (0, h // group, 0))
    values = pl.BlockSpec((seq, None, block_dv), lambda h, j: (0, h, j))
    g = pl.BlockSpec((None, seq), lambda h, j: (h, 0))
    state = pl.BlockSpec((None, dk, block_dv), lambda h, j: (h, 0, j))
    states = pl.BlockSpec((None, n_chunks * dk, block_dv), lambda h, j: (h, 0, j))
    # The backward's per-value-block partials of dq/dk ([blocks, seq, heads, dk]), dg.
    partial_qk = pl.BlockSpec((None, seq, None, dk), lambda h, j: (j, 0, h, 0))
    partial_g = pl.BlockSpec((None, None, seq), lambda h, j: (j, h, 0))
    return qk, values, g, state, states, partial_qk, partial_g


def _chunk_specs(chunk, dk, block_dv, group):
    """`_linear_specs` for a grid (head, value block, chunk): one chunk a program."""
    qk = pl.BlockSpec((chunk, None, dk), lambda h, j, c: (c, h // group, 0))
    values = pl.BlockSpec((chunk, None, block_dv), lambda h, j, c: (c, h, j))
    g = pl.BlockSpec((None, chunk), lambda h, j, c: (h, c))
    state = pl.BlockSpec((None, dk, block_dv), lambda h, j, c: (h, c, j))  # of `states`
    partial_qk = pl.BlockSpec((None, chunk, None, dk), lambda h, j, c: (j, c, h, 0))
    partial_g = pl.BlockSpec((None, None, chunk), lambda h, j, c: (j, h, c))
    return qk, values, g, state, partial_qk, partial_g


def chunked_linear_attention(q, k, v, log_decay, h0, *, config: ChunkedLinearConfig):
    """`(o, h_last)`: `o_t = q_t^T S_t`, `S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T`.

    Shapes: `q, k` `[seq, kv_heads, dk]` (each shared by `heads / kv_heads` heads), `v`
    `[seq, heads, dv]`, `log_decay` `[seq, heads]` (`<= 0`) or `None`, `h0`
    `[heads, dk, dv]`. `o` is float32 `[seq, heads, dv]`, `h_last` `[heads, dk, dv]`.
    """
    cfg, chunk = config, config.chunk
    seq, kv_heads, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    group = heads // kv_heads
    if seq == 0:  # no steps: the state stays (the kernel needs a chunk)
        return jnp.zeros((0, heads, dv), f32), h0.astype(f32)
    seq_p, dk_p, dv_p = _round_up(seq, chunk), _next_pow2(dk, 16), _next_pow2(dv, 16)
    n_chunks = seq_p // chunk
    block_dv = dv_p if cfg.block_dv is None else min(cfg.block_dv, dv_p)
    n_blocks = dv_p // block_dv
    grid = (heads, n_blocks)
    decay = log_decay is not None
    dtype = jnp.promote_types(q.dtype, v.dtype)

    def pad(t, width):
        return jnp.pad(t.astype(dtype), ((0, seq_p - seq), (0, 0), (0, width - t.shape[2])))

    def pad_state(s):
        return jnp.pad(s.astype(f32), ((0, 0), (0, dk_p - dk), (0, dv_p - dv)))

    def cumulative(g):  # [seq, heads] -> chunk-local cumsum, [heads, seq_p]
        g = jnp.pad(g.astype(f32), ((0, seq_p - seq), (0, 0))).reshape(n_chunks, chunk, heads)
        return jnp.cumsum(g, axis=1).reshape(seq_p, heads).T

    qk_spec, values, g_spec, state, states, partial_qk, partial_g = _linear_specs(
        seq_p, dk_p, block_dv, group, n_chunks
    )
    in_specs = [qk_spec, qk_spec, values, g_spec, state]
    o_shape = jax.ShapeDtypeStruct((seq_p, heads, dv_p), f32)
    s_shape = jax.ShapeDtypeStruct((heads, dk_p, dv_p), f32)

    def forward(qp, kp, vp, gp, h0p, keep_states):
        out_specs, out_shape = [values, state], [o_shape, s_shape]
        if keep_states:
            out_specs.append(states)
            out_shape.append(jax.ShapeDtypeStruct((heads, n_chunks * dk_p, dv_p), f32))
        kernel = functools.partial(_linear_fwd_kernel, chunk=chunk, decay=decay)
        return _call(kernel, cfg, grid, in_specs, out_specs, out_shape,
                     "probjax_chunked_linear_fwd_triton")(qp, kp, vp, gp, h0p)  # fmt: skip

    def operands(q, k, v, g, h0):
        gp = cumulative(g) if decay else jnp.zeros((heads, seq_p), f32)
        return pad(q, dk_p), pad(k, dk_p), pad(v, dv_p), gp, pad_state(h0)

    def unpad(o, h_last):
        return o[:seq, :, :dv], h_last[:, :dk, :dv]

    @jax.custom_vjp
    def run(q, k, v, g, h0):
        return unpad(*forward(*operands(q, k, v, g, h0), keep_states=False))

    def run_fwd(q, k, v, g, h0):
        ops = operands(q, k, v, g, h0)
        o, h_last, saved = forward(*ops, keep_states=True)
        return unpad(o, h_last), (ops, saved, (q, k, v, g, h0))

    grad_qk = jax.ShapeDtypeStruct((n_blocks, seq_p, heads, dk_p), f32)
    grad_g = jax.ShapeDtypeStruct((n_blocks, heads, seq_p), f32)

    def sequential_backward(qp, kp, vp, gp, saved, dop, dhtp):
        kernel = functools.partial(_linear_bwd_kernel, chunk=chunk, decay=decay)
        return _call(
            kernel, cfg, grid,
            [qk_spec, qk_spec, values, g_spec, states, values, state],
            [partial_qk, partial_qk, values, partial_g, state],
            [grad_qk, grad_qk, o_shape, grad_g, s_shape],
            "probjax_chunked_linear_bwd_triton",
        )(qp, kp, vp, gp, saved, dop, dhtp)  # fmt: skip

    def chunk_parallel_backward(qp, kp, vp, gp, saved, dop, dhtp):
        pass_1 = functools.partial(_linear_dstate_kernel, chunk=chunk, decay=decay)
        dstates, dh0 = _call(
            pass_1, cfg, grid, [qk_spec, g_spec, values, state], [states, state],
            [jax.ShapeDtypeStruct(saved.shape, f32), s_shape],
            "probjax_chunked_linear_bwd_state_triton",
        )(qp, gp, dop, dhtp)  # fmt: skip
        c_qk, c_values, c_g, c_state, c_partial_qk, c_partial_g = _chunk_specs(
            chunk, dk_p, block_dv, group
        )
        pass_2 = functools.partial(_linear_chunk_grads_kernel, chunk=chunk, decay=decay)
        dq, dk_, dv_, dg = _call(
            pass_2, cfg, (heads, n_blocks, n_chunks),
            [c_qk, c_qk, c_values, c_g, c_state, c_values, c_state],
            [c_partial_qk, c_partial_qk, c_values, c_partial_g],
            [grad_qk, grad_qk, o_shape, grad_g],
            "probjax_chunked_linear_bwd_chunks_triton",
        )(qp, kp, vp, gp, saved, dop, dstates)  # fmt: skip
        return dq, dk_, dv_, dg, dh0

    def run_bwd(residuals, cotangents):
        (qp, kp, vp, gp, _), saved, primals = residuals
        do, dh_last = cotangents
        backward = chunk_parallel_backward if cfg.chunk_parallel_backward else sequential_backward
        dq, dk_, dv_, dg, dh0 = backward(qp, kp, vp, gp, saved, pad(do, dv_p), pad_state(dh_last))
        dq, dk_, dg = (t.sum(0) for t in (dq, dk_, dg))  # the value blocks' partials
        # Heads that share q/k add their shares; the cumsum's cotangent is a reverse cumsum.
        fold = lambda t: t[:seq, :, :dk].reshape(seq, kv_heads, group, dk).sum(2)  # noqa: E731
        grads = [fold(dq), fold(dk_), dv_[:seq, :, :dv]]
        if decay:
            dg = dg.T.reshape(n_chunks, chunk, heads)
            dg = jnp.flip(jnp.cumsum(jnp.flip(dg, 1), axis=1), 1).reshape(seq_p, heads)[:seq]
        grads += [dg if decay else None, dh0[:, :dk, :dv]]
        q, k, v, g, h0 = primals
        out = [None if t is None else t.astype(p.dtype) for t, p in zip(grads, primals)]
        return tuple(out)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, log_decay, h0)
