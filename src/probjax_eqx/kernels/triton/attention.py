"""Pallas Triton flash attention: forward and split backward (`implementation="triton"`).

Forward: FlashAttention-2 (Dao, 2023, Algorithm 1) with the online softmax in float32
in base 2 (`exp2`, the scale folded with log2(e)) and deferred normalisation (FA2
§3.1.1); the base-2 log-sum-exp is saved for the backward. Backward: FA2 Algorithm 2
split in two kernels, one per key tile for dK/dV (looping over query tiles) and one per
query tile for dQ (looping over key tiles), with `delta = rowsum(dO * O)` precomputed.
Few query tiles over many keys split the keys of each tile over several programs in
the forward (`num_splits`, merged by log-sum-exp) and in dQ (`num_splits_dq`, summed).

Masks and score mods run inside the kernels through `kernels._tiles`; the key (query)
tiles each program visits come from the mask's `kv_range` (`q_range`), computed per
(batch element, tile) in the wrapper, so tiles a mask empties are neither loaded nor
computed. GQA reads the KV head `h // groups` through the index maps (no repetition in
memory); dK/dV are produced per query head, in float32 where a group sums them. With
power-of-two head dims the forward reads the caller's q, k, v in place (masked loads of
partial tiles, masked stores of o); otherwise, and for the backward, lengths and head
dims that are not tile multiples are padded. Rows without a valid key give zeros (their
log-sum-exp is stored as +inf, so the backward sees p = 0).
"""

import dataclasses
import functools
import math
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from probjax_eqx.attention_call import AttentionCall, AttentionCapabilities
from probjax_eqx.backends import DeviceInfo, UnsupportedError, atomics_refusal
from probjax_eqx.kernels import _flash, _tiles
from probjax_eqx.masks import MaskContext

LOG2E = math.log2(math.e)
_MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
_SMEM_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
_SMEM_DEFAULT = 99 * 1024


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonAttentionConfig:
    """Tiles and launch parameters of the Triton kernels.

    Attributes:
        block_q: query rows per forward program.
        block_k: keys per forward loop step.
        block_q_dkv: query rows per loop step of the dK/dV kernel.
        block_k_dkv: keys per dK/dV program.
        block_q_dq: query rows per dQ program.
        block_k_dq: keys per loop step of the dQ kernel.
        num_warps: warps per forward program.
        num_warps_bwd: warps per backward program.
        num_stages: software pipelining depth of the forward.
        num_stages_bwd: software pipelining depth of the backward.
        backward_pass_impl: `"triton_split"` (a dK/dV kernel and a dQ kernel),
            `"triton_fused"` (one kernel: dK/dV per key tile, dQ by atomic adds; over
            keys that fit one `block_k_dkv` tile, dQ stored without atomics) or
            `"auto"` (`BACKWARD_RULES`). Where the fused one cannot run (score-mod
            parameter gradients; over several key tiles, lengths more than 4x apart,
            which would shrink its tiles below 16 rows, or deterministic ops) `"auto"`
            runs split and an explicit fused request is refused with the reason.
        num_splits: split the keys of each query tile over this many forward programs
            (flash-decoding); their partial outputs merge exactly by log-sum-exp. For
            few queries over long KV, where query tiles alone leave the GPU idle.
        num_splits_dq: the same for the split backward's dQ kernel: each split sums
            its keys' share of dQ in float32, and the shares are added after it.
        group_dkv: with GQA, one dK/dV program per KV head sums its query heads' shares
            as it loops over them (split backward only), where otherwise each query
            head's dK/dV is written in float32 and the group summed afterwards. Off by
            default: H100 run 75 (B2, 32 query heads over 8, T4096, fwd+bwd, without /
            with) hd 128 5.56 / 5.64 ms, causal 3.09 / 3.13; hd 64 3.49 / 3.40, causal
            2.00 / 2.00.
        pack_gqa: run the query heads that share a KV head as rows of one tile, so K/V
            are read once per group (masks that ignore the query position only).
        tangent_tiles: forward mode's kernel (`jax.jvp`) as (query rows per program,
            keys per loop step, warps, stages); None: `TANGENT_TILES` where measured
            (16-bit heads on Hopper), else the dQ kernel's launch. Shrunk while its
            shared memory would not fit.
        interpret: run in Pallas interpret mode (CPU tests).
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_warps: int = 4
    num_warps_bwd: int = 4
    num_stages: int = 2
    num_stages_bwd: int = 2
    backward_pass_impl: Literal["auto", "triton_split", "triton_fused"] = "auto"
    num_splits: int = 1
    num_splits_dq: int = 1
    group_dkv: bool = False
    pack_gqa: bool = False
    tangent_tiles: tuple[int, int, int, int] | None = None
    interpret: bool = False

    def __post_init__(self):
        if self.tangent_tiles is not None:  # a tuple (configs are hashed), from JSON lists too
            object.__setattr__(self, "tangent_tiles", tuple(self.tangent_tiles))
        tangent = zip(("block_q", "block_k", "num_warps", "num_stages"), self.tangent_tiles or ())
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values |= {f"tangent_tiles' {name}": value for name, value in tangent}
        for field, value in values.items():
            if "block_" in field and (not _pow2(value) or value < _MIN_BLOCK):
                raise ValueError(f"{field}={value} must be a power of two >= {_MIN_BLOCK}")
            if "num_warps" in field and value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{field}={value} must be 1, 2, 4, 8 or 16")
            if ("num_stages" in field or "num_splits" in field) and value < 1:
                raise ValueError(f"{field}={value} must be >= 1")
        if self.backward_pass_impl not in ("auto", "triton_split", "triton_fused"):
            raise ValueError(
                f"backward_pass_impl={self.backward_pass_impl!r}: expected 'auto', "
                "'triton_split' or 'triton_fused'"
            )
        if self.group_dkv and self.backward_pass_impl == "triton_fused":
            raise ValueError(
                "group_dkv sums dK/dV in the split backward's dK/dV kernel: the fused "
                "backward's dQ atomics index one query head a program"
            )


def _fit(block: int, n: int) -> int:
    """`block`, or the power of two (>= the minimum tile) that covers `n` if smaller."""
    return max(_MIN_BLOCK, min(block, 1 << max(0, (n - 1).bit_length())))


def _padded_dim(d: int) -> int:
    return max(_MIN_BLOCK, 1 << (d - 1).bit_length())


def smem_bytes(block_q: int, block_k: int, d: int, dv: int, itemsize: int, stages: int) -> int:
    """Shared memory of one forward program: the query tile plus K and V tiles per stage."""
    return itemsize * (
        block_q * _padded_dim(d) + stages * block_k * (_padded_dim(d) + _padded_dim(dv))
    )


# How "auto" picks the backward, per registry entry: Hopper runs split (the dQ atomics of
# the fused kernel contend) unless the keys fit one dK/dV tile, where the fused kernel
# stores dQ without atomics; elsewhere fused when the lengths are balanced.
BACKWARD_RULES = {"sm_90": "triton_split", "generic": "fused_if_balanced"}


def _balanced(call: AttentionCall) -> bool:
    short, long = sorted((call.q_len, call.kv_len))
    return short >= _MIN_BLOCK and long <= 4 * short


def kv_padded(kv_len: int, config: TritonAttentionConfig) -> int:
    """Keys padded to every kernel's key tile."""
    return _round_up(kv_len, max(config.block_k, config.block_k_dkv, config.block_k_dq))


def one_key_tile(call: AttentionCall, config: TritonAttentionConfig) -> bool:
    """All keys fit one dK/dV tile.

    The fused backward then stores each dQ row whole (no atomics: deterministic) and
    steps through query tiles of its own size whatever the query length.
    """
    return kv_padded(call.kv_len, config) == config.block_k_dkv


def _fused_refusal(
    call: AttentionCall, device: DeviceInfo, config: TritonAttentionConfig
) -> str | None:
    """Why the fused backward cannot take `call` (`None` when it can)."""
    if any(n in _PARAMETRIC for n in _tiles.spec_names(call.score_mod)):
        return (
            "backward_pass_impl='triton_fused' has no score-mod parameter gradients (the "
            "split backward's dQ kernel accumulates them): use 'triton_split' or 'auto'"
        )
    if one_key_tile(call, config):
        return None
    if device.atomics_vary:
        return atomics_refusal("backward_pass_impl='triton_fused' (its dQ)", "'triton_split'")
    if not _balanced(call):
        return (
            f"backward_pass_impl='triton_fused' on {call.q_len} queries x {call.kv_len} keys "
            f"(not within 4x of each other, both >= {_MIN_BLOCK}) would shrink its tiles "
            f"below {_MIN_BLOCK} rows: use 'triton_split' or 'auto'"
        )
    return None


