"""The training read path: epochs delivered to the GPU (or host memory without CUDA) by hsdata's Loader and by a
plain DataLoader with collate_eagle3, against raw reads of the same bytes, hsdata's own ``store[i]`` on all
cores, and the formats users pick instead (per-sample safetensors and ``torch.save`` files, MDS, LitData), all
on the same samples in one run.

Every pass reads every sample once in a shuffled order (``ShardAwareSampler`` for hsdata; the same order for the
per-sample files; MDS and LitData shuffle with their own loaders), batch size 1 unless a row says 4 (padded).
"To the GPU": each batch's tensors arrive on the GPU and the loop waits for them (the current stream is
synchronized per batch; hsdata's Loader copies on its side stream, the others use ``.cuda(non_blocking=True)``
from ``DataLoader(pin_memory=True)``). Without CUDA every reader's states are touched once per 4 KiB page. Figures
are GB/s of the samples' states (padding not counted) and ratios against baselines of the same run:

  raw ranges   the samples' byte ranges cut at 8 MiB, read by --threads threads into reused (pinned) buffers
               and copied to the GPU: the physical limit, also cold
  raw files    every shard file read from start to end with 8 MiB reads on --threads threads (the kernel's
               read-ahead), same bytes plus chunk checksums
  store[i]     hsdata.open(path, concurrency=--threads) read by --threads threads, one sample each, host memory

Sections (``--parts``): ``warm`` and ``cold`` (page cache dropped before each pass; needs root), ``ranks`` (--ranks
processes, each its sampler's share of one epoch, host delivery, together) and ``consumer`` (a GPU step of fixed
cost per token sized to --tokens-per-s: the share of time the GPU waits for data); with --compression, each also
reads the compressed store. Medians over --repeat interleaved passes; warm passes follow untimed ones, and every
reader is made once and reused, as a training job reuses its loader. ``--read-gbps`` caps the run's disk reads (a
cgroup throttle): the same machine with a slower disk.

    python benchmarks/loader_bench.py --dir /tmp/hsbench-loader --gib 1 --hidden 4096 --workers 2
    python benchmarks/loader_bench.py --dir /tmp/hsbench-loader --gib 6 --workers 8 --parts warm cold ranks consumer
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch
from torch.utils.data import DataLoader

import hsdata
from formats_bench import (LAYERS, SpeculatorsDir, make_samples, write_hsdata, write_litdata, write_mds,
                           write_specforge, write_speculators)
from dataset_bench import TorchSaveDir
from read_bench import drop_caches, interleaved_times, make_lengths, throttle_reads
from hsdata.layout import shard_key
from hsdata.shard import token_ranges
from hsdata.torch import Eagle3Dataset, Loader, ShardAwareSampler, collate_eagle3, decoding


RANGE = 8 << 20
FORMATS = ("safetensors", "torch.save", "mds", "litdata")
STARTED = time.perf_counter()
GPU = torch.cuda.is_available()


def log(message: str) -> None:
    print(f"[loader_bench {time.perf_counter() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---- delivering a batch: to the GPU, or (host) touching each page of its states ----

STATES = ("aux_hidden_states", "hidden_states", "aux_hidden_state", "hidden_state", "target",
          "base_model_outputs")


def deliver(batch) -> None:
    if GPU:
        moved = _to_gpu(batch)
        torch.cuda.current_stream().synchronize()
        del moved
    else:
        _touch(batch)


def _to_gpu(value):
    if isinstance(value, torch.Tensor):
        return value if value.is_cuda else value.cuda(non_blocking=True)
    if isinstance(value, dict):
        return {k: _to_gpu(v) for k, v in value.items()}
    return value


def _touch(value) -> None:
    if isinstance(value, dict):
        for key, v in value.items():
            if key in STATES:
                _touch(v)
    elif isinstance(value, torch.Tensor) and value.numel():
        value.reshape(-1).view(torch.uint8)[::4096].sum()


def epoch(batches) -> int:
    """Run ``batches`` to the end, delivering each; the number of batches."""
    count = 0
    for batch in batches:
        deliver(batch)
        count += 1
    if GPU:
        torch.cuda.synchronize()
    return count


# ---- baselines ----

class RawRanges:
    """The samples' byte ranges (each tensor's, per shard, cut at 8 MiB) read by ``threads`` threads into reused
    buffers (pinned with CUDA), each copied to the GPU on its thread's stream."""

    def __init__(self, store_path: str, order, threads: int, whole_files: bool = False):
        store = hsdata.open(store_path)
        self.root, self.threads = store_path, threads
        if whole_files:
            files = sorted({os.path.join(store_path, shard_key(store.location(i)[0], t, s))
                            for i in range(len(store)) for t in store.spec.tensors
                            for s in {r.shard for r in token_ranges(store.spec, t, *store.location(i)[1:])}})
            self.jobs = [[(path, start, min(RANGE, os.path.getsize(path) - start))
                          for start in range(0, os.path.getsize(path), RANGE)] for path in files]
        else:
            ranges = []
            for i in order:
                part, offset, length = store.location(int(i))
                for t in store.spec.tensors:
                    for r in token_ranges(store.spec, t, offset, length):
                        path = os.path.join(store_path, shard_key(part, t, r.shard))
                        for start in range(r.file_start, r.file_end, RANGE):
                            ranges.append((path, start, min(RANGE, r.file_end - start)))
            self.jobs = [[job] for job in ranges]
        self.nbytes = sum(n for job in self.jobs for _, _, n in job)
        self._buffers = [torch.empty(RANGE, dtype=torch.uint8, pin_memory=GPU) for _ in range(threads)]
        self._streams = [torch.cuda.Stream() for _ in range(threads)] if GPU else None
        self._gpu = [torch.empty(RANGE, dtype=torch.uint8, device="cuda") for _ in range(threads)] if GPU else None

    def __call__(self) -> int:
        fds: dict[str, int] = {}
        for path in {p for job in self.jobs for p, _, _ in job}:
            fds[path] = os.open(path, os.O_RDONLY)
        slots = list(range(self.threads))
        lock = threading.Lock()

        def run(job) -> int:
            with lock:
                slot = slots.pop()
            try:
                total = 0
                for path, start, n in job:
                    view = self._buffers[slot][:n]
                    got = os.preadv(fds[path], [memoryview(view.numpy())], start)
                    if GPU:
                        with torch.cuda.stream(self._streams[slot]):
                            self._gpu[slot][:n].copy_(view, non_blocking=True)
                        self._streams[slot].synchronize()
                    total += got
                return total
            finally:
                with lock:
                    slots.append(slot)

        try:
            with ThreadPoolExecutor(self.threads) as pool:
                return sum(pool.map(run, self.jobs))
        finally:
            for fd in fds.values():
                os.close(fd)


