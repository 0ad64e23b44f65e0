"""Run benchmark suites and write JSON rows: `python -m bench.run --suite attention --out F`."""

import argparse
import datetime
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from bench import (  # noqa: E402
    attention_suite,
    decode_suite,
    dit_suite,
    forward_mode_suite,
    kv_lengths_suite,
    moe_suite,
    scaling_suite,
    sequence_suite,
    set_transformer_suite,
)
from bench.harness import (  # noqa: E402
    RowWriter,
    device_info,
    parse_overrides,
    versions,
    warm_up_device,
)

SUITES = {
    "attention": attention_suite,
    "decode": decode_suite,
    "dit": dit_suite,
    "forward_mode": forward_mode_suite,
    "kv_lengths": kv_lengths_suite,
    "moe": moe_suite,
    "scaling": scaling_suite,
    "sequence": sequence_suite,
    "set_transformer": set_transformer_suite,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suite", choices=sorted(SUITES), action="append")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/out/results.json"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", nargs="*", help="implementation names to run")
    parser.add_argument("--seq", nargs="*", type=int, help="sequence lengths to run")
    parser.add_argument("--set", nargs="*", metavar="KEY=V1,V2", help="restrict a grid axis")
    args = parser.parse_args(argv)
    writer = RowWriter(args.out)
    base = dict(
        device=device_info(),
        versions=versions(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    suites = args.suite or sorted(SUITES)
    overrides = parse_overrides(args.set)
    axes = {suite: set(getattr(SUITES[suite], "FULL", {})) for suite in suites}
    unknown = set(overrides) - set().union(*axes.values())
    if unknown:
        parser.error(f"--set {sorted(unknown)}: no selected suite has such a grid axis")
    warm_up_device()
    for suite in suites:
        rows = SUITES[suite].run(
            writer,
            base,
            quick=args.quick,
            repeats=args.repeats,
            only=set(args.only) if args.only else None,
            seqs=args.seq,
            overrides={k: v for k, v in overrides.items() if k in axes[suite]},
        )
        for row in tqdm(rows, desc=suite, mininterval=2.0):
            shape = " ".join(f"{k}={v}" for k, v in row["shape"].items())
            if "step_ms" in row:
                timing = f"{row['step_ms']:.3f} ms/step, efficiency {row['efficiency']:.2f}"
            elif "fwd_ms" in row:
                bwd = f"{row['fwd_bwd_ms']:.3f}" if "fwd_bwd_ms" in row else "-"
                timing = f"{row['fwd_ms']:.3f} / {bwd} ms"
            else:
                timing = row["message"][:80]
            tqdm.write(f"{row['implementation']:22s} {shape:48s} {row['status']:6s} {timing}")
    print(f"wrote {len(writer.rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
