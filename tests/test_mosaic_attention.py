"""The Mosaic GPU kernels under the Mosaic GPU interpreter (CPU) against the float32 oracle.

The interpreter simulates shared memory, barriers, TMA and wgmma; every case here runs
the forward kernel and both backward kernels. Shapes are small but still exercise
padding (lengths and head dims off the 64-row tiles), GQA and several tiles per loop.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _attention_cases import MASKS, make_qkv
from _check import check_against_oracle
from probjax_eqx import UnsupportedError, biases, dot_product_attention, flex_attention, masks
from probjax_eqx.kernels.mosaic import attention as mosaic_attention
from probjax_eqx.kernels.mosaic._compat import JAX_011
from probjax_eqx.kernels.mosaic.attention import MosaicAttentionConfig, smem_bytes
from probjax_eqx.kernels.triton.attention import TritonAttentionConfig

CFG = MosaicAttentionConfig(block_k=64, interpret=True)


def check(q, k, v, ct, mask=None, config=CFG, primal=False):
    f = lambda q, k, v: flex_attention(q, k, v, mask=mask, implementation="mosaic", config=config)
    return check_against_oracle(f, q, k, v, ct, mask=mask, primal=primal)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks_fwd_and_grads(getkey, name):
    # The interpreter's time grows with the programs: one KV head (GQA's pair of query
    # heads) for the masks; "none" keeps two KV heads, each read by its own query heads.
    q_heads, kv_heads = (4, 2) if name == "none" else (2, 1)
    q, k, v = make_qkv(getkey(), q_heads=q_heads, kv_heads=kv_heads, dtype=jnp.bfloat16)
    ct = jax.random.normal(getkey(), (2, 7, q_heads, 16))
    check(q, k, v, ct, MASKS[name], primal=True)  # the undifferentiated call too


@pytest.mark.parametrize(
    "q_len, kv_len, mask",
    [
        (100, 150, masks.Causal("bottom_right")),
        (150, 70, masks.causal_local_window(40) & masks.KVLengths(jnp.array([60]))),
    ],
)
def test_several_tiles_unaligned_fp16(getkey, q_len, kv_len, mask):
    q, k, v = make_qkv(
        getkey(),
        batch=1,
        q_len=q_len,
        kv_len=kv_len,
        q_heads=2,
        kv_heads=1,
        qk_dim=40,
        v_dim=72,
        dtype=jnp.float16,
    )
    ct = jax.random.normal(getkey(), (1, q_len, 2, 72))
    # FA3's ping-pong schedule (the GPU default's forward, there with 24 registers for
    # the TMA warpgroup; here its turns on mbarriers) stays exact with a 40-register split.
    config = dataclasses.replace(CFG, memory_registers=40, pingpong=True, named_turns=False)
    check(q, k, v, ct, mask, config)


@pytest.mark.parametrize(
    "q_len, kv_len, mask",
    [
        # Two key programs, the second half-empty, 3 query tiles through the dK/dV ring;
        # two dQ programs, 4 key tiles through theirs.
        (150, 200, masks.Causal("bottom_right") & masks.KVLengths(jnp.array([170]))),
        (70, 130, "segments"),  # each warpgroup's own key ids
    ],
)
def test_two_warpgroup_backward(getkey, q_len, kv_len, mask):
    """block_k_dkv = block_q_dq = 128: dK/dV and dQ programs with two compute warpgroups
    of 64 keys / rows and a TMA warpgroup."""
    if mask == "segments":
        ids = jnp.arange(max(q_len, kv_len)) // 50
        mask = masks.Segments(ids[None, :q_len], ids[None, :kv_len])
    q, k, v = make_qkv(getkey(), batch=1, q_len=q_len, kv_len=kv_len, q_heads=2, kv_heads=1,
                       qk_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), (1, q_len, 2, 16))
    check(q, k, v, ct, mask, dataclasses.replace(CFG, block_k_dkv=128, block_q_dq=128))


@pytest.mark.parametrize(
    "q_len, kv_len, mask",
    [
        # Masked first and last key tiles around full ones; a batch element with no keys
        # (no step to start the pipeline) beside one with a single tile.
        (150, 260, masks.Causal("bottom_right")),
        (70, 130, masks.KVLengths(jnp.array([0, 60]))),
    ],
)
def test_overlapped_softmax_forward(getkey, q_len, kv_len, mask):
    """overlap_softmax: each step's softmax runs beside the previous step's P @ V."""
    causal = isinstance(mask, masks.Causal)
    batch = 1 if causal else 2
    q, k, v = make_qkv(getkey(), batch=batch, q_len=q_len, kv_len=kv_len, q_heads=2,
                       kv_heads=1, qk_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), (batch, q_len, 2, 16))
    # 128-key steps: the scores and P @ V products differ in shape. The causal case in
    # FA3's ping-pong turns too, each around a step's two products.
    config = dataclasses.replace(CFG, block_k=128, overlap_softmax=True, memory_registers=24,
                                 pingpong=causal, named_turns=False)  # fmt: skip
    check(q, k, v, ct, mask, config)


def test_one_slot_rings(getkey):
    """num_stages=1: the one-warpgroup dK/dV and dQ programs load each step once the last
    one's products are done (prefetching into the one slot raced, and crashed the H100 in
    run 117); the forward's overlapped steps share the slot's K and V barriers."""
    q, k, v = make_qkv(getkey(), batch=1, q_len=130, kv_len=200, q_heads=2, kv_heads=1,
                       qk_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), (1, 130, 2, 16))
    config = dataclasses.replace(CFG, num_stages=1, overlap_softmax=True)
    check(q, k, v, ct, masks.Causal(), config)


@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_key_tile_programs_share_the_union_of_their_ranges(as_array):
    """key_tiles_dkv=2: each tile's [lo, hi) becomes its program's union over non-empty
    tiles, its full range clipped into it; an all-empty program stays empty. Unmasked
    calls' numpy ranges stay numpy (constants in the kernel call)."""
    # Programs of tiles 0-1 (both non-empty), 2-3 (tile 2 empty) and 4 (empty).
    rows = [0, 2, 0, 1, 0], [1, 4, 0, 2, 0], [2, 4, 0, 2, 0], [2, 4, 0, 3, 0]
    lo, full_lo, full_hi, hi = (as_array(np.array([row], np.int32)) for row in rows)
    ranges = mosaic_attention._over_key_tiles((lo, full_lo, full_hi, hi), 2)
    assert all(isinstance(x, type(lo)) for x in ranges)
    expected = [[0, 0, 1, 1, 0], [1, 4, 1, 2, 0], [2, 4, 1, 2, 0], [4, 4, 3, 3, 0]]
    np.testing.assert_array_equal(np.stack([np.asarray(x)[0] for x in ranges]), expected)


