"""How fast the command line answers: `hsdata --version`, `--help`, `info`, `validate` and `show` on the demo
store, each a fresh process, against `python -c "import torch"` and `python -c "pass"` in the same run.

Every command runs ``--repeat`` times, interleaved with the baselines (so drifts of the machine hit all alike);
figures are medians of wall seconds, and ratios against ``import torch`` (the bar: <= 0.4x).

    python benchmarks/cli_start_bench.py --dir /tmp/hsbench-cli --repeat 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

BASELINES = {"python -c pass": ["-c", "pass"], "python -c 'import torch'": ["-c", "import torch"]}


def commands(store: str) -> dict[str, list[str]]:
    return {f"hsdata {' '.join(args)}": ["-m", "hsdata", *args] for args in (
        ["--version"], ["--help"], ["info", store], ["validate", store], ["show", store, "3"])}


def wall(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    store = os.path.join(args.dir, "demo-store")
    subprocess.run([sys.executable, "-m", "hsdata", "extract", "--out", store], check=True, capture_output=True)
    methods = {**BASELINES, **commands(store)}
    for run in methods.values():  # untimed: the files in the page cache, as for a user's second command
        wall(run)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeat):
        for name, run in methods.items():
            times[name].append(wall(run))
    torch_s = statistics.median(times["python -c 'import torch'"])
    result = {"repeat": args.repeat, "cores": os.cpu_count(), "rows": [
        {"command": name, "median_s": statistics.median(t), "min_s": min(t),
         "x_import_torch": statistics.median(t) / torch_s} for name, t in times.items()]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"medians of {result['repeat']} fresh processes each, interleaved; {result['cores']} cores", "",
             "| command | s (median) | s (min) | x `import torch` |", "|---|---:|---:|---:|"]
    lines += [f"| `{r['command']}` | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['x_import_torch']:.2f} |"
              for r in result["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
