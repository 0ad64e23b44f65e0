"""Moving rows by gathers in both directions, gradients included.

`jnp.take`'s transpose is a scatter-add, slow on GPUs (a scatter of rows into the padded
grouped-matmul layout measured 5x slower than the gather back on the H200). When the
index is a permutation, or each row's copies are listed, the transpose is a gather too:
these custom VJPs use it, and call each other, so reverse-mode derivatives of any order
stay gathers (forward mode is JAX's own: gathers too).
"""

import jax.numpy as jnp

from probjax_eqx._autodiff import both_modes


def inverse_permutation(order):
    """`inverse[order[i]] = i` (an integer scatter of one value per row)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def bin_counts(values, length: int):
    """`counts[b]` = how many of `values` equal `b`, for `b` in `[0, length)`.

    Compared against every bin and summed (XLA fuses it into one reduction): a scatter-add
    of ones contends on the few counters, 0.295 / 2.33 ms at 131k / 1M tokens x top-8
    over 64 experts vs 0.049 / 0.127 this way (H200, run 28).
    """
    bins = jnp.arange(length, dtype=values.dtype)
    return jnp.sum(values.reshape(-1)[:, None] == bins, axis=0, dtype=jnp.int32)


# An MoE's copy of each token to its top-k rows and the weighted combine back are each
# other's transposes. As `x[rows]` and `.at[rows].add`, one of them is a scatter-add
# forward and backward; here both are gathers: `slots[t]` lists the k rows holding
# token t, and `rows[r]` is the token of row r (out of range, e.g. padding rows: none).
def _copy_to_rows(x, rows, slots):
    """`out[r] = x[rows[r]]`, zeros where `rows[r]` is out of range."""
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _combine_rows(ys, slots, rows, scale):
    """`out[t] = sum_k scale[r] * ys[r]` over the rows `r = slots[t, k]`, in float32.

    The rows stay in their (16-bit) dtype: each is widened and weighted inside the sum.
    """

    def term(k):
        r = slots[:, k]
        return jnp.take(ys, r, axis=0).astype(jnp.float32) * jnp.take(scale, r)[:, None]

    out = term(0)
    for k in range(1, slots.shape[1]):  # k gathers into one fused sum, no [t, k, d]
        out = out + term(k)
    return out


def sum_copies(dcopies, rows, slots):
    """`copy_to_rows`' transpose: each token's sum over its rows, in `dcopies`' dtype."""
    ones = jnp.ones(rows.shape, jnp.float32)
    return combine_rows(dcopies, slots, rows, ones).astype(dcopies.dtype)


def _copy_to_rows_bwd(residuals, dout):  # dout has x's dtype
    rows, slots = residuals
    return sum_copies(dout, rows, slots), None, None


def _combine_rows_bwd(residuals, dout):
    ys, slots, rows, scale = residuals
    per_row = copy_to_rows(dout, rows, slots)  # float32 [rows, d]
    dys = (per_row * scale[:, None].astype(jnp.float32)).astype(ys.dtype)
    dscale = jnp.sum(ys.astype(jnp.float32) * per_row, axis=-1).astype(scale.dtype)
    return dys, None, None, dscale


def _combine_rows_tangent(residuals, tangents):  # bilinear in the rows and the scale
    ys, slots, rows, scale = residuals
    t_ys, _, _, t_scale = tangents
    return combine_rows(t_ys, slots, rows, scale) + combine_rows(ys, slots, rows, t_scale)


copy_to_rows = both_modes(
    _copy_to_rows,
    lambda x, rows, slots: (_copy_to_rows(x, rows, slots), (rows, slots)),
    _copy_to_rows_bwd,
    lambda residuals, tangents: copy_to_rows(tangents[0], *residuals),
)
combine_rows = both_modes(
    _combine_rows,
    lambda ys, slots, rows, scale: (_combine_rows(ys, slots, rows, scale),
                                    (ys, slots, rows, scale)),
    _combine_rows_bwd,
    _combine_rows_tangent,
)  # fmt: skip


def _permute_rows(x, index, inverse):
    """`x[index]` (zeros where out of range) for an `index` taking each row at most once.

    `inverse` is the index that takes the rows back, so the gradient is the gather
    `dout[inverse]`. With `jnp.take`'s scatter-add transposes, the Mosaic grouped matmul
    took 18.7 ms fwd+bwd at 1M rows on the H200 (run 18), of which its three kernels
    took 2.5 and the four row gathers about 3.
    """
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _permute_rows_fwd(x, index, inverse):
    return _permute_rows(x, index, inverse), (index, inverse)


def _permute_rows_bwd(residuals, dout):
    index, inverse = residuals
    return permute_rows(dout, inverse, index), None, None


permute_rows = both_modes(
    _permute_rows,
    _permute_rows_fwd,
    _permute_rows_bwd,
    lambda residuals, tangents: permute_rows(tangents[0], *residuals),
)