# Top-left causal: a program's key tiles loop over different query tiles (one of them
# none), the program over their union (`_over_key_tiles`).
CAUSAL_LENGTHS = masks.Causal() & masks.KVLengths(jnp.array([0, 150]))


@pytest.mark.parametrize(
    "batch, kv_len, q_heads, block_k_dkv, key_tiles, num_stages, mask",
    [
        # Unmasked MHA: both query tiles stay in the ring for every key tile; 6 key
        # tiles over programs of 4 (the last one short, its last tile padded).
        (1, 330, 2, 64, 4, 2, None),
        # GQA, causal, KV lengths: the steps stream on across key tiles; the example
        # without keys stores zeros.
        (2, 200, 4, 64, 3, 2, CAUSAL_LENGTHS),
        # Key segment ids in the two slots beside K and V; a one-slot ring.
        (1, 260, 2, 64, 2, 1, "segments"),
        # Two compute warpgroups of 64 keys, each loading its own half of the next tile,
        # fed by the TMA warpgroup: resident with each warpgroup's key ids, and streamed.
        (1, 330, 2, 128, 2, 2, "segments"),
        (2, 200, 4, 128, 2, 2, CAUSAL_LENGTHS),
    ],
)
def test_dkv_programs_over_several_key_tiles(getkey, batch, kv_len, q_heads, block_k_dkv,
                                             key_tiles, num_stages, mask):  # fmt: skip
    """key_tiles_dkv > 1: a dK/dV program runs its key tiles in turn, the next tile's K / V
    loading into the other slot while one computes."""
    q_len = 100
    if mask == "segments":
        ids = jnp.arange(max(q_len, kv_len)) // 70
        mask = masks.Segments(ids[None, :q_len], ids[None, :kv_len])
    kv_heads = 2 if q_heads == 2 else 1
    q, k, v = make_qkv(getkey(), batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads,
                       kv_heads=kv_heads, qk_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), (batch, q_len, q_heads, 16))
    config = dataclasses.replace(CFG, block_k_dkv=block_k_dkv, key_tiles_dkv=key_tiles,
                                 num_stages=num_stages)  # fmt: skip
    check(q, k, v, ct, mask, config)


