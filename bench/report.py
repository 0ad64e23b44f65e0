"""Render benchmark rows into a Markdown report and plots.

    python -m bench.report bench/results/h200.json --out docs/benchmarks

Writes `<out>/<device>.md` (a table per suite in ms, our default marked, each other
implementation's time over our default's, XLA's buffer plan for MoE, the GPU test
counts, and a "known gaps" section listing every case where a peer beats our default)
and `<out>/<device>_<suite>.png` (time relative to our default, per case). Rows are
validated first (`validate`); a cell shows the newest run of its case.
"""

import argparse
import collections
import json
import pathlib
import re

from bench.harness import STATUSES

# Our default per suite (sequence: per model, `_default_for`).
DEFAULTS = {
    "attention": "probjax auto",
    "decode": "probjax auto",
    "kv_lengths": "probjax auto",
    "grouped_matmul": "grouped_matmul triton",
    "moe": "probjax moe auto",
    "set_transformer": "probjax auto",
    "dit": "dit auto",
    "forward_mode": "probjax auto",
}
_REQUIRED = {"suite": str, "implementation": str, "shape": dict, "dtype": str, "status": str}


def validate(row: dict) -> None:
    """Raise ValueError naming what is wrong with a row."""
    for key, kind in _REQUIRED.items():
        if not isinstance(row.get(key), kind):
            raise ValueError(f"row needs {key!r} of type {kind.__name__}: {row}")
    if row["status"] not in STATUSES:
        raise ValueError(f"status {row['status']!r} is not one of {STATUSES}: {row}")
    if row["status"] == "ok" and not any(
        isinstance(row.get(k), int | float) for k in ("fwd_ms", "fwd_bwd_ms", "step_ms")
    ):
        raise ValueError(f"an 'ok' row needs fwd_ms, fwd_bwd_ms or step_ms: {row}")
    if row["status"] != "ok" and not row.get("message"):
        raise ValueError(f"a {row['status']!r} row needs a message: {row}")


def _case(row: dict) -> tuple:
    group = row["implementation"].split()[0] if row["suite"] == "sequence" else ""
    shape = json.dumps(row["shape"], sort_keys=True)
    return row["suite"], group, shape, row["dtype"], row.get("mask", "")


def _default_for(suite: str, group: str, impls: set[str]) -> str | None:
    if suite == "sequence":
        for name in (f"{group} triton", f"{group} auto"):
            if name in impls:
                return name
        return None
    name = DEFAULTS.get(suite)
    return name if name in impls else None


