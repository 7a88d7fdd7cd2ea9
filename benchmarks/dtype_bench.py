"""Writing and reading stores of each hidden-state dtype: bf16, fp16 and fp32 stored as given, and fp32 states
converted to bf16 by the writer; each against raw file I/O of the same stored bytes on the same disk.

The same synthetic states (slices of one random fp32 pool, and that pool rounded to bf16 and fp16) go into:
  bf16, fp16, fp32   hsdata.create(dtype=D) given D tensors: stored as they are
  fp32->bf16         hsdata.create(dtype="bfloat16", compute_dtype="float32") given fp32 tensors: add converts
Baselines in the same run, paired per round:
  raw write          the bytes that store holds (ids, masks, states in the stored dtype) written to one flat file
                     with plain file writes, then fsync (the writer fsyncs every shard and manifest too)
  raw read           one pread per tensor per sample from that flat file, in the same random order as hsdata;
                     and the same ranges cut into 8 MiB pieces read by 4 threads (hsdata's local I/O threads)
  convert            torch .to(torch.bfloat16) (and float16) of every fp32 tensor, in memory: the conversion alone
Writes start after one untimed round of them (on this VM's disk, the first writes after a start run up to 4x
slower); reads drop the page cache before each pass (cold; needs root).

    cd benchmarks && python dtype_bench.py --dir /tmp/hsbench-dtype --gib 1 --repeat 3 --json results/dtype_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from functools import partial

import numpy as np
import torch

import hsdata
from read_bench import TENSORS, drop_caches, interleaved_times, make_lengths, read_hsdata, read_raw, read_raw_parallel

VARIANTS = {"bf16": ("bfloat16", "bfloat16"), "fp16": ("float16", "float16"), "fp32": ("float32", "float32"),
            "fp32->bf16": ("bfloat16", "float32")}  # name: (stored dtype, dtype of the tensors given to add)


def make_samples(lengths: list[int], hidden: int, layers: int, seed: int) -> dict[str, list[dict]]:
    """The same samples in each input dtype: views into one pool per dtype, at the same offsets."""
    rng = np.random.default_rng(seed)
    pool32 = torch.randn(2 * max(lengths) * layers * hidden, generator=torch.Generator().manual_seed(seed))
    pools = {"float32": pool32, "bfloat16": pool32.to(torch.bfloat16), "float16": pool32.to(torch.float16)}
    samples: dict[str, list[dict]] = {dtype: [] for dtype in pools}
    for n in lengths:
        ids = torch.from_numpy(rng.integers(0, 160_000, n, dtype=np.int32))
        mask = torch.from_numpy(rng.integers(0, 2, n, dtype=np.uint8))
        a, f = (int(rng.integers(0, len(pool32) - n * width)) for width in (layers * hidden, hidden))
        for dtype, pool in pools.items():
            samples[dtype].append({"input_ids": ids, "loss_mask": mask,
                                   "aux_hidden_states": pool[a : a + n * layers * hidden].view(n, layers * hidden),
                                   "hidden_states": pool[f : f + n * hidden].view(n, hidden)})
    return samples


def nbytes(samples: list[dict]) -> int:
    return sum(s[name].nbytes for s in samples for name in TENSORS)


def write_raw(path: str, samples: list[dict]) -> list[dict]:
    """Every sample's tensors back to back, then fsync; returns each sample's ``{tensor: (offset, nbytes)}``."""
    ranges, position = [], 0
    with open(path, "wb") as f:
        for sample in samples:
            row = {}
            for name in TENSORS:
                data = memoryview(sample[name].contiguous().view(torch.uint8).numpy())
                f.write(data)
                row[name] = (position, data.nbytes)
                position += data.nbytes
            ranges.append(row)
        f.flush()
        os.fsync(f.fileno())
    return ranges


def write_hsdata(path: str, samples: list[dict], hidden: int, layers: int, stored: str, given: str) -> None:
    with hsdata.create(path, hidden_size=hidden, aux_layers=list(range(1, layers + 1)), model="bench",
                       dtype=stored, compute_dtype=given) as w:
        for i, sample in enumerate(samples):
            w.add(f"s{i:06d}", **sample)


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied)")
    parser.add_argument("--gib", type=float, default=1.0, help="payload size at bf16")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of writes first")
    parser.add_argument("--json", help="also write results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root, to drop the page cache before each read pass")

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    bf16_token_nbytes = 2 * args.hidden * (args.layers + 1) + 5
    lengths = make_lengths(np.random.default_rng(args.seed), int(args.gib * 2**30 / bf16_token_nbytes))
    samples = make_samples(lengths, args.hidden, args.layers, args.seed)
    tokens = sum(lengths)
    print(f"{len(lengths)} samples, {tokens:,} tokens, hidden {args.hidden}, {args.layers} aux layers; "
          f"{args.warmup} untimed + {args.repeat} timed rounds, medians")

    # conversion alone, in memory
    fp32 = [s[name] for s in samples["float32"] for name in ("aux_hidden_states", "hidden_states")]
    convert = {target: [timed(lambda: [t.to(getattr(torch, target)) for t in fp32]) for _ in range(args.repeat)]
               for target in ("bfloat16", "float16")}

    # writes: per round and variant, a raw write of the stored bytes, then the store (files removed untimed)
    paths = {v: (os.path.join(args.dir, f"flat-{v.replace('->', '-to-')}.bin"),
                 os.path.join(args.dir, f"store-{v.replace('->', '-to-')}")) for v in VARIANTS}
    write_s: dict[str, dict[str, list[float]]] = {v: {"raw": [], "hsdata": []} for v in VARIANTS}
    ranges = {}
    for round_ in range(args.warmup + args.repeat):
        for variant, (stored, given) in VARIANTS.items():
            flat, store = paths[variant]
            shutil.rmtree(store, ignore_errors=True)
            if os.path.exists(flat):
                os.remove(flat)
            os.sync()
            started = time.perf_counter()
            ranges[variant] = write_raw(flat, samples[stored])
            raw_s = time.perf_counter() - started
            os.sync()
            hsdata_s = timed(partial(write_hsdata, store, samples[given], args.hidden, args.layers, stored, given))
            if round_ >= args.warmup:
                write_s[variant]["raw"].append(raw_s)
                write_s[variant]["hsdata"].append(hsdata_s)

    # cold reads, interleaved: hsdata.open(store)[i] (every xxh3 verified) and raw preads of the same bytes
    order = np.random.default_rng(args.seed + 1).permutation(len(lengths))
    io = (hsdata.reader.LOCAL_CONCURRENCY, hsdata.reader.DEFAULT_RANGE_BYTES)
    methods = {}
    for variant in VARIANTS:
        flat, store = paths[variant]
        methods[f"raw {variant}"] = partial(read_raw, flat, ranges[variant], order)
        methods[f"raw4 {variant}"] = partial(read_raw_parallel, flat, ranges[variant], order, *io)
        methods[f"hsdata {variant}"] = partial(read_hsdata, store, order, *io)
    read_s = interleaved_times(methods, mode="cold", repeat=args.repeat)
    drop_caches()

    rows = []
    for variant, (stored, given) in VARIANTS.items():
        flat, store = paths[variant]
        stored_bytes, input_bytes = nbytes(samples[stored]), nbytes(samples[given])
        spec = hsdata.open(store).spec
        assert spec.token_nbytes * tokens == stored_bytes == os.path.getsize(flat)
        raw_w, ours_w = (np.array(write_s[variant][k]) for k in ("raw", "hsdata"))
        raw_r, raw4_r, ours_r = (np.array(read_s[f"{k} {variant}"]) for k in ("raw", "raw4", "hsdata"))
        rows.append({
            "variant": variant, "stored": stored, "given": given, "input_bytes": input_bytes,
            "stored_bytes": stored_bytes, "disk_bytes_per_token": disk_bytes(store) / tokens,
            "payload_bytes_per_token": spec.token_nbytes,
            "write_raw_s": float(np.median(raw_w)), "write_hsdata_s": float(np.median(ours_w)),
            "write_input_gb_s": input_bytes / 1e9 / float(np.median(ours_w)),
            "write_raw_gb_s": stored_bytes / 1e9 / float(np.median(raw_w)),
            "write_x_raw": float(np.median(raw_w / ours_w)),
            "read_raw_s": float(np.median(raw_r)), "read_hsdata_s": float(np.median(ours_r)),
            "read_gb_s": stored_bytes / 1e9 / float(np.median(ours_r)),
            "read_raw_gb_s": stored_bytes / 1e9 / float(np.median(raw_r)),
            "read_raw4_gb_s": stored_bytes / 1e9 / float(np.median(raw4_r)),
            "read_x_raw": float(np.median(raw_r / ours_r)), "read_x_raw4": float(np.median(raw4_r / ours_r)),
            "all": {"write_raw": raw_w.tolist(), "write_hsdata": ours_w.tolist(), "read_raw": raw_r.tolist(),
                    "read_raw4": raw4_r.tolist(), "read_hsdata": ours_r.tolist()},
        })
    print("write: GB/s of input to hsdata, GB/s of the raw write, x raw (paired: raw s / hsdata s per round)")
    print("read:  GB/s of hsdata, of raw 1 thread, of raw 4 threads, x raw 1 thread, x raw 4 threads (paired)")
    print(f"{'variant':11} {'stored GB':>9} {'B/token':>8} | {'write in':>8} {'raw':>5} {'x raw':>5} | "
          f"{'read':>5} {'raw':>5} {'raw4':>5} {'x raw':>5} {'x raw4':>6}")
    for r in rows:
        print(f"{r['variant']:11} {r['stored_bytes'] / 1e9:9.2f} {r['disk_bytes_per_token']:8.0f} | "
              f"{r['write_input_gb_s']:8.2f} {r['write_raw_gb_s']:5.2f} {r['write_x_raw']:5.2f} | "
              f"{r['read_gb_s']:5.2f} {r['read_raw_gb_s']:5.2f} {r['read_raw4_gb_s']:5.2f} {r['read_x_raw']:5.2f} "
              f"{r['read_x_raw4']:6.2f}")
    fp32_gb = sum(t.nbytes for t in fp32) / 1e9
    conversion = {target: fp32_gb / float(np.median(s)) for target, s in convert.items()}
    print("conversion alone (GB/s of fp32 input, in memory): "
          + ", ".join(f"to {target} {gbs:.2f}" for target, gbs in conversion.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": len(lengths), "tokens": tokens, "rows": rows,
                       "conversion_gb_s": conversion, "conversion_s": convert}, f, indent=2)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
