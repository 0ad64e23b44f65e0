"""Append a device run's rows to the committed results: `python -m bench.merge --run N F...`.

Suite rows (`bench.run`) go to `bench/results/h200.json`; a sweep's rows go to the
results file named by `--into`. Every row gets `run=N`, so the report can tell runs
apart; the rows are validated as the report validates them.
"""

import argparse
import json
import pathlib

from bench.report import validate

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def merge(files: list[pathlib.Path], run: int, into: pathlib.Path, *, suite_rows: bool) -> int:
    """Append the rows of `files` to `into` (a `{"rows": [...]}` file), each with `run`."""
    target = json.loads(into.read_text()) if into.exists() else {"rows": []}
    added = 0
    for path in files:
        data = json.loads(path.read_text())
        for row in data["rows"] if isinstance(data, dict) else data:
            row["run"] = run
            if suite_rows:
                validate(row)
            target["rows"].append(row)
            added += 1
    into.write_text(json.dumps(target, indent=1) + "\n")
    return added


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", type=int, required=True)
    parser.add_argument("--into", type=pathlib.Path, help="a sweep's results file")
    parser.add_argument("files", type=pathlib.Path, nargs="+")
    args = parser.parse_args(argv)
    into = args.into or RESULTS / "h200.json"
    added = merge(args.files, args.run, into, suite_rows=args.into is None)
    print(f"appended {added} rows (run {args.run}) to {into}")


if __name__ == "__main__":
    main()
