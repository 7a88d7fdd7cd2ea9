"""``python -m benchmarks``: every benchmark at one size, their tables into ``benchmarks/RESULTS.md``.

    python -m benchmarks                      # all, small: minutes on 2 cores
    python -m benchmarks --size large         # the sizes the figures in RESULTS.md were measured at
    python -m benchmarks --only formats read  # some of them
    python -m benchmarks --list
    python -m benchmarks --render             # rewrite the RESULTS.md block from the saved JSON, running nothing

Each benchmark is its own script (``benchmarks/<name>_bench.py``, runnable alone with the command line shown in its
section), run here in a fresh process with the arguments of the chosen size. Its JSON goes to
``benchmarks/results/suite-<size>/<name>.json`` and all of them, with the machine, to
``benchmarks/results/suite-<size>.json``; its tables replace its section of the generated part of RESULTS.md
(between the ``suite`` markers; the write-up and the hand-written sections around it stay). GPU benchmarks run
when CUDA is available and are reported as skipped otherwise. Cold passes drop the page cache, which needs root.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")
BEGIN, END = "<!-- suite: begin (written by python -m benchmarks) -->", "<!-- suite: end -->"


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    what: str
    small: tuple[str, ...]  # arguments; {dir} is the benchmark's scratch folder, {json} its result file
    large: tuple[str, ...]
    gpu: bool = False


SUITE = [
    Bench("formats", "formats_bench.py", "the same samples in every format users pick today: write, random reads "
          "cold and warm, a DataLoader epoch, size on disk, files per TB",
          ("--dir", "{dir}", "--size", "small"), ("--dir", "{dir}", "--size", "large")),
    Bench("write", "write_bench.py", "the writer against raw writes of the same bytes, one and two processes",
          ("--dir", "{dir}", "--gib", "1", "--hidden", "4096", "--mix", "chat", "--writers", "1", "2"),
          ("--dir", "{dir}", "--gib", "4", "--hidden", "4096", "7168", "--mix", "chat", "short", "--writers", "1",
           "2")),
    Bench("read", "read_bench.py", "random-order sample reads against raw pread and zarr-python",
          ("--dir", "{dir}", "--gib", "1", "--hidden", "4096"), ("--dir", "{dir}", "--gib", "6")),
    Bench("dataset", "dataset_bench.py", "a DataLoader epoch: Eagle3Dataset against raw reads and torch.save files",
          ("--dir", "{dir}", "--gib", "1", "--hidden", "4096", "--workers", "2"),
          ("--dir", "{dir}", "--gib", "3", "--workers", "4")),
    Bench("loader", "loader_bench.py", "the training read path: Loader and DataLoader epochs to the GPU (host memory "
          "without CUDA) against raw reads, store[i] on all cores and every other format, warm, cold, ranks of a node, "
          "and a training-shaped consumer (GPU)",
          ("--dir", "{dir}", "--gib", "1", "--hidden", "4096", "--workers", "2", "--ranks", "2"),
          ("--dir", "{dir}", "--gib", "4", "--hidden", "4096", "--workers", "8", "--ranks", "8")),
    Bench("decode", "decode_bench.py", "CPU decoding of compressed chunks (each preset) and the reads' checks, GB/s "
          "on 1 thread to all cores", ("--threads", "1", "2", "--seconds", "0.5"),
          ("--threads", "1", "2", "4", "8", "16", "--seconds", "1")),
    Bench("validate", "validate_bench.py", "hsdata validate against raw reads of the same files",
          ("--dir", "{dir}", "--gib", "1", "--hidden", "4096", "--workers", "2"), ("--dir", "{dir}", "--gib", "6")),
    Bench("cli", "cli_start_bench.py", "how fast the command line answers (--version, --help, info, validate, show) "
          "against python -c 'import torch'", ("--dir", "{dir}", "--repeat", "5"), ("--dir", "{dir}", "--repeat", "9")),
    Bench("metadata", "metadata_bench.py", "open, len and lookups from 1K to 1M samples against listing "
          "per-sample files", ("--dir", "{dir}", "--samples", "1000", "10000", "100000", "--runs", "3"),
          ("--dir", "{dir}", "--samples", "1000", "10000", "100000", "1000000", "--runs", "5")),
    Bench("remote", "remote_bench.py", "reads over HTTP range requests, with added latency",
          ("--dir", "{dir}", "--gib", "0.5", "--hidden", "4096"), ("--dir", "{dir}", "--gib", "2")),
    Bench("dtype", "dtype_bench.py", "stored dtypes bf16, fp16, fp32 and fp32 converted",
          ("--dir", "{dir}", "--gib", "0.5"), ("--dir", "{dir}", "--gib", "2")),
    Bench("compression", "compression_bench.py", "lossless codecs on a trained model's hidden states",
          ("--dir", "{dir}", "--size", "small"), ("--dir", "{dir}", "--size", "large")),
    Bench("migrate", "migrate_bench.py", "hsdata import and export of a SpecForge dump",
          ("--workdir", "{dir}", "--samples", "16"), ("--workdir", "{dir}", "--samples", "64")),
    Bench("capture", "capture_bench.py", "the capture path over chunked-prefill forwards on a GPU",
          ("--store", "{dir}/store", "--forwards", "16", "--rounds", "2"),
          ("--store", "{dir}/store", "--forwards", "64", "--rounds", "2"), gpu=True),
    Bench("extract", "extract_bench.py", "hsdata extract --engine hf against the forwards alone",
          ("--out", "{dir}/out", "--tokens", "100000", "--rounds", "2"),
          ("--out", "{dir}/out", "--tokens", "400000", "--rounds", "3"), gpu=True),
]
BY_NAME = {b.name: b for b in SUITE}


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    facts = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
             "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
             "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
             "root": os.geteuid() == 0, "utc": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M}"}
    for package in ("hsdata", "zarr", "numpy", "pyarrow"):
        try:
            facts[package] = importlib.import_module(package).__version__
        except (ImportError, AttributeError):
            facts[package] = None
    try:
        facts["commit"] = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        facts["commit"] = None
    return facts


def command_line(bench: Bench, size: str, scratch: str, python: str = sys.executable) -> list[str]:
    args = [a.format(dir=scratch) for a in (bench.small if size == "small" else bench.large)]
    return [python, os.path.join("benchmarks", bench.script), *args]


def run(bench: Bench, size: str, scratch_root: str, results_dir: str, facts: dict) -> dict:
    """Run one benchmark, its output shown as it comes; its record: the command, status, seconds and the script's
    JSON result."""
    scratch = os.path.join(scratch_root, bench.name)
    result_path = os.path.join(results_dir, f"{bench.name}.json")
    shown = shlex.join(command_line(bench, size, scratch, python="python"))
    record = {"name": bench.name, "what": bench.what, "command": shown, "size": size, "machine": machine_line(facts),
              "commit": facts.get("commit"), "utc": facts.get("utc")}
    if bench.gpu and facts["gpu"] is None:
        return {**record, "status": "skipped: needs a CUDA GPU, none here"}
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch, exist_ok=True)
    if os.path.exists(result_path):
        os.remove(result_path)
    started = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    with subprocess.Popen([*command_line(bench, size, scratch), "--json", result_path], cwd=os.path.dirname(HERE),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:
            print(f"  {bench.name} | {line}", end="", file=sys.stderr, flush=True)
            tail.append(line.rstrip("\n"))
    record["seconds"] = round(time.monotonic() - started, 1)
    shutil.rmtree(scratch, ignore_errors=True)
    if child.returncode != 0 or not os.path.exists(result_path):
        return {**record, "status": f"failed (exit {child.returncode})", "output": "\n".join(tail)}
    with open(result_path) as f:
        record["result"] = json.load(f)
    record["status"] = "ok"
    return record


def section(record: dict) -> str:
    """One benchmark's part of RESULTS.md."""
    lines = [f"### {record['name']}: {record['what']}", "", "```", record["command"], "```", ""]
    if record["status"] != "ok":
        lines += [f"**{record['status']}**", ""]
        if record.get("output"):
            lines += ["```", record["output"], "```", ""]
        return "\n".join(lines)
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    module = importlib.import_module(os.path.splitext(BY_NAME[record["name"]].script)[0])
    render = getattr(module, "markdown", None)
    lines += [render(record["result"]) if render else generic_markdown(record["result"]), "",
              f"(size {record['size']}, {record['seconds']:.0f} s on {record['machine']}{_when(record)})", ""]
    return "\n".join(lines)


