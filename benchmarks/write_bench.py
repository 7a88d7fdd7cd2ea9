"""The writer against raw writes of the same bytes on the same disk, fsync included, cold page cache.

Methods, each timed from the first byte to durable (fsync) and measured in paired, interleaved rounds (every
round runs every method once, in a rotated order, after ``sync`` and a page-cache drop; outputs are deleted
between passes):
  raw seq   one file, every sample's four tensors appended back to back with write(), one fsync at the end
  raw par   one file per tensor (the layout hsdata writes), one thread per file appending that tensor's rows,
            each file fsynced at the end
  hsdata    hsdata.create(...).add(...) for every sample, then close() (shards, metadata and manifests fsynced)
The bar is hsdata against the best raw mode of the same round.

With ``--writers N`` (N > 1) the same bytes are split over N processes: N hsdata writers joining one store
against N raw processes (each raw process writes its share in the best single-process raw layout of that
round's raw passes: one stream, or one file per tensor on threads). Processes build their samples first, wait
on a barrier, and the time is from the barrier to the last process done. Every process first writes two
16-token samples the same way, untimed, as the single-writer passes run in a process that already wrote: a
writer lives for hours, so its first use in a process (imports, thread start-up) is not the write path. Variant
``cold`` (N > 1 only) skips that for hsdata, to show what it costs.

    python benchmarks/write_bench.py --dir /tmp/hswrite --gib 2
    python benchmarks/write_bench.py --dir /mnt/nvme/hswrite --gib 8 --hidden 4096 7168 --writers 1 2 4 \
        --json benchmarks/results/write_bench_h200.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import threading
import time

import numpy as np
import torch

import hsdata
import hsdata.io.storage

TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
COMPRESSED = ("zstd", "lz4")  # variants writing a compressed store (hsdata.create(..., compression=...))
COMPRESSED_METHODS = tuple(f"hsdata{before} {name}" for before in ("", " before") for name in COMPRESSED)
WARM_UP_LENGTHS = [16, 16]  # samples each process (and the single-writer driver) writes before it is timed

# sample-length mixes: (name, draw(rng) -> tokens)
MIXES = {
    "chat": lambda rng: int(np.clip(rng.lognormal(np.log(900), 0.8), 32, 8192)),  # ShareGPT-like
    "long": lambda rng: int(rng.integers(4096, 16385)),  # long-context extraction
    "short": lambda rng: int(np.clip(rng.lognormal(np.log(64), 0.7), 4, 512)),  # many small samples
}


def make_lengths(mix: str, token_budget: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    total = 0
    while total < token_budget:
        lengths.append(MIXES[mix](rng))
        total += lengths[-1]
    return lengths


def make_samples(lengths: list[int], hidden: int, layers: int, seed: int,
                 values: str = "bits") -> list[dict[str, torch.Tensor]]:
    """bf16 torch tensors as an engine hands them over: slices of one random pool (so the pool, not every
    sample, is resident), ids and masks of their own. ``values``: "bits", uniformly random bit patterns
    (incompressible); "normal", N(0, 1) rounded to bf16 (the zstd preset stores 0.67 of it, as it does a
    random-weight model's states; a trained model's compress to 0.68-0.69, benchmarks/compression_bench.py)."""
    rng = np.random.default_rng(seed)
    widest = max(lengths) * layers * hidden
    if values == "normal":
        pool = torch.from_numpy(rng.standard_normal(2 * widest, dtype=np.float32)).to(torch.bfloat16)
    else:
        pool = torch.from_numpy(rng.integers(0, 2**16, 2 * widest, dtype=np.uint16)).view(torch.bfloat16)
    samples = []
    for n in lengths:
        def block(width: int, n: int = n) -> torch.Tensor:
            start = int(rng.integers(0, len(pool) - n * width))
            return pool[start : start + n * width].view(n, width)

        samples.append({
            "input_ids": torch.from_numpy(rng.integers(0, 160_000, n, dtype=np.int32)),
            "loss_mask": torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8)),
            "aux_hidden_states": block(layers * hidden),
            "hidden_states": block(hidden),
        })
    return samples


def stored_bytes(value: torch.Tensor) -> memoryview:
    return memoryview(value.contiguous().view(torch.uint8).numpy()).cast("B")


def sample_nbytes(sample: dict) -> int:
    return sum(stored_bytes(sample[name]).nbytes for name in TENSORS)


def raw_seq(directory: str, samples: list[dict]) -> None:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "flat.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for sample in samples:
            for name in TENSORS:
                _write_all(fd, stored_bytes(sample[name]))
        os.fsync(fd)
    finally:
        os.close(fd)
    hsdata.io.storage.fsync_dir(directory)


def raw_par(directory: str, samples: list[dict]) -> None:
    os.makedirs(directory, exist_ok=True)
    errors: list[BaseException] = []

    def stream(name: str) -> None:
        try:
            fd = os.open(os.path.join(directory, f"{name}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for sample in samples:
                    _write_all(fd, stored_bytes(sample[name]))
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(name,)) for name in TENSORS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    hsdata.io.storage.fsync_dir(directory)


def hsdata_module(method: str, before: str | None):
    """The package a method writes with: ``hsdata``, or for "hsdata before" (and "hsdata before zstd", ...) an
    older copy of it (a folder holding the package renamed ``hsdata_old``, e.g. ``git archive HEAD hsdata``), for
    a same-run comparison."""
    if method.startswith("hsdata before"):
        import importlib
        import sys
        if before not in sys.path:
            sys.path.insert(0, before)
        return importlib.import_module("hsdata_old")
    return hsdata


def write_hsdata(directory: str, samples: list[dict], hidden: int, layers: int, prefix: str = "s",
                 package=hsdata, method: str = "hsdata") -> None:
    saved = hsdata.io.storage.WRITEBACK_BYTES
    if method == "hsdata no-wb":  # ablation: no early writeback (sync_file_range) of the files being written
        hsdata.io.storage.WRITEBACK_BYTES = 1 << 62
    elif method.startswith("hsdata wb-"):  # the early writeback started every N MiB instead
        hsdata.io.storage.WRITEBACK_BYTES = int(method.removeprefix("hsdata wb-")) << 20
    compression = method.split()[-1] if method in COMPRESSED_METHODS else None
    try:
        with package.create(directory, hidden_size=hidden, aux_layers=list(range(1, layers + 1)), model="bench",
                            compression=compression) as w:
            for i, sample in enumerate(samples):
                w.add(f"{prefix}{i:07d}", **sample)
    finally:
        hsdata.io.storage.WRITEBACK_BYTES = saved


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data) :]


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def clear(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def warm_up(write, directory: str, hidden: int, layers: int, seed: int, values: str) -> None:
    """A writer lives for hours: its first use in a process (imports, threads) is not the write path."""
    write(directory, make_samples(WARM_UP_LENGTHS, hidden, layers, seed, values))
    shutil.rmtree(directory)


# ---- N processes ------------------------------------------------------------------------------------------

def _worker(method: str, directory: str, lengths, hidden, layers, seed, values, rank, barrier, results,
            before) -> None:
    samples = make_samples(lengths, hidden, layers, seed + 1000 * (rank + 1), values)
    if method.startswith("hsdata"):
        package = hsdata_module(method, before)
        write = lambda into, some: write_hsdata(into, some, hidden, layers, prefix=f"w{rank}-", package=package,
                                                method=method)
    else:
        write = lambda into, some: (raw_seq if method == "raw seq" else raw_par)(os.path.join(into, f"w{rank}"),
                                                                               some)
    if method != "hsdata cold":  # paid before the barrier, as the single-writer passes have it paid
        warm_up(write, f"{directory}.warm{rank}", hidden, layers, seed, values)
    barrier.wait()
    started = time.time()
    write(directory, samples)
    results.put((rank, started, time.time()))


def run_processes(method: str, directory: str, shares: list[list[int]], hidden: int, layers: int, seed: int,
                  values: str, before: str | None) -> float:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(shares))
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(method, directory, lengths, hidden, layers, seed, values, rank,
                                               barrier, results, before)) for rank, lengths in enumerate(shares)]
    for p in procs:
        p.start()
    got = []
    while len(got) < len(procs):  # a worker that dies leaves the others at the barrier: stop them all
        try:
            got.append(results.get(timeout=1))
        except queue.Empty:
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode]
            if failed:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{method}: writer process {failed[0][0]} exited with code {failed[0][1]}")
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{method} worker failed with exit code {p.exitcode}")
    return max(end for _, _, end in got) - min(start for _, start, _ in got)


# ---- driver -----------------------------------------------------------------------------------------------

def token_bytes(hidden: int, layers: int) -> int:
    return 2 * hidden * (layers + 1) + 5


def lengths_of(args, mix: str, hidden: int) -> list[int]:
    """The sample lengths of one measurement: ``--gib`` of the mix at this width."""
    return make_lengths(mix, int(args.gib * 2**30 / token_bytes(hidden, args.layers)), args.seed)


def measure(args, mix: str, hidden: int, writers: int) -> dict:
    lengths = lengths_of(args, mix, hidden)
    scratch = os.path.join(args.dir, "out")
    methods = ["raw seq", "raw par", "hsdata"] + (["hsdata before"] if args.before else []) + \
        [f"hsdata {v}" for v in args.variants] + \
        [f"hsdata before {v}" for v in args.variants if args.before and v in COMPRESSED]
    times: dict[str, list[float]] = {m: [] for m in methods}
    disk: dict[str, int] = {}  # bytes on disk of each hsdata method's store
    if writers == 1:
        samples = make_samples(lengths, hidden, args.layers, args.seed, args.values)
        nbytes = sum(sample_nbytes(s) for s in samples)
        run = {"raw seq": lambda: raw_seq(scratch, samples), "raw par": lambda: raw_par(scratch, samples)}
        for m in methods[2:]:
            run[m] = lambda m=m: write_hsdata(scratch, samples, hidden, args.layers,
                                              package=hsdata_module(m, args.before), method=m)
    else:
        shares = [lengths[r::writers] for r in range(writers)]
        nbytes = sum(n * token_bytes(hidden, args.layers) for n in lengths)
        run = {m: (lambda m=m: run_processes(m, scratch, shares, hidden, args.layers, args.seed, args.values,
                                             args.before))
               for m in methods}
    clear(scratch)
    drop_caches()
    run["raw par"]()  # untimed: the first pass after a large delete is often slow on a discard-mounted disk
    if writers == 1:  # each writer's first use in this process, untimed (as in each process of N, _worker)
        for m in methods[2:]:
            write = lambda into, some, m=m: write_hsdata(into, some, hidden, args.layers,
                                                         package=hsdata_module(m, args.before), method=m)
            warm_up(write, scratch + ".warm", hidden, args.layers, args.seed, args.values)
    for r in range(args.repeat):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for m in order:
            clear(scratch)
            drop_caches()
            started = time.perf_counter()
            inner = run[m]()
            elapsed = time.perf_counter() - started
            times[m].append(inner if writers > 1 else elapsed)  # N processes: barrier to the last one done
            if m.startswith("hsdata"):
                disk[m] = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(scratch) for f in files)
    clear(scratch)
    med = {m: statistics.median(t) for m, t in times.items()}
    best_raw = min(med["raw seq"], med["raw par"])
    paired = [min(times["raw seq"][i], times["raw par"][i]) / times["hsdata"][i] for i in range(args.repeat)]
    row = {"mix": mix, "hidden": hidden, "writers": writers, "samples": len(lengths), "tokens": sum(lengths),
           "bytes": nbytes, "times": times, "median_s": med, "disk_bytes": disk, "values": args.values,
           "gbps": {m: nbytes / s / 1e9 for m, s in med.items()},
           "hsdata_x_best_raw": best_raw / med["hsdata"], "paired_ratios": paired,
           "x_best_raw": {m: best_raw / med[m] for m in methods}}
    print(f"{mix:6s} H={hidden} writers={writers} {len(lengths):>7,} samples {nbytes / 1e9:.2f} GB | "
          + " | ".join(f"{m} {med[m]:.2f} s {row['gbps'][m]:.2f} GB/s ({row['x_best_raw'][m]:.2f}x)" for m in methods)
          + f" | hsdata x best raw {row['hsdata_x_best_raw']:.3f} (paired {', '.join(f'{p:.2f}' for p in paired)})",
          flush=True)
    return row


def markdown(result: dict) -> str:
    """Each configuration's GB/s by method and the writer's ratio to the faster raw mode (medians, and per round)."""
    methods = list(result["results"][0]["gbps"]) if result["results"] else []
    out = ["| mix | H | writers | GB | " + " | ".join(f"{m} GB/s" for m in methods)
           + " | **hsdata x best raw** | paired per round |",
           "|---|---:|---:|---:|" + "---:|" * len(methods) + "---:|---|"]
    for row in result["results"]:
        out.append(f"| {row['mix']} | {row['hidden']} | {row['writers']} | {row['bytes'] / 1e9:.2f} | "
                   + " | ".join(f"{row['gbps'][m]:.2f}" for m in methods)
                   + f" | **{row['hsdata_x_best_raw']:.2f}** | {', '.join(f'{p:.2f}' for p in row['paired_ratios'])} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory on the disk to measure (emptied)")
    parser.add_argument("--gib", type=float, default=2.0, help="payload per measurement")
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    parser.add_argument("--layers", type=int, default=3, help="aux layers (EAGLE-3: 3)")
    parser.add_argument("--mix", nargs="+", default=["chat", "long"], choices=sorted(MIXES))
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2], help="writer processes")
    parser.add_argument("--repeat", type=int, default=3, help="paired rounds; medians are reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--before", help="folder holding an older hsdata as package hsdata_old: adds method "
                        "'hsdata before', and 'hsdata before zstd' with variant zstd (and so on) (git archive HEAD "
                        "hsdata | tar -x -C DIR; mv DIR/hsdata DIR/hsdata_old)")
    parser.add_argument("--values", choices=["bits", "normal"], default="bits",
                        help="sample values: random bit patterns (incompressible), or N(0, 1) in bf16 (make_samples)")
    parser.add_argument("--variants", nargs="*", default=[], choices=["no-wb", "wb-8", "wb-128", "wb-512", "cold",
                                                                      *COMPRESSED],
                        help="ablations: no-wb = without early writeback (sync_file_range), wb-N = started every "
                        "N MiB (default 32); zstd, lz4 = a compressed store (with --values normal); cold = each "
                        "writer process times its first use (--writers N > 1 only)")
    parser.add_argument("--json", help="also write results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("cold passes drop the page cache: run as root")
    if "cold" in args.variants and 1 in args.writers:
        parser.error("variant cold times a fresh writer process: use it with --writers N > 1 only")
    if os.path.realpath(args.dir).startswith("/dev/shm"):
        parser.error("--dir must be on the disk to measure, not tmpfs")
    for mix in args.mix:
        for hidden in args.hidden:
            samples = len(lengths_of(args, mix, hidden))
            if samples < max(args.writers):
                parser.error(f"the {mix} mix at --gib {args.gib} and H = {hidden} is {samples} sample(s), fewer "
                             f"than {max(args.writers)} writers: raise --gib")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    rows = [measure(args, mix, hidden, writers) for writers in args.writers for hidden in args.hidden
            for mix in args.mix]
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
