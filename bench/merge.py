"""Append a device run's rows to the committed results: `python -m bench.merge --run N F...`.

Suite rows (`bench.run`) go to their GPU's file, `bench/results/h200.json` or
`h100.json` (so that the report of one card never mixes in the other's times); a sweep's
rows, which carry no device, go to the results file named by `--into`. Every row gets
`run=N`, so the report can tell runs apart; the rows are validated as the report
validates them.
"""

import argparse
import json
import pathlib
import re

from bench.report import validate

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _rows(path: pathlib.Path) -> list[dict]:
    """A run file's rows: a suite's `{"rows": [...]}` or a sweep's bare list."""
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def merge(files: list[pathlib.Path], run: int, into: pathlib.Path, *, suite_rows: bool) -> int:
    """Append the rows of `files` to `into` (a `{"rows": [...]}` file), each with `run`."""
    target = json.loads(into.read_text()) if into.exists() else {"rows": []}
    added = 0
    for path in files:
        for row in _rows(path):
            row["run"] = run
            if suite_rows:
                validate(row)
            target["rows"].append(row)
            added += 1
    into.write_text(json.dumps(target, indent=1) + "\n")
    return added


def results_for(device_kind: str) -> pathlib.Path:
    """The suite results file of a GPU kind (`NVIDIA H100 80GB HBM3` -> h100.json)."""
    match = re.search(r"\b(H[12]00)\b", device_kind)
    if match is None:
        raise ValueError(f"no results file for device {device_kind!r}: pass --into")
    return RESULTS / f"{match.group(1).lower()}.json"


def _device_kind(files: list[pathlib.Path]) -> str:
    kinds = {row["device"]["kind"] for path in files for row in _rows(path)}
    if len(kinds) != 1:
        raise ValueError(f"the rows come from {sorted(kinds)}: merge one device's at a time")
    return kinds.pop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", type=int, required=True)
    parser.add_argument("--into", type=pathlib.Path, help="a sweep's results file")
    parser.add_argument("files", type=pathlib.Path, nargs="+")
    args = parser.parse_args(argv)
    into = args.into or results_for(_device_kind(args.files))
    added = merge(args.files, args.run, into, suite_rows=args.into is None)
    print(f"appended {added} rows (run {args.run}) to {into}")


if __name__ == "__main__":
    main()
