"""The same samples written and read in every format EAGLE-3 users store hidden states in, side by side in one run,
each figure a ratio against raw reads and writes of the same bytes measured in the same run (the physical limit).

Formats, each written here from the same in-memory samples (bf16, 3 aux layers + final, read_bench's lengths):
  raw          one flat file, every sample's four tensors back to back (the limit)
  specforge    SpecForge: torch.save per sample, rows_<g>-<g+2000>/data_<i>.ckpt, written through a thread pool
  modelopt     NVIDIA Model-Optimizer: torch.save per sample, <conversation_id>.pt
  speculators  vLLM speculators: safetensors per sample, hs_<i>.safetensors ([T, 4, H] hidden_states, token_ids),
               loss masks in a Parquet table beside the files
  mds          mosaicml-streaming MDSWriter shards (compression=None, default 64 MiB size_limit)
  litdata      litdata.optimize chunks (default 64MB chunk_bytes)
  hsdata       hsdata.create / add / close; read by hsdata, plain zarr-python and tensorstore
Neither MDS nor LitData stores bf16: both get the bf16 states as their 16-bit bit pattern (uint16 / int16) and
readers view them back as bf16 (zero-copy), which is what a user of either has to do.

Measured: write time from the first byte to durable (fsync where the format's writer does it, else os.sync()
inside the timing), random-order reads one sample at a time (cold: page cache dropped before each pass, needs
root; warm: after an untimed pass), a cold DataLoader epoch with 0 and 2 workers, bytes on disk and files per TB.
Readers touch every 4 KiB page of the states they return (as a copy to the GPU would), so memory-mapped readers
(safetensors, litdata) pay their page faults. speculators' [T, 4, H] stacking happens inside its timed write.
Medians of --repeat interleaved passes; every format's read-back is checked against the source bytes.

    flock /tmp/hsdata-bench.lock python benchmarks/formats_bench.py --dir /tmp/hsfmt --size small \\
        --json benchmarks/results/formats_bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zarr
from dataset_bench import TorchSaveDir
from read_bench import (
    TENSORS,
    drop_caches,
    interleaved_times,
    make_lengths,
    read_raw,
    read_raw_parallel,
    sample_arrays,
    stored_bytes,
)
from torch.utils.data import DataLoader, Dataset

import hsdata
from hsdata.layout import array_node
from hsdata.torch import Eagle3Dataset


def _optional(name: str):
    """A format's library (the bench extra), or None where it is not installed: that format cannot be measured,
    the others can (loader_bench --formats with none of them runs on torch and hsdata alone)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


litdata, streaming, ts = _optional("litdata"), _optional("streaming"), _optional("tensorstore")
safetensors = _optional("safetensors")
if safetensors is not None:
    import safetensors.torch

LAYERS = 3
SIZES = {"small": {"gib": 1.0, "hidden": 4096}, "large": {"gib": 8.0, "hidden": 7168}}
FORMATS = ("raw", "specforge", "modelopt", "speculators", "mds", "litdata", "hsdata")
DURABLE = {"raw": "fsync", "hsdata": "fsync (close)"}  # the others' writers do not fsync: os.sync() is timed
STATE_KEYS = {"aux_hidden_state", "hidden_state", "aux_hidden_states", "hidden_states"}
CANONICAL = {"input_ids": "input_ids", "token_ids": "input_ids", "loss_mask": "loss_mask",
             "aux_hidden_state": "aux_hidden_states", "aux_hidden_states": "aux_hidden_states",
             "hidden_state": "hidden_states", "hidden_states": "hidden_states"}
RAW_THREADS, RAW_RANGE = 2, 8 << 20
STARTED = time.perf_counter()

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # MDS returns read-only arrays


