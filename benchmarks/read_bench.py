"""Random-order sample reads from an hsdata store vs the same bytes read raw and through plain zarr-python.

Baselines, measured in the same run on the same samples in the same order:
  raw pread   one flat file holding every sample's tensors back to back; one pread per tensor per sample
  zarr-python the store's own arrays sliced with zarr.open_group(...)[...][offset:offset + length]
Cold passes drop the page cache first (needs root); warm passes follow an untimed pass over the same data.

    python benchmarks/read_bench.py --dir /tmp/hsbench --gib 6
    python benchmarks/read_bench.py --dir /tmp/hsbench --gib 2 --chunk-tokens 8 16 32 64 128 256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch
import zarr

import hsdata
from hsdata.layout import array_node
from hsdata.shard import token_ranges

TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")


def make_lengths(rng, token_budget: int) -> list[int]:
    lengths = []
    while sum(lengths) < token_budget:
        lengths.append(int(np.clip(rng.lognormal(np.log(900), 0.8), 32, 8192)))
    return lengths


def sample_arrays(pool: np.ndarray, rng, length: int, hidden: int, layers: int) -> dict[str, torch.Tensor]:
    def block(width: int) -> torch.Tensor:
        start = int(rng.integers(0, len(pool) - length * width))
        return torch.from_numpy(pool[start : start + length * width]).view(torch.bfloat16).view(length, width)

    return {
        "input_ids": torch.from_numpy(rng.integers(0, 160_000, length, dtype=np.int32)),
        "loss_mask": torch.from_numpy(rng.integers(0, 2, length, dtype=np.uint8)),
        "aux_hidden_states": block(layers * hidden),
        "hidden_states": block(hidden),
    }


def stored_bytes(value: torch.Tensor) -> memoryview:
    return memoryview(value.contiguous().view(torch.uint8).numpy()).cast("B")


def build(root: str, lengths: list[int], hidden: int, layers: int, chunk_tokens_list, seed: int) -> dict:
    """Write one store per chunk size and one flat file with the same bytes; returns paths, ranges, write times."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**16, 2 * max(lengths) * layers * hidden, dtype=np.uint16)  # samples are slices of it
    samples = [sample_arrays(pool, rng, n, hidden, layers) for n in lengths]
    flat_path = os.path.join(root, "flat.bin")
    ranges, position = [], 0
    t0 = time.perf_counter()
    with open(flat_path, "wb") as f:
        for sample in samples:
            row = {}
            for name in TENSORS:
                data = stored_bytes(sample[name])
                row[name] = (position, data.nbytes)
                f.write(data)
                position += data.nbytes
            ranges.append(row)
        f.flush()
        os.fsync(f.fileno())
    write_s = {"raw": time.perf_counter() - t0}
    stores = {}
    for ct in chunk_tokens_list:
        path = os.path.join(root, f"store-ct{ct}")
        t0 = time.perf_counter()
        with hsdata.create(path, hidden_size=hidden, aux_layers=list(range(1, layers + 1)), model="bench",
                           chunk_tokens=ct) as w:
            for i, sample in enumerate(samples):
                w.add(f"s{i:06d}", **sample)
        write_s[f"hsdata ct={ct}"] = time.perf_counter() - t0
        stores[ct] = path
    return {"flat": flat_path, "ranges": ranges, "stores": stores, "write_s": write_s, "bytes": position}


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def throttle_reads(path: str, bytes_per_s: int) -> None:
    """Cap reads from the disk holding ``path`` at ``bytes_per_s`` for this process and the processes it starts
    (a cgroup's block I/O throttle, v1 ``blkio`` or v2 ``io``; needs root): a slower disk on the same machine."""
    if os.geteuid() != 0:
        raise SystemExit("cannot throttle reads: a cgroup's I/O limit needs root")
    st = os.stat(path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if os.path.exists(f"/sys/dev/block/{device}/partition"):  # throttles apply to whole disks
        device = Path(f"/sys/dev/block/{device}/../dev").read_text().strip()
    v1, v2 = "/sys/fs/cgroup/blkio", "/sys/fs/cgroup"
    if os.path.isdir(v1):
        group, limit = os.path.join(v1, "hsbench"), ("blkio.throttle.read_bps_device", f"{device} {bytes_per_s}")
    elif "io" in Path(v2, "cgroup.controllers").read_text().split():
        with open(os.path.join(v2, "cgroup.subtree_control"), "w") as f:
            f.write("+io")
        group, limit = os.path.join(v2, "hsbench"), ("io.max", f"{device} rbps={bytes_per_s}")
    else:
        raise SystemExit("cannot throttle reads: no cgroup v1 blkio hierarchy and no v2 io controller")
    os.makedirs(group, exist_ok=True)
    with open(os.path.join(group, limit[0]), "w") as f:
        f.write(limit[1])
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def interleaved_times(methods: dict, *, mode: str, repeat: int, check=None) -> dict[str, list[float]]:
    """Seconds of each ``methods[name]()`` over ``repeat`` interleaved passes (so drifts of the machine hit
    every method alike). ``cold`` drops the page cache before each pass, ``warm`` runs an untimed pass first;
    ``check(name, result)`` sees what each timed pass returned."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeat):
        for name, run in methods.items():
            if mode == "cold":
                drop_caches()
            else:
                run()
            started = time.perf_counter()
            result = run()
            times[name].append(time.perf_counter() - started)
            if check is not None:
                check(name, result)
    return times


def read_raw(flat: str, ranges: list[dict], order) -> int:
    fd = os.open(flat, os.O_RDONLY)
    total = 0
    try:
        for i in order:
            for offset, nbytes in ranges[i].values():
                buf = np.empty(nbytes, np.uint8)
                total += os.preadv(fd, [buf], offset)
    finally:
        os.close(fd)
    return total


def read_raw_parallel(flat: str, ranges: list[dict], order, threads: int, range_bytes: int) -> int:
    """The same ranges cut into pieces of ``range_bytes`` read by ``threads`` threads, sample after sample."""
    fd = os.open(flat, os.O_RDONLY)
    total = 0

    def pread(buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    try:
        with ThreadPoolExecutor(threads) as pool:
            for i in order:
                futures = []
                for offset, nbytes in ranges[i].values():
                    buf = memoryview(np.empty(nbytes, np.uint8))
                    for start in range(0, nbytes, range_bytes):
                        futures.append(pool.submit(pread, buf[start : start + range_bytes], offset + start))
                total += sum(f.result() for f in futures)
    finally:
        os.close(fd)
    return total


def read_hsdata(path: str, order, threads: int, range_bytes: int) -> int:
    store = hsdata.open(path, concurrency=threads, range_bytes=range_bytes)
    total = 0
    for i in order:
        sample = store[int(i)]
        total += len(sample["input_ids"]) * store.spec.token_nbytes
    store.close()
    return total


def read_zarr(path: str, order) -> int:
    store = hsdata.open(path)
    root = zarr.open_group(path, mode="r")
    arrays = {}
    total = 0
    for i in order:
        part, offset, length = store.location(int(i))
        for tensor in store.spec.tensors:
            key = array_node(part, tensor)
            if key not in arrays:
                arrays[key] = root[key]
            total += arrays[key][offset : offset + length].nbytes
    return total


def ranges_per_sample(path: str) -> float:
    store = hsdata.open(path)
    counts = [sum(len(token_ranges(store.spec, t, *store.location(i)[1:])) for t in store.spec.tensors)
              for i in range(len(store))]
    return float(np.mean(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied)")
    parser.add_argument("--gib", type=float, default=6.0, help="payload size")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[None])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=hsdata.reader.LOCAL_CONCURRENCY)
    parser.add_argument("--range-mib", type=int, default=hsdata.reader.DEFAULT_RANGE_BYTES >> 20)
    parser.add_argument("--repeat", type=int, default=3, help="passes per method and mode; the median is reported")
    parser.add_argument("--skip-zarr", action="store_true")
    parser.add_argument("--json", help="also write results here")
    args = parser.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    token_nbytes = 2 * args.hidden * (args.layers + 1) + 5
    lengths = make_lengths(np.random.default_rng(args.seed), int(args.gib * 2**30 / token_nbytes))
    chunk_list = args.chunk_tokens
    built = build(args.dir, lengths, args.hidden, args.layers, chunk_list, args.seed)
    order = np.random.default_rng(args.seed + 1).permutation(len(lengths))
    gb = built["bytes"] / 1e9
    print(f"{len(lengths)} samples, {sum(lengths)} tokens, {gb:.2f} GB, hidden {args.hidden}, "
          f"mean {np.mean(lengths):.0f} tokens/sample")
    print("write seconds:", {k: round(v, 2) for k, v in built["write_s"].items()})
    can_drop = os.geteuid() == 0
    results = []
    for mode in ("cold", "warm") if can_drop else ("warm",):
        io = (args.threads, args.range_mib << 20)
        methods = [("raw pread", read_raw, (built["flat"], built["ranges"], order)),
                   (f"raw pread {args.threads} thr", read_raw_parallel, (built["flat"], built["ranges"], order, *io))]
        for ct, path in built["stores"].items():
            methods.append((f"hsdata ct={ct}", read_hsdata, (path, order, *io)))
            if not args.skip_zarr:
                methods.append((f"zarr-python ct={ct}", read_zarr, (path, order)))
        def check(name, nbytes):
            assert nbytes == built["bytes"], (name, nbytes, built["bytes"])

        times = interleaved_times({name: partial(fn, *fargs) for name, fn, fargs in methods}, mode=mode,
                                  repeat=args.repeat, check=check)
        for name, samples in times.items():
            seconds = float(np.median(samples))
            results.append({"mode": mode, "method": name, "seconds": seconds, "gb_per_s": gb / seconds,
                            "all_seconds": samples})
        raw = {r["method"]: r["seconds"] for r in results if r["mode"] == mode and r["method"].startswith("raw")}
        for r in results:
            if r["mode"] == mode:
                r["vs_raw"] = raw["raw pread"] / r["seconds"]
                r["vs_raw_same_threads"] = raw[f"raw pread {args.threads} thr"] / r["seconds"]
    print(f"{'mode':5} {'method':24} {'seconds':>8} {'GB/s':>6} {'x raw':>6} {'x raw same threads':>18}")
    for r in results:
        print(f"{r['mode']:5} {r['method']:24} {r['seconds']:8.2f} {r['gb_per_s']:6.2f} {r['vs_raw']:6.2f} "
              f"{r['vs_raw_same_threads']:18.2f}")
    for ct, path in built["stores"].items():
        spec = hsdata.open(path).spec
        chunks = {t.name: t.chunk_tokens for t in spec.tensors}
        print(f"ct={ct}: chunk_tokens {chunks}, shard_tokens {spec.shard_tokens}, "
              f"range reads per sample {ranges_per_sample(path):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "write_s": built["write_s"], "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
