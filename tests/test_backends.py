import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from probjax_eqx import UnsupportedError, biases, explain, explain_attention, masks, resolve
from probjax_eqx.backends import DeviceInfo, detect_device

H200 = DeviceInfo("gpu", "NVIDIA H200", "sm_90")
A100 = DeviceInfo("gpu", "NVIDIA A100", "sm_80")
CPU = DeviceInfo("cpu", "cpu")


def shapes(dtype=jnp.bfloat16, d=64, lq=128, lkv=128):
    q = jax.ShapeDtypeStruct((2, lq, 4, d), dtype)
    kv = jax.ShapeDtypeStruct((2, lkv, 4, d), dtype)
    return q, kv, kv


def test_detect_device_on_cpu():
    info = detect_device()
    assert info.platform == jax.devices()[0].platform
    assert info.registry_key == ("sm_90" if info.compute_capability == "sm_90" else "generic")


def test_registry_entries_and_opt_outs():
    assert resolve("attention", device=H200, environ={}).priority == (
        "cudnn",
        "mosaic",
        "triton",
        "xla",
    )
    assert resolve("attention", device=A100, environ={}).priority == ("triton", "xla")
    env = {"PROBJAX_ATTENTION_CUDNN": "0", "PROBJAX_ATTENTION_MOSAIC": "false"}
    backend = resolve("attention", device=H200, environ=env)
    assert backend.priority == ("triton", "xla")
    assert [name for name, _ in backend.pruned] == ["cudnn", "mosaic"]
    generic = resolve("attention", device=H200, environ={"PROBJAX_ATTENTION_DEVICE_DEFAULTS": "0"})
    assert generic.priority == ("triton", "xla")
    # Opt-outs never replace a pinned choice.
    assert resolve("attention", "cudnn", device=H200, environ=env).priority == ("cudnn",)


def test_backend_is_hashable_and_frozen():
    a = resolve("attention", device=H200, environ={})
    b = resolve("attention", device=H200, environ={})
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.requested = "xla"  # type: ignore[misc]