def log(message: str) -> None:
    print(f"[formats_bench {time.perf_counter() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def make_samples(lengths: list[int], hidden: int, seed: int,
                 activations: bool = False) -> list[dict[str, torch.Tensor]]:
    """read_bench's samples, each tensor in its own storage (torch.save writes a view's whole storage): random
    bits, or with ``activations`` gaussian values of log-normal scales in bf16 (compressible as a trained model's
    states are: blosc zstd keeps about 0.70 of them)."""
    rng = np.random.default_rng(seed)
    if activations:
        values = rng.standard_normal(2 * max(lengths) * LAYERS * hidden, dtype=np.float32)
        values.reshape(-1, LAYERS * hidden)[:] *= np.exp(rng.standard_normal(LAYERS * hidden, dtype=np.float32))
        pool = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()
    else:
        pool = rng.integers(0, 2**16, 2 * max(lengths) * LAYERS * hidden, dtype=np.uint16)
    return [{k: v.clone() for k, v in sample_arrays(pool, rng, n, hidden, LAYERS).items()} for n in lengths]


def raw_ranges(samples) -> list[dict[str, tuple[int, int]]]:
    ranges, position = [], 0
    for s in samples:
        ranges.append({})
        for name in TENSORS:
            ranges[-1][name] = (position, s[name].nbytes)
            position += s[name].nbytes
    return ranges


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor as its int16 bit pattern (for libraries that cannot serialize bf16)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# ---- writers: each writes samples under root and returns once they are durable ----

def write_raw(root: str, samples) -> None:
    with open(os.path.join(root, "flat.bin"), "wb") as f:
        f.writelines(stored_bytes(s[name]) for s in samples for name in TENSORS)
        f.flush()
        os.fsync(f.fileno())


def write_specforge(root: str, samples) -> None:
    paths = TorchSaveDir(root, len(samples)).paths
    for folder in sorted({os.path.dirname(p) for p in paths}):
        os.makedirs(folder)

    def save(i: int) -> None:
        s = samples[i]
        torch.save({"input_ids": s["input_ids"].long(), "loss_mask": s["loss_mask"].long(),
                    "aux_hidden_state": s["aux_hidden_states"].unsqueeze(0),
                    "hidden_state": s["hidden_states"].unsqueeze(0)}, paths[i])

    with ThreadPoolExecutor(2) as pool:  # SpecForge's rank 0 writes through a thread pool
        list(pool.map(save, range(len(samples))))
    os.sync()


def write_modelopt(root: str, samples) -> None:
    for i, s in enumerate(samples):
        torch.save({"input_ids": s["input_ids"].long(), "hidden_states": s["hidden_states"],
                    "aux_hidden_states": s["aux_hidden_states"], "loss_mask": s["loss_mask"].long(),
                    "conversation_id": f"s{i:06d}"}, os.path.join(root, f"s{i:06d}.pt"))
    os.sync()


def write_speculators(root: str, samples) -> None:
    for i, s in enumerate(samples):
        n, hidden = s["hidden_states"].shape
        layers = torch.cat([s["aux_hidden_states"].view(n, LAYERS, hidden), s["hidden_states"].view(n, 1, hidden)], 1)
        safetensors.torch.save_file({"hidden_states": layers, "token_ids": s["input_ids"].long()},
                                    os.path.join(root, f"hs_{i}.safetensors"))
    pq.write_table(pa.table({"seq_len": [len(s["input_ids"]) for s in samples],
                             "loss_mask": [s["loss_mask"].numpy() for s in samples]}),
                   os.path.join(root, "data.parquet"))
    os.sync()


MDS_COLUMNS = {"input_ids": "ndarray:int32", "loss_mask": "ndarray:uint8",
               "aux_hidden_states": "ndarray:uint16", "hidden_states": "ndarray:uint16"}


def write_mds(root: str, samples) -> None:
    with streaming.MDSWriter(out=root, columns=MDS_COLUMNS, compression=None) as writer:
        for s in samples:
            writer.write({name: bits(s[name]).numpy().view(np.uint16) if name in STATE_KEYS else s[name].numpy()
                          for name in TENSORS})
    os.sync()


_SAMPLES: list = []  # litdata.optimize's workers are forked (start_method="fork") and see the samples here


def litdata_item(i: int) -> dict:
    return {"index": i, **{name: bits(_SAMPLES[i][name]) for name in TENSORS}}