def store_threads(store, order, threads: int) -> int:
    with ThreadPoolExecutor(threads) as pool:
        return sum(1 for _ in pool.map(lambda i: store[int(i)], order))


# ---- hsdata's readers, made once and reused ----

def write_fp8(root: str, samples) -> None:
    with hsdata.create(root, hidden_size=samples[0]["hidden_states"].shape[1], aux_layers=[1, 2, 3], model="bench",
                       dtype="float8_e4m3fn") as w:
        for i, s in enumerate(samples):
            finite = {k: v.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) if v.is_floating_point() else v
                      for k, v in s.items()}
            w.add(f"s{i:06d}", **finite)


def hsdata_loader(path: str, threads: int, workers: int, batch: int, verify: bool, device,
                  decode: str = "host") -> tuple:
    dataset = Eagle3Dataset(path, verify=verify)
    sampler = ShardAwareSampler(dataset, seed=0)
    loader = Loader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, threads=threads,
                    multiprocessing_context="fork" if workers else None, persistent_workers=workers > 0,
                    device=device, decode=decode)
    return loader


def hsdata_dataloader(path: str, workers: int, batch: int) -> DataLoader:
    dataset = Eagle3Dataset(path)
    return DataLoader(dataset, batch_size=batch, sampler=ShardAwareSampler(dataset, seed=0),
                      collate_fn=collate_eagle3, num_workers=workers, pin_memory=GPU,
                      multiprocessing_context="fork" if workers else None, persistent_workers=workers > 0)