@pytest.mark.parametrize(
    "qk_dim, num_stages, lengths",
    [
        # One 64-row block of dQ^T, the warpgroups' in turns. Two query heads over one KV
        # head (steps carry on across GQA members); under jax.vmap, an example with no
        # keys and one with a half-empty second key program.
        (16, 1, (0, 170)),
        # Two blocks, one each; masked tiles at both ends of the dK/dV programs' loops.
        (72, 2, None),
    ],
)
def test_fused_dq_backward(getkey, qk_dim, num_stages, lengths):
    """fused_dq: dQ's products in the dK/dV program, both warpgroups' dS^T through shared
    memory, dQ^T's shares added up outside (interpreted: per-program buffers)."""
    batch = 1 if lengths is None else len(lengths)
    q, k, v = make_qkv(getkey(), batch=batch, q_len=150, kv_len=200, q_heads=2, kv_heads=1,
                       qk_dim=qk_dim, v_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), (batch, 150, 2, 16))
    config = dataclasses.replace(CFG, block_k_dkv=128, fused_dq=True, num_stages=num_stages)
    # The kernels themselves: the staged (interpreted) layout at head dim 128 exceeds the
    # GPU's shared memory, which the interpreter does not have.
    attend = functools.partial(mosaic_attention.flash_attention, score_mod=None,
                               scale=qk_dim**-0.5, config=config)  # fmt: skip
    if lengths is None:
        mask = masks.Causal("bottom_right")
        f = functools.partial(attend, mask=mask)
    else:
        mask = masks.KVLengths(jnp.array(lengths))

        def f(q, k, v):  # one example at a time, as vmap sees it: `[1, seq, heads, dim]`
            one = lambda q, k, v, n: attend(  # noqa: E731
                q[None], k[None], v[None], mask=masks.KVLengths(n[None])
            )[0]
            return jax.vmap(one)(q, k, v, mask.lengths)

    check_against_oracle(f, q, k, v, ct, mask=mask, primal=False)


@pytest.mark.parametrize("group", [None, 1, 2, 3, 4, 9])
def test_launch_group_covers_every_program_once(group):
    """`launch_group`'s order: every (tile, head, batch) once; each run of `group * tiles`
    programs in launch order (the grid's last axis fastest) holds `group` pairs (the
    last run fewer), whose tiles go rank by rank."""
    tiles, heads, batch = 3, 2, 2
    config = MosaicAttentionConfig(launch_group=group, interpret=True)
    grid, names = mosaic_attention._grid(config, tiles, heads, batch, "q")
    program = functools.partial(mosaic_attention._program, config, tiles, heads, batch, "q")
    for name in reversed(names):  # the outermost vmap is the grid's first (slowest) axis
        program = jax.vmap(program, axis_name=name, axis_size=grid[names.index(name)])
    ranks, hs, bs = (x.reshape(-1) for x in program())  # launch order: row-major
    seen = [(int(r), int(h), int(b)) for r, h, b in zip(ranks, hs, bs)]
    assert sorted(seen) == [(t, h, b) for t in range(tiles) for h in range(heads)
                            for b in range(batch)]  # fmt: skip
    pairs = heads * batch
    size = pairs if group is None else min(group, pairs)
    for start in range(0, pairs * tiles, size * tiles):
        run = seen[start : start + size * tiles]
        assert len({(h, b) for _, h, b in run}) == len(run) // tiles
        assert [r for r, _, _ in run] == sorted(r for r, _, _ in run)


