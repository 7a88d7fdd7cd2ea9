"""`hsdata validate` (every chunk crc32c, shard index and per-sample xxh3) vs a raw read of the same files.

Baselines in the same run, cold page cache: every shard file read whole in 64 MiB blocks, by one thread and by
as many threads as validate's workers.

    python benchmarks/validate_bench.py --dir /tmp/hsbench-validate --gib 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hsdata.validate import validate
from read_bench import build, interleaved_times, make_lengths

BLOCK = 64 << 20


def shard_files(store: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(os.path.join(store, "parts"))
            for name in names if not name.endswith(".json")]


def read_whole(path: str) -> int:
    total = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(BLOCK):
            total += len(chunk)
    return total


def read_files(files: list[str], threads: int) -> int:
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read_whole, sorted(files, key=os.path.getsize, reverse=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--gib", type=float, default=6.0)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write results here")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    lengths = make_lengths(np.random.default_rng(0), int(args.gib * 2**30 / (8 * args.hidden + 5)))
    store = build(args.dir, lengths, args.hidden, 3, [None], 0)["stores"][None]
    os.remove(os.path.join(args.dir, "flat.bin"))
    files = shard_files(store)
    nbytes = sum(os.path.getsize(f) for f in files)
    methods = {
        "raw read 1 thread": lambda: read_files(files, 1),
        f"raw read {args.workers} threads": lambda: read_files(files, args.workers),
        f"hsdata validate --workers {args.workers}": lambda: validate(store, workers=args.workers).bytes_checked,
    }
    def check(name, result):
        assert result > 0.99 * nbytes, (name, result, nbytes)

    times = interleaved_times(methods, mode="cold", repeat=args.repeat, check=check)
    print(f"{len(files)} shard files, {nbytes / 1e9:.2f} GB, {len(lengths)} samples; cold page cache, median of "
          f"{args.repeat}")
    base = {name: float(np.median(t)) for name, t in times.items()}
    raw1, rawn = base["raw read 1 thread"], base[f"raw read {args.workers} threads"]
    rows = []
    for name, seconds in base.items():
        print(f"{name:32} {seconds:6.2f} s  {nbytes / 1e9 / seconds:5.2f} GB/s  x raw 1 thread {raw1 / seconds:4.2f}  "
              f"x raw {args.workers} threads {rawn / seconds:4.2f}   (all: {[round(t, 2) for t in times[name]]})")
        rows.append({"method": name, "s": seconds, "GB_per_s": nbytes / 1e9 / seconds, "x_raw_1_thread": raw1 / seconds,
                     f"x_raw_{args.workers}_threads": rawn / seconds, "all_s": times[name]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "files": len(files), "bytes": nbytes, "samples": len(lengths),
                       "mode": "cold", "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
