import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name, *args):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quickstart_learns_continues_from_kv_caches_and_round_trips_a_checkpoint(tmp_path):
    out = run_example(
        "quickstart.py", "--steps", "120", "--checkpoint", str(tmp_path / "m.eqx"),
        "--plot", str(tmp_path / "loss.png"),
    )  # fmt: skip
    initial, final = (float(x) for x in re.search(r"eval loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert final < 0.5 * initial, out
    accuracy = float(re.search(r"greedy continuations .*: ([\d.]+)% of tokens", out).group(1))
    assert accuracy > 3 * 100 / 17, out  # 3x chance (vocab 17), decoding from KV caches
    assert "checkpoint saved and reloaded" in out
    assert (tmp_path / "m.eqx").stat().st_size > 0


def test_bench_quick_run_writes_rows(tmp_path):
    import json

    out_file = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--suite",
            "attention",
            "--suite",
            "kv_lengths",
            "--suite",
            "moe",
            "--suite",
            "sequence",
            "--suite",
            "set_transformer",
            "--suite",
            "dit",
            "--quick",
            "--repeats",
            "2",
            "--only",
            "probjax auto",
            "probjax triton",
            "probjax moe auto",
            "probjax moe triton",
            "grouped_matmul xla",
            "mamba scan",
            "mamba triton",
            "isab auto",
            "dit auto",
            "dit triton",
            "--out",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out_file.read_text())["rows"]
    assert {r["status"] for r in rows} == {"ok", "unsup."}
    assert {r["suite"] for r in rows} == {
        "attention", "kv_lengths", "moe", "grouped_matmul", "sequence", "set_transformer", "dit",
    }  # fmt: skip
    for row in rows:
        assert {
            "suite",
            "implementation",
            "shape",
            "dtype",
            "status",
            "message",
            "device",
            "versions",
        } <= set(row)
        if row["status"] == "ok":
            assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["max_abs_err"] < 2e-2
        if row["suite"] in ("attention", "kv_lengths") and row["status"] == "ok":
            # The kernel our call ran; on the CPU auto's priority list ends at XLA.
            assert row["kernel"] == row["implementation"].split()[1].replace("auto", "xla")


def test_forward_mode_suite_rows(tmp_path):
    """`bench.run --suite forward_mode`'s rows, in process: each tangent checked against
    the float32 reference's; jax.nn's cuDNN route, which has no forward mode, a failure
    row with its message (on the CPU: no cuDNN)."""
    import jax
    from bench import forward_mode_suite
    from bench.harness import RowWriter

    writer = RowWriter(tmp_path / "rows.json")
    base = dict(device={"platform": "cpu"}, versions={})
    with jax.numpy_dtype_promotion("standard"):  # jax.nn's XLA JVP mixes bf16 and f32
        rows = list(forward_mode_suite.run(writer, base, quick=True, repeats=2,
                                           overrides={"causal": [True]}))  # fmt: skip
    by_name = {row["implementation"]: row for row in rows}
    assert set(by_name) == {"probjax auto", "probjax xla", "jax.nn xla", "jax.nn cudnn"}
    for name in ("probjax auto", "probjax xla", "jax.nn xla"):
        row = by_name[name]
        assert row["status"] == "ok" and row["fwd_ms"] > 0 and row["max_abs_err"] < 2e-2, row[
            "message"
        ]
    assert by_name["jax.nn cudnn"]["status"] != "ok" and by_name["jax.nn cudnn"]["message"]


def test_train_dit_samples_approach_the_data(tmp_path):
    import ast

    out = run_example("train_dit.py", "--steps", "500", "--plot", str(tmp_path / "dit.png"))
    data = ast.literal_eval(re.search(r"data moments +(\{.*\})", out).group(1))
    samples = ast.literal_eval(re.search(r"sample moments +(\{.*\})", out).group(1))
    assert abs(samples["radius"] - data["radius"]) < 0.25, out
    assert abs(samples["radius_std"] - data["radius_std"]) < 0.25, out
    assert max(abs(m) for m in samples["mean"]) < 0.3, out
    assert (tmp_path / "dit.png").stat().st_size > 0


def test_train_ssm_runs_and_learns(tmp_path):
    out = run_example(
        "train_ssm.py", "--steps", "60", "--plot", str(tmp_path / "ssm.png"),
        "--checkpoint-dir", str(tmp_path),
    )  # fmt: skip
    for kind in ("mamba", "rla"):
        loss = float(re.search(rf"{kind}: eval loss ([\d.]+)", out).group(1))
        assert loss < 2.0, out  # below chance (log 7 = 1.95 is the uniform loss over 7 tokens)
    assert (tmp_path / "ssm.png").stat().st_size > 0


def test_amortized_inference_is_calibrated(tmp_path):
    out = run_example(
        "amortized_inference.py", "--steps", "300", "--plot", str(tmp_path / "npe.png"),
        "--checkpoint", str(tmp_path / "npe.eqx"),
    )  # fmt: skip
    c68, c95 = (float(x) for x in re.search(r"68%: ([\d.]+)\s+95%: ([\d.]+)", out).groups())
    assert abs(c68 - 0.68) < 0.1 and abs(c95 - 0.95) < 0.06, out


def test_train_moe_lm_resumes_and_balances(tmp_path):
    ckpt = tmp_path / "moe.eqx"
    args = ["--steps", "40", "--plot", str(tmp_path / "moe.png"), "--checkpoint", str(ckpt)]
    out = run_example("train_moe_lm.py", *args)
    first = float(re.search(r"eval cross-entropy ([\d.]+)", out).group(1))
    # The optimiser state (its step count too) comes back: a longer --steps horizon lets
    # the schedule continue past the first run's 40 steps.
    args[1] = "80"
    out = run_example("train_moe_lm.py", *args, "--resume", str(ckpt))
    assert "resuming from" in out
    second = float(re.search(r"eval cross-entropy ([\d.]+)", out).group(1))
    assert second < first, out
    lb = float(re.search(r"load-balancing loss ([\d.]+)", out).group(1))
    assert lb < 2.0, out


def test_train_moe_lm_on_a_mesh_matches_one_device(tmp_path):
    """`--mesh data=2,expert=4`: data- and expert-parallel training on 8 CPU devices
    reaches the single-device run's eval loss."""
    args = ["--steps", "30", "--plot", str(tmp_path / "m.png"), "--checkpoint", str(tmp_path / "c")]
    pattern = r"eval cross-entropy ([\d.]+)"
    single = float(re.search(pattern, run_example("train_moe_lm.py", *args)).group(1))
    out = run_example("train_moe_lm.py", *args, "--mesh", "data=2,expert=4")
    assert "mesh {'data': 2, 'expert': 4}" in out, out
    assert abs(float(re.search(pattern, out).group(1)) - single) < 0.02, out