def resolve_backward(config: TritonAttentionConfig, call: AttentionCall, device: DeviceInfo):
    """Replace `"auto"` by the backward that will run (an explicit one stays as asked)."""
    impl = config.backward_pass_impl
    if impl == "auto":
        rule = BACKWARD_RULES.get(device.registry_key, BACKWARD_RULES["generic"])
        fused = (rule != "triton_split" or one_key_tile(call, config)) and not config.group_dkv
        fused = fused and _fused_refusal(call, device, config) is None
        impl = "triton_fused" if fused else "triton_split"
    return dataclasses.replace(config, backward_pass_impl=impl)


_TILE_SKIPPING = frozenset({"causal", "local_window", "block_diagonal", "segments"})

# Decoding tiles (key step, warps, stages), per registry entry. The H100 read K/V fastest
# in 64-key steps with 4 warps, one program per SM (`SPLIT_KV_RULES`): batch 1, 8 KV heads
# over 131,072 keys 0.181 ms vs 0.191 for 128-key steps with 8 warps (run 101); batch 8
# 1.360 vs 1.373 (run 83). The H200 (run 107) within 1% either way but at batch 8, 8 KV
# heads, where 64-key steps led (0.969 vs 0.979 ms, two programs per SM). Generic devices
# keep the 128-key steps the H200 preferred before the kernel read its operands in place.
# Against cuDNN's decoding kernel (16 rows x 128 keys, 4 warps; kernel times from the
# profilers, H100 runs 119-120, us): batch 8, 8 KV heads, 8192 keys 89.2 vs 91.3 (the
# per-call gap there, 0.097 vs 0.094 ms, is JAX's dispatch); batch 1, 8 KV heads, 131k
# keys 180.1 vs 174.6; batch 8 MHA 131k 5562 vs 5434 (3.09 vs 3.16 TB/s), where 128-key
# steps, 8 warps and 2-5 stages all took 5.650-5.674 ms a call. Nor do TMA loads (Mosaic's
# forward 5.660 ms a call against 5.620, run 123) or head-major K/V (5.566; 0.189 against
# 0.180 ms at batch 1 MHA over 32k keys, run 122) close it. Over 32k keys ncu finds the
# two kernels alike (1.40 ms, 3.08 TB/s, 92% of DRAM peak each; run 129).
DECODE_TILES = {"sm_90": (64, 4, 3), "generic": (128, 8, 3)}


def default_config(call: AttentionCall, device: DeviceInfo) -> TritonAttentionConfig:
    """Tiles for `call`: large tiles, shrunk only while the shared memory would not fit."""
    itemsize = 4 if call.dtype == "float32" else 2
    d = max(call.qk_dim, call.v_dim)
    limit = _SMEM_LIMIT.get(device.compute_capability or "", _SMEM_DEFAULT)
    # Measured on the H200 at T=4096 (bench/results/h200_triton_sweep.json): 128x64 tiles,
    # 8 warps, 3 stages for dense hd 128; masks that empty tiles (causal, windows) gain
    # from finer 64x64 tiles with 4 warps.
    fine = any(t[0] in _TILE_SKIPPING for t in call.mask_terms) and d > 64
    pack, rows, _ = _query_rows(call)
    # One query tile of 16 rows per head (decoding) is bandwidth-bound: its key steps,
    # warps and stages per registry entry (`DECODE_TILES`).
    decode = rows <= _MIN_BLOCK
    decode_k, decode_warps, stages = DECODE_TILES.get(device.registry_key, DECODE_TILES["generic"])
    block_q, block_k = _fit(64 if fine else 128, rows), (decode_k if decode else 64)
    stages = stages if decode else 3
    while smem_bytes(block_q, block_k, call.qk_dim, call.v_dim, itemsize, stages) > limit:
        if block_k > 32:
            block_k //= 2
        elif block_q > 32:
            block_q //= 2
        else:
            stages = 1
            break
    block_k = _fit(block_k, call.kv_len)
    bwd = 64 if d <= 64 or itemsize == 2 else 32
    # Wide float32 heads step 16 queries at a time through the dK/dV kernel (and 16 keys
    # through dQ): with 32 x 256 float32 tiles the backward spilled, 359 ms fwd+bwd at
    # hd 256, T=4096 vs 51 ms (H200 sweep, run 26).
    step = 16 if itemsize == 4 and d > 128 else bwd
    # 65..128 keys at 16-bit heads of <= 32 dims fit one 128-key dK/dV tile, so the fused
    # backward stores dQ without atomics: 0.161 / 0.157 ms fwd+bwd vs 0.170 / 0.171 split
    # (H100 runs 87 / 89: 64 sets x 4 heads, 1024 queries over 128 keys, hd 32). At hd 64
    # that tile was slower (0.367 vs 0.241 split, run 89).
    wide_dkv = itemsize == 2 and d <= 32 and bwd < call.kv_len <= 128
    config = TritonAttentionConfig(
        block_q=block_q,
        block_k=block_k,
        block_q_dkv=_fit(step, call.q_len),
        block_k_dkv=128 if wide_dkv else _fit(bwd, call.kv_len),
        block_q_dq=_fit(bwd, call.q_len),
        block_k_dq=_fit(step, call.kv_len),
        num_warps=decode_warps if decode else 4 if d <= 64 or fine else 8,
        num_warps_bwd=4,
        num_stages=stages,
        pack_gqa=pack,
        interpret=not device.is_gpu,
    )
    # The dQ kernel's grid is the forward's over its own query tiles: 8 heads of 128
    # queries over 65,536 keys (16 programs) took 1.97 ms fwd+bwd unsplit, 0.56 with 16
    # dQ splits; 64 x 4 heads over 4096 keys (512 programs) was fastest unsplit (H100,
    # runs 71-73).
    dq_tiles = (config.block_q_dq, config.block_k_dq)
    config = dataclasses.replace(
        config,
        num_splits=_split_plan(
            call, device, (block_q, block_k), call.v_dim, stages, fill="forward_fill_per_sm"
        ),
        num_splits_dq=_split_plan(call, device, dq_tiles, call.qk_dim, config.num_stages_bwd),
    )
    return resolve_backward(config, call, device)


# Split-KV (flash-decoding) plan, per registry entry. `programs_per_sm` is the residency
# of the forward's programs by registers (ncu on the H200: 8 warps x 96 registers allow
# 2); shared memory (`smem_per_sm`) may allow fewer. A grid whose last wave is part-empty
# reads memory at the rate of its few last programs: 320 programs (1.21 waves) read K/V at
# 3.2 TB/s, 1024 (3.88 waves) at 4.3 TB/s. So a call with few programs takes the fewest
# splits whose waves are >= `min_efficiency` full, keeping >= `min_tiles` key tiles a
# split. Different per-batch KV lengths make programs unequal: >= `ragged_waves` waves
# let the scheduler even them out. Each split writes float32 partial outputs that the
# merge reads back: at most `partial_share` of the K/V bytes it reads (64-row tiles with
# 128 splits over 16k keys wrote as much as they read, run 31). The forward fills at most
# `forward_fill_per_sm` programs per SM: on the H100 one program per SM read K/V faster
# than two at every decoding shape timed (run 101, batch 1, 8 KV heads, 131,072 keys:
# 16 splits 0.181 ms, 33 splits 0.185; run 83, batch 8: 2 splits 1.360, 4 splits 1.374).
# The H200's faster memory wants more loads in flight: two per SM (run 107, batch 8:
# 4 splits 0.969 ms, 2 splits 0.996; batch 1: 0.136 either way). `by_kind`: changes for
# devices whose name holds the key. Stream-K (Lean Attention: the key tiles of every head
# laid end to end over one wave of equally busy programs, runs crossing heads) was tried
# against that part-empty last wave and removed: H100 run 116, Lq 1, fwd ms (splits /
# 132 programs / 264 / torch SDPA cuDNN): batch 1 GQA 131k keys 0.189 / 0.194 / 0.192 /
# 0.182, MHA 32k 0.184 / 0.257 / 0.200 / 0.178, batch 8 MHA 131k 5.716 / 5.820 / 5.762 /
# 5.633; ahead only at batch 1 MHA 8192 (0.097 / 0.107 / 0.087 / 0.096). sm_90 wants its
# waves 95% full: at 90%, 8 programs took 15 splits (120 of 132 SMs reading) where 16
# fill 128; the H100's timings had 16 (run 101, fwd, batch 1, 8 KV heads, 131k keys:
# 0.180 ms, 33 splits 0.183; run 72, dQ of 8 heads x 128 queries over 65,536 keys: 16
# splits 0.561 ms fwd+bwd, 4 splits 0.807). In one run (H100 run 123, two rounds) 16
# splits led 15 and 33 or tied: 0.181 / 0.185 ms against 0.184 / 0.184 and 0.187 (torch
# SDPA cuDNN 0.182), over 32k keys 0.054 against 0.055 and 0.056 (0.053); dQ's 16 splits
# 0.554 ms fwd+bwd against 15 splits' 0.560.
SPLIT_KV_RULES = {
    "sm_90": dict(sms=132, programs_per_sm=2, smem_per_sm=228 * 1024, min_tiles=4,
                  min_efficiency=0.95, max_splits=256, ragged_waves=4, partial_share=0.125,
                  forward_fill_per_sm=1, by_kind={"H200": dict(forward_fill_per_sm=2)}),
    "generic": dict(sms=108, programs_per_sm=2, smem_per_sm=164 * 1024, min_tiles=4,
                    min_efficiency=0.9, max_splits=256, ragged_waves=4, partial_share=0.125,
                    forward_fill_per_sm=2),
}  # fmt: skip