def _when(record: dict) -> str:
    """``, commit C, D UTC`` for a record that has them (a section may be rerun alone, at a later commit)."""
    return "".join(f", {label}{record[key]}{suffix}" for key, label, suffix in
                   (("commit", "commit ", ""), ("utc", "", " UTC")) if record.get(key))


def generic_markdown(result: dict) -> str:
    """A result's list of rows (``results`` or ``rows``) as a table of its scalar columns, or its scalars."""
    rows = next((result[k] for k in ("results", "rows", "rounds") if isinstance(result.get(k), list)), None)
    if rows is None:
        rows = [{k: v for k, v in result.items() if not isinstance(v, (dict, list))}]
    columns = [k for k in rows[0] if all(not isinstance(r.get(k), (dict, list)) for r in rows)]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def update_results(text: str, sections: dict[str, str], header: str) -> str:
    """RESULTS.md with the suite block's header and the given benchmarks' sections replaced (or added, in suite
    order); other benchmarks' sections from an earlier run stay."""
    if BEGIN in text:
        before, rest = text.split(BEGIN, 1)
        block, after = rest.split(END, 1)
    else:
        before, block, after = text.rstrip() + "\n\n", "", "\n"
    kept = {}
    for bench in SUITE:
        start, stop = f"<!-- suite:{bench.name} -->", f"<!-- /suite:{bench.name} -->"
        if start in block:
            kept[bench.name] = block.split(start, 1)[1].split(stop, 1)[0].strip("\n")
    kept.update({name: body.strip("\n") for name, body in sections.items()})
    body = [header.strip("\n")]
    body += [f"<!-- suite:{b.name} -->\n{kept[b.name]}\n<!-- /suite:{b.name} -->" for b in SUITE if b.name in kept]
    return before + BEGIN + "\n" + "\n\n".join(body) + "\n" + END + after