def write_litdata(root: str, samples) -> None:
    _SAMPLES[:] = samples
    with contextlib.redirect_stdout(sys.stderr):  # its progress goes to stdout
        litdata.optimize(fn=litdata_item, inputs=list(range(len(samples))), output_dir=root, chunk_bytes="64MB",
                         num_workers=os.cpu_count(), start_method="fork")
    _SAMPLES.clear()
    os.sync()


def write_hsdata(root: str, samples, compression: str | None = None) -> None:
    with hsdata.create(root, hidden_size=samples[0]["hidden_states"].shape[1], aux_layers=[1, 2, 3],
                       model="bench", compression=compression) as w:
        for i, s in enumerate(samples):
            w.add(f"s{i:06d}", **s)


WRITERS = {"raw": write_raw, "specforge": write_specforge, "modelopt": write_modelopt,
           "speculators": write_speculators, "mds": write_mds, "litdata": write_litdata, "hsdata": write_hsdata}


# ---- readers: map-style, sample i of the source at position i, the way each project's trainer reads it ----

class ModelOptDir(Dataset):
    def __init__(self, root: str, count: int):
        self.paths = [os.path.join(root, f"s{i:06d}.pt") for i in range(count)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        return torch.load(self.paths[i])


class SpeculatorsDir(Dataset):
    """speculators' ArrowDataset: safetensors.load_file, 3 aux layers flattened to [T, 3H], the last one final."""

    def __init__(self, root: str, count: int):
        self.root, self.count = root, count
        self.masks = pq.read_table(os.path.join(root, "data.parquet"))["loss_mask"]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        data = safetensors.torch.load_file(os.path.join(self.root, f"hs_{i}.safetensors"))
        layers = data["hidden_states"]
        return {"input_ids": data["token_ids"], "loss_mask": torch.from_numpy(self.masks[i].values.to_numpy()),
                "aux_hidden_states": layers[:, :-1].flatten(1), "hidden_states": layers[:, -1]}


def as_bf16(item: dict) -> dict:
    return {k: torch.from_numpy(np.asarray(v)).view(torch.bfloat16) if k in STATE_KEYS
            else torch.from_numpy(np.asarray(v)) for k, v in item.items()}


class MdsSamples(Dataset):
    """``StreamingDataset(...)[i]`` on a local directory (remote=None)."""

    def __init__(self, root: str, count: int):
        self.ds = streaming.StreamingDataset(local=root, remote=None, shuffle=False, batch_size=1)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return as_bf16(self.ds[i])


class LitSamples(Dataset):
    """``litdata.StreamingDataset(root)[position]``; optimize's workers each write their share of the inputs, so
    sample i sits at ``positions[i]`` (read from the stored ``index`` once, untimed)."""

    def __init__(self, root: str, count: int, positions: list[int]):
        self.ds, self.positions = litdata.StreamingDataset(root), positions

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        item = self.ds[self.positions[i]]
        return {"index": item["index"], **{k: item[k].view(torch.bfloat16) if k in STATE_KEYS else item[k]
                                           for k in TENSORS}}


class StoreArrays:
    """hsdata's arrays read as plain zarr v3 arrays, each sample's token range sliced from them."""

    def __init__(self, root: str, count: int, engine: str):
        self.root, self.engine, self.arrays = root, engine, {}
        self.store = hsdata.open(root)

    def array(self, key: str):
        if key not in self.arrays:
            path = os.path.join(self.root, key)
            self.arrays[key] = (zarr.open_array(path, mode="r") if self.engine == "zarr" else
                                ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}},
                                        read=True).result())
        return self.arrays[key]

    def __getitem__(self, i: int) -> dict:
        part, offset, length = self.store.location(i)
        out = {}
        for tensor in self.store.spec.tensors:
            part_slice = self.array(array_node(part, tensor))[offset : offset + length]
            out[tensor.name] = part_slice if self.engine == "zarr" else part_slice.read().result()
        return out