def split_count(
    programs: int,
    kv_tiles: int,
    rule: dict,
    *,
    ragged: bool = False,
    per_sm: int | None = None,
    most: int | None = None,
) -> int:
    """Splits of the key axis for a grid of `programs` (see `SPLIT_KV_RULES`).

    `per_sm`: resident programs per SM, when fewer than the rule's `programs_per_sm`;
    `most`: a cap on the splits below the rule's.
    """
    capacity = rule["sms"] * (rule["programs_per_sm"] if per_sm is None else per_sm)
    if programs >= 2 * capacity:
        return 1  # many programs: the last wave is a small part of the time
    cap = rule["max_splits"] if most is None else most
    most = max(1, min(rule["max_splits"], kv_tiles // rule["min_tiles"], cap))
    min_waves = rule["ragged_waves"] if ragged else 0

    def efficiency(splits):
        waves = programs * splits / capacity
        return waves / math.ceil(waves) if waves >= min_waves or splits == most else 0.0

    best = max(range(1, most + 1), key=efficiency)
    wanted = min(rule["min_efficiency"], efficiency(best))
    return next(n for n in range(1, most + 1) if efficiency(n) >= wanted)


def _query_rows(call: AttentionCall) -> tuple[bool, int, int]:
    """`(pack_gqa, rows, heads)`: query rows per head of the forward's grid, and its heads.

    Packing (`pack_gqa`) runs the query heads sharing a KV head as rows of one tile.
    """
    pack = call.groups > 1 and packable(call) and call.q_len * call.groups <= 128
    if pack:
        return True, call.q_len * call.groups, call.kv_heads
    return False, call.q_len, call.q_heads


def split_rule(device: DeviceInfo) -> dict:
    """`device`'s split-KV rule: its registry entry's, with its kind's changes."""
    rule = SPLIT_KV_RULES.get(device.registry_key, SPLIT_KV_RULES["generic"])
    for kind, changes in rule.get("by_kind", {}).items():
        if kind in device.device_kind:
            rule = {**rule, **changes}
    return rule


def _split_plan(
    call: AttentionCall,
    device: DeviceInfo,
    tiles,
    width: int,
    stages: int,
    fill: str = "programs_per_sm",
):
    """Splits of the keys for a grid of `(block_q, block_k)` `tiles` (`SPLIT_KV_RULES`).

    Its programs, one per query tile and head, pipeline `stages` key tiles and write
    partials `width` columns wide: the forward's (`num_splits`) or dQ's (`num_splits_dq`).
    `fill`: the rule's key for the programs per SM that the splits fill, at most.
    """
    rule = split_rule(device)
    block_q, block_k = tiles
    itemsize = 4 if call.dtype == "float32" else 2
    _, rows, heads = _query_rows(call)
    programs = call.batch * heads * -(-rows // block_q)
    smem = smem_bytes(block_q, block_k, call.qk_dim, call.v_dim, itemsize, stages)
    per_sm = int(max(1, min(rule[fill], rule["smem_per_sm"] // smem)))
    # One batch element's lengths leave its programs equal.
    ragged = call.batch > 1 and any(t[0] == "kv_lengths" for t in call.mask_terms)
    kv_bytes = call.kv_len * (call.qk_dim + call.v_dim) * itemsize
    partial_bytes = 8 * block_q * width  # float32, written and read back
    most = int(rule["partial_share"] * kv_bytes // partial_bytes)
    kv_tiles = -(-call.kv_len // block_k)
    return split_count(programs, kv_tiles, rule, ragged=ragged, per_sm=per_sm, most=most)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one kernel launch."""

    call: AttentionCall
    config: TritonAttentionConfig
    scale: float
    q_pad: int
    kv_pad: int
    kinds: tuple[str, ...]
    n_mask_ops: int
    param_slots: tuple[int, ...] = ()  # float per-head operands: their gradients are computed
    rows: "_Rows | None" = None  # the forward's query rows, when it reads the caller's q
    unmasked: bool = False  # no mask: the forward computes its tile ranges itself

    @property
    def ctx(self) -> MaskContext:
        return MaskContext(self.call.batch, self.call.q_len, self.call.kv_len)

    @property
    def one_key_tile(self) -> bool:
        return one_key_tile(self.call, self.config)

    @property
    def dq_atomics(self) -> bool:
        """The fused backward adds dQ by float32 atomics into a zeroed, aliased buffer.

        Over one key tile each program stores its query head's dQ instead.
        """
        return self.config.backward_pass_impl == "triton_fused" and not self.one_key_tile

    @property
    def dkv_heads_a_program(self) -> int:
        """Query heads one dK/dV program loops over: a GQA group with `group_dkv`."""
        return self.call.groups if self.config.group_dkv else 1


@dataclasses.dataclass(frozen=True)
class _Rows:
    """How a forward program's `block` query rows map onto the caller's `q` and `o`.

    The caller's `[batch, q_len, heads, c]` array, viewed as
    `[batch, q_len, kv_heads, pack, c]` when `pack` query heads share a tile (GQA
    packing): a tile holds `block // pack` query positions of `pack` heads each. Rows past
    `q_len` are masked on load (zeros) and store.
    """

    block: int
    q_len: int
    pack: int

    @property
    def positions(self) -> int:
        return self.block // self.pack

    def view_shape(self, shape):
        """The shape the kernels index, of the caller's `shape` (a free reshape)."""
        if self.pack == 1:
            return tuple(shape)
        batch, q_len, heads, c = shape
        return (batch, q_len, heads // self.pack, self.pack, c)

    def view(self, x):
        return x.reshape(self.view_shape(x.shape))

    def unview(self, x):
        return x if self.pack == 1 else x.reshape(*x.shape[:2], -1, x.shape[-1])

    def spec(self, c: int, tile_of, col_of=lambda t: 0):
        """Blocks of `c` columns: tile `tile_of(t)`, column block `col_of(t)`."""
        if self.pack == 1:
            return pl.BlockSpec(
                (None, self.block, None, c), lambda t, h, b: (b, tile_of(t), h, col_of(t))
            )
        return pl.BlockSpec(
            (None, self.positions, None, self.pack, c),
            lambda t, h, b: (b, tile_of(t), h, 0, col_of(t)),
        )

    def _mask(self, tile):
        if self.q_len % self.positions == 0:
            return None  # every tile full
        pos = tile * self.positions + jnp.arange(self.positions, dtype=jnp.int32)
        return (pos < self.q_len).reshape((self.positions,) + (1,) * (1 + (self.pack > 1)))

    def load(self, ref, tile):
        mask = self._mask(tile)
        x = ref[...] if mask is None else plt.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))
        return x.reshape(self.block, x.shape[-1])

    def store(self, ref, x, tile):
        x = x.reshape(ref.shape).astype(ref.dtype)
        mask = self._mask(tile)
        if mask is None:
            ref[...] = x
        else:
            plt.store(ref, x, mask=mask)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tile_scores(s, st: _Static, mask, mod, b, h, q_idx, kv_idx, *, masked: bool):
    """Scores in log2 units and d(score)/d(q.k) for the backward.

    `masked=False` is for tiles inside the mask's full range: nothing to evaluate.
    """
    if mod is None:
        scores, slope = s * (st.scale * LOG2E), st.scale
    else:

        def modded(raw):
            return mod(raw * st.scale, b, h, q_idx, kv_idx).astype(jnp.float32)

        scores, slope = jax.jvp(modded, (s,), (jnp.ones_like(s),))
        scores = scores * LOG2E
    if not masked:
        return scores, slope
    valid = _flash.valid_pairs(st.ctx, mask, b, h, q_idx, kv_idx)
    return jnp.where(valid, scores, -jnp.inf), slope


def _scores_of_params(st: _Static, build, values, raw, b, h, q_idx, kv_idx):
    """`(scores_of, params)`: the tile's modded scores of the score mod's parameters.

    `params` are their values (`st.param_slots`); the scores are in natural units, for
    derivatives with respect to the parameters.
    """

    def scores_of(params):
        vals = list(values)
        for slot, param in zip(st.param_slots, params):
            vals[slot] = param
        return build(vals)[1](raw * st.scale, b, h, q_idx, kv_idx).astype(jnp.float32)

    return scores_of, tuple(values[slot] for slot in st.param_slots)


def _rebuilders(st: _Static, rebuild_mask, rebuild_mod):
    def build(values):
        return rebuild_mask(values[: st.n_mask_ops]), rebuild_mod(values[st.n_mask_ops :])

    return build


def _load_operands(refs, kinds, *, q_tile, kv_tile, head=None):
    """Values of the mask/score-mod operands for the current tiles (see `_tiles`).

    `head`: the query head within the program's block of heads (`group_dkv`).
    """
    values = []
    for ref, kind in zip(refs, kinds):
        if kind == "head" and head is not None:
            values.append(ref[head])
        elif kind in ("batch", "head"):
            values.append(ref[()])
        elif kind == "q_pos":
            values.append(ref[...] if q_tile is None else ref[q_tile])
        else:
            values.append(ref[...] if kv_tile is None else ref[kv_tile])
    return values


def _query_tile_kv_ranges(st: _Static, range_refs, tile):
    """Query tile `tile`'s key-tile ranges (`block_ranges`): computed here when unmasked."""
    if st.unmasked:
        return _tiles.unmasked_kv_ranges(
            st.ctx, tile, program_block=st.config.block_q, loop_block=st.config.block_k
        )
    return tuple(ref[()] for ref in range_refs)


def _split_share(ranges, split, splits: int):
    """Split `split`'s share of the key tiles `ranges` visits, `splits` shares in all.

    Evenly split between the range's ends: with per-batch KV lengths every split of a
    short row still gets work.
    """
    if splits == 1:
        return ranges
    lo, hi = ranges[0], ranges[3]
    per = (hi - lo + splits - 1) // splits
    first = lo + split * per
    return tuple(jnp.clip(r, first, first + per) for r in ranges)


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, st: _Static, build):
    n_ops = len(st.kinds)
    range_refs, refs = ((), refs) if st.unmasked else (refs[:4], refs[4:])
    op_refs, (o_ref, lse_ref) = refs[:n_ops], refs[n_ops:]
    t, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    splits = st.config.num_splits
    bq, bk = st.config.block_q, st.config.block_k
    i = _flash.last_first(t // splits, st.q_pad // bq)
    q = q_ref[...] if st.rows is None else st.rows.load(q_ref, i)
    # Reading the caller's K / V: the last key tile may run past them (masked loads).
    ragged_tail = st.rows is not None and st.call.kv_len % bk != 0

    def kv_tile(ref, start, masked):
        if not (masked and ragged_tail):
            return ref[pl.ds(start, bk), :]
        keep = (start + jnp.arange(bk, dtype=jnp.int32) < st.call.kv_len)[:, None]
        return plt.load(ref.at[pl.ds(start, bk), :], mask=keep, other=jnp.zeros((), ref.dtype))

    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
    ranges = _query_tile_kv_ranges(st, range_refs, i)
    ranges = _split_share(ranges, t % splits, splits)

    def body(j, carry, masked):
        acc, m, denom = carry
        start = pl.multiple_of(j * bk, bk)
        tile = pl.ds(start, bk)
        mask, mod = build(_load_operands(op_refs, st.kinds, q_tile=None, kv_tile=tile))
        kv_idx = start + jnp.arange(bk, dtype=jnp.int32)[None, :]
        s = plt.dot(q, kv_tile(k_ref, start, masked), trans_b=True)
        if mod is None:
            # Scale after the row max and inside `s * c - m` (one FMA an element): the
            # softmax's ALU work competes with the MMAs in this kernel.
            c = st.scale * LOG2E
            if masked:
                s = jnp.where(_flash.valid_pairs(st.ctx, mask, b, h, q_idx, kv_idx), s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
        else:
            s, _ = _tile_scores(s, st, mask, mod, b, h, q_idx, kv_idx, masked=masked)
            c = 1.0
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # Only a masked tile can leave a row without a finite score.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s * c - m_safe[:, None])
        v = kv_tile(v_ref, start, masked)
        acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v)
        return acc, m_new, denom * alpha + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, m, denom = _flash.tile_loop(ranges, body, init)
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    if st.rows is not None and splits == 1:
        st.rows.store(o_ref, acc / safe[:, None], i)
    else:
        o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
    # An empty row: +inf makes the backward's p = 0; an empty split weighs 0 in the merge.
    lse_ref[...] = jnp.where(empty, -jnp.inf if splits > 1 else jnp.inf, m + jnp.log2(safe))


def _tangent_kernel(q_ref, k_ref, v_ref, tq_ref, tk_ref, tv_ref, *refs, st: _Static, build,
                    zero: tuple[bool, bool, bool]):  # fmt: skip
    """The output's tangent in one pass over the keys (forward mode).

    Along `(tq, tk, tv)` and the score mod's parameters' tangents (refs after the mask
    operands'). With `p = softmax(s)` and `t` the scores' tangent, `to = p tv + (p * t) v - o
    rowsum(p * t)`: three sums rescaled online as the forward's output is, so no score
    matrix is kept. The forward's own statistics are recomputed beside them. A tangent
    flagged in `zero` is never read, and its products are skipped.
    """
    zero_q, zero_k, zero_v = zero
    scores_move = not (zero_q and zero_k) or bool(st.param_slots)
    n_ops = len(st.kinds)
    range_refs, refs = ((), refs) if st.unmasked else (refs[:4], refs[4:])
    op_refs, refs = refs[:n_ops], refs[n_ops:]
    t_param_refs, (to_ref,) = refs[:-1], refs[-1:]
    t_params = tuple(ref[()] for ref in t_param_refs)
    t, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = st.config.block_q, st.config.block_k
    i = _flash.last_first(t, st.q_pad // bq)
    q = q_ref[...]
    tq = None if zero_q else tq_ref[...]
    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
    ranges = _query_tile_kv_ranges(st, range_refs, i)

    def body(j, carry, masked):
        acc, t_acc, m, denom, t_mass = carry
        tile = pl.ds(pl.multiple_of(j * bk, bk), bk)
        values = _load_operands(op_refs, st.kinds, q_tile=None, kv_tile=tile)
        mask, mod = build(values)
        kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
        k = k_ref[tile, :]
        raw = plt.dot(q, k, trans_b=True)
        s, slope = _tile_scores(raw, st, mask, mod, b, h, q_idx, kv_idx, masked=masked)
        terms = []  # the scores' tangent
        if not zero_q:
            terms.append(plt.dot(tq, k, trans_b=True) * slope)
        if not zero_k:
            terms.append(plt.dot(q, tk_ref[tile, :], trans_b=True) * slope)
        if st.param_slots:  # through the parameters too
            scores_of, params = _scores_of_params(st, build, values, raw, b, h, q_idx, kv_idx)
            terms.append(jax.jvp(scores_of, (params,), (t_params,))[1])
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        v = v_ref[tile, :]
        acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v)
        t_acc = t_acc * alpha[:, None]
        if not zero_v:
            t_acc = t_acc + plt.dot(p.astype(v.dtype), tv_ref[tile, :])
        if scores_move:
            pt = p * functools.reduce(jnp.add, terms)
            if masked:  # a masked pair's score tangent is never used, whatever its value
                pt = jnp.where(s == -jnp.inf, 0.0, pt)
            t_acc = t_acc + plt.dot(pt.astype(v.dtype), v)
            t_mass = t_mass * alpha + jnp.sum(pt, axis=1)
        return acc, t_acc, m_new, denom * alpha + jnp.sum(p, axis=1), t_mass

    width = to_ref.shape[-1]
    rows = jnp.zeros((bq,), jnp.float32)
    init = (
        jnp.zeros((bq, width), jnp.float32),
        jnp.zeros((bq, width), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        rows,
        rows,
    )
    acc, t_acc, _, denom, t_mass = _flash.tile_loop(ranges, body, init)
    safe = jnp.where(denom == 0.0, 1.0, denom)  # a row without a valid key: zeros
    to = (t_acc - acc * (t_mass / safe)[:, None]) / safe[:, None]
    to_ref[...] = to.astype(to_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static, build):
    n_ops = len(st.kinds)
    range_refs, refs = refs[:4], refs[4:]
    fused = st.config.backward_pass_impl == "triton_fused"
    op_refs, outs = refs[:n_ops], refs[n_ops + st.dq_atomics :]
    dk_ref, dv_ref = outs[:2]
    j, head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = st.config.block_q_dkv, st.config.block_k_dkv
    k, v = k_ref[...], v_ref[...]
    kv_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
    # With `group_dkv` the program's KV head `head` loops over its query heads.
    groups = st.dkv_heads_a_program

    def head_body(g, carry):
        h = head * groups + g
        at = (lambda ref, tile: ref[tile, g, :]) if groups > 1 else (lambda ref, tile: ref[tile, :])
        row = (lambda ref, tile: ref[g, tile]) if groups > 1 else (lambda ref, tile: ref[tile])

        def body(i, carry, masked):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            tile = pl.ds(start, bq)
            values = _load_operands(
                op_refs, st.kinds, q_tile=tile, kv_tile=None, head=g if groups > 1 else None
            )
            mask, mod = build(values)
            q, do = at(q_ref, tile), at(do_ref, tile)
            q_idx = start + jnp.arange(bq, dtype=jnp.int32)[:, None]
            raw = plt.dot(q, k, trans_b=True)
            s, slope = _tile_scores(raw, st, mask, mod, b, h, q_idx, kv_idx, masked=masked)
            p = jnp.exp2(s - row(lse_ref, tile)[:, None])
            dv = dv + plt.dot(p.astype(do.dtype), do, trans_a=True)
            dp = plt.dot(do, v, trans_b=True)
            ds = p * (dp - row(delta_ref, tile)[:, None]) * slope
            dk = dk + plt.dot(ds.astype(q.dtype), q, trans_a=True)
            if fused:
                dq_ref = outs[2]
                dq = plt.dot(ds.astype(k.dtype), k)
                if st.one_key_tile:  # this program's dQ rows are whole: store them
                    dq_ref[tile, :] = dq.astype(dq_ref.dtype)
                else:  # every key tile adds its share of dQ
                    plt.atomic_add(dq_ref, (tile, pl.ds(0, dq_ref.shape[1])), dq)
            return dk, dv

        ranges = tuple(ref[()] for ref in range_refs)
        if fused and st.one_key_tile:  # query tiles the loop skips see no key: dQ = 0

            def zero_dq(i, _):
                outs[2][pl.ds(pl.multiple_of(i * bq, bq), bq), :] = jnp.zeros(
                    (bq, outs[2].shape[1]), outs[2].dtype
                )

            jax.lax.fori_loop(0, ranges[0], zero_dq, None)
            jax.lax.fori_loop(ranges[3], st.q_pad // bq, zero_dq, None)
        return _flash.tile_loop(ranges, body, carry)

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = head_body(0, init) if groups == 1 else jax.lax.fori_loop(0, groups, head_body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


_PARAM_LANES = 16  # per-program parameter gradients are stored as one 16-wide row


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static, build):
    n_ops = len(st.kinds)
    range_refs, refs = refs[:4], refs[4:]
    op_refs, (dq_ref, *dparam_ref) = refs[:n_ops], refs[n_ops:]
    bq, bk = st.config.block_q_dq, st.config.block_k_dq
    t, splits = pl.program_id(0), st.config.num_splits_dq
    i = _flash.last_first(t // splits, st.q_pad // bq)
    h, b = pl.program_id(1), pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]

    def body(j, carry, masked):
        dq, dparams = carry
        start = pl.multiple_of(j * bk, bk)
        tile = pl.ds(start, bk)
        values = _load_operands(op_refs, st.kinds, q_tile=None, kv_tile=tile)
        mask, mod = build(values)
        kv_idx = start + jnp.arange(bk, dtype=jnp.int32)[None, :]
        k = k_ref[tile, :]
        raw = plt.dot(q, k, trans_b=True)
        s, slope = _tile_scores(raw, st, mask, mod, b, h, q_idx, kv_idx, masked=masked)
        p = jnp.exp2(s - lse)
        dp = plt.dot(do, v_ref[tile, :], trans_b=True)
        d_modded = p * (dp - delta)
        if st.param_slots:  # d(loss)/d(score-mod parameters) of this tile, by its VJP
            scores_of, params = _scores_of_params(st, build, values, raw, b, h, q_idx, kv_idx)
            _, pullback = jax.vjp(scores_of, params)
            dparams = tuple(a + g for a, g in zip(dparams, pullback(d_modded)[0]))
        return dq + plt.dot((d_modded * slope).astype(k.dtype), k), dparams

    init = (jnp.zeros(dq_ref.shape, jnp.float32), tuple(jnp.float32(0.0) for _ in st.param_slots))
    ranges = _split_share(tuple(ref[()] for ref in range_refs), t % splits, splits)
    dq, dparams = _flash.tile_loop(ranges, body, init)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    if dparam_ref:
        lanes = jnp.arange(_PARAM_LANES, dtype=jnp.int32)
        row = jnp.zeros((_PARAM_LANES,), jnp.float32)
        for n, g in enumerate(dparams):
            row = row + jnp.where(lanes == n, g, 0.0)
        dparam_ref[0][...] = row


def _same(t):
    return t


def _operand_specs(
    kinds, *, seq_role: str, block: int, q_pad: int, kv_pad: int, tile_of=_same, heads: int = 1
):
    """BlockSpecs for the mask operands, for a grid (grid row, head, batch).

    `tile_of(row)` is the tile of the program's own axis that grid row `row` works on;
    `heads`: query heads a program works on (`group_dkv`), a block of per-head values.
    """
    specs = []
    for kind in kinds:
        if kind == "batch":
            specs.append(pl.BlockSpec((None,), lambda t, h, b: (b,)))
        elif kind == "head":
            specs.append(pl.BlockSpec((None,) if heads == 1 else (heads,), lambda t, h, b: (h,)))
        elif kind == seq_role:  # the program's own tile
            specs.append(pl.BlockSpec((None, block), lambda t, h, b: (b, tile_of(t))))
        else:  # the looped axis: the whole row, sliced per step
            n = q_pad if kind == "q_pos" else kv_pad
            specs.append(pl.BlockSpec((None, n), lambda t, h, b: (b, 0)))
    return specs


def _range_specs(tile_of=_same):
    return [pl.BlockSpec((None, None), lambda t, h, b: (b, tile_of(t)))] * 4


def _kv_spec(st: _Static, c: int):
    """A program's whole padded K (or V) rows, `c` columns, of its query head's KV head."""
    groups = st.call.groups
    return pl.BlockSpec((None, st.kv_pad, None, c), lambda t, h, b: (b, 0, h // groups, 0))


def _query_tile_operand_specs(st: _Static, tile_of):
    """Specs of the key-tile ranges and mask operands for a grid over query tiles."""
    return [
        *([] if st.unmasked else _range_specs(tile_of)),
        *_operand_specs(
            st.kinds,
            seq_role="q_pos",
            block=st.config.block_q,
            q_pad=st.q_pad,
            kv_pad=st.kv_pad,
            tile_of=tile_of,
        ),
    ]


def _forward(st: _Static, build, q, k, v, fwd_ranges, operands):
    """`(o, lse)`: `o` in the caller's shape when `st.rows` (direct), else padded."""
    cfg = st.config
    batch, heads, d, dv = q.shape[0], st.call.q_heads, q.shape[-1], v.shape[-1]
    n, tiles = cfg.num_splits, st.q_pad // cfg.block_q
    grid = (tiles * n, heads, batch)
    rows = st.rows or _Rows(cfg.block_q, st.q_pad, 1)
    o_shape = (*q.shape[:-1], dv) if st.rows else (batch, st.q_pad, heads, dv)

    def tile_of(t):  # grid row t: split t % n of query tile tile_of(t)
        return _flash.last_first(t // n, tiles)

    in_specs = [
        rows.spec(d, tile_of),
        _kv_spec(st, d),
        _kv_spec(st, dv),
        *_query_tile_operand_specs(st, tile_of),
    ]
    if n == 1:
        out_specs = [
            rows.spec(dv, tile_of),
            pl.BlockSpec((None, None, cfg.block_q), lambda t, h, b: (b, h, tile_of(t))),
        ]
        out_shape = [
            jax.ShapeDtypeStruct(rows.view_shape(o_shape), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, st.q_pad), jnp.float32),
        ]
    else:  # float32 partials per split, merged below
        out_specs = [
            pl.BlockSpec(
                (None, None, cfg.block_q, None, dv),
                lambda t, h, b: (t % n, b, tile_of(t), h, 0),
            ),
            pl.BlockSpec(
                (None, None, None, cfg.block_q), lambda t, h, b: (t % n, b, h, tile_of(t))
            ),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((n, batch, st.q_pad, heads, dv), jnp.float32),
            jax.ShapeDtypeStruct((n, batch, heads, st.q_pad), jnp.float32),
        ]
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, build=build),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="probjax_attention_triton_fwd" if n == 1 else "probjax_attention_triton_fwd_split",
    )(rows.view(q), k, v, *(() if st.unmasked else fwd_ranges), *operands)
    if n == 1:
        return rows.unview(outs[0]), outs[1]
    return merge_splits(outs[0], outs[1], q.dtype, cfg, rows=st.rows)


def _tangent(st: _Static, build, q, k, v, tq, tk, tv, fwd_ranges, operands, t_params, zero):
    """The output's tangent (`_tangent_kernel`) of padded, unpacked operands, padded.

    `t_params`: the tangents of the score mod's parameters (`st.param_slots`), per head.
    `zero`: which of `(tq, tk, tv)` are zero (placeholders the kernel never reads).
    """
    cfg = st.config
    batch, heads, d, dv = q.shape[0], st.call.q_heads, q.shape[-1], v.shape[-1]
    tiles = st.q_pad // cfg.block_q

    def tile_of(t):
        return _flash.last_first(t, tiles)

    if len(t_params) != len(st.param_slots):
        raise ValueError(f"{len(st.param_slots)} score-mod parameters, {len(t_params)} tangents")
    rows = _Rows(cfg.block_q, st.q_pad, 1)
    in_specs = [
        *(rows.spec(d, tile_of), _kv_spec(st, d), _kv_spec(st, dv)) * 2,
        *_query_tile_operand_specs(st, tile_of),
        *[pl.BlockSpec((None,), lambda t, h, b: (h,))] * len(t_params),
    ]
    return pl.pallas_call(
        functools.partial(_tangent_kernel, st=st, build=build, zero=zero),
        grid=(tiles, heads, batch),
        in_specs=in_specs,
        out_specs=rows.spec(dv, tile_of),
        out_shape=jax.ShapeDtypeStruct((batch, st.q_pad, heads, dv), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="probjax_attention_triton_tangent",
    )(q, k, v, tq, tk, tv, *(() if st.unmasked else fwd_ranges), *operands, *t_params)


def _merge_kernel(o_ref, lse_ref, out_ref, out_lse_ref, *, rows, splits, columns):
    """One block of `merge_splits`: every split of `rows.block` rows x some columns at once.

    The splits are a block axis (padded to a power of two, masked): one load each of the
    log-sum-exps and the partial outputs, all in flight together, where a loop over the
    splits would wait on one load after another.
    """
    keep = jnp.arange(lse_ref.shape[0], dtype=jnp.int32) < splits
    lse = plt.load(lse_ref, mask=keep[:, None], other=jnp.float32(-jnp.inf))  # [S, rows]
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # no split saw a key
    weight = jnp.exp2(lse - m_safe[None, :])
    total = jnp.sum(weight, axis=0)
    o = plt.load(o_ref, mask=keep[:, None, None], other=jnp.float32(0.0))  # [S, rows, cols]
    acc = jnp.sum(o * weight[:, :, None], axis=0)
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    tile = pl.program_id(0) // columns
    rows.store(out_ref, acc / safe[:, None], tile)
    out_lse_ref[...] = jnp.where(
        empty, jnp.inf, m + jnp.log2(safe)
    )  # the same in every column block


_MERGE_ROWS = 16
_MERGE_BYTES = 32 * 1024  # float32 partials one merge program holds at once


def merge_splits(o, lse, dtype, config: TritonAttentionConfig, *, rows: "_Rows | None" = None):
    """Exact merge of per-split partials by their log-sum-exp, in one small kernel.

    `o` is `[splits, b, q, h, dv]`, each split normalised over its keys; `lse` is base 2,
    `[splits, b, h, q]`, -inf where a split saw no key. Returns `o` in `dtype` and `lse`
    `[b, h, q]` (+inf on rows no split saw a key of); `o` is `[b, q, h, dv]`, or with
    `rows` the caller's output (`_Rows`). One kernel instead of XLA's reductions and
    transposes (at decode sizes each launch costs more than the data it moves), its
    programs small blocks of rows and columns so that many SMs share the reading.
    """
    splits, batch, q_pad, heads, dv = o.shape
    pack = 1 if rows is None else rows.pack
    block = min(config.block_q, max(_MERGE_ROWS, pack))
    rows = _Rows(block, q_pad if rows is None else rows.q_len, pack)
    s_pad = 1 << (splits - 1).bit_length()
    fits = max(1, _MERGE_BYTES // (4 * s_pad * block))  # columns, to a power of two below
    cols = min(dv, 1 << (fits.bit_length() - 1))
    columns = dv // cols

    def tile_of(t):
        return t // columns

    def col_of(t):
        return t % columns

    out, out_lse = pl.pallas_call(
        functools.partial(_merge_kernel, rows=rows, splits=splits, columns=columns),
        grid=(q_pad // block * columns, heads, batch),
        in_specs=[
            pl.BlockSpec(
                (s_pad, None, block, None, cols), lambda t, h, b: (0, b, tile_of(t), h, col_of(t))
            ),
            pl.BlockSpec((s_pad, None, None, block), lambda t, h, b: (0, b, h, tile_of(t))),
        ],
        out_specs=[
            rows.spec(cols, tile_of, col_of),
            pl.BlockSpec((None, None, block), lambda t, h, b: (b, h, tile_of(t))),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(rows.view_shape((batch, rows.q_len, heads * pack, dv)), dtype),
            jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=config.interpret,
        name="probjax_attention_triton_merge_splits",
    )(o, lse)
    return rows.unview(out), out_lse


def _backward(st: _Static, build, q, k, v, o, lse, do, dq_ranges, dkv_ranges, operands):
    cfg, groups = st.config, st.call.groups
    batch, _, heads, d = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    params = plt.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    fused = cfg.backward_pass_impl == "triton_fused"
    dq_spec = pl.BlockSpec((None, st.q_pad, None, d), lambda j, h, b: (b, 0, h, 0))
    dq_acc = [jnp.zeros(q.shape, jnp.float32)] if st.dq_atomics else []

    # One program per query head (float32 dK/dV where a group's are summed afterwards),
    # or per KV head looping over its group's query heads (`group_dkv`).
    g = st.dkv_heads_a_program
    sums = groups > g
    dkv_heads = heads // g

    def dkv_dtype(dtype):
        return jnp.float32 if sums else dtype

    def kv_head(h):  # the KV head of a program's (first) query head
        return h * g // groups

    def rows_spec(c):  # query rows of the program's query heads
        if g == 1:
            return pl.BlockSpec((None, st.q_pad, None, c), lambda j, h, b: (b, 0, h, 0))
        return pl.BlockSpec((None, st.q_pad, g, c), lambda j, h, b: (b, 0, h, 0))

    stats_spec = pl.BlockSpec(
        (None, None, st.q_pad) if g == 1 else (None, g, st.q_pad), lambda j, h, b: (b, h, 0)
    )
    n_in = 6 + len(dkv_ranges) + len(operands)
    outs = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, build=build),
        grid=(st.kv_pad // bk, dkv_heads, batch),
        in_specs=[
            rows_spec(d),
            pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, kv_head(h), 0)),
            pl.BlockSpec((None, bk, None, dv), lambda j, h, b: (b, j, kv_head(h), 0)),
            rows_spec(dv),
            stats_spec,
            stats_spec,
            *_range_specs(),
            *_operand_specs(
                st.kinds, seq_role="kv_pos", block=bk, q_pad=st.q_pad, kv_pad=st.kv_pad, heads=g
            ),
            *[dq_spec] * st.dq_atomics,
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, d), lambda j, h, b: (b, j, h, 0)),
            pl.BlockSpec((None, bk, None, dv), lambda j, h, b: (b, j, h, 0)),
            *[dq_spec] * fused,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, st.kv_pad, dkv_heads, d), dkv_dtype(k.dtype)),
            jax.ShapeDtypeStruct((batch, st.kv_pad, dkv_heads, dv), dkv_dtype(v.dtype)),
            *[jax.ShapeDtypeStruct(q.shape, jnp.float32 if st.dq_atomics else q.dtype)] * fused,
        ],
        input_output_aliases={n_in: 2} if st.dq_atomics else {},
        compiler_params=params,
        interpret=cfg.interpret,
        name="probjax_attention_triton_bwd_fused" if fused else "probjax_attention_triton_bwd_dkv",
    )(q, k, v, do, lse, delta, *dkv_ranges, *operands, *dq_acc)
    dk, dv_ = outs[:2]
    if sums:  # per-query-head dK/dV, summed over the query heads sharing a KV head
        dk = dk.reshape(batch, st.kv_pad, kv_heads, groups, d).sum(3).astype(k.dtype)
        dv_ = dv_.reshape(batch, st.kv_pad, kv_heads, groups, dv).sum(3).astype(v.dtype)
    if fused:
        return outs[2].astype(q.dtype), dk, dv_, (None,) * len(operands)
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    has_params = bool(st.param_slots)
    n, tiles = cfg.num_splits_dq, st.q_pad // bq

    def tile_of(t):  # grid row t: split t % n of query tile tile_of(t)
        return _flash.last_first(t // n, tiles)

    if n == 1:
        dq_spec = pl.BlockSpec((None, bq, None, d), lambda t, h, b: (b, tile_of(t), h, 0))
        dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:  # float32 shares per split, added below
        dq_spec = pl.BlockSpec(
            (None, None, bq, None, d), lambda t, h, b: (t % n, b, tile_of(t), h, 0)
        )
        dq_shape = jax.ShapeDtypeStruct((n, *q.shape), jnp.float32)
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, build=build),
        grid=(tiles * n, heads, batch),
        in_specs=[
            pl.BlockSpec((None, bq, None, d), lambda i, h, b: (b, tile_of(i), h, 0)),
            _kv_spec(st, d),
            _kv_spec(st, dv),
            pl.BlockSpec((None, bq, None, dv), lambda i, h, b: (b, tile_of(i), h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, h, b: (b, h, tile_of(i))),
            pl.BlockSpec((None, None, bq), lambda i, h, b: (b, h, tile_of(i))),
            *_range_specs(tile_of),
            *_operand_specs(
                st.kinds,
                seq_role="q_pos",
                block=bq,
                q_pad=st.q_pad,
                kv_pad=st.kv_pad,
                tile_of=tile_of,
            ),  # fmt: skip
        ],
        out_specs=[
            dq_spec,
            *[pl.BlockSpec((None, None, None, _PARAM_LANES), lambda t, h, b: (b, h, t, 0))]
            * has_params,
        ],
        out_shape=[
            dq_shape,
            *[jax.ShapeDtypeStruct((batch, heads, tiles * n, _PARAM_LANES), jnp.float32)]
            * has_params,
        ],
        compiler_params=params,
        interpret=cfg.interpret,
        name="probjax_attention_triton_bwd_dq",
    )(q, k, v, do, lse, delta, *dq_ranges, *operands)
    dq = outs[0] if n == 1 else outs[0].sum(0).astype(q.dtype)
    dops: list = [None] * len(operands)
    if has_params:
        per_head = outs[1].sum(axis=(0, 2))  # [heads, lanes]
        for lane, slot in enumerate(st.param_slots):
            dops[slot] = per_head[:, lane].astype(operands[slot].dtype)
    return dq, dk, dv_, tuple(dops)


def flash_attention(
    q, k, v, *, mask, score_mod, scale: float, config: TritonAttentionConfig, plan=None
):
    """Triton flash attention of `[batch, seq, heads, dim]` operands (see module docstring).

    `plan(q, k, v, mask, score_mod) -> config`: the config at other shapes (a batch that
    `vmap` folds in, `_flash.attend`); without it, `config` at every shape.
    """

    def build(q, k, v, mask, score_mod):
        cfg = config if plan is None else plan(q, k, v, mask, score_mod)
        return kernels(q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=cfg)

    return _flash.run_call(build, build, q, k, v, mask, score_mod)


def kernels(q, k, v, *, mask, score_mod, scale: float, config: TritonAttentionConfig,
            zero_tangents: tuple[bool, bool, bool] = (False, False, False)):  # fmt: skip
    """The `_flash.FlashKernels` of one call (`zero_tangents`: as `_tangent`'s `zero`).

    With `pack_gqa` the query heads of each KV head run as rows of one tile. The forward
    reads the caller's operands (`direct`) when the head dims need no padding and a
    packed group is a power of two; otherwise they are padded (and packed) for it.
    """
    call = AttentionCall.from_args(q.shape, k.shape, v.shape, q.dtype, mask, score_mod)
    pack = call.groups if config.pack_gqa and call.groups > 1 else 1
    if pack > 1:
        if not packable(call):
            raise UnsupportedError("triton", "pack_gqa needs a mask that ignores query positions")
        batch, q_len, heads, d = q.shape
        packed = (batch, q_len * pack, heads // pack, d)
        call = AttentionCall.from_args(packed, k.shape, v.shape, q.dtype, mask, score_mod)
    cfg = dataclasses.replace(config, pack_gqa=False)
    d_pad, dv_pad = _padded_dim(call.qk_dim), _padded_dim(call.v_dim)
    direct = (d_pad, dv_pad) == (call.qk_dim, call.v_dim) and _pow2(pack)
    direct = direct and cfg.block_q % pack == 0
    q_pad = _round_up(call.q_len, max(cfg.block_q, cfg.block_q_dkv, cfg.block_q_dq))
    kv_pad = kv_padded(call.kv_len, cfg)
    mask_ops, mask_kinds, rebuild_mask = _tiles.split(
        mask, batch=call.batch, heads=call.q_heads, q_pad=q_pad, kv_pad=kv_pad
    )
    mod_ops, mod_kinds, rebuild_mod = _tiles.split(
        score_mod, batch=call.batch, heads=call.q_heads, q_pad=q_pad, kv_pad=kv_pad
    )
    kinds = tuple(mask_kinds + mod_kinds)
    param_slots = tuple(
        n
        for n, (kind, x) in enumerate(zip(kinds, mask_ops + mod_ops))
        if kind == "head" and jnp.issubdtype(x.dtype, jnp.floating)
    )
    if len(param_slots) > _PARAM_LANES:
        raise UnsupportedError("triton", f"at most {_PARAM_LANES} score-mod parameter arrays")
    if param_slots and cfg.backward_pass_impl != "triton_split":
        raise ValueError("score-mod parameter gradients need backward_pass_impl='triton_split'")
    rows = _Rows(cfg.block_q, call.q_len // pack, pack) if direct else None
    st = _Static(
        call, cfg, scale, q_pad, kv_pad, kinds, len(mask_ops), param_slots, rows, mask is None
    )
    build = _rebuilders(st, rebuild_mask, rebuild_mod)
    operands = tuple(mask_ops + mod_ops)
    ranges = _flash.tile_ranges(
        st.ctx,
        mask,
        q_pad,
        kv_pad,
        fwd=(cfg.block_q, cfg.block_k),
        dq=(cfg.block_q_dq, cfg.block_k_dq),
        dkv=(cfg.block_k_dkv, cfg.block_q_dkv),
    )

    def forward(q, k, v, fwd_ranges, operands):
        return _forward(st, build, q, k, v, fwd_ranges, operands)

    def backward(qp, kp, vp, o, lse, do, ranges, operands):
        return _backward(st, build, qp, kp, vp, o, lse, do, ranges["dq"], ranges["dkv"], operands)

    def tangent(q, k, v, tq, tk, tv, fwd_ranges, operands, t_params):
        return _tangent(
            st, build, q, k, v, tq, tk, tv, fwd_ranges, operands, t_params, zero_tangents
        )

    one_pass = pack == 1 and cfg.num_splits == 1
    return _flash.FlashKernels(
        forward, backward, ranges, operands, q_pad, kv_pad, d_pad, dv_pad, direct, pack,
        tangent if one_pass else None,
    )  # fmt: skip


# Forward mode's kernel (query rows, keys per step, warps, stages) for 16-bit heads, by
# registry entry and head dim. H100 run 138 (`jax.jvp` of Triton pinned, B4 H8 T4096
# bf16, ms; the forward alone 0.39 / 0.26 at hd 64, 0.66 / 0.40 at hd 128, dense /
# causal): hd 64, 64 x 64 with 4 warps and 3 stages 1.34 / 0.78 against 1.44 / 0.80 at
# the dQ kernel's 2 stages; hd 128, 128 x 64 with 8 warps and 2 stages 2.29 / 1.35
# against 2.71 / 1.52. Wider heads, float32 and generic devices (not timed) keep the dQ
# kernel's launch.
TANGENT_TILES = {"sm_90": {64: (64, 64, 4, 3), 128: (128, 64, 8, 2)}, "generic": {}}


def tangent_config(
    config: TritonAttentionConfig, call: AttentionCall, device: DeviceInfo
) -> TritonAttentionConfig:
    """The forward-mode kernel's launch: `config.tangent_tiles`, else `TANGENT_TILES`.

    Shrunk while its shared memory would not fit. Like the dQ kernel it keeps a query
    tile and loops over keys, with twice the operands (q and its tangent; K, V and
    theirs) and one more accumulator than the forward; one pass a query tile, unpacked.
    """
    itemsize = 4 if call.dtype == "float32" else 2
    limit = _SMEM_LIMIT.get(device.compute_capability or "", _SMEM_DEFAULT)
    d = max(call.qk_dim, call.v_dim)
    by_dim = TANGENT_TILES.get(device.registry_key, TANGENT_TILES["generic"])
    measured = next((t for dim, t in sorted(by_dim.items()) if d <= dim), None)
    dq = (config.block_q_dq, config.block_k_dq, config.num_warps_bwd, config.num_stages_bwd)
    tiles = config.tangent_tiles or (measured if itemsize == 2 and measured else dq)
    block_q, block_k, warps, stages = tiles
    if config.tangent_tiles is None:  # short sequences need no tiles longer than themselves
        block_q, block_k = _fit(block_q, call.q_len), _fit(block_k, call.kv_len)
    while 2 * smem_bytes(block_q, block_k, call.qk_dim, call.v_dim, itemsize, stages) > limit:
        if block_k > _MIN_BLOCK:
            block_k //= 2
        elif block_q > _MIN_BLOCK:
            block_q //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return dataclasses.replace(
        config,
        block_q=block_q,
        block_k=block_k,
        num_warps=warps,
        num_stages=stages,
        num_splits=1,
        pack_gqa=False,
        backward_pass_impl="triton_split",  # unused here; the one `kernels` takes parameters to
    )


def flash_tangent(q, k, v, tq, tk, tv, *, mask, score_mod, scale: float,
                  config: TritonAttentionConfig, t_score_mod=None):  # fmt: skip
    """The tangent of `flash_attention`'s output along `(tq, tk, tv)` (forward mode).

    One pass over the keys per query tile (`_tangent_kernel`), at the forward's memory:
    no score matrix. A tangent given as None is zero: its products are skipped (keys
    and values of a fixed context: 4 products a key tile instead of 6). `t_score_mod`:
    the tangent of the score mod's parameters (ALiBi's slopes), shaped as
    `eqx.filter(score_mod, eqx.is_inexact_array)`; None: fixed. `config` is the launch
    as `tangent_config` makes it: one split, unpacked.
    """
    if config.num_splits != 1 or config.pack_gqa:
        raise ValueError("the tangent kernel runs one split of unpacked rows: tangent_config")
    zero = (tq is None, tk is None, tv is None)
    if not jax.tree.leaves(t_score_mod):  # every parameter's tangent zero
        t_score_mod = None
    if all(zero) and t_score_mod is None:
        return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)
    # A zero tangent's place holds its primal, which the kernel never reads.
    tq, tk, tv = (x if t is None else t for x, t in zip((q, k, v), (tq, tk, tv), strict=True))

    def build(q, k, v, mask, score_mod):
        return kernels(q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=config,
                       zero_tangents=zero)  # fmt: skip

    return _flash.run_tangent(build, q, k, v, tq, tk, tv, mask, score_mod, t_score_mod)


def packable(call: AttentionCall) -> bool:
    """Whether the query heads of a group can run as rows of one tile.

    Nothing may depend on the query position or head: no score mod, masks on key lengths.
    """
    return call.score_mod is None and all(t[0] == "kv_lengths" for t in call.mask_terms)


_PARAMETRIC = frozenset({"alibi", "head_scale"})
# Spec names the kernels cannot evaluate per tile, with the reason.
_NOT_IN_KERNEL = {
    "dense": "a dense mask cannot be evaluated per tile; use structured masks or MaskFn",
    "dense_bias": "a dense bias cannot be evaluated per tile; use a score_mod function",
    "relative_position": "RelativePosition (table lookup) is not in the kernel yet",
}


def _kernel_rule(call: AttentionCall) -> str | None:
    for spec in (*call.mask_terms, call.score_mod):
        for name in _tiles.spec_names(spec):
            if name in _NOT_IN_KERNEL:
                return _NOT_IN_KERNEL[name]
    return None


@dataclasses.dataclass(frozen=True)
class TritonAttention:
    """The `"triton"` implementation: our Pallas Triton flash-attention kernels."""

    name: str = "triton"
    capabilities: AttentionCapabilities = AttentionCapabilities(
        platforms=frozenset({"gpu", "cpu"}),
        min_compute_capability="sm_80",
        max_head_dim=256,
        extra=(_kernel_rule,),
    )

    # `__call__` takes `plan`: under `vmap` its kernels plan for the folded batch.
    plans_per_batch: ClassVar[bool] = True

    def check(self, call: AttentionCall, device: DeviceInfo, config=None) -> str | None:
        why = _flash.check_pallas(
            "triton", TritonAttentionConfig, config, device, "Pallas Triton needs a GPU"
        )
        if why is None and config is not None and config.backward_pass_impl == "triton_fused":
            why = _fused_refusal(call, device, config)
        return why if why is not None else self.capabilities.check(call, device)

    def default_config(self, call: AttentionCall, device: DeviceInfo) -> TritonAttentionConfig:
        return default_config(call, device)

    def resolve_config(self, config, call: AttentionCall, device: DeviceInfo):
        return resolve_backward(config, call, device)

    def __call__(self, q, k, v, *, mask, score_mod, scale, config: TritonAttentionConfig,
                 plan=None):  # fmt: skip
        return flash_attention(
            q, k, v, mask=mask, score_mod=score_mod, scale=scale, config=config, plan=plan
        )

    def tangent_config(self, config, call: AttentionCall, device: DeviceInfo):
        return tangent_config(config, call, device)

    def tangent(self, q, k, v, tq, tk, tv, *, mask, score_mod, scale,
                config: TritonAttentionConfig, t_score_mod=None):  # fmt: skip
        """Forward mode's kernel (`flash_tangent`), launched as `tangent_config` makes it."""
        return flash_tangent(q, k, v, tq, tk, tv, mask=mask, score_mod=score_mod, scale=scale,
                             config=config, t_score_mod=t_score_mod)  # fmt: skip

    def blocks(self, q, k, v, *, mask, scale, config: TritonAttentionConfig):
        """Forward-with-lse and backward-given-lse halves (`_flash.FlashKernels`)."""
        config = dataclasses.replace(config, pack_gqa=False)  # the halves index query heads
        return kernels(q, k, v, mask=mask, score_mod=None, scale=scale, config=config)