def map_loader(dataset, order, workers: int) -> DataLoader:
    return DataLoader(dataset, batch_size=None, sampler=[int(i) for i in order], num_workers=workers,
                      pin_memory=GPU, multiprocessing_context="fork" if workers else None,
                      persistent_workers=workers > 0)


def mds_loader(root: str, workers: int):
    import streaming

    ds = streaming.StreamingDataset(local=root, remote=None, shuffle=True, batch_size=1)
    return streaming.StreamingDataLoader(ds, batch_size=1, num_workers=workers, pin_memory=GPU,
                                         persistent_workers=workers > 0)


def litdata_loader(root: str, workers: int):
    import litdata

    ds = litdata.StreamingDataset(root, shuffle=True)
    return litdata.StreamingDataLoader(ds, batch_size=1, num_workers=workers, pin_memory=GPU)


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


# ---- running methods ----

def measure(methods: dict, *, mode: str, repeat: int, only: str = "") -> dict[str, list[float]]:
    """Seconds per pass of each method, interleaved (``read_bench.interleaved_times``: cold, the page cache dropped
    before each pass; warm, each pass right after an untimed one, as a VM's memory manager may drop pages left
    idle for seconds). Each method first runs one untimed pass: it sizes its reader's memory and starts its
    workers, which a training job does once, not each epoch. ``only``: a regular expression of the names to run."""
    methods = {name: run for name, run in methods.items() if re.search(only, name)}
    for name, run in methods.items():
        log(f"first pass: {name}")
        run()
    return interleaved_times(methods, mode=mode, repeat=repeat,
                             check=lambda name, _: log(f"{mode} pass done: {name}"))


def rows(times: dict[str, list[float]], gb: float, baselines: dict[str, str]) -> list[dict]:
    """Each method's median seconds and GB/s, x each baseline's median; a compressed store's Loader also x the
    uncompressed one at the same workers and batch (``x_uncompressed``: the median of the rounds' ratios, each
    pair read in the same round)."""
    out = []
    for name, t in times.items():
        row = {"method": name, "seconds": float(np.median(t)), "all_seconds": t, "gb_per_s": gb / float(np.median(t))}
        for label, base in baselines.items():
            if base in times:
                row[label] = float(np.median(times[base])) / row["seconds"]
        uncompressed = re.sub(r"^Loader (zstd|lz4)( GPU decode)?,", "Loader,", name)
        if uncompressed != name and uncompressed in times:
            row["x_uncompressed"] = float(np.median(np.array(times[uncompressed]) / np.array(t)))
        out.append(row)
    return out


def _rank_epoch(path: str, rank: int, world: int, threads: int, barrier, results) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dataset = Eagle3Dataset(path)
    sampler = ShardAwareSampler(dataset, seed=0, rank=rank, world_size=world, drop_last=True)
    loader = Loader(dataset, batch_size=1, sampler=sampler, threads=threads)
    nbytes = int(dataset.lengths[list(sampler)].sum()) * dataset.store.spec.token_nbytes
    for _ in range(int(os.environ.get("HSBENCH_WARM", "1"))):
        for batch in loader:
            _touch(batch)
    barrier.wait()
    started = time.perf_counter()
    for batch in loader:
        _touch(batch)
    results.put((rank, started, time.perf_counter(), nbytes))