def write_results(records: list[dict], header: str) -> None:
    """Rewrite RESULTS.md's suite block: rendered in full first, then swapped in by a rename (a rendering error
    leaves the file as it was)."""
    with open(RESULTS) as f:
        text = f.read()
    updated = update_results(text, {r["name"]: section(r) for r in records}, header)
    with open(RESULTS + ".partial", "w") as f:
        f.write(updated)
    os.replace(RESULTS + ".partial", RESULTS)


def machine_line(facts: dict) -> str:
    return f"{facts['cpus']} CPUs, {facts['memory_gib']} GiB, GPU {facts['gpu'] or 'none'}"


def suite_header(size: str, facts: dict) -> str:
    gpu = facts["gpu"] or "none"
    return (f"## The benchmark suite (`python -m benchmarks`)\n\n"
            f"Last run (`--size {size}`){' ' + facts['utc'] + ' UTC' if facts.get('utc') else ''} at commit "
            f"{facts['commit']}: "
            f"{facts['cpus']} CPUs, {facts['memory_gib']} GiB, GPU {gpu}, Python {facts['python']}, torch "
            f"{facts['torch']}, zarr {facts['zarr']}; {facts['platform']}. Every ratio is against a baseline "
            f"measured in the same run; each section's command runs it alone, and a section rerun alone (`--only`) "
            f"names its own commit and time under its table.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these (see --list)")
    parser.add_argument("--dir", default="/tmp/hsdata-benchmarks", help="scratch folder (its contents are removed)")
    parser.add_argument("--no-results", action="store_true", help="do not touch RESULTS.md (JSON is still written)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--render", action="store_true", help="run nothing: rewrite RESULTS.md's suite block from "
                        "results/suite-<size>.json (e.g. after adding records from a run on another machine)")
    args = parser.parse_args(argv)
    if args.list:
        for b in SUITE:
            print(f"{b.name:12} {'(GPU) ' if b.gpu else ''}{b.what}")
        return 0
    unknown = sorted(set(args.only or ()) - set(BY_NAME))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    chosen = [b for b in SUITE if not args.only or b.name in args.only]
    summary_path = os.path.join(HERE, "results", f"suite-{args.size}.json")
    if args.render:
        with open(summary_path) as f:
            saved = json.load(f)
        records = [saved["benchmarks"][b.name] for b in chosen if b.name in saved["benchmarks"]]
        write_results(records, suite_header(args.size, saved["machine"]))
        return 0
    facts = machine()
    results_dir = os.path.join(HERE, "results", f"suite-{args.size}")
    os.makedirs(results_dir, exist_ok=True)
    if not facts["root"]:
        print("note: not root: cold passes cannot drop the page cache", file=sys.stderr)
    records = []
    for i, bench in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {bench.name}: {bench.what}", file=sys.stderr, flush=True)
        record = run(bench, args.size, args.dir, results_dir, facts)
        print(f"[{i}/{len(chosen)}] {bench.name}: {record['status']}"
              + (f" in {record['seconds']:.0f} s" if "seconds" in record else ""), file=sys.stderr, flush=True)
        records.append(record)
    previous = {}
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            previous = json.load(f).get("benchmarks", {})
    with open(summary_path, "w") as f:
        json.dump({"machine": facts, "size": args.size,
                   "benchmarks": {**previous, **{r["name"]: r for r in records}}}, f, indent=1)
    if not args.no_results:
        write_results(records, suite_header(args.size, facts))
    failed = [r["name"] for r in records if r["status"].startswith("failed")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
