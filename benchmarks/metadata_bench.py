"""Metadata at scale (issue 16, item 4): open a store of many tiny samples, look samples up by id, against listing
the per-sample-file layout that today's tools write (SpecForge: ``rows_{g}-{g+2000}/data_{idx}.ckpt``).

    python benchmarks/metadata_bench.py --dir /tmp/hsmeta --samples 1000000 --runs 5 --reuse

Builds (once; ``--reuse`` keeps both under ``--dir`` between runs):

- ``store``: an hsdata store of ``--samples`` samples of 1-4 tokens, hidden size 8, 3 aux layers, written by
  ``--writers`` ``hsdata.create`` processes in parallel (each its own part, concurrent writers being supported);
  ids are 32 hex digits like SGLang request ids; ``--shard-tokens`` sets how many rows a manifest holds.
- ``files``: the same number of empty files ``rows_{g}-{g+2000}/data_{idx}.ckpt`` (listing cost does not depend on
  the content).

Then measures, each run in a fresh subprocess (imports excluded from every time), cold runs after
``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root), warm runs after an untimed pass:

- ``hsdata.open``; then the first ``get(sample_id)`` of a random id, ``len``, ``sample_ids`` (len, one item, a
  slice), ``lengths.sum()``; then ``get`` of 1,000 random ids and ``index`` of 100,000 random ids; the process's RSS
  growth (``/proc/self/statm``) after open and after the first get;
- the baseline: an ``os.scandir`` walk collecting every path into a list, and ``fsspec`` ``find``; RSS growth.

Medians of ``--runs`` runs are printed as a markdown table, and the raw runs as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import xxhash

HIDDEN = 8
AUX_LAYERS = [1, 2, 3]
FILES_PER_DIR = 2000  # SpecForge's rows_{g}-{g+2000}


def sample_id(i: int) -> str:
    return xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little"))  # 32 hex digits, like a uuid4().hex request id


def _write_part(url: str, first: int, count: int, shard_tokens: int) -> None:
    import hsdata

    rng = np.random.default_rng(first)
    lengths = rng.integers(1, 5, count)
    k = len(AUX_LAYERS)
    pool = {t: (np.arange(t, dtype=np.int32), np.ones(t, np.uint8), np.full((t, k * HIDDEN), 0.5, np.float16),
                np.full((t, HIDDEN), 0.25, np.float16)) for t in range(1, 5)}
    with hsdata.create(url, HIDDEN, AUX_LAYERS, "tiny", dtype="float16", shard_tokens=shard_tokens) as writer:
        for i, t in zip(range(first, first + count), lengths.tolist()):
            ids, mask, aux, final = pool[t]
            writer.add(sample_id(i), input_ids=ids, loss_mask=mask, aux_hidden_states=aux, hidden_states=final)


def build_store(path: str, samples: int, writers: int, shard_tokens: int) -> float:
    import hsdata

    shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    hsdata.create(path, HIDDEN, AUX_LAYERS, "tiny", dtype="float16", shard_tokens=shard_tokens).close()
    bounds = np.linspace(0, samples, writers + 1).astype(int)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_part, args=(path, int(a), int(b - a), shard_tokens))
             for a, b in zip(bounds[:-1], bounds[1:])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a writer failed (exit code {p.exitcode})")
    return time.perf_counter() - start


def build_files(path: str, samples: int) -> float:
    shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    for g in range(0, samples, FILES_PER_DIR):
        folder = os.path.join(path, f"rows_{g}-{g + FILES_PER_DIR}")
        os.makedirs(folder)
        for idx in range(g, min(samples, g + FILES_PER_DIR)):
            os.close(os.open(os.path.join(folder, f"data_{idx}.ckpt"), os.O_CREAT | os.O_WRONLY, 0o644))
    return time.perf_counter() - start


# --- measured in a fresh process -------------------------------------------------------------------------------

CHILD_STORE = r"""
import json, os, sys, time
import numpy as np
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import hsdata, hsdata.reader  # imports excluded
path = sys.argv[1]
with open(sys.argv[2]) as f:
    probes = json.load(f)