def ranks(path: str, world: int, threads: int, cold: bool) -> dict:
    """``world`` processes, each its sampler's share (Loader, threads each), host memory; GB/s together."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(world + 1), context.Queue()
    os.environ["HSBENCH_WARM"] = "0" if cold else "1"
    procs = [context.Process(target=_rank_epoch, args=(path, r, world, threads, barrier, results))
             for r in range(world)]
    for p in procs:
        p.start()
    if cold:
        drop_caches()
    barrier.wait()
    done = [results.get() for _ in procs]
    for p in procs:
        p.join()
    start, end = min(d[1] for d in done), max(d[2] for d in done)
    nbytes = sum(d[3] for d in done)
    return {"ranks": world, "threads_each": threads, "mode": "cold" if cold else "warm", "seconds": end - start,
            "gb_per_s": nbytes / (end - start) / 1e9}


def rank_rows(stores: dict[str, str], world: int, threads: int, repeat: int) -> list[dict]:
    """:func:`ranks` over each store (name -> path), warm then cold, ``repeat`` interleaved rounds: each store's
    median, and a compressed store's ``x_uncompressed`` (the median of the rounds' ratios, each pair read in the
    same round; decoded by each rank's read threads)."""
    out = []
    for cold in (False, True):
        passes = collections.defaultdict(list)
        for _ in range(repeat):
            for name, path in stores.items():
                passes[name].append(ranks(path, world, threads, cold))
                log(f"ranks: {name}: {passes[name][-1]}")
        for name, runs in passes.items():
            row = {"store": name, **sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2],
                   "all_seconds": [r["seconds"] for r in runs]}
            if name != "uncompressed":
                row["x_uncompressed"] = float(np.median([a["seconds"] / b["seconds"] for a, b in
                                                         zip(passes["uncompressed"], runs)]))
            out.append(row)
    return out


