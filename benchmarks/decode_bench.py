"""CPU decoding of compressed hidden-state chunks on 1 to all cores: GB/s of decoded bytes (what a reader
delivers) per thread count, for each codec hsdata names (``hsdata.compression.PRESETS``) and the checks a read
makes beside it (the chunk's crc32c, the sample's xxh3), on activation-like bf16 chunks (gaussian values of
log-normal channel scales, which compress as a trained model's states do) of the size a store of --hidden
would use. Each thread decodes its own chunks into its own buffer, in a loop for --seconds; every codec's
output is checked bit for bit first.

    python benchmarks/decode_bench.py --hidden 4096 --threads 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
import torch
import xxhash
from crc32c import crc32c

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hsdata  # noqa: E402
from hsdata.compression import PRESETS  # noqa: E402


def activation_chunk(tokens: int, width: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(width, generator=g))
    return (torch.randn(tokens, width, generator=g) * scales).to(torch.bfloat16).view(torch.uint8).numpy().ravel()


def rate(work, threads: int, seconds: float) -> float:
    """GB/s of ``work(k) -> bytes`` run in a loop on ``threads`` threads for ``seconds``."""
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def loop(k: int) -> None:
        while time.perf_counter() < stop:
            done[k] += work(k)

    started = time.perf_counter()
    pool = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(done) / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, os.cpu_count() or 1])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    if min(args.threads) < 1 or args.seconds <= 0 or args.hidden < 1:
        parser.error("--threads must all be >= 1, --seconds > 0, --hidden >= 1")
    spec = hsdata.StoreSpec.new(args.hidden, [1, 2, 3], compression="zstd")
    aux = spec.tensor("aux_hidden_states")
    chunks = [activation_chunk(aux.chunk_tokens, aux.width, seed) for seed in range(8)]
    raw = sum(c.nbytes for c in chunks)
    result = {"machine": f"{os.cpu_count()} cores", "hidden": args.hidden, "chunk_bytes": chunks[0].nbytes,
              "rows": []}
    outs = {}

    def out(k: int) -> np.ndarray:
        return outs.setdefault(k, np.empty(chunks[0].nbytes, np.uint8))

    for name, compression in PRESETS.items():
        codec = compression.codec(2)
        encoded = [codec.encode(c) for c in chunks]
        for c, e in zip(chunks, encoded):
            assert np.array_equal(np.frombuffer(codec.decode(e), np.uint8), c), name

        def decode(k: int, codec=codec, encoded=encoded) -> int:
            for e in encoded:
                codec.decode(e, out=out(k))
            return raw

        size = sum(len(e) for e in encoded) / raw
        for n in args.threads:
            result["rows"].append({"work": f"blosc {name} decode", "size": round(size, 4), "threads": n,
                                   "gb_s": round(rate(decode, n, args.seconds), 2)})
            print(result["rows"][-1], flush=True)
    def each_chunk(step):
        def work(k: int) -> int:
            for c in chunks:
                step(k, c)
            return raw
        return work

    checks = {"crc32c": each_chunk(lambda k, c: crc32c(c)),
              "xxh3_64": each_chunk(lambda k, c: xxhash.xxh3_64_intdigest(c)),
              "memcpy": each_chunk(lambda k, c: np.copyto(out(k), c))}
    for name, work in checks.items():
        for n in args.threads:
            result["rows"].append({"work": name, "threads": n, "gb_s": round(rate(work, n, args.seconds), 2)})
            print(result["rows"][-1], flush=True)
    print("| work | size | " + " | ".join(f"{n} thr GB/s" for n in args.threads) + " |")
    print("|---|---:|" + "---:|" * len(args.threads))
    for work in dict.fromkeys(r["work"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["work"] == work]
        size = f"{rows[0]['size']:.3f}" if "size" in rows[0] else ""
        print(f"| {work} | {size} | " + " | ".join(f"{r['gb_s']:.2f}" for r in rows) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