def latest(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """`case -> implementation -> row`, the newest run of each."""
    cases: dict[tuple, dict[str, dict]] = collections.defaultdict(dict)
    for row in sorted(rows, key=lambda r: (r.get("run", 0), r.get("date", ""))):
        cases[_case(row)][row["implementation"]] = row
    return cases


def by_run(rows: list[dict]) -> dict[tuple, dict]:
    """`(case, run, implementation) -> row` (the newest of a run): ratios pair rows of one run."""
    out = {}
    for row in sorted(rows, key=lambda r: r.get("date", "")):
        out[_case(row), row.get("run", 0), row["implementation"]] = row
    return out


_TIMES = ("fwd_bwd_ms", "step_ms", "fwd_ms")


def _time(row: dict, keys=_TIMES) -> float | None:
    if row["status"] != "ok":
        return None
    for key in keys:
        if isinstance(row.get(key), int | float):
            return float(row[key])
    return None


def _ratio(row: dict, base: dict | None) -> float | None:
    """`row`'s time over `base`'s, on the first measure both have."""
    if base is None:
        return None
    for key in _TIMES:
        t, b = _time(row, (key,)), _time(base, (key,))
        if t is not None and b is not None:
            return t / b
    return None


def _staleness(peer: dict, default: dict | None) -> str:
    """The run of a gap, and whether our default was measured again after it (the
    default may have changed since: head_dim 256 moved from Triton to cuDNN in run 20)."""
    run, newest = peer.get("run", 0), (default or {}).get("run", 0)
    if newest > run:
        return f" (run {run}; our default's newest row, run {newest}, has no peer beside it)"
    return f" (run {run})"


# Below this a call times the host more than the GPU: one decode config measured 0.038
# and 0.058 ms in two passes of the same run (bench/results/h200_decode_sweep.json, run 33).
HOST_FLOOR_MS = 0.06


def _host_bound(peer: dict, default: dict | None) -> str:
    times = [_time(r) for r in (peer, default) if r is not None]
    if times and all(t is not None and t < HOST_FLOOR_MS for t in times):
        return f" (both under {HOST_FLOOR_MS} ms: within the host's pass-to-pass spread)"
    return ""


# Runs before this one timed 20 ms samples (`harness.time_fn`), which spread JAX's sync,
# 0.41 ms longer than torch's (H100 run 152), over each call of a JAX route: 2-3% at calls
# of 1-5 ms, more below.
LONG_SAMPLES_SINCE_RUN = 152


def _short_samples(peer: dict) -> str:
    if peer.get("run", 0) < LONG_SAMPLES_SINCE_RUN and peer["implementation"].startswith("torch"):
        return " (20 ms samples: our time carries JAX's sync)"
    return ""


def _fmt(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bytes(count) -> str:
    """`count` bytes in the largest binary unit that keeps it >= 1: flash kernels' few KiB
    of statistics and XLA's GiBs of score matrices in one column."""
    if count is None:
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} GiB"


def gpu_test_counts(folder: pathlib.Path, name: str) -> list[str]:
    """One line per saved GPU test log of `name`'s GPU (`<name>_gpu_tests*.txt`)."""
    lines = []

    def run_number(path: pathlib.Path) -> int:  # run1 < run9 < run11
        found = re.search(r"run(\d+)", path.name)
        return int(found.group(1)) if found else 0

    for path in sorted(folder.glob(f"{name}_gpu_tests*.txt"), key=run_number):
        found = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", path.read_text(), re.M)
        lines.append(f"- `{path.name}`: {found[-1] if found else 'no summary (run cut short)'}")
    return lines


def render(rows: list[dict], out: pathlib.Path, name: str, logs: pathlib.Path | None = None):
    """Write `<out>/<name>.md` and one PNG per suite; returns the Markdown path."""
    for row in rows:
        validate(row)
    out.mkdir(parents=True, exist_ok=True)
    cases, runs = latest(rows), by_run(rows)
    newest = max(rows, key=lambda r: r.get("date", ""))
    lines = [
        f"# Benchmarks: {newest.get('device', {}).get('kind', name)}",
        "",
        f"Versions: {json.dumps(newest.get('versions', {}))}. Rendered by `bench/report.py`",
        "from the committed rows; each cell is the newest run of its case (column `run`). Times",
        "are medians in ms (fwd+bwd, or one train step). **ratio** = that implementation's time",
        "over our default's **in the same run**, on the first of fwd+bwd / step / fwd that both",
        "have (above 1: we are faster; `-`: no default row in that run). Status `unsup.` /",
        "`OOM` / `error` rows keep their message.",
        "",
        "A case with `layers=N` times each call inside a stack of N, each call's output the",
        "next one's queries: one program for JAX, N eager launches for torch. JAX pays a fixed",
        "cost per dispatched program that torch's launches do not, and a model pays it once",
        "per step, not once per layer. JAX fwd+bwd times take `jax.vjp` on a cotangent in the",
        "output's dtype (`harness.fwd_bwd_program`), as torch's `backward` gets it; rows before",
        "run 93 (H100) also timed a conversion of a float32 cotangent. `ok, grads E`: the",
        "row's gradients were checked against the float32 oracle too (rows from run 99 on),",
        "E the largest |difference|.",
        "",
        "JAX's route to cuDNN runs the kernels torch's SDPA runs (ncu, H100 runs 95 and 101),",
        "but its backward also zero-fills dK and dV, and under GQA the per-query-head dK/dV",
        "it sums afterwards (`bench/trace_program.py`; H100 run 104, 8 x 128 queries over",
        "8192 keys: 2 x 164 us with 32 KV heads, 334 + 2 x 42 us with 8): most of its gap to",
        "torch's cuDNN where few queries train against many keys.",
        "",
    ]
    if logs is not None:
        lines += ["## GPU tests", "", *gpu_test_counts(logs, name), ""]
    gaps, plots = [], collections.defaultdict(list)
    by_suite = collections.defaultdict(list)
    for case in cases:
        by_suite[case[0]].append(case)
    for suite in sorted(by_suite):
        lines += [f"## {suite}", ""]
        memory = suite in ("moe", "forward_mode")
        header = "| case | implementation | status | fwd ms | fwd+bwd / step ms | TFLOP/s | ratio |"
        lines += [
            header + (" scratch |" if memory else "") + " run |",
            "|---" * (8 + memory) + "|",
        ]
        for case in by_suite[suite]:
            impls = cases[case]
            default = _default_for(suite, case[1], set(impls))
            shape = ", ".join(f"{k}={v}" for k, v in json.loads(case[2]).items())
            label = f"{shape}, {case[3]}" + (f", {case[4]}" if case[4] else "")
            for impl, row in sorted(impls.items(), key=lambda kv: (kv[0] != default, kv[0])):
                t = _time(row)
                base = runs.get((case, row.get("run", 0), default)) if default else None
                ratio = _ratio(row, base)
                mark = f"**{impl}** (default)" if impl == default else impl
                if row.get("kernel") and not impl.endswith(row["kernel"]):
                    mark += f": {row['kernel']}"  # which kernel `auto` ran
                status = row["status"] if row["status"] == "ok" else (
                    f"{row['status']}: {row['message'][:60]}"
                )  # fmt: skip
                if row["status"] == "ok" and "max_grad_err" in row:
                    status += f", grads {row['max_grad_err']:.1e}"
                cells = [label, mark, status, _fmt(row.get("fwd_ms")), _fmt(t),
                         _fmt(row.get("tflops_fwd_bwd"), 0), _fmt(ratio, 2)]  # fmt: skip
                if memory:
                    cells.append(_bytes(row.get("temp_bytes")))
                cells.append(str(row.get("run", "-")))  # old runs may predate the code
                lines.append("| " + " | ".join(cells) + " |")
                if ratio is not None and impl != default:
                    compact = "x".join(str(v) for v in json.loads(case[2]).values())
                    plots[suite].append((f"{compact} {case[4]} | {impl}", ratio))
                    if row.get("peer") and ratio < 1.0:
                        gaps.append(f"- {suite}, {label}: {impl} takes {ratio:.2f}x our time"
                                    + _staleness(row, impls.get(default))
                                    + _host_bound(row, base)
                                    + _short_samples(row))  # fmt: skip
        lines.append("")
    lines += ["## Known gaps", "", *(gaps or ["- none: our default is fastest in every case"]), ""]
    for suite, bars in plots.items():
        _plot(out / f"{name}_{suite}.png", suite, bars)
        lines += [f"![{suite}]({name}_{suite}.png)", ""]
    path = out / f"{name}.md"
    path.write_text("\n".join(lines))
    return path


def _plot(path: pathlib.Path, suite: str, bars: list[tuple[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = bars[:80]
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(bars) + 1.2))
    ax.barh(range(len(bars)), [r for _, r in bars])
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=6)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time / our default's time (right of 1: our default is faster)")
    ax.set_title(suite)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    rows = json.loads(args.rows.read_text())["rows"]
    path = render(rows, args.out, args.rows.stem, logs=args.rows.parent)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