READERS = {"specforge": TorchSaveDir, "modelopt": ModelOptDir, "speculators": SpeculatorsDir, "mds": MdsSamples,
           "litdata": LitSamples, "hsdata": lambda root, count: hsdata.open(root),
           "zarr-python": partial(StoreArrays, engine="zarr"),
           "tensorstore": partial(StoreArrays, engine="tensorstore")}


def consume(item: dict) -> int:
    """Touch a byte in every 4 KiB of each state tensor, as a copy to the GPU would (memory-mapped readers,
    safetensors' and litdata's, pay their page faults here), and return the state bytes."""
    total = 0
    for key, value in item.items():
        if key in STATE_KEYS:
            flat = (value.reshape(-1).view(torch.uint8) if isinstance(value, torch.Tensor)
                    else np.asarray(value).reshape(-1).view(np.uint8))
            flat[::4096].sum()
            total += value.nbytes
    return total


def read_samples(make, order) -> int:
    reader = make()
    total = sum(consume(reader[int(i)]) for i in order)
    if hasattr(reader, "close"):
        reader.close()
    return total


def map_epoch(dataset: Dataset, order, workers: int) -> int:
    """One epoch of a map-style dataset in ``order``, batch_size=None (one sample per step, no collation)."""
    if isinstance(dataset, Eagle3Dataset):
        dataset.expect(order)  # what ShardAwareSampler does
    loader = DataLoader(dataset, batch_size=None, sampler=[int(i) for i in order], num_workers=workers)
    return sum(consume(item) for item in loader)


def mds_epoch(root: str, workers: int) -> int:
    ds = streaming.StreamingDataset(local=root, remote=None, shuffle=True, batch_size=1)
    return sum(consume(b) for b in streaming.StreamingDataLoader(ds, batch_size=1, num_workers=workers))


def litdata_epoch(root: str, workers: int) -> int:
    ds = litdata.StreamingDataset(root, shuffle=True)
    return sum(consume(b) for b in litdata.StreamingDataLoader(ds, batch_size=1, num_workers=workers))


def verify(reader, samples, indices) -> None:
    """Every tensor of each sample in ``indices`` equals the source: ids and masks by value, states by bits."""
    for i in indices:
        read = reader[int(i)]
        item = {CANONICAL[k]: v for k, v in read.items() if k in CANONICAL}
        for name in TENSORS:
            got, want = item[name], samples[i][name]
            got = bits(got).numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
            if name in STATE_KEYS:
                ok = np.array_equal(np.ascontiguousarray(got).reshape(-1).view(np.uint16),
                                    bits(want).numpy().reshape(-1).view(np.uint16))
            else:
                ok = np.array_equal(got.reshape(-1).astype(np.int64), want.numpy().astype(np.int64))
            assert ok, f"{type(reader).__name__}: sample {i} {name} differs from the source"
        assert int(read.get("index", i)) == i, f"{type(reader).__name__}: position {i} holds sample {read['index']}"


def on_disk(root: str) -> tuple[int, int]:
    """Allocated bytes (st_blocks, like du) of root and everything in it, and the number of files."""
    allocated, files = os.stat(root).st_blocks * 512, 0
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            st = os.lstat(os.path.join(folder, name))
            allocated += st.st_blocks * 512
            files += name in names
    return allocated, files


