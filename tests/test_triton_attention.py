"""The Pallas Triton kernels in interpret mode (CPU) against the float32 oracle."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _attention_cases import MASKS, make_qkv
from _check import check_against_oracle, check_higher_derivatives, oracle
from _tolerance import assert_close
from probjax_eqx import (
    UnsupportedError,
    biases,
    dot_product_attention,
    explain_attention,
    flex_attention,
    masks,
)
from probjax_eqx.attention_call import AttentionCall
from probjax_eqx.backends import DeviceInfo
from probjax_eqx.backends import resolve as resolve_backend
from probjax_eqx.kernels import _tiles
from probjax_eqx.kernels.reference import attention as reference
from probjax_eqx.kernels.triton import attention as triton_attention
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

CFG = TritonAttentionConfig(
    block_q=16,
    block_k=16,
    block_q_dkv=16,
    block_k_dkv=16,
    block_q_dq=16,
    block_k_dq=16,
    interpret=True,
)


def run_triton(q, k, v, mask=None, score_mod=None, config=CFG):
    return flex_attention(
        q, k, v, mask=mask, score_mod=score_mod, implementation="triton", config=config
    )


def check(q, k, v, ct, mask=None, score_mod=None, config=CFG, primal=False):
    f = lambda q, k, v: run_triton(q, k, v, mask, score_mod, config)
    return check_against_oracle(f, q, k, v, ct, mask=mask, score_mod=score_mod, primal=primal)


@pytest.mark.parametrize("name", sorted(set(MASKS)))
def test_masks_fwd_and_grads(getkey, name):
    q, k, v = make_qkv(getkey(), v_dim=12)
    ct = jax.random.normal(getkey(), (2, 7, 4, 12))
    check(q, k, v, ct, MASKS[name], primal=True)  # the undifferentiated call too


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit(getkey, dtype):
    q, k, v = make_qkv(getkey(), q_len=20, kv_len=33, dtype=dtype)
    ct = jax.random.normal(getkey(), (2, 20, 4, 16))
    check(q, k, v, ct, masks.Causal("bottom_right") & masks.KVLengths(jnp.array([30, 9])))


@pytest.mark.parametrize("q_len, kv_len", [(48, 100), (100, 48), (129, 17)])
def test_unaligned_lengths_and_head_dims(getkey, q_len, kv_len):
    q, k, v = make_qkv(
        getkey(), batch=1, q_len=q_len, kv_len=kv_len, q_heads=2, kv_heads=1, qk_dim=24, v_dim=40
    )
    ct = jax.random.normal(getkey(), (1, q_len, 2, 40))
    config = TritonAttentionConfig(
        block_q=32,
        block_k=32,
        block_q_dkv=32,
        block_k_dkv=32,
        block_q_dq=32,
        block_k_dq=32,
        interpret=True,
    )
    check(q, k, v, ct, masks.Causal(), config=config)


def test_score_mods_in_kernel(getkey):
    q, k, v = make_qkv(getkey())
    ct = jax.random.normal(getkey(), (2, 7, 4, 16))
    mod = biases.Compose(
        (
            biases.ScoreFn(lambda s, b, h, qi, ki: s - 0.3 * jnp.abs(qi - ki).astype(s.dtype)),
            biases.SoftCap(1.5),
        )
    )
    check(q, k, v, ct, masks.Causal(), mod)
    fn_mask = masks.MaskFn(lambda b, h, qi, ki: (qi + ki) % 3 != 0)
    check(q, k, v, ct, fn_mask & masks.KVLengths(jnp.array([9, 2])))


def test_empty_rows_give_zero_output_and_gradients(getkey):
    q, k, v = make_qkv(getkey())
    mask = masks.KVLengths(jnp.array([0, 9])) & masks.QLengths(jnp.array([7, 3]))
    out, (dq, dk, dv) = check(q, k, v, jnp.ones((2, 7, 4, 16)), mask)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1, 3:], 0.0)
    for g in (dq[0], dk[0], dv[0], dq[1, 3:]):
        np.testing.assert_array_equal(g, 0.0)


def test_bitwise_reruns_jit_vmap_and_scan(getkey):
    q, k, v = make_qkv(getkey())
    f = jax.jit(lambda q, k, v: run_triton(q, k, v, masks.Causal()))
    np.testing.assert_array_equal(f(q, k, v), f(q, k, v))
    stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), (q, k, v))
    batched = jax.vmap(lambda q, k, v: run_triton(q, k, v, masks.Causal()))(*stacked)
    np.testing.assert_allclose(batched[0], f(q, k, v), atol=1e-6)

    def layers(q):
        def body(x, _):
            return run_triton(x, k, v, masks.Causal()), None

        return jax.lax.scan(body, q, None, length=2)[0]

    grad = jax.jit(jax.grad(lambda q: layers(q).sum()))(q)
    expected = jax.grad(
        lambda q: jax.lax.scan(
            lambda x, _: (
                reference.attention(x, k, v, mask=masks.Causal(), score_mod=None, scale=0.25),
                None,
            ),
            q,
            None,
            length=2,
        )[0].sum()
    )(q)
    assert_close(grad, expected, jnp.float32, grad=True)


def test_unsupported_calls_raise_with_reason():
    q, k, v = make_qkv(jax.random.key(0))
    table = biases.RelativePosition(jnp.zeros((4, 8)))
    with pytest.raises(
        UnsupportedError, match="RelativePosition .table lookup. is not in the kernel"
    ):
        run_triton(q, k, v, score_mod=table)
    with pytest.raises(UnsupportedError, match="dense mask cannot be evaluated per tile"):
        run_triton(q, k, v, mask=masks.DenseMask(jnp.ones((1, 1, 7, 9), bool)))
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(UnsupportedError, match="interpret=True"):
            dot_product_attention(q, k, v, implementation="triton")
    with pytest.raises(ValueError, match="needs a pinned implementation|pass implementation="):
        dot_product_attention(q, k, v, config=CFG)


def test_config_validation():
    with pytest.raises(ValueError, match="block_q=24 must be a power of two >= 16"):
        TritonAttentionConfig(block_q=24)
    with pytest.raises(ValueError, match="num_warps=3"):
        TritonAttentionConfig(num_warps=3)
    with pytest.raises(ValueError, match="num_splits_dq=0 must be >= 1"):
        TritonAttentionConfig(num_splits_dq=0)
    with pytest.raises(Exception, match="triton_joint"):
        TritonAttentionConfig(backward_pass_impl="triton_joint")  # type: ignore[arg-type]


def test_tile_selection_fits_shared_memory():
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    for dtype, d in (("bfloat16", 256), ("float32", 128), ("bfloat16", 64)):
        call = AttentionCall(4, 4096, 4096, 8, 8, d, d, dtype)
        cfg = triton_attention.default_config(call, h200)
        itemsize = 4 if dtype == "float32" else 2
        used = triton_attention.smem_bytes(cfg.block_q, cfg.block_k, d, d, itemsize, cfg.num_stages)
        assert used <= 227 * 1024, (dtype, d, cfg)
        assert not cfg.interpret
    short = triton_attention.default_config(AttentionCall(1, 8, 20, 2, 2, 32, 32, "float32"), h200)
    assert (short.block_q, short.block_k) == (16, 32)


def test_tangent_launch_fits_shared_memory():
    """The tangent kernel holds twice the forward's operand tiles: its launch shrinks its
    tiles until they fit (hd 256 bf16: 64 keys a step would not). On Hopper 16-bit heads
    of <= 128 dims take `TANGENT_TILES`; float32, wider heads and other GPUs the dQ
    kernel's launch; short sequences tiles no longer than themselves."""
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    a100 = DeviceInfo("gpu", "NVIDIA A100", "sm_80")
    expected = {  # (block_q, block_k, warps, stages)
        ("bfloat16", 128, h200): (128, 64, 8, 2),
        ("float16", 64, h200): (64, 64, 4, 3),
        ("bfloat16", 32, h200): (64, 64, 4, 3),
        ("float32", 128, h200): (32, 32, 4, 2),  # the dQ kernel's float32 tiles
        ("bfloat16", 128, a100): (64, 64, 4, 2),
    }
    cases = [("bfloat16", 256, h200), ("float32", 256, h200), *expected]
    for dtype, d, device in cases:
        call = AttentionCall(4, 4096, 4096, 8, 8, d, d, dtype)
        cfg = triton_attention.tangent_config(triton_attention.default_config(call, device),
                                              call, device)  # fmt: skip
        itemsize = 4 if dtype == "float32" else 2
        limit = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}[device.compute_capability]
        used = 2 * triton_attention.smem_bytes(cfg.block_q, cfg.block_k, d, d, itemsize,
                                               cfg.num_stages)  # fmt: skip
        assert used <= limit, (dtype, d, cfg)
        assert (cfg.num_splits, cfg.pack_gqa) == (1, False)
        launch = (cfg.block_q, cfg.block_k, cfg.num_warps, cfg.num_stages)
        assert launch == expected.get((dtype, d, device), launch), (dtype, d, device, launch)
    short = AttentionCall(2, 24, 40, 4, 4, 64, 64, "bfloat16")
    cfg = triton_attention.tangent_config(triton_attention.default_config(short, h200), short,
                                          h200)  # fmt: skip
    assert (cfg.block_q, cfg.block_k, cfg.num_warps) == (32, 64, 4)
    asked = dataclasses.replace(triton_attention.default_config(short, h200),
                                tangent_tiles=(16, 16, 2, 1))  # fmt: skip
    cfg = triton_attention.tangent_config(asked, short, h200)
    assert (cfg.block_q, cfg.block_k, cfg.num_warps, cfg.num_stages) == (16, 16, 2, 1)
    for bad in ((48, 64, 4, 2), (64, 8, 4, 2), (64, 64, 3, 2), (64, 64, 4, 0)):
        with pytest.raises(ValueError, match="tangent_tiles"):
            triton_attention.TritonAttentionConfig(tangent_tiles=bad)