@pytest.mark.parametrize("group, fused_dq", [(1, True), (3, False)])
def test_launch_group_kernels(getkey, group, fused_dq):
    """Every kernel in `launch_group`'s order over two batch elements and two heads (3:
    a group of three pairs and one of one), its indices remapped from the grid's."""
    q, k, v = make_qkv(getkey(), batch=2, q_len=70, kv_len=130, q_heads=2, kv_heads=2,
                       qk_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), q.shape)
    blocks = dict(block_k_dkv=128) if fused_dq else {}
    config = dataclasses.replace(CFG, launch_group=group, fused_dq=fused_dq, **blocks)
    check(q, k, v, ct, masks.Causal("bottom_right"), config)


@pytest.mark.skipif(not JAX_011, reason="jax 0.10's interpreter cannot read transposed views")
def test_transposed_views(getkey):
    """transposed_views: K^T, Q^T, dO^T, V^T as views of the tiles TMA brought in."""
    q, k, v = make_qkv(getkey(), batch=1, q_len=100, kv_len=150, q_heads=2, kv_heads=1,
                       qk_dim=16, dtype=jnp.bfloat16)  # fmt: skip
    ct = jax.random.normal(getkey(), (1, 100, 2, 16))
    mask = masks.Causal("bottom_right")
    check(q, k, v, ct, mask, dataclasses.replace(CFG, transposed_views=True, block_k_dkv=128))


@pytest.mark.parametrize(
    "mod, mask, tuned",
    [
        (biases.SoftCap(2.0), masks.Causal(), {}),
        (
            biases.Compose((biases.SoftCap(3.0), biases.SoftCap(1.5))),
            masks.KVLengths(jnp.array([9, 4])),
            {},
        ),
        # FA3's backward (the GPU's default): the scaled dS^T also feeds dQ's products.
        (biases.SoftCap(2.0), masks.Causal(), dict(fused_dq=True, block_k_dkv=128)),
    ],
)
def test_softcap_fwd_and_grads(getkey, mod, mask, tuned):
    """SoftCap in the kernel: its scores forward, its derivative scaling dS backward."""
    q, k, v = make_qkv(getkey(), q_heads=2, kv_heads=1, dtype=jnp.bfloat16)
    ct = jax.random.normal(getkey(), (2, 7, 2, 16))
    config = dataclasses.replace(CFG, **tuned)
    f = lambda q, k, v: flex_attention(  # noqa: E731
        q, k, v, mask=mask, score_mod=mod, implementation="mosaic", config=config
    )
    check_against_oracle(f, q, k, v, ct, mask=mask, score_mod=mod, primal=False)


def test_rows_without_keys_are_zero(getkey):
    q, k, v = make_qkv(getkey(), q_heads=2, kv_heads=1, dtype=jnp.bfloat16)
    mask = masks.KVLengths(jnp.array([0, 4]))
    ct = jax.random.normal(getkey(), (2, 7, 2, 16))
    out, (dq, dk, dv) = check(q, k, v, ct, mask)
    assert not jnp.any(out[0]) and not jnp.any(dq[0]) and not jnp.any(dk[0]) and not jnp.any(dv[0])