out = {}
base = rss()
c, t = time.process_time(), time.perf_counter()
store = hsdata.open(path)
out["open_s"], out["open_cpu_s"] = time.perf_counter() - t, time.process_time() - c
out["rss_open_mib"] = (rss() - base) / 2**20
t = time.perf_counter(); sample = store.get(probes[0]); out["first_get_s"] = time.perf_counter() - t
assert sample["sample_id"] == probes[0]
out["rss_first_get_mib"] = (rss() - base) / 2**20
t = time.perf_counter(); n = len(store); out["len_s"] = time.perf_counter() - t
t = time.perf_counter()
ids = store.sample_ids; k = len(ids); one = ids[n // 2]; head = ids[:3]
out["sample_ids_s"] = time.perf_counter() - t
t = time.perf_counter(); total = int(store.lengths.sum()); out["lengths_sum_s"] = time.perf_counter() - t
t = time.perf_counter()
for sid in probes[1:1001]:
    store.get(sid)
out["get_1000_s"] = time.perf_counter() - t
t = time.perf_counter()
for sid in probes[1001:]:
    store.index(sid)
out["index_rest_s"] = time.perf_counter() - t
out["index_rest_n"] = len(probes) - 1001
out["rss_end_mib"] = (rss() - base) / 2**20
out["samples"], out["tokens"] = n, total
print(json.dumps(out))
"""

CHILD_FILES = r"""
import json, os, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import fsspec
fs = fsspec.filesystem("file")
path, how = sys.argv[1], sys.argv[2]
base = rss()
t = time.perf_counter()
if how == "scandir":
    found, stack = [], [path]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                (stack.append(e.path) if e.is_dir(follow_symlinks=False) else found.append(e.path))
else:
    found = fs.find(path)
out = {"list_s": time.perf_counter() - t, "files": len(found), "rss_mib": (rss() - base) / 2**20}
print(json.dumps(out))
"""


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def child(code: str, *args: str, pythonpath: str | None = None) -> dict:
    # cwd: not the checkout, so that PYTHONPATH can name another copy of hsdata to measure (python -c puts the
    # working directory first on sys.path)
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd="/", env=env)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/hsmeta")
    parser.add_argument("--samples", type=int, nargs="+", default=[1_000_000], help="store sizes, measured in turn")
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--shard-tokens", type=int, default=65536)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reuse", action="store_true", help="keep a store and file tree built earlier with these "
                        "parameters")
    parser.add_argument("--no-files", action="store_true", help="skip the per-sample-file baseline")
    parser.add_argument("--json", help="write the raw runs here")
    parser.add_argument("--compare", nargs="+", metavar="NAME=PYTHONPATH", default=[],
                        help="also measure other copies of hsdata (a folder holding an hsdata package), their runs "
                        "interleaved with this checkout's, e.g. before=/tmp/hsdata-before")
    args = parser.parse_args()
    args.dir = os.path.abspath(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    versions = dict(item.split("=", 1) for item in args.compare)
    result = {"args": vars(args), "sizes": [measure(args, samples, versions) for samples in args.samples]}
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def measure(args, samples: int, versions: dict[str, str]) -> dict:
    """Build (or reuse) a store and a file tree of ``samples`` samples; every version's runs and the baselines'."""
    key = f"{samples}-{args.writers}-{args.shard_tokens}"
    store_path, files_path = os.path.join(args.dir, f"store-{key}"), os.path.join(args.dir, f"files-{samples}")
    built: dict = {}
    if not (args.reuse and os.path.exists(os.path.join(store_path, ".built"))):
        built["store_build_s"] = build_store(store_path, samples, args.writers, args.shard_tokens)
        open(os.path.join(store_path, ".built"), "w").close()
    if not args.no_files and not (args.reuse and os.path.exists(os.path.join(files_path, ".built"))):
        built["files_build_s"] = build_files(files_path, samples)
        open(os.path.join(files_path, ".built"), "w").close()
    if built:
        print("built:", json.dumps(built), flush=True)

    rng = np.random.default_rng(0)
    probes = os.path.join(args.dir, f"probes-{samples}.json")
    with open(probes, "w") as f:
        json.dump([sample_id(int(i)) for i in rng.integers(0, samples, 1001 + 100_000)], f)
    manifests = len([n for n in os.listdir(os.path.join(store_path, "manifests")) if not n.startswith(".")])
    runs: dict[str, list[dict]] = {}
    for mode in ("cold", "warm"):
        if mode == "warm":  # the untimed pass
            child(CHILD_STORE, store_path, probes)
            for path in versions.values():
                child(CHILD_STORE, store_path, probes, pythonpath=path)
            if not args.no_files:
                child(CHILD_FILES, files_path, "scandir")
        for _ in range(args.runs):  # interleaved
            for what in ("hsdata",) + tuple(versions) + (() if args.no_files else ("scandir", "fsspec find")):
                if mode == "cold":
                    drop_caches()
                if what == "hsdata" or what in versions:
                    result = child(CHILD_STORE, store_path, probes, pythonpath=versions.get(what))
                else:
                    result = child(CHILD_FILES, files_path, "scandir" if what == "scandir" else "find")
                runs.setdefault(f"{mode} {what}", []).append(result)
                print(samples, mode, what, json.dumps(result), flush=True)
    return {"samples": samples, "built": built, "manifests": manifests, "writers": args.writers,
            "shard_tokens": args.shard_tokens, "runs": runs}


def markdown(result: dict) -> str:
    """Medians of each size's runs: hsdata's open and lookups, then the per-sample-file listing baseline."""

    def med(rows: list[dict], name: str) -> float:
        return statistics.median(r[name] for r in rows)

    out = ["| samples | hsdata | mode | open s | open CPU s | first get ms | len us | sample_ids us | lengths.sum ms "
           "| get x1000 ms | index us/id | RSS after open MiB | after first get MiB | at end MiB "
           "| list files s | list / hsdata open | files RSS MiB |",
           "|---:|---|---|" + "---:|" * 14]
    for size in result["sizes"]:
        runs = size["runs"]
        versions = sorted({key.split(" ", 1)[1] for key in runs} - {"scandir", "fsspec find"},
                          key=lambda v: v != "hsdata")
        for version, mode in [(v, m) for v in versions for m in ("cold", "warm")]:
            rows = runs[f"{mode} {version}"]
            n = rows[0]["index_rest_n"]
            files = runs.get(f"{mode} scandir")
            listing = (f"{med(files, 'list_s'):.3f} | {med(files, 'list_s') / med(rows, 'open_s'):.1f} | "
                       f"{med(files, 'rss_mib'):.0f}") if files and version == "hsdata" else " | | "
            out.append(
                f"| {size['samples']:,} | {'this checkout' if version == 'hsdata' else version} | {mode} | "
                f"{med(rows, 'open_s'):.3f} | {med(rows, 'open_cpu_s'):.3f} | {med(rows, 'first_get_s') * 1e3:.1f} | "
                f"{med(rows, 'len_s') * 1e6:.1f} | {med(rows, 'sample_ids_s') * 1e6:.1f} | "
                f"{med(rows, 'lengths_sum_s') * 1e3:.2f} | {med(rows, 'get_1000_s') * 1e3:.0f} | "
                f"{med(rows, 'index_rest_s') / max(n, 1) * 1e6:.2f} | {med(rows, 'rss_open_mib'):.0f} | "
                f"{med(rows, 'rss_first_get_mib'):.0f} | {med(rows, 'rss_end_mib'):.0f} | {listing} |")
    first = result["sizes"][0]
    out += ["", f"{first['writers']} writer parts, shard_tokens {first['shard_tokens']:,}; medians of "
            f"{result['args']['runs']} runs; list files: an `os.scandir` walk of as many empty "
            f"`rows_*/data_*.ckpt` files ({FILES_PER_DIR} per folder), each run in a fresh process."]
    return "\n".join(out)

if __name__ == "__main__":
    main()
