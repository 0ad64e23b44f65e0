"""bench/report.py renders a fixture of rows: schema checks, default marking, known gaps."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench.report import render, validate  # noqa: E402


def _row(impl, fwd_bwd, *, peer=False, status="ok", **extra):
    row = dict(suite="attention", implementation=impl, peer=peer, dtype="bfloat16",
               shape=dict(seq=4096, head_dim=128), mask="none", status=status, message="",
               device=dict(kind="NVIDIA H200"), versions=dict(jax="0.11.2"), run=1,
               date="2026-12-03T00:00:00")  # fmt: skip
    if status == "ok":
        row.update(fwd_ms=fwd_bwd / 3, fwd_bwd_ms=fwd_bwd)
    return {**row, **extra}


def test_report_marks_the_default_and_lists_gaps(tmp_path):
    rows = [
        _row("probjax auto", 2.0),
        _row("torch sdpa cudnn", 1.6, peer=True),  # a peer that wins: a known gap
        _row("jax.nn xla", 6.0, peer=True, max_grad_err=0.0117),  # gradients checked
        _row("probjax mosaic", 0.0, status="unsup.", message="UnsupportedError: no"),
        _row("probjax triton", 1.8, kernel="triton"),
        # The newer run wins; its default names the kernel it ran.
        _row("probjax auto", 1.5, run=2, date="2026-12-04T00:00:00", kernel="cudnn"),
        _row("torch sdpa flash", 1.0, peer=True, run=3),  # no default in its run: no ratio
        dict(_row("probjax moe auto", 4.0, temp_bytes=2**30), suite="moe"),
    ]
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "h200_gpu_tests_run1.txt").write_text("..\n==== 2 passed, 1 failed in 3.0s ====\n")
    path = render(rows, tmp_path / "out", "h200", logs=logs)
    text = path.read_text()
    assert "| **probjax auto** (default): cudnn | ok | 0.500 | 1.500 |" in text
    assert "| probjax triton | ok | 0.600 | 1.800 |" in text
    assert "torch sdpa flash | ok | 0.333 | 1.000 | - | - | 3 |" in text  # its run
    # Ratios pair rows of one run: run 1's default (2.0), not the newer run's (1.5).
    assert "torch sdpa cudnn | ok | 0.533 | 1.600 | - | 0.80 |" in text
    assert "jax.nn xla | ok, grads 1.2e-02 | 2.000 | 6.000 | - | 3.00 |" in text
    assert "torch sdpa flash | ok | 0.333 | 1.000 | - | - |" in text
    assert "unsup.: UnsupportedError: no" in text
    assert "| 1.00 | 1 GiB |" in text.split("## moe")[1]  # ratio, then the scratch
    assert "2 passed, 1 failed" in text
    assert "torch sdpa cudnn takes 0.80x our time" in text
    assert "(20 ms samples: our time carries JAX's sync)" in text  # run 1, a torch peer
    assert "(run 1; our default's newest row, run 2, has no peer beside it)" in text
    assert "torch sdpa flash takes" not in text
    assert (tmp_path / "out" / "h200_attention.png").stat().st_size > 0
    rows[1]["fwd_bwd_ms"] = 2.4
    text = render(rows, tmp_path / "out", "h200").read_text()
    assert "none: our default is fastest" in text


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(status="fast"), "status 'fast'"),
        (dict(suite=None), "'suite'"),
        (dict(fwd_ms=None, fwd_bwd_ms=None), "needs fwd_ms"),
        (dict(status="error", message=""), "needs a message"),
    ],
)
def test_report_rejects_malformed_rows(change, match):
    with pytest.raises(ValueError, match=match):
        validate({**_row("probjax auto", 1.0), **change})


def test_classify_names_rejections_oom_and_errors():
    from bench.harness import classify

    from probjax_eqx import UnsupportedError

    assert classify(UnsupportedError("triton", "no"))[0] == "unsup."
    assert classify(RuntimeError("No available kernel. Aborting execution."))[0] == "unsup."
    rejected = ValueError("q_seq_len and kv_seq_len must be divided into the same number of blocks")
    assert classify(rejected)[0] == "unsup."
    assert classify(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))[0] == "OOM"
    status, message = classify(ValueError("shapes (3,) and (4,) differ\nsecond line"))
    assert (status, message) == ("error", "ValueError: shapes (3,) and (4,) differ")


def test_set_overrides_parse_ints_floats_booleans_names_and_tuples():
    from bench.harness import parse_overrides

    got = parse_overrides(
        ["head_dim=64,128", "causal=false", "fraction=0.25", "dtype=bfloat16", "heads=32:8,4:4"]
    )
    assert got == {
        "head_dim": [64, 128],
        "causal": [False],
        "fraction": [0.25],
        "dtype": ["bfloat16"],
        "heads": [(32, 8), (4, 4)],
    }


def test_fwd_bwd_program_is_the_vjp_on_an_output_dtype_cotangent_and_stacks_chain():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.harness import fwd_bwd_program, stack

    def layer(q, k, v, scale):
        return jax.nn.softmax(scale * q @ k.T) @ v

    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (8, 4), jnp.float32) for key in keys[:3])
    ct = jax.random.normal(keys[3], (8, 4), jnp.bfloat16)  # cast to the output's float32
    scale = jnp.float32(0.5)  # a trailing argument: passed on, not differentiated
    out, grads = fwd_bwd_program(stack(layer, 2))(q, k, v, scale, ct)
    two_layers = lambda q, k, v: layer(layer(q, k, v, scale), k, v, scale)  # noqa: E731
    expected, pullback = jax.vjp(two_layers, q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert len(grads) == 3 and all(g.dtype == jnp.float32 for g in grads)
    for got, want in zip(grads, pullback(ct.astype(jnp.float32)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_layer_caches_give_a_stack_distinct_kv_past_l2_and_the_stack_takes_them_in_turn():
    import jax.numpy as jnp
    import numpy as np
    from bench.harness import L2_BYTES, layer_caches, stack

    small = jnp.zeros((L2_BYTES // 8,), jnp.uint8)  # K and V: a quarter of L2 together
    ks, vs = layer_caches(small, small + 1, 32, jnp.copy)
    assert len(ks) == len(vs) == 16  # 4x L2 read in all, not one copy per layer
    assert ks[0] is small and all(x is not small for x in ks[1:])
    assert len({x.unsafe_buffer_pointer() for x in ks}) == len(ks)  # distinct memory
    assert len(layer_caches(small, small, 3, jnp.copy)[0]) == 3  # at most one per layer
    large = jnp.zeros((2 * L2_BYTES,), jnp.uint8)
    k, v = layer_caches(large, large, 16, jnp.copy)  # past L2 already: as they are
    assert k is large and v is large

    seen = []
    stack(lambda q, k, v: seen.append((k, v)) or q + 1, 5)(0, (10, 11), (20, 21))
    assert seen == [(10, 20), (11, 21), (10, 20), (11, 21), (10, 20)]
    assert stack(lambda q, k, v: q + k * v, 3)(np.float32(0), 2, 3) == 18  # one K/V for all


def test_oracle_grads_on_the_first_rows_equal_the_full_vjp_of_that_cotangent():
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench.harness import check_grads, oracle_grads, rows_cotangent

    from probjax_eqx import masks
    from probjax_eqx.kernels.reference import attention as reference

    keys = jax.random.split(jax.random.key(1), 4)
    q, ct = (jax.random.normal(key, (2, 12, 4, 8), jnp.float32) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, 20, 2, 8), jnp.float32) for key in keys[2:])
    oracle = functools.partial(reference.attention, mask=masks.Causal(),
                               score_mod=None, scale=0.3, oracle=True)  # fmt: skip
    got = oracle_grads(oracle, q, k, v, ct, 5)
    full = jax.vjp(oracle, q, k, v)[1](rows_cotangent(ct, 5))
    for g, f in zip(got, full, strict=True):
        np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-6)
    row = dict(status="ok", message="")
    check_grads(row, full, got, atol=1e-4)
    assert row["status"] == "ok" and row["max_grad_err"] < 1e-4
    check_grads(row, (full[0] + 0.1, *full[1:]), got, atol=0.06)
    assert row["status"] == "error" and "gradients differ" in row["message"]


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_sweep_configs_are_valid_over_the_gpu_default(causal):
    # A sweep's configs replace fields of the call's GPU default: one the config refuses
    # would time nothing (the backward list's tile tuples had, predating the fused dQ).
    import dataclasses

    import jax.numpy as jnp
    from bench.sweep_attention import _configs

    from probjax_eqx import masks
    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo
    from probjax_eqx.kernels.mosaic.attention import default_config

    shape, sm90 = (4, 4096, 8, 128), DeviceInfo("gpu", "NVIDIA H100", "sm_90")
    mask = masks.Causal() if causal else None
    call = AttentionCall.from_args(shape, shape, shape, jnp.dtype(jnp.bfloat16), mask, None)
    default = default_config(call, sm90)
    for _, overrides in _configs("mosaic"):
        dataclasses.replace(default, **overrides)


def test_triton_sweep_configs_are_valid_and_tangent_tiles_fit_hopper():
    # The tangent rows time the tiles they name only where `tangent_config` keeps them
    # (the sweep marks the others unsup.): all at hd 64, and the hd 128 default among them.
    import dataclasses

    import jax.numpy as jnp
    from bench.sweep_attention import TANGENT, _configs, tangent_launch

    from probjax_eqx.attention_call import AttentionCall
    from probjax_eqx.backends import DeviceInfo
    from probjax_eqx.kernels.triton.attention import TANGENT_TILES, default_config

    sm90 = DeviceInfo("gpu", "NVIDIA H100", "sm_90")
    for d in (64, 128):
        shape = (4, 4096, 8, d)
        q = jnp.zeros(shape, jnp.bfloat16)
        call = AttentionCall.from_args(shape, shape, shape, q.dtype, None, None)
        default = default_config(call, sm90)
        kept = []
        for part, overrides in _configs("triton"):
            config = dataclasses.replace(default, **overrides)
            if part == "tangent":
                tiles = overrides["tangent_tiles"]
                if tangent_launch(q, q, q, None, None, config, sm90) == tiles:
                    kept.append(tiles)
        if d == 64:
            assert kept == TANGENT
        assert TANGENT_TILES["sm_90"][d] in kept and len(kept) >= 10, (d, kept)


def test_merge_appends_validated_rows_with_their_run(tmp_path):
    import json

    from bench.merge import merge

    into, new = tmp_path / "h200.json", tmp_path / "new.json"
    into.write_text(json.dumps({"rows": [{**_row("probjax auto", 1.0), "run": 1}]}))
    new.write_text(json.dumps({"rows": [_row("probjax auto", 0.9), _row("torch sdpa", 0.8)]}))
    assert merge([new], 2, into, suite_rows=True) == 2
    assert [row["run"] for row in json.loads(into.read_text())["rows"]] == [1, 2, 2]
    new.write_text(json.dumps({"rows": [{**_row("probjax auto", 0.9), "status": "fine"}]}))
    with pytest.raises(ValueError, match="status"):
        merge([new], 3, into, suite_rows=True)


def test_merged_suite_rows_go_to_their_gpus_file():
    from bench.merge import results_for

    assert results_for("NVIDIA H100 80GB HBM3").name == "h100.json"
    assert results_for("NVIDIA H200").name == "h200.json"
    with pytest.raises(ValueError, match="--into"):
        results_for("cpu")