def test_split_kv_forward_joined_to_the_mosaic_backward(getkey):
    """The split-KV Triton forward's output and log-sum-exp, then the Mosaic backward."""
    q, k, v = make_qkv(
        getkey(), batch=1, q_len=20, kv_len=300, q_heads=4, kv_heads=2, dtype=jnp.bfloat16
    )
    ct = jax.random.normal(getkey(), (1, 20, 4, 16))
    triton = TritonAttentionConfig(block_q=16, block_k=32, num_splits=3, interpret=True)
    config = dataclasses.replace(CFG, split_kv_forward=triton)
    check(q, k, v, ct, config=config, primal=True)
    attend = functools.partial(flex_attention, implementation="mosaic", config=config)
    assert "probjax_attention_triton_fwd_split" in str(jax.make_jaxpr(attend)(q, k, v))
    with pytest.raises(UnsupportedError, match="no masks or score mods"):
        check(q, k, v, ct, masks.Causal(), config=config)


def test_cudnn_backward_joined_to_the_mosaic_forward_traces(getkey):
    """`cudnn_backward`: the Mosaic forward (interpreted here), then cuDNN's backward given
    its output and log-sum-exp. The CPU runs no cuDNN: this checks what is traced (the
    gradients' shapes and dtypes, which kernels run where); the GPU test runs it."""
    q, k, v = make_qkv(
        getkey(), batch=1, q_len=100, kv_len=100, q_heads=2, kv_heads=1, dtype=jnp.bfloat16
    )
    config = dataclasses.replace(CFG, cudnn_backward=True)

    def attend(q, k, v):
        return mosaic_attention.flash_attention(
            q, k, v, mask=masks.Causal(), score_mod=None, scale=0.25, config=config
        )

    grad = jax.grad(lambda *qkv: attend(*qkv).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for g, x in zip(jax.eval_shape(grad, q, k, v), (q, k, v)):
        assert (g.shape, g.dtype) == (x.shape, x.dtype)
    assert "dot_product_attention_bwd" in str(jax.make_jaxpr(grad)(q, k, v))
    assert "dot_product_attention" not in str(jax.make_jaxpr(attend)(q, k, v))
    with pytest.raises(UnsupportedError, match="cudnn_backward's cuDNN backward: runs on"):
        flex_attention(q, k, v, implementation="mosaic", config=config)
    with pytest.raises(UnsupportedError, match="no other masks or score mods"):
        window = masks.causal_local_window(8)
        flex_attention(q, k, v, mask=window, implementation="mosaic", config=config)
    with pytest.raises(ValueError, match="would leave no half to these kernels"):
        dataclasses.replace(config, split_kv_forward=TritonAttentionConfig(interpret=True))


def test_refusals_name_the_reason(getkey):
    q, k, v = make_qkv(getkey(), dtype=jnp.bfloat16)
    mask_fn = masks.MaskFn(lambda b, h, q, kv: (q + kv) % 2 == 0)
    with pytest.raises(UnsupportedError, match="MaskFn is not in the Mosaic kernel"):
        flex_attention(q, k, v, mask=mask_fn, implementation="mosaic", config=CFG)
    with pytest.raises(UnsupportedError, match=r"score mods \['head_scale'\] are not in the"):
        head_scale = biases.HeadScale(jnp.ones(4))
        flex_attention(q, k, v, score_mod=head_scale, implementation="mosaic", config=CFG)
    with pytest.raises(UnsupportedError, match="dtype float32 not supported"):
        q32, k32, v32 = make_qkv(getkey())
        dot_product_attention(q32, k32, v32, implementation="mosaic", config=CFG)
    with pytest.raises(ValueError, match="multiple of 64"):
        MosaicAttentionConfig(block_k=32)
    with pytest.raises(ValueError, match="must be 64 or 128"):
        MosaicAttentionConfig(block_q_dq=192)
    with pytest.raises(ValueError, match="named_turns needs the GPU"):
        dataclasses.replace(CFG, pingpong=True)
    with pytest.raises(ValueError, match="fused_dq needs block_k_dkv=128"):
        dataclasses.replace(CFG, fused_dq=True)
    with pytest.raises(ValueError, match="p_in_registers needs the GPU"):
        dataclasses.replace(CFG, p_in_registers=True)
    if not JAX_011:
        with pytest.raises(ValueError, match="transposed_views needs the GPU or jax >= 0.11"):
            dataclasses.replace(CFG, transposed_views=True)
    # Two-warpgroup backward tiles at head dim 256 do not fit: refused before compiling.
    q, k, v = make_qkv(getkey(), qk_dim=256, dtype=jnp.bfloat16)
    big = dataclasses.replace(CFG, block_k_dkv=128)
    with pytest.raises(UnsupportedError, match="shared memory"):
        dot_product_attention(q, k, v, implementation="mosaic", config=big)


def test_shared_memory_estimate_fits_hopper_at_head_dim_128():
    sizes = smem_bytes(MosaicAttentionConfig(), 128, 128)
    assert max(sizes.values()) <= 227 * 1024, sizes


def test_shared_memory_is_counted_as_mosaic_counts_it():
    # Mosaic GPU's own counts from the H200 (runs 15-16), 1 KiB-aligned buffers and
    # barriers included: the two-warpgroup dK/dV program with one segment-id pair, and a
    # dQ program with 128-key steps.
    two_wg = MosaicAttentionConfig(block_k_dkv=128, block_q_dq=128)
    assert smem_bytes(two_wg, 128, 128, 1, 1)["dkv"] == 233648
    assert smem_bytes(MosaicAttentionConfig(block_k_dq=128), 128, 128)["dq"] == 247888
    # Register operands free P's staging (two warpgroups' 64 x 128 tiles), P^T's and
    # dS^T's (two warpgroups' 64 x 64 each) and dS's (64 x 64).
    staged, in_registers = (
        smem_bytes(MosaicAttentionConfig(block_k_dkv=128, p_in_registers=p), 128, 128)
        for p in (False, True)
    )
    freed = {kernel: staged[kernel] - in_registers[kernel] for kernel in staged}
    assert freed == {"forward": 32768, "dkv": 32768, "dq": 8192}
    # Transposed views drop the rings' Q^T and dO^T tiles (dK/dV) and K^T (dQ), with
    # their barriers; the forward's K tiles only change shape.
    views = smem_bytes(MosaicAttentionConfig(block_k_dkv=128, transposed_views=True), 128, 128)
    freed = {kernel: staged[kernel] - views[kernel] for kernel in staged}
    assert freed == {"forward": 0, "dkv": 2 * 2 * 64 * 128 * 2 + 32, "dq": 2 * 64 * 128 * 2 + 16}


def test_auto_joins_the_split_kv_forward_where_the_grid_is_short():
    """One wave of programs or fewer, unmasked: the Triton split-KV forward (run 108),
    in automatic selection; "mosaic" by name runs its own kernels."""
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo, resolve
    from probjax_eqx.kernels.mosaic.attention import auto_config

    h100, cpu = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", "sm_90"), DeviceInfo("cpu", "cpu")

    def call_of(batch, q_len, kv_len, mask=None):
        q, kv = (batch, q_len, 32, 128), (batch, kv_len, 8, 128)
        return AttentionCall.from_args(q, kv, kv, jnp.dtype(jnp.bfloat16), mask, None)

    def joined(batch, q_len, kv_len, mask=None, device=h100):
        return auto_config(call_of(batch, q_len, kv_len, mask), device).split_kv_forward

    short = call_of(1, 128, 32768)
    for implementation, expected in (("auto", True), ("mosaic", False)):
        choice = resolve("attention", implementation, device=h100, environ={}).select(short)
        assert choice.kernel == "mosaic"
        assert (choice.config.split_kv_forward is not None) == expected, implementation
        assert ("its forward from the split-KV Triton kernel" in choice.reason) == expected

    # 32 and 64 programs: joined, the Triton forward splitting the keys.
    assert joined(1, 128, 32768).num_splits > 1 and joined(2, 128, 32768).num_splits > 1
    assert joined(1, 256, 16384) is not None
    assert joined(8, 128, 8192) is None  # 256 programs, about two waves: slower joined
    assert joined(1, 128, 32768, masks.Causal()) is None  # the join takes no masks
    assert joined(1, 128, 32768, device=cpu) is None  # interpreted tests set it themselves
    assert joined(1, 128, 256) is None  # too few keys for the Triton forward to split
    assert joined(1, 16, 32768) is None  # the Triton plan packs 4 heads: not the join's


def test_default_gives_dq_its_own_kernel_at_one_query_tile_over_many_keys():
    """MHA, <= 128 queries, >= half a wave of dQ programs: no fused dQ (runs 109, 111),
    and dK/dV programs over 16 key tiles of 128 (runs 156-159); fused dQ keeps one."""
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo
    from probjax_eqx.kernels.mosaic.attention import default_config

    h100 = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", "sm_90")

    def fused(batch, q_len, kv_len, kv_heads=32, mask=None):
        q, kv = (batch, q_len, 32, 128), (batch, kv_len, kv_heads, 128)
        call = AttentionCall.from_args(q, kv, kv, jnp.dtype(jnp.bfloat16), mask, None)
        config = default_config(call, h100)
        assert config.block_k_dkv == 128
        assert config.key_tiles_dkv == (1 if config.fused_dq else 16)
        return config.fused_dq

    assert not fused(4, 128, 8192) and not fused(8, 128, 32768)  # 128 / 256 programs
    assert fused(1, 128, 32768)  # 32 programs: the dQ kernel's grid is short
    assert fused(8, 128, 8192, kv_heads=8)  # grouped heads: fused was faster
    assert fused(8, 256, 8192) and fused(8, 128, 4096)  # not timed (hd 64 at 4096: fused)
    assert fused(8, 128, 8192, mask=masks.Causal())


def test_default_tiles_step_down_where_shared_memory_is_short(getkey):
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo
    from probjax_eqx.kernels.mosaic.attention import default_config

    sm90 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
    shape, ids = (2, 1024, 8, 128), jnp.zeros((2, 1024), jnp.int32)

    def call(mask, shape=shape, score_mod=None):
        return AttentionCall.from_args(shape, shape, shape, jnp.dtype(jnp.bfloat16), mask,
                                       score_mod)  # fmt: skip

    cpu = DeviceInfo("cpu", "cpu", None)
    tiles = lambda cfg: (cfg.block_k, cfg.block_k_dkv, cfg.block_q_dq)  # noqa: E731
    # The GPU's default takes FA3's register operands and transposed views (run 44) and
    # its forward schedule (run 47); the interpreter's cannot, and stages P, P^T, dS^T,
    # dS and the transposed tiles.
    fa3_forward = lambda cfg: (cfg.pingpong, cfg.overlap_softmax, cfg.memory_registers)  # noqa: E731
    dense, interpreted = default_config(call(None), sm90), default_config(call(None), cpu)
    assert tiles(dense) == tiles(interpreted) == (128, 128, 128)
    assert dense.p_in_registers and dense.transposed_views and not dense.interpret
    assert fa3_forward(dense) == (True, True, 24) and dense.named_turns
    assert not (interpreted.p_in_registers or interpreted.transposed_views)
    assert fa3_forward(interpreted) == (False, False, None)
    # Segment-id tiles push the staged two-warpgroup dK/dV program over the limit (run
    # 16); the GPU's, without staging or transposed tiles, fits.
    segments = lambda device: default_config(call(masks.Segments(ids)), device)  # noqa: E731
    assert tiles(segments(cpu)) == (128, 64, 128)
    assert tiles(segments(sm90)) == (128, 128, 128)
    # Segment ids take FA3's forward and backward too (their GPU tests passed in run 51).
    assert fa3_forward(segments(sm90)) == (True, True, 24) and segments(sm90).fused_dq
    # FA3's backward and the approximate exp2 unless a score mod brings its tanh.
    assert dense.fused_dq and dense.approx_math
    assert not (interpreted.fused_dq or interpreted.approx_math)

    def gpu(seq, head_dim, mask=None, score_mod=None):
        return default_config(call(mask, (1, seq, 8, head_dim), score_mod), sm90)

    # Each pair's tiles launched together (H100 run 53), but for causal calls below
    # T 16384: groups of 4 pairs, longest tiles first within each (run 59).
    assert dense.launch_group == gpu(4096, 64).launch_group == 1
    assert interpreted.launch_group is None
    assert gpu(4096, 128, masks.Causal()).launch_group == 4
    assert gpu(16384, 128, masks.Causal()).launch_group == 1
    assert gpu(4096, 128, masks.PrefixLM(100) & masks.KVLengths(jnp.array([9]))).launch_group == 4
    # Ping-pong turns but at hd 64 or T 16384, under any mask (runs 59 and 65).
    assert gpu(4096, 128).pingpong and gpu(4096, 128, masks.Causal()).pingpong
    assert not (gpu(4096, 64).pingpong or gpu(16384, 128).pingpong)
    assert not (gpu(4096, 64, masks.Causal()).pingpong or gpu(16384, 128, masks.Causal()).pingpong)
    assert not gpu(8192, 64, masks.KVLengths(jnp.array([9]))).pingpong
    # 24 registers for the backward's TMA warpgroup under causal-like masks (runs 65, 74).
    assert gpu(4096, 128, masks.Causal()).backward_memory_registers == 24
    assert gpu(4096, 64, masks.PrefixLM(100)).backward_memory_registers == 24
    assert gpu(4096, 128).backward_memory_registers == interpreted.backward_memory_registers == 40
    # `fused_dq` up to 1 GiB of dQ reductions a head with groups of 1 (run 53), 512 MiB
    # in the other orders (run 48: slower at T 16384 hd 128).
    assert gpu(16384, 128).fused_dq and not gpu(32768, 128).fused_dq
    assert gpu(12288, 128).fused_dq and not gpu(12288, 128, masks.Causal()).fused_dq  # 576 MiB
    assert not gpu(16384, 64, score_mod=biases.SoftCap(30.0)).approx_math
    q, k, v = make_qkv(getkey(), batch=2, q_len=64, kv_len=64, qk_dim=128, dtype=jnp.bfloat16)
    big = dataclasses.replace(CFG, block_k_dkv=128)
    with pytest.raises(UnsupportedError, match="shared memory"):
        dot_product_attention(q, k, v, mask=masks.Segments(ids[:, :64]), implementation="mosaic",
                              config=big)  # fmt: skip


def test_auto_joins_cudnn_backward_for_long_self_attention():
    """Self-attention over >= 16384 keys at hd 128, unmasked or causal: Mosaic's forward
    with cuDNN's backward, in automatic selection (H100 runs 94, 164-166); "mosaic" by
    name runs its own backward, and other calls keep their routes."""
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo, resolve

    h100 = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", "sm_90")

    def choice(seq, head_dim=128, mask=None, kv_heads=8, implementation="auto"):
        q, kv = (4, seq, 8, head_dim), (4, seq, kv_heads, head_dim)
        call = AttentionCall.from_args(q, kv, kv, jnp.dtype(jnp.bfloat16), mask, None)
        choice = resolve("attention", implementation, device=h100, environ={}).select(call)
        joined = getattr(choice.config, "cudnn_backward", None)
        assert ("its backward from cuDNN's" in choice.reason) == bool(joined), choice.reason
        return choice.kernel, joined

    assert choice(16384) == ("mosaic", True)
    assert choice(16384, mask=masks.Causal()) == ("mosaic", True)
    assert choice(16384, implementation="mosaic") == ("mosaic", False)
    assert choice(4096) == ("cudnn", None)  # cuDNN's own forward is as fast there
    assert choice(16384, head_dim=64) == ("cudnn", None)  # Mosaic's hd 64 forward is not
    assert choice(16384, head_dim=64, mask=masks.Causal()) == ("mosaic", False)
    assert choice(16384, kv_heads=2) == ("cudnn", None)  # GQA: not timed
    assert choice(16384, mask=masks.causal_local_window(256)) == ("cudnn", None)