def consumer(loader, token_nbytes: int, tokens_per_s: float) -> dict:
    """A GPU step of fixed cost per token (torch.cuda._sleep, calibrated), synchronized at its end as a step that
    logs its loss is: the share of the epoch's wall time the GPU was not running a step (each step timed on the
    GPU by a pair of events: the calibration drifts with the clocks), and the loop's time waiting for batches
    (the first, all, the longest)."""
    probe = 50_000_000
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    cycles_per_s = probe / (start.elapsed_time(end) / 1e3)
    busy_s, tokens, waits = 0.0, 0, []
    torch.cuda.synchronize()
    started = time.perf_counter()
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        waits.append(time.perf_counter() - asked)
        if batch is None:
            break
        n = int(batch["attention_mask"].sum())  # tokens of the batch (on the GPU already)
        tokens += n
        start.record()
        torch.cuda._sleep(int(cycles_per_s * n / tokens_per_s))
        end.record()
        end.synchronize()
        busy_s += start.elapsed_time(end) / 1e3
    wall = time.perf_counter() - started
    return {"seconds": wall, "step_seconds": busy_s, "waiting": max(0.0, 1 - busy_s / wall),
            "first_batch_s": waits[0], "next_s": sum(waits), "longest_next_s": max(waits),
            "tokens_per_s": tokens / wall, "gb_per_s": tokens * token_nbytes / wall / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied unless --reuse)")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens-per-s", type=float, default=25_000.0)
    parser.add_argument("--parts", nargs="+", default=["warm", "cold", "ranks", "consumer"],
                        choices=["warm", "cold", "ranks", "consumer"])
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--reuse", action="store_true", help="keep the stores of an earlier run in --dir")
    parser.add_argument("--fp8", action="store_true",
                        help="also read the same samples stored as float8_e4m3fn, warm and cold (GB/s: of the "
                             "bfloat16 states delivered)")
    parser.add_argument("--compression", choices=["zstd", "lz4"],
                        help="also read the same samples stored with this compression (warm, cold, by the ranks "
                             "and under the consumer, against the uncompressed store); every store "
                             "of the run then holds activation-like states (gaussian values of log-normal scales, "
                             "which compress as a trained model's do) instead of random bits")
    parser.add_argument("--methods", default="", help="a regular expression: run only the methods (and consumer "
                                                            "rows) whose names it finds (default: all)")
    parser.add_argument("--read-gbps", type=float, help="cap the run's reads from the disk at this many GB/s "
                        "(a cgroup throttle; root): the same machine with a slower disk")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.read_gbps is not None and args.read_gbps <= 0:
        parser.error(f"--read-gbps must be positive, got {args.read_gbps}")
    cold_parts = {"cold"} & set(args.parts) or ({"ranks"} & set(args.parts))
    if cold_parts and os.geteuid() != 0:
        sys.exit("needs root: cold passes drop the page cache")
    if args.read_gbps is not None:
        os.makedirs(args.dir, exist_ok=True)
        throttle_reads(args.dir, int(args.read_gbps * 1e9))
    roots = {name: os.path.join(args.dir, name) for name in ("hsdata", *FORMATS)}
    compressed_root = os.path.join(args.dir, f"hsdata-{args.compression}")  # (used with --compression)
    meta = os.path.join(args.dir, "samples.json")
    if not (args.reuse and os.path.exists(meta)):
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
        lengths = make_lengths(np.random.default_rng(0), int(args.gib * 2**30 / (2 * args.hidden * (LAYERS + 1))))
        log(f"writing {len(lengths)} samples, {sum(lengths)} tokens, H {args.hidden}, in {1 + len(args.formats)} formats")
        samples = make_samples(lengths, args.hidden, 0, activations=args.compression is not None)
        writers = {"hsdata": write_hsdata, "safetensors": write_speculators, "torch.save": write_specforge,
                   "mds": write_mds, "litdata": write_litdata}
        for name in ("hsdata", *args.formats):
            os.makedirs(roots[name])
            started = time.perf_counter()
            writers[name](roots[name], samples)
            log(f"wrote {name} in {time.perf_counter() - started:.1f} s")
        if args.fp8:  # the same states, their NaN and Inf bit patterns (random bits hold some) made 0
            write_fp8(os.path.join(args.dir, "hsdata-fp8"), samples)
            log("wrote hsdata fp8")
        if args.compression:
            started = time.perf_counter()
            write_hsdata(compressed_root, samples, compression=args.compression)
            log(f"wrote hsdata {args.compression} in {time.perf_counter() - started:.1f} s")
        del samples
        with open(meta, "w") as f:
            json.dump({"count": len(lengths), "formats": args.formats}, f)
    count = json.load(open(meta))["count"]
    store = hsdata.open(roots["hsdata"], concurrency=args.threads)
    plain = hsdata.open(roots["hsdata"], concurrency=args.threads, verify=False)
    order = list(ShardAwareSampler(Eagle3Dataset(roots["hsdata"]), seed=0))
    gb = store.num_tokens * store.spec.token_nbytes / 1e9
    device = "cuda" if GPU else None
    W = args.workers
    result = {"args": vars(args), "samples": count, "tokens": store.num_tokens, "state_gb": gb,
              "machine": f"{platform.node()}: {os.cpu_count()} cores, {torch.cuda.get_device_name() if GPU else 'no GPU'}",
              "versions": {"torch": torch.__version__, "hsdata": hsdata.__version__}, "delivery": "GPU" if GPU else "host"}
    if args.compression:
        result["compressed_size"] = round(tree_bytes(compressed_root) / tree_bytes(roots["hsdata"]), 4)

    def save(result: dict) -> None:  # after each part, so a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    def hs(workers, batch, verify=True, root=roots["hsdata"], decode="host"):
        loader = hsdata_loader(root, args.threads, workers, batch, verify, device, decode)
        return partial(epoch, loader)

    fp8_root = os.path.join(args.dir, "hsdata-fp8")

    def fp8_methods():  # GB/s of the bf16 states delivered, as for every method
        if not args.fp8:
            return {}
        return {"Loader fp8, 0 workers": hs(0, 1, root=fp8_root), f"Loader fp8, {W} workers": hs(W, 1, root=fp8_root),
                "Loader fp8, 0 workers, batch 4": hs(0, 4, root=fp8_root),
                f"Loader fp8, {W} workers, batch 4": hs(W, 4, root=fp8_root)}

    def loaders(root=roots["hsdata"], label="", decode="host") -> dict:  # name -> (root, workers, batch, decode)
        return {f"Loader{label}, {workers} workers{', batch 4' if batch == 4 else ''}": (root, workers, batch, decode)
                for workers, batch in ((0, 1), (0, 4), (W, 1), (W, 4))}

    def compressed_loaders() -> dict:  # decoded by the read threads (or workers); on the GPU where it can
        if not args.compression:
            return {}
        c = args.compression
        settings = loaders(compressed_root, f" {c}")
        if GPU and decoding.decodable(hsdata.open(compressed_root).spec) is None and decoding.nvcomp_available():
            settings.update(loaders(compressed_root, f" {c} GPU decode", "device"))
        return settings

    def methods_of(settings: dict) -> dict:
        return {name: hs(workers, batch, root=root, decode=decode)
                for name, (root, workers, batch, decode) in settings.items()}

    def uncompressed_methods():
        return methods_of(loaders())

    def compressed_methods():  # GB/s of the decompressed states delivered, as for every method
        return methods_of(compressed_loaders())

    def formats(workers):
        methods = {}
        for name in args.formats:
            if name == "safetensors":
                methods[f"safetensors, {workers} workers"] = partial(epoch, map_loader(
                    SpeculatorsDir(roots[name], count), order, workers))
            elif name == "torch.save":
                methods[f"torch.save, {workers} workers"] = partial(epoch, map_loader(
                    TorchSaveDir(roots[name], count), order, workers))
            elif name == "mds":
                methods[f"mds, {workers} workers"] = partial(epoch, mds_loader(roots[name], workers))
            else:
                methods[f"litdata, {workers} workers"] = partial(epoch, litdata_loader(roots[name], workers))
        return methods

    baselines = {"x_raw": "raw ranges", "x_store": f"store[i] {args.threads} thr"}
    if "warm" in args.parts:
        methods = {
            "raw ranges": RawRanges(roots["hsdata"], order, args.threads),
            f"store[i] {args.threads} thr": partial(store_threads, store, order, args.threads),
            f"store[i] {args.threads} thr, verify off": partial(store_threads, plain, order, args.threads),
            "store[i] 1 thr": partial(store_threads, store, order, 1),
            **uncompressed_methods(),
            "Loader, 0 workers, verify off": hs(0, 1, verify=False),
            "Loader, 0 workers, batch 4, verify off": hs(0, 4, verify=False),
            "DataLoader + collate_eagle3, 0 workers": partial(epoch, hsdata_dataloader(roots["hsdata"], 0, 1)),
            "DataLoader + collate_eagle3, 0 workers, batch 4": partial(epoch, hsdata_dataloader(roots["hsdata"], 0, 4)),
            f"DataLoader + collate_eagle3, {W} workers": partial(epoch, hsdata_dataloader(roots["hsdata"], W, 1)),
            f"DataLoader + collate_eagle3, {W} workers, batch 4": partial(
                epoch, hsdata_dataloader(roots["hsdata"], W, 4)),
            **fp8_methods(), **compressed_methods(), **formats(0), **formats(W),
        }
        result["warm"] = rows(measure(methods, mode="warm", repeat=args.repeat, only=args.methods), gb, baselines)
        save(result)
        del methods
    if "cold" in args.parts:
        methods = {
            "raw ranges": RawRanges(roots["hsdata"], order, args.threads),
            "raw files": RawRanges(roots["hsdata"], order, args.threads, whole_files=True),
            **uncompressed_methods(), **fp8_methods(), **compressed_methods(), **formats(W),
        }
        result["cold"] = rows(measure(methods, mode="cold", repeat=args.repeat, only=args.methods), gb,
                              {"x_raw": "raw ranges", "x_raw_files": "raw files"})
        save(result)
        del methods
    if "ranks" in args.parts:
        stores = {"uncompressed": roots["hsdata"], **({args.compression: compressed_root} if args.compression else {})}
        result["ranks"] = rank_rows(stores, args.ranks, max(1, args.threads // args.ranks), args.repeat)
        save(result)
    if "consumer" in args.parts:
        if not GPU:
            result["consumer"] = "skipped: needs a CUDA GPU"
        else:
            result["consumer"] = []
            settings = {name: setting for name, setting in {**loaders(), **compressed_loaders()}.items()
                        if re.search(args.methods, name)}
            for name, (root, workers, batch, decode) in settings.items():
                loader = hsdata_loader(root, args.threads, workers, batch, True, device, decode)
                for _ in range(3):  # warm: the page cache, and the loader's memory sized to what is in flight
                    epoch(loader)
                passes = [consumer(loader, store.spec.token_nbytes, args.tokens_per_s) for _ in range(args.repeat)]
                row = sorted(passes, key=lambda p: p["waiting"])[len(passes) // 2]  # the median pass
                result["consumer"].append({"method": name, "workers": workers, "batch": batch, **row,
                                           "waiting_all": [p["waiting"] for p in passes]})
                save(result)
                log(f"consumer: {result['consumer'][-1]}")
                del loader
    save(result)
    print(markdown(result))


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"{result['samples']} samples, {result['tokens']:,} tokens, {result['state_gb']:.2f} GB of states, "
             f"H {a['hidden']}, 3 aux layers + final, bf16, shuffled; delivered to the {result['delivery']}; "
             f"{a['threads']} threads, {a['workers']} workers; medians of {a['repeat']} passes; {result['machine']}."]
    if a.get("compression"):
        lines[0] += (f" States activation-like (gaussian, log-normal scales); the {a['compression']} store is "
                     f"{result['compressed_size']:.3f} of the uncompressed one on disk.")
    if a.get("read_gbps"):
        lines[0] += f" Disk reads capped at {a['read_gbps']} GB/s."

    def table(title, header, body):
        lines.extend(["", title, "", "| " + " | ".join(header) + " |",
                      "|---|" + "---:|" * (len(header) - 1),
                      *("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in row) + " |"
                        for row in body)])

    for mode in ("warm", "cold"):
        if mode in result:
            keys = [k for k in ("x_raw", "x_store", "x_raw_files", "x_uncompressed")
                    if any(k in r for r in result[mode])]
            table(f"**{mode}**", ["method", "s", "GB/s", *(k.replace("_", " ") for k in keys)],
                  [[r["method"], r["seconds"], r["gb_per_s"], *(r.get(k, "") for k in keys)]
                   for r in result[mode]])
    if "ranks" in result:
        table("**ranks on one node** (host delivery, together)",
              ["store", "mode", "ranks", "threads each", "s", "GB/s", "x uncompressed"],
              [[r.get("store", "uncompressed"), r["mode"], r["ranks"], r["threads_each"], r["seconds"], r["gb_per_s"],
                r.get("x_uncompressed", "")] for r in result["ranks"]])
    if isinstance(result.get("consumer"), list):  # (rows saved before they had a method name: by workers, batch)
        table(f"**a training step of {a['tokens_per_s']:,.0f} tokens/s on the GPU, warm**",
              ["method", "GPU waiting (median)", "all passes", "first batch s", "longest wait s", "tokens/s", "GB/s"],
              [[r.get("method", f"Loader, {r['workers']} workers, batch {r['batch']}"), f"{100 * r['waiting']:.1f}%",
                " ".join(f"{100 * w:.1f}%" for w in r["waiting_all"]), f"{r['first_batch_s']:.3f}",
                f"{r['longest_next_s']:.3f}", f"{r['tokens_per_s']:,.0f}", r["gb_per_s"]]
               for r in result["consumer"]])
    elif "consumer" in result:
        lines += ["", f"consumer: {result['consumer']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