def test_wide_float32_backward_steps_16_rows():
    # float32 hd 256: 32-row steps spilled (359 ms fwd+bwd at T=4096, run 26; 51 at 16).
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    for dtype, d, tiles in (("float32", 256, (16, 32, 32, 16)), ("float32", 128, (32,) * 4),
                            ("bfloat16", 256, (64,) * 4)):  # fmt: skip
        cfg = triton_attention.default_config(AttentionCall(4, 4096, 4096, 8, 8, d, d, dtype), h200)
        got = (cfg.block_q_dkv, cfg.block_k_dkv, cfg.block_q_dq, cfg.block_k_dq)
        assert got == tiles, (dtype, d, cfg)


@pytest.mark.parametrize(
    "q_len, kv_len, block_q, block_k", [(1, 1000, 16, 64), (40, 100, 16, 16), (50, 10, 32, 16)]
)
def test_unmasked_ranges_in_kernel_match_block_ranges(q_len, kv_len, block_q, block_k):
    """Without a mask the forward computes its tile ranges (no range arrays to launch)."""
    ctx = masks.MaskContext(2, q_len, kv_len)
    q_pad, kv_pad = -(-q_len // 64) * 64, -(-kv_len // 64) * 64
    want = _tiles.block_ranges(ctx, None, q_pad, kv_pad, program_block=block_q, loop_block=block_k)
    for tile in range(q_pad // block_q):
        got = _tiles.unmasked_kv_ranges(
            ctx, jnp.int32(tile), program_block=block_q, loop_block=block_k
        )
        assert [int(g) for g in got] == [int(w[1, tile]) for w in want], tile


def test_causal_skips_tiles_and_mask_work():
    ctx = masks.MaskContext(1, 64, 64)
    lo, full_lo, full_hi, hi = _tiles.block_ranges(
        ctx, masks.Causal(), 64, 64, program_block=16, loop_block=16
    )
    np.testing.assert_array_equal(lo, [[0, 0, 0, 0]])
    np.testing.assert_array_equal(hi, [[1, 2, 3, 4]])
    # Only the diagonal tile evaluates the mask (an empty full range sits at `hi`).
    np.testing.assert_array_equal(full_lo, [[1, 0, 0, 0]])
    np.testing.assert_array_equal(full_hi, [[1, 1, 2, 3]])
    lo, full_lo, full_hi, hi = _tiles.block_ranges(
        ctx, masks.KVLengths(20), 64, 64, program_block=16, loop_block=16, kv_loop=False
    )
    np.testing.assert_array_equal(hi, [[4, 4, 0, 0]])  # key tiles past the length: no work
    # Keys 16..31 straddle the length: every query tile of that program is masked.
    np.testing.assert_array_equal(full_hi - full_lo, [[4, 0, 0, 0]])


FUSED = dataclasses.replace(CFG, backward_pass_impl="triton_fused")


FUSED_MASKS = {
    "causal_bottom_right": masks.Causal("bottom_right"),
    "segments": masks.Segments(
        jnp.array([[0] * 9 + [1] * 11] * 2), jnp.array([[0] * 15 + [1] * 22] * 2), sorted=True
    ),
    "or_not": (masks.Causal() | masks.BlockDiagonal(4)) & ~masks.KVLengths(jnp.array([3, 0])),
    "q_and_kv_lengths": masks.QLengths(jnp.array([20, 5])) & masks.KVLengths(jnp.array([0, 30])),
}


@pytest.mark.parametrize("name", sorted(FUSED_MASKS))
def test_fused_backward(getkey, name):
    q, k, v = make_qkv(getkey(), q_len=20, kv_len=37, v_dim=12)
    ct = jax.random.normal(getkey(), (2, 20, 4, 12))
    mask = FUSED_MASKS[name]
    choice = explain_attention(q, k, v, mask=mask, implementation="triton", config=FUSED)
    assert choice.config.backward_pass_impl == "triton_fused"
    check(q, k, v, ct, mask, config=FUSED)


ONE_KEY_TILE = dataclasses.replace(CFG, block_k_dkv=32)  # keys padded to one dK/dV tile


@pytest.mark.parametrize(
    "mask",
    [masks.Causal("bottom_right"),
     masks.QLengths(jnp.array([40, 5])) & masks.KVLengths(jnp.array([20, 0]))],
    ids=["causal_bottom_right", "q_and_kv_lengths"],
)  # fmt: skip
def test_fused_backward_over_one_key_tile(getkey, mask):
    """Keys that fit one dK/dV tile: the fused backward stores dQ (no atomics), zeros
    for the query tiles its loop skips (rows before the diagonal, a row with no key)."""
    q, k, v = make_qkv(getkey(), q_len=40, kv_len=20, v_dim=12)
    ct = jax.random.normal(getkey(), (2, 40, 4, 12))
    call = AttentionCall.from_args(q.shape, k.shape, v.shape, q.dtype, mask, None)
    assert triton_attention.one_key_tile(call, ONE_KEY_TILE)
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90", deterministic=True)
    resolved = triton_attention.resolve_backward(ONE_KEY_TILE, call, h200)
    assert resolved.backward_pass_impl == "triton_fused"  # deterministic: no atomics
    assert triton_attention.resolve_backward(CFG, call, h200).backward_pass_impl == (
        "triton_split"
    )  # two key tiles: dQ atomics would contend
    fused = dataclasses.replace(ONE_KEY_TILE, backward_pass_impl="triton_fused")
    choice = explain_attention(q, k, v, mask=mask, implementation="triton", config=fused)
    assert choice.config.backward_pass_impl == "triton_fused"
    out, grads = check(q, k, v, ct, mask, config=fused)
    if not isinstance(mask, masks.Causal):  # batch element 1 sees no key
        assert not np.any(np.asarray(out[1])) and not np.any(np.asarray(grads[0][1]))


def test_backward_rule():
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    a100 = DeviceInfo("gpu", "NVIDIA A100", "sm_80")
    square = AttentionCall(1, 2048, 2048, 8, 8, 64, 64, "bfloat16")
    skewed = AttentionCall(1, 256, 16384, 8, 8, 64, 64, "bfloat16")
    resolve = triton_attention.resolve_backward
    assert resolve(CFG, square, h200).backward_pass_impl == "triton_split"
    assert resolve(CFG, square, a100).backward_pass_impl == "triton_fused"
    assert resolve(CFG, skewed, a100).backward_pass_impl == "triton_split"
    # An explicit fused request stays as asked; one the fused kernel cannot run (256 x
    # 16384 would shrink its tiles below 16 rows) is refused with the reason.
    assert resolve(FUSED, square, h200).backward_pass_impl == "triton_fused"
    pinned = resolve_backend("attention", "triton", device=a100, environ={})
    with pytest.raises(UnsupportedError, match="256 queries x 16384 keys .*below 16 rows"):
        pinned.select(skewed, FUSED)
    assert pinned.select(square, FUSED).config.backward_pass_impl == "triton_fused"
    assert triton_attention.default_config(square, h200).backward_pass_impl == "triton_split"

    # 65..128 keys: one 128-key dK/dV tile at 16-bit hd <= 32 (fused, dQ stored), two
    # 64-key tiles (split) at hd 64 or in float32, where the wide tile was not faster.
    def default(kv_len, dim, dtype="bfloat16"):
        call = AttentionCall(64, 1024, kv_len, 4, 4, dim, dim, dtype)
        config = triton_attention.default_config(call, h200)
        return config.block_k_dkv, config.backward_pass_impl

    assert default(128, 32) == (128, "triton_fused")
    assert default(100, 16) == (128, "triton_fused")
    assert default(64, 32) == (64, "triton_fused")
    assert default(129, 32) == (64, "triton_split")
    assert default(128, 64) == (64, "triton_split")
    assert default(128, 32, "float32") == (64, "triton_split")
    with pytest.raises(TypeError, match="takes a TritonAttentionConfig"):
        dot_product_attention(
            *make_qkv(jax.random.key(0)), implementation="triton", config=object()
        )


@pytest.mark.parametrize("dq_splits", [1, 3])
def test_score_mod_parameter_gradients(getkey, dq_splits):
    """Parameter gradients summed over the dQ kernel's programs, its keys split or not."""
    q, k, v = make_qkv(getkey(), q_len=20, kv_len=37)
    ct = jax.random.normal(getkey(), (2, 20, 4, 16))
    mask = masks.Causal("bottom_right") & masks.KVLengths(jnp.array([37, 11]))
    slopes = jnp.asarray(biases.alibi_slopes(4))
    scales = jax.random.uniform(getkey(), (4,), minval=0.5, maxval=2.0)

    def loss(attend, slopes, scales, q):
        mod = biases.Compose((biases.ALiBi(slopes), biases.HeadScale(scales), biases.SoftCap(3.0)))
        return jnp.sum(attend(q, k, v, mask, mod) * ct)

    config = dataclasses.replace(CFG, num_splits_dq=dq_splits)
    triton = lambda q, k, v, m, s: run_triton(q, k, v, m, s, config)
    grads = jax.jit(jax.grad(lambda *a: loss(triton, *a), argnums=(0, 1, 2)))(slopes, scales, q)
    oracle_fn = lambda q, k, v, m, s: oracle(q, k, v, m, s)
    expected = jax.grad(lambda *a: loss(oracle_fn, *a), argnums=(0, 1, 2))(slopes, scales, q)
    for a, b in zip(grads, expected):
        assert_close(a, b, jnp.float32, grad=True)
    # Parameter gradients live in the split backward's dQ kernel: a fused request is
    # refused with that reason.
    with pytest.raises(UnsupportedError, match="no score-mod parameter gradients"):
        explain_attention(q, k, v, mask=mask, score_mod=biases.ALiBi(slopes),
                          implementation="triton", config=FUSED)  # fmt: skip


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_kv_and_packed_gqa(getkey, splits, pack, dtype):
    """Few queries over long KV: every split count (forward and dQ), ragged and zero KV
    lengths, GQA packed."""
    q, k, v = make_qkv(getkey(), q_len=3, kv_len=150, q_heads=4, kv_heads=2, dtype=dtype)
    ct = jax.random.normal(getkey(), (2, 3, 4, 16))
    config = dataclasses.replace(CFG, num_splits=splits, num_splits_dq=splits, pack_gqa=pack)
    mask = masks.KVLengths(jnp.array([0, 101]))  # one batch element sees no key at all
    out, grads = check(q, k, v, ct, mask, config=config)
    assert not np.any(np.asarray(out[0], np.float32))
    assert not np.any(np.asarray(grads[0][0], np.float32))


@pytest.mark.parametrize("q_heads", [4, 6], ids=["groups_2", "groups_3"])
def test_group_dkv(getkey, q_heads):
    """dK/dV summed over a GQA group inside one program per KV head: per-head score mods
    (ALiBi's slopes indexed by query head), causal and ragged KV lengths, in bf16."""
    q, k, v = make_qkv(getkey(), q_len=20, kv_len=37, q_heads=q_heads, kv_heads=2,
                       dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), q.shape)
    mask = masks.Causal("bottom_right") & masks.KVLengths(jnp.array([37, 11]))
    mod = biases.ALiBi(jnp.asarray(biases.alibi_slopes(q_heads)))
    config = dataclasses.replace(CFG, group_dkv=True)
    check(q, k, v, ct, mask, mod, config=config)
    with pytest.raises(ValueError, match="group_dkv sums dK/dV in the split backward"):
        dataclasses.replace(FUSED, group_dkv=True)
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    a100 = DeviceInfo("gpu", "NVIDIA A100", "sm_80")
    square = AttentionCall(2, 256, 256, 8, 2, 64, 64, "bfloat16")
    grouped = TritonAttentionConfig(group_dkv=True)
    assert triton_attention.resolve_backward(grouped, square, a100).backward_pass_impl == (
        "triton_split"
    )  # where "auto" would fuse
    assert triton_attention.resolve_backward(CFG, square, a100).backward_pass_impl == (
        "triton_fused"
    )
    assert not triton_attention.default_config(square, h200).group_dkv  # not yet timed


@pytest.mark.parametrize("q_heads, dim", [(6, 16), (4, 24)], ids=["groups_3", "dim_24"])
def test_packed_gqa_through_padded_operands(getkey, q_heads, dim):
    """Packing that the direct forward cannot read (a group of 3, a head dim of 24): the
    operands are packed and padded for the kernels instead."""
    q, k, v = make_qkv(
        getkey(), q_len=2, kv_len=70, q_heads=q_heads, kv_heads=2, qk_dim=dim, v_dim=dim
    )
    ct = jax.random.normal(getkey(), (2, 2, q_heads, dim))
    config = dataclasses.replace(CFG, num_splits=2, pack_gqa=True)
    check(q, k, v, ct, masks.KVLengths(jnp.array([70, 33])), config=config)


def test_few_query_plan_splits_and_packs():
    h100 = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", "sm_90")
    h200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    decode = AttentionCall(1, 1, 32768, 32, 8, 128, 128, "bfloat16")
    cfg = triton_attention.default_config(decode, h100)
    assert cfg.pack_gqa and (cfg.block_q, cfg.block_k, cfg.num_stages) == (16, 64, 3)
    assert cfg.num_warps == 4
    # 8 programs (1 batch x 8 KV heads) of 100 KiB shared memory: two would fit an SM; on
    # the H100 the forward fills one per SM, 132 at once: 16 splits fill 97% of one wave
    # (15 would leave 12 SMs idle).
    assert cfg.num_splits == 16
    # The H200 fills two per SM (its faster memory wants more loads in flight): 32 splits.
    assert triton_attention.default_config(decode, h200).num_splits == 32
    # Per-batch KV lengths of 4 batch elements ask for >= 4 waves: 20 splits, 4.85 waves
    # (the H200: 33, 4 waves of 264).
    lengths = (("kv_lengths",),)
    ragged = dataclasses.replace(decode, batch=4, mask_terms=lengths)
    assert triton_attention.default_config(ragged, h100).num_splits == 20
    assert triton_attention.default_config(ragged, h200).num_splits == 33
    # One batch element's length leaves its programs equal: planned as without lengths.
    one = dataclasses.replace(decode, mask_terms=lengths)
    assert triton_attention.default_config(one, h100).num_splits == 16
    # 16 queries x 4 heads: 64-row tiles, whose float32 partials may cost 1/8 of the
    # 4 MiB of K/V a head reads: at most 8 splits over 8192 keys.
    rows = dataclasses.replace(decode, q_len=16, kv_len=8192)
    assert triton_attention.default_config(rows, h100).num_splits == 8
    # 64 programs at batch 8: 2 splits on the H100 (128 of 132, run 83's best), 4 on the
    # H200 (256 of 264, run 107's best).
    batched = dataclasses.replace(decode, batch=8, kv_len=131072)
    assert triton_attention.default_config(batched, h100).num_splits == 2
    assert triton_attention.default_config(batched, h200).num_splits == 4
    rule = triton_attention.SPLIT_KV_RULES["sm_90"]
    assert triton_attention.split_count(8, 2048, rule, per_sm=1) == 16
    assert triton_attention.split_count(8, 2048, rule, most=0) == 1  # partials cost too much
    assert triton_attention.split_count(64, 2048, rule) == 4  # 256 of 264: one wave
    assert triton_attention.split_count(320, 2048, rule) == 4  # 1.21 waves -> 4.85
    assert triton_attention.split_count(8, 8, rule) == 2  # >= 4 key tiles a split
    assert triton_attention.split_count(600, 2048, rule) == 1
    assert triton_attention.split_count(64, 2048, rule, ragged=True) == 20  # 4.85 waves, 97% full
    train = AttentionCall(4, 4096, 4096, 8, 8, 128, 128, "bfloat16")
    cfg = triton_attention.default_config(train, h200)
    assert cfg.num_splits == cfg.num_splits_dq == 1 and not cfg.pack_gqa
    # The dQ kernel's plan, by the same rule over its own grid: 16 programs (8 heads x 2
    # tiles of 64 queries) over 65,536 keys take 16 splits (the H100's best, run 72);
    # 512 programs (64 sets x 4 heads x 2 tiles) over 4096 keys none (run 71).
    cross = AttentionCall(1, 128, 65536, 8, 8, 128, 128, "bfloat16")
    assert triton_attention.default_config(cross, h200).num_splits_dq == 16
    assert triton_attention.default_config(cross, h100).num_splits_dq == 16
    sets = AttentionCall(64, 128, 4096, 4, 4, 32, 32, "bfloat16")
    assert triton_attention.default_config(sets, h200).num_splits_dq == 1
    with pytest.raises(UnsupportedError, match="pack_gqa"):
        q, k, v = make_qkv(jax.random.key(0), q_heads=4, kv_heads=2)
        run_triton(q, k, v, masks.Causal(), config=dataclasses.replace(CFG, pack_gqa=True))


def test_split_kv_over_several_query_tiles_causal(getkey):
    """Splits of every query tile (the grid runs the last tile first) under a causal mask."""
    q, k, v = make_qkv(getkey(), q_len=40, kv_len=100, q_heads=2, kv_heads=2)
    ct = jax.random.normal(getkey(), (2, 40, 2, 16))
    config = dataclasses.replace(CFG, num_splits=3, num_splits_dq=3)
    check(q, k, v, ct, masks.Causal("bottom_right"), config=config)


@pytest.mark.parametrize(
    "mask, score_mod",
    [
        (masks.Causal("bottom_right") & masks.KVLengths(jnp.array([13, 5])), None),
        (None, biases.ALiBi(jnp.array([0.5, 0.25, 0.125, 1.0]))),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_higher_derivatives(getkey, mask, score_mod, dtype):
    """Beyond the kernels' own first-order VJP: forward mode (`jax.jvp`), a gradient
    penalty and Hessian-vector products either way round, with respect to q, k, v and the
    score mod's parameters, equal the reference's throughout."""
    q, k, v = make_qkv(getkey(), batch=2, q_len=9, kv_len=13, q_heads=4, kv_heads=2,
                       qk_dim=16, dtype=dtype)  # fmt: skip

    def attend(implementation, config):
        return lambda q, k, v, mod: dot_product_attention(
            q, k, v, mask=mask, bias=mod, implementation=implementation, config=config
        )

    check_higher_derivatives(
        attend("triton", CFG), attend("xla", None), q, k, v, score_mod, dtype=dtype
    )


def test_jacfwd_through_the_kernels(getkey):
    """`jax.jacfwd` (forward mode under vmap) and `jax.hessian` through the kernels equal
    the reference's: here of the output in per-head query temperatures."""
    q, k, v = make_qkv(getkey(), batch=1, q_len=5, kv_len=7, q_heads=2, kv_heads=1,
                       qk_dim=16, dtype=jnp.float32)  # fmt: skip

    def attend(implementation, config):
        def out(temperature):
            scaled = q * temperature[None, None, :, None]
            return dot_product_attention(scaled, k, v, mask=masks.Causal(),
                                         implementation=implementation, config=config)  # fmt: skip

        return out

    t = jnp.array([0.7, 1.3])
    for transform in (jax.jacfwd, lambda f: jax.hessian(lambda t: jnp.sum(jnp.sin(f(t))))):
        got = jax.jit(transform(attend("triton", CFG)))(t)
        want = transform(attend("xla", None))(t)
        assert_close(got, want, jnp.float32, grad=True)


@pytest.fixture
def tangent_kernel_calls(monkeypatch):
    """Calls of Triton's forward-mode kernel (`flash_tangent`) made while a test runs."""
    calls = []
    run = triton_attention.flash_tangent

    def counted(*args, **kwargs):
        calls.append(kwargs["mask"])
        return run(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "flash_tangent", counted)
    return calls


def check_tangent(q, k, v, tangents, mask=None, score_mod=None, config=CFG):
    """`jax.jvp` through the kernels against the float32 oracle's; returns the tangent."""
    f = lambda q, k, v: run_triton(q, k, v, mask, score_mod, config)  # noqa: E731
    g = lambda q, k, v: oracle(q, k, v, mask, score_mod)  # noqa: E731
    out, tangent = jax.jvp(f, (q, k, v), tangents)
    up = [x.astype(jnp.float32) for x in (q, k, v, *tangents)]
    want_out, want = jax.jvp(g, tuple(up[:3]), tuple(up[3:]))
    assert tangent.dtype == q.dtype
    assert np.all(np.isfinite(np.asarray(tangent, np.float32)))
    assert_close(out, want_out, q.dtype)
    assert_close(tangent, want, q.dtype, grad=True)
    return tangent


@pytest.mark.parametrize("name", sorted(MASKS))
def test_forward_mode_kernel_over_masks(getkey, tangent_kernel_calls, name):
    """`jax.jvp` runs the one-pass tangent kernel, no score matrix, and equals the oracle's
    tangent under every mask (GQA, lengths off the tiles, rows without a valid key)."""
    q, k, v = make_qkv(getkey(), v_dim=12)
    tangents = make_qkv(getkey(), v_dim=12)
    check_tangent(q, k, v, tangents, MASKS[name])
    assert len(tangent_kernel_calls) == 1


def test_forward_mode_kernel_16_bit_score_mods_and_empty_rows(getkey, tangent_kernel_calls):
    """bf16 at lengths past one tile with Lq != Lkv, score mods without parameters (their
    slope scales the scores' tangent), and zeros where a row has no valid key."""
    q, k, v = make_qkv(getkey(), q_len=20, kv_len=37, dtype=jnp.bfloat16)
    tangents = make_qkv(getkey(), q_len=20, kv_len=37, dtype=jnp.bfloat16)
    mod = biases.Compose(
        (
            biases.ScoreFn(lambda s, b, h, qi, ki: s - 0.3 * jnp.abs(qi - ki).astype(s.dtype)),
            biases.SoftCap(1.5),
        )
    )
    check_tangent(q, k, v, tangents, masks.Causal("bottom_right"), mod)
    empty = masks.KVLengths(jnp.array([0, 37])) & masks.QLengths(jnp.array([20, 6]))
    tangent = check_tangent(q, k, v, tangents, empty)
    np.testing.assert_array_equal(np.asarray(tangent[0], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(tangent[1, 6:], np.float32), 0.0)
    assert len(tangent_kernel_calls) == 2


def test_forward_mode_kernel_under_vmap_and_through_parameters(getkey, tangent_kernel_calls):
    """Under `vmap` (an unbatched module's call) the tangent kernel runs once over the
    folded batch; the score mod's parameters (ALiBi's slopes, head scales) have tangents
    in it too, under `jax.jacfwd` (their tangents mapped) as well."""
    q, k, v = make_qkv(getkey(), q_heads=2, kv_heads=2)
    tangents = make_qkv(getkey(), q_heads=2, kv_heads=2)

    def unbatched(f):
        return jax.vmap(lambda *a: f(*(x[None] for x in a))[0])

    f = unbatched(lambda q, k, v: run_triton(q, k, v, masks.Causal()))
    g = unbatched(lambda q, k, v: oracle(q, k, v, masks.Causal()))
    got = jax.jit(lambda p, t: jax.jvp(f, p, t)[1])((q, k, v), tangents)
    assert_close(got, jax.jvp(g, (q, k, v), tangents)[1], jnp.float32, grad=True)
    assert len(tangent_kernel_calls) == 1

    def mods(slopes, scales):
        return biases.Compose((biases.ALiBi(slopes), biases.HeadScale(scales)))

    def attend(attention):
        return lambda q, slopes, scales: attention(q, k, v, masks.Causal(), mods(slopes, scales))

    params = (jnp.array([0.5, 0.25]), jnp.array([1.2, 0.7]))
    t_params = (jnp.array([1.0, -2.0]), jnp.array([0.3, 0.5]))
    got = jax.jvp(attend(run_triton), (q, *params), (tangents[0], *t_params))[1]
    want = jax.jvp(attend(oracle), (q, *params), (tangents[0], *t_params))[1]
    assert_close(got, want, jnp.float32, grad=True)
    assert len(tangent_kernel_calls) == 2
    jacobian = lambda a: jax.jacfwd(lambda s: a(q, s, params[1]))(params[0])  # noqa: E731
    assert_close(jacobian(attend(run_triton)), jacobian(attend(oracle)), jnp.float32, grad=True)
    assert len(tangent_kernel_calls) == 3


@pytest.mark.parametrize("moving", ["q", "kv", "v", "qk"])
def test_forward_mode_kernel_skips_arguments_held_fixed(getkey, monkeypatch, moving):
    """An argument that does not depend on what `jax.jvp` differentiates (keys and values
    of a fixed context) reaches the tangent kernel as None, which skips its products; the
    tangent still equals the oracle's, under a mask with lengths and rows without keys."""
    q, k, v = make_qkv(getkey(), q_len=20, kv_len=37, dtype=jnp.bfloat16)
    tq, tk, tv = make_qkv(getkey(), q_len=20, kv_len=37, dtype=jnp.bfloat16)
    mask = masks.Causal("bottom_right") & masks.KVLengths(jnp.array([0, 30]))
    seen = []
    run = triton_attention.flash_tangent
    monkeypatch.setattr(triton_attention, "flash_tangent",
                        lambda *a, **kw: seen.append(a[3:6]) or run(*a, **kw))  # fmt: skip
    names = [n for n in "qkv" if n in moving]
    primal, tangent = dict(q=q, k=k, v=v), dict(q=tq, k=tk, v=tv)

    def of(attention):
        def f(*moved):
            args = dict(primal, **dict(zip(names, moved, strict=True)))
            return attention(args["q"], args["k"], args["v"], mask, None)

        return f

    up = lambda xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
    moved, t_moved = [primal[n] for n in names], [tangent[n] for n in names]
    got = jax.jvp(of(lambda *a: run_triton(*a, CFG)), tuple(moved), tuple(t_moved))[1]
    want = jax.jvp(lambda *m: of(oracle)(*m), up(moved), up(t_moved))[1]
    assert_close(got, want, jnp.bfloat16, grad=True)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)
    assert [[t is None for t in ts] for ts in seen] == [[n not in names for n in "qkv"]]


def test_gradient_beside_a_stopped_tangent_runs_kernels_only(getkey, tangent_kernel_calls):
    """MeanFlow's and consistency models' losses: `jax.grad` of a loss holding a `jax.jvp`
    whose tangent is a stopped-gradient target. The gradient equals the oracle's, and the
    compiled program holds no score matrix: the reference's derivatives of the tangent,
    which nothing uses, are gone."""
    q, k, v = make_qkv(getkey(), q_len=40, kv_len=56)
    t_q = make_qkv(getkey(), q_len=40, kv_len=56)[0]

    def loss(attention):
        def of(q):
            out, tangent = jax.jvp(lambda q: attention(q, k, v, masks.Causal()), (q,), (t_q,))
            return jnp.sum(out**2) + jnp.sum(jax.lax.stop_gradient(tangent) * out)

        return of

    grad = jax.jit(jax.grad(loss(run_triton)))
    assert_close(grad(q), jax.grad(loss(oracle))(q), jnp.float32, grad=True)
    assert tangent_kernel_calls
    program = grad.lower(q).compile().as_text()
    assert "40,56]" not in program and "56,40]" not in program