def summarize(times: dict[str, list[float]], gb: float, baselines: dict[str, str]) -> list[dict]:
    rows = []
    for name, t in times.items():
        row = {"method": name, "seconds": float(np.median(t)), "all_seconds": t}
        row["gb_per_s"] = gb / row["seconds"]
        for label, base in baselines.items():
            row[label] = float(np.median(times[base])) / row["seconds"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied); needs ~8x --gib free")
    parser.add_argument("--size", choices=SIZES, default="small", help="small: 1 GiB, H 4096; large: 8 GiB, H 7168")
    parser.add_argument("--gib", type=float, help="states to write (overrides --size)")
    parser.add_argument("--hidden", type=int, help="hidden size (overrides --size)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved passes per measurement; medians reported")
    parser.add_argument("--only-formats", nargs="+", choices=FORMATS[1:], help="formats besides raw (default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    gib = args.gib or SIZES[args.size]["gib"]
    hidden = args.hidden or SIZES[args.size]["hidden"]
    formats = ["raw", *(f for f in FORMATS[1:] if not args.only_formats or f in args.only_formats)]
    if os.geteuid() != 0:
        sys.exit("needs root: cold passes drop the page cache")

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    if shutil.disk_usage(args.dir).free < (len(formats) + 1) * gib * 2**30:
        sys.exit(f"{args.dir}: less than {len(formats) + 1} x {gib} GiB free")
    streaming.base.util.clean_stale_shared_memory()  # MDS: shared memory left by an interrupted earlier run
    lengths = make_lengths(np.random.default_rng(args.seed), int(gib * 2**30 / (2 * hidden * (LAYERS + 1) + 5)))
    log(f"generating {len(lengths)} samples, {sum(lengths)} tokens, H {hidden}")
    samples = make_samples(lengths, hidden, args.seed)
    order = np.random.default_rng(args.seed + 1).permutation(len(samples))
    state_bytes = sum(consume(s) for s in samples)
    gb = state_bytes / 1e9
    roots = {f: os.path.join(args.dir, f) for f in formats}

    write_times: dict[str, list[float]] = {f: [] for f in formats}
    for r in range(args.repeat):  # each round in a rotated order; the last round's output is what is read
        for f in formats[r % len(formats):] + formats[: r % len(formats)]:
            log(f"write round {r + 1}/{args.repeat}: {f}")
            shutil.rmtree(roots[f], ignore_errors=True)
            os.makedirs(roots[f])
            drop_caches()
            started = time.perf_counter()
            WRITERS[f](roots[f], samples)
            write_times[f].append(time.perf_counter() - started)
    writes = summarize(write_times, gb, {"vs_raw": "raw"})
    for row in writes:
        row["durable"] = DURABLE.get(row["method"], "os.sync()")

    flat, ranges = os.path.join(roots["raw"], "flat.bin"), raw_ranges(samples)
    raw_bytes = sum(n for row in ranges for _, n in row.values())
    readers = [f for f in READERS if f in formats or ("hsdata" in formats and f in ("zarr-python", "tensorstore"))]
    makes = {f: partial(READERS[f], roots.get(f, roots.get("hsdata")), len(samples)) for f in readers}
    if "litdata" in formats:
        stored = litdata.StreamingDataset(roots["litdata"])
        positions = np.empty(len(samples), dtype=np.int64)
        positions[[int(stored[j]["index"]) for j in range(len(stored))]] = np.arange(len(stored))
        makes["litdata"] = partial(LitSamples, roots["litdata"], len(samples), positions.tolist())
    few = sorted({*order[:3].tolist(), int(np.argmax(lengths))})
    verified = {}
    for f in readers:
        log(f"verifying {f}")
        indices = range(len(samples)) if f == "hsdata" else few
        verify(makes[f](), samples, indices)
        verified[f] = len(indices)

    def check(name: str, nbytes: int) -> None:
        assert nbytes == (raw_bytes if name.startswith("raw") else state_bytes), (name, nbytes)

    reads = []
    for mode in ("cold", "warm"):
        log(f"random sample reads, {mode}")
        methods = {"raw pread": partial(read_raw, flat, ranges, order),
                   f"raw pread {RAW_THREADS} thr": partial(read_raw_parallel, flat, ranges, order, RAW_THREADS,
                                                           RAW_RANGE),
                   **{f: partial(read_samples, makes[f], order) for f in readers}}
        times = interleaved_times(methods, mode=mode, repeat=args.repeat, check=check)
        reads += [{"mode": mode, **row} for row in summarize(
            times, gb, {"vs_raw": "raw pread", "vs_raw_threads": f"raw pread {RAW_THREADS} thr"})]

    log("DataLoader epochs, cold")
    epochs = {"raw pread": partial(read_raw, flat, ranges, order),
              f"raw pread {RAW_THREADS} thr": partial(read_raw_parallel, flat, ranges, order, RAW_THREADS, RAW_RANGE)}
    for workers in (0, 2):
        for f in formats[1:]:
            if f == "mds":
                epochs[f"mds, {workers} workers"] = partial(mds_epoch, roots[f], workers)
            elif f == "litdata":
                epochs[f"litdata, {workers} workers"] = partial(litdata_epoch, roots[f], workers)
            else:
                dataset = Eagle3Dataset(roots[f]) if f == "hsdata" else READERS[f](roots[f], len(samples))
                epochs[f"{f}, {workers} workers"] = partial(map_epoch, dataset, order, workers)
    times = interleaved_times(epochs, mode="cold", repeat=args.repeat, check=check)
    loaders = summarize(times, gb, {"vs_raw": "raw pread", "vs_raw_threads": f"raw pread {RAW_THREADS} thr"})

    disk = []
    for f in formats:
        allocated, files = on_disk(roots[f])
        disk.append({"format": f, "bytes": allocated, "vs_states": allocated / state_bytes, "files": files,
                     "files_per_tb": files * 1e12 / state_bytes})
    result = {
        "args": {**vars(args), "gib": gib, "hidden": hidden, "formats": formats},
        "samples": len(samples), "tokens": int(sum(lengths)), "state_bytes": state_bytes,
        "machine": f"{platform.node()}: {os.cpu_count()} cores, Linux {platform.release()}",
        "versions": {name: importlib.metadata.version(name) for name in
                     ("torch", "numpy", "hsdata", "zarr", "tensorstore", "safetensors", "mosaicml-streaming",
                      "litdata")},
        "verified": verified, "writes": writes, "reads": reads, "loaders": loaders, "disk": disk,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    log("done")
    print(markdown(result))


def markdown(result: dict) -> str:
    """The result as Markdown tables (for benchmarks/RESULTS.md)."""
    def table(title: str, header: list[str], rows: list[list]) -> list[str]:
        return ["", title, "", "| " + " | ".join(header) + " |",
                "|" + "|".join("---" if h in ("format", "method", "mode", "durable by") else "---:"
                               for h in header) + "|",
                *("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in row) + " |"
                  for row in rows)]

    a, threads = result["args"], f"x raw {RAW_THREADS} thr"
    checked = ", ".join(f"{f} {n}" for f, n in result["verified"].items())
    intro = (f"{result['samples']} samples, {result['tokens']:,} tokens, {result['state_bytes'] / 1e9:.2f} GB of "
             f"states, H {a['hidden']}, 3 aux layers + final, bf16; medians of {a['repeat']} interleaved passes. "
             f"Samples checked byte for byte against the source: {checked}.")
    lines = [intro]
    lines += table("**Write, first byte to durable**", ["format", "durable by", "s", "GB/s", "x raw"],
                   [[r["method"], r["durable"], r["seconds"], r["gb_per_s"], r["vs_raw"]] for r in result["writes"]])
    lines += table("**Random-order sample reads, one sample at a time** (raw: one pread per tensor; "
                   f"raw {RAW_THREADS} thr: 8 MiB ranges on {RAW_THREADS} threads)",
                   ["mode", "method", "s", "GB/s", "x raw", threads],
                   [[r["mode"], r["method"], r["seconds"], r["gb_per_s"], r["vs_raw"], r["vs_raw_threads"]]
                    for r in result["reads"]])
    lines += table("**DataLoader epoch, cold** (map-style: batch_size=None, the benchmark's random order; "
                   "mds, litdata: their StreamingDataLoader, batch_size=1, their own shuffle)",
                   ["method", "s", "GB/s", "x raw", threads],
                   [[r["method"], r["seconds"], r["gb_per_s"], r["vs_raw"], r["vs_raw_threads"]]
                    for r in result["loaders"]])
    lines += table("**On disk** (allocated bytes, like du; files per TB of states extrapolated linearly)",
                   ["format", "GB on disk", "x states", "files", "files per TB"],
                   [[r["format"], f"{r['bytes'] / 1e9:.3f}", f"{r['vs_states']:.3f}", r["files"],
                     f"{r['files_per_tb']:,.0f}"] for r in result["disk"]])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