def test_auto_on_sm90_prefers_cudnn_and_records_rejections():
    backend = resolve("attention", device=H200, environ={})
    choice = explain_attention(*shapes(), implementation=backend)
    assert choice.kernel == "cudnn" and choice.rejected == ()
    assert "'sm_90' priority list" in choice.reason
    # Causal masks below T 16384: Mosaic first (H100 run 82); from T 16384 on Mosaic's
    # forward with its backward at heads of <= 64 dims (run 83), with cuDNN's at 128
    # (runs 164-166).
    choice = explain_attention(*shapes(), mask=masks.Causal(), implementation=backend)
    assert choice.kernel == "mosaic" and "'sm_90:causal' priority list" in choice.reason
    for d, entry, joined in ((128, "long", True), (64, "causal", False)):
        long = explain_attention(
            *shapes(lq=16384, lkv=16384, d=d), mask=masks.Causal(), implementation=backend
        )
        assert long.kernel == "mosaic" and f"'sm_90:{entry}' priority list" in long.reason, d
        assert long.config.cudnn_backward == joined, d

    # Grouped query heads without a mask, up to 1024 queries over >= 4096 keys at hd 64
    # or 128: Mosaic sums dK/dV over each group in its kernel (H100 runs 103, 114, 115);
    # beyond that cuDNN. One KV head per query head: Mosaic at 65-128 queries (runs 109,
    # 114), cuDNN above, the split-KV Triton kernel below.
    def cross(lq, lkv, kv_heads=2, d=128, score_mod=None):
        q = jax.ShapeDtypeStruct((2, lq, 8, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((2, lkv, kv_heads, d), jnp.bfloat16)
        return explain_attention(q, kv, kv, score_mod=score_mod, implementation=backend)

    choice = cross(1024, 8192)
    assert choice.kernel == "mosaic" and "'sm_90:cross' priority list" in choice.reason
    assert cross(2048, 8192).kernel == "cudnn"
    assert cross(1024, 4096).kernel == cross(1024, 8192, d=64).kernel == "mosaic"
    assert cross(1024, 2048).kernel == "cudnn"  # shorter key sets: not timed yet
    assert cross(1024, 8192, d=256).kernel == "cudnn"
    mha = {lq: cross(lq, 8192, kv_heads=8) for lq in (64, 65, 128, 129, 1024)}
    kernels = {64: "triton", 65: "mosaic", 128: "mosaic", 129: "cudnn", 1024: "cudnn"}
    assert {lq: c.kernel for lq, c in mha.items()} == kernels
    assert "'sm_90:few_queries' priority list" in mha[64].reason
    assert "'sm_90:cross' priority list" in mha[128].reason
    assert cross(128, 4096, kv_heads=8).kernel == "mosaic"
    assert cross(128, 2048, kv_heads=8).kernel == "cudnn"  # below both regimes
    soft_cap = cross(128, 8192, kv_heads=8, score_mod=biases.SoftCap(30.0))
    assert soft_cap.kernel == "triton" and "few_queries" in soft_cap.reason
    # float32 goes past both to Triton.
    f32 = explain_attention(*shapes(jnp.float32), mask=masks.Causal(), implementation=backend)
    assert f32.kernel == "triton"
    # float32 is beyond cuDNN and the 16-bit Mosaic kernel; Triton takes it.
    choice = explain_attention(*shapes(jnp.float32), implementation=backend)
    assert choice.kernel == "triton"
    reasons = dict(choice.rejected)
    assert "dtype float32 not supported" in reasons["cudnn"]
    assert "dtype float32 not supported" in reasons["mosaic"]
    # Without cuDNN, Mosaic takes what it computes: segment ids too, which cuDNN lacks;
    # score mods go on to Triton.
    no_cudnn = resolve("attention", device=H200, environ={"PROBJAX_ATTENTION_CUDNN": "0"})
    choice = explain_attention(*shapes(), mask=masks.Causal(), implementation=no_cudnn)
    assert choice.kernel == "mosaic"
    segments = masks.Segments(jnp.zeros((2, 128), jnp.int32), sorted=True)
    choice = explain_attention(*shapes(), mask=segments, implementation=backend)
    assert choice.kernel == "mosaic"
    assert "mask 'segments' not supported" in dict(choice.rejected)["cudnn"]
    # Score mods: their own regime, Mosaic first (its SoftCap beat Triton's in run 60),
    # Triton for the mods Mosaic lacks; Mosaic, pinned, refuses those with the reason.
    soft = biases.SoftCap(30.0)
    choice = explain_attention(*shapes(), score_mod=soft, implementation=backend)
    assert choice.kernel == "mosaic" and "'sm_90:score_mod' priority list" in choice.reason
    alibi = biases.ALiBi.from_num_heads(4)
    choice = explain_attention(*shapes(), score_mod=alibi, implementation=backend)
    assert choice.kernel == "triton"
    assert "score mods ['alibi'] are not in the Mosaic" in dict(choice.rejected)["mosaic"]
    mosaic = resolve("attention", "mosaic", device=H200, environ={})
    with pytest.raises(UnsupportedError, match=r"score mods \['alibi'\] are not in the Mosaic"):
        explain_attention(*shapes(), score_mod=alibi, implementation=mosaic)
    # A dense mask is beyond every kernel: only XLA computes it.
    dense = masks.DenseMask(jnp.ones((1, 1, 128, 128), bool))
    choice = explain_attention(*shapes(), mask=dense, implementation=backend)
    assert choice.kernel == "xla"
    assert "dense mask cannot be evaluated per tile" in dict(choice.rejected)["triton"]
    assert "rejected 'cudnn'" in str(choice)


@pytest.mark.parametrize(
    "mask, d, lq, match",
    [
        (masks.Causal("bottom_right"), 64, 64, "bottom-right needs Lq == Lkv"),
        (masks.LocalWindow(4, 2), 64, 128, "no right window"),
        (masks.Segments(jnp.zeros((2, 128), jnp.int32)), 64, 128, "mask 'segments' not supported"),
        (None, 72 + 1, 128, "not a multiple of 8"),
        (None, 264, 128, "exceeds the maximum 256"),
        (masks.KVLengths(3) & masks.KVLengths(4), 64, 128, "at most one 'kv_lengths'"),
    ],
)
def test_pinned_cudnn_refuses_with_reason(mask, d, lq, match):
    backend = resolve("attention", "cudnn", device=H200, environ={})
    with pytest.raises(UnsupportedError, match=match) as info:
        explain_attention(*shapes(d=d, lq=lq), mask=mask, implementation=backend)
    assert info.value.implementation == "cudnn"


def test_cudnn_head_dims_follow_the_architecture():
    # 256-dim heads on Hopper (what JAX's cuDNN check allows), 128 before it.
    on_h200 = resolve("attention", "cudnn", device=H200, environ={})
    assert explain_attention(*shapes(d=256), implementation=on_h200).kernel == "cudnn"
    auto = resolve("attention", device=H200, environ={})
    assert explain_attention(*shapes(d=256), implementation=auto).kernel == "cudnn"
    on_a100 = resolve("attention", "cudnn", device=A100, environ={})
    with pytest.raises(UnsupportedError, match="exceeds the maximum 128 before sm_90"):
        explain_attention(*shapes(d=256), implementation=on_a100)
    assert explain_attention(*shapes(d=128), implementation=on_a100).kernel == "cudnn"


def test_cudnn_accepts_what_it_can_state():
    backend = resolve("attention", "cudnn", device=H200, environ={})
    ok = masks.Causal() & masks.KVLengths(jnp.array([3, 4])) & masks.QLengths(5)
    assert explain_attention(*shapes(), mask=ok, implementation=backend).kernel == "cudnn"
    window = masks.causal_local_window(16)
    assert explain_attention(*shapes(), mask=window, implementation=backend).kernel == "cudnn"
    with pytest.raises(UnsupportedError, match="compute capability >= sm_80"):
        explain_attention(
            *shapes(),
            implementation=resolve(
                "attention", "cudnn", device=DeviceInfo("gpu", "T4", "sm_75"), environ={}
            ),
        )


def test_auto_on_cpu_explains_itself():
    q, k, v = shapes(jnp.float32)
    choice = explain_attention(q, k, v)
    if jax.devices()[0].platform == "cpu":
        assert choice.kernel == "xla"
        assert dict(choice.rejected)["triton"]


def test_explain_says_what_forward_mode_runs():
    """`jax.jvp`'s tangent: Triton's kernel wherever Triton computes the call (cuDNN chosen
    on sm_90 too), XLA's JVP where XLA was chosen, and the reason where Triton refuses."""
    from probjax_eqx import attention
    from probjax_eqx.backends import Choice

    backend = resolve("attention", device=H200, environ={})
    choice = explain_attention(*shapes(), implementation=backend)
    assert choice.kernel == "cudnn"
    assert choice.forward_mode.startswith("Triton's one-pass tangent kernel (64x64 tiles")
    assert "forward mode (jax.jvp): Triton's" in str(choice)
    mod = biases.RelativePosition(jnp.zeros((4, 15)), max_distance=7)
    choice = explain_attention(*shapes(), score_mod=mod, implementation=backend)
    assert choice.kernel == "xla" and choice.forward_mode.startswith("XLA's JVP of the chosen")
    dense = attention._describe(*shapes(), masks.DenseMask(jnp.ones((1, 1, 128, 128), bool)), None)
    _, why = attention._tangent_plan(dense, Choice("cudnn", None, "test"), backend)
    assert why.startswith("XLA's JVP of the reference, with the full score matrix")
    assert "a dense mask cannot be evaluated per tile" in why


def test_explain_dispatch():
    from probjax_eqx import dot_product_attention

    choice = explain(dot_product_attention, *shapes(jnp.float32), implementation="xla")
    assert choice.kernel == "xla" and choice.reason == "requested by name"
    with pytest.raises(TypeError, match="no backend to explain"):
        explain(len)


def test_unknown_op_and_implementation():
    with pytest.raises(ValueError, match="unknown op"):
        resolve("convolution")
    with pytest.raises(ValueError, match="unknown implementation='fast'"):
        resolve("attention", "fast")


def test_cli_reports_device_and_choices():
    out = subprocess.run(
        [sys.executable, "-m", "probjax_eqx"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PROBJAX_ATTENTION_CUDNN": "0", "JAX_PLATFORMS": "cpu"},
    ).stdout
    assert "registry entry: 'generic'" in out
    assert "attention: cudnn disabled" in out
    assert "chose 'xla'" in out


def test_few_query_calls_route_to_split_kv_on_sm_90():
    from probjax_eqx.attention_call import AttentionCall

    backend = resolve("attention", device=H200, environ={})
    decode = AttentionCall(2, 1, 65536, 32, 8, 128, 128, "bfloat16", (("kv_lengths",),))
    choice = backend.select(decode)
    assert choice.kernel == "triton" and "sm_90:few_queries" in choice.reason
    assert choice.config.num_splits > 1 and choice.config.pack_gqa
    train = AttentionCall(4, 4096, 4096, 8, 8, 128, 128, "bfloat16")
    assert backend.select(train).kernel == "cudnn"
    # The generic entry has no regime: triton leads there anyway.
    generic = resolve("attention", device=H200, environ={"PROBJAX_ATTENTION_DEVICE_DEFAULTS": "0"})
    assert generic.regimes == () and generic.select(decode).kernel == "triton"


def test_small_heads_route_to_triton_on_sm_90():
    from probjax_eqx.attention_call import AttentionCall

    backend = resolve("attention", device=H200, environ={})
    isab = AttentionCall(64, 128, 1024, 4, 4, 32, 32, "bfloat16")
    choice = backend.select(isab)
    assert choice.kernel == "triton" and "sm_90:small_heads" in choice.reason
    wide = AttentionCall(64, 128, 1024, 4, 4, 64, 64, "bfloat16")
    assert backend.select(wide).kernel == "cudnn"


def test_padded_calls_skip_cudnn_on_sm_90():
    from probjax_eqx.attention_call import AttentionCall

    backend = resolve("attention", device=H200, environ={})
    terms = (("causal", "top_left"), ("kv_lengths",))
    train = AttentionCall(2, 512, 512, 8, 8, 128, 128, "bfloat16", terms)
    choice = backend.select(train)
    assert choice.kernel == "triton" and "sm_90:padded" in choice.reason
    q_padded = AttentionCall(2, 512, 512, 8, 8, 128, 128, "bfloat16", (("q_lengths",),))
    assert backend.select(q_padded).kernel == "triton"
    priority = {regime: names for regime, names, _ in backend.regimes}["padded"]
    assert "cudnn" not in priority and priority.index("mosaic") > priority.index("triton")
    # Pinned by name, cuDNN still takes the call.
    assert resolve("attention", "cudnn", device=H200, environ={}).select(train).kernel == "cudnn"


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("", False),
        ("--xla_gpu_deterministic_ops=true", True),
        ("--xla_gpu_deterministic_ops", True),
        ("--xla_force_host_platform_device_count=8 --xla_gpu_exclude_nondeterministic_ops=1", True),
        ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ],
)
def test_determinism_is_read_from_xla_flags(flags, expected):
    from probjax_eqx.backends import deterministic_requested

    assert deterministic_requested({"XLA_FLAGS": flags}) is expected
    device = resolve("attention", device=A100, environ={"XLA_FLAGS": flags}).device
    assert device.deterministic is expected and device.atomics_vary is expected


def test_deterministic_ops_refuse_float_atomics():
    # With XLA's determinism flag: no kernel that adds floats with atomics (their order
    # varies between runs on a GPU). On the CPU (interpret mode) atomics run in order.
    from probjax_eqx import moe as moe_module
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.kernels.triton import attention as triton_attention

    env = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}
    strict = resolve("attention", device=A100, environ=env).device
    assert moe_module.auto_dispatch(A100) == "fused_gsum"
    assert moe_module.auto_dispatch(strict) == "sorted"
    with pytest.raises(UnsupportedError, match="fused_gsum.*varies between runs"):
        moe_module.resolve_dispatch("fused_gsum", device=A100, environ=env)
    cpu = moe_module.resolve_dispatch("fused_gsum", device=CPU, environ=env)
    assert cpu.device.deterministic and not cpu.device.atomics_vary
    # The Triton attention backward: split (dQ without atomics) under "auto"; an explicit
    # fused request is refused with the reason.
    square = AttentionCall(1, 2048, 2048, 8, 8, 64, 64, "bfloat16")
    auto = triton_attention.TritonAttentionConfig()
    assert triton_attention.resolve_backward(auto, square, A100).backward_pass_impl == (
        "triton_fused"
    )
    assert triton_attention.resolve_backward(auto, square, strict).backward_pass_impl == (
        "triton_split"
    )
    fused = triton_attention.TritonAttentionConfig(backward_pass_impl="triton_fused")
    pinned = resolve("attention", "triton", device=strict, environ={})
    with pytest.raises(UnsupportedError, match="triton_fused.*varies between runs"):
        pinned.select(square, fused)
    allowed = resolve("attention", "triton", device=A100, environ={}).select(square, fused)
    assert allowed.config.backward_pass_impl == "triton_fused"
