"""CPU decoding of compressed hidden-state chunks on 1 to all cores: GB/s of decoded bytes (what a reader
delivers) per thread count, for each codec hsdata names (``hsdata.codecs.compression.PRESETS``) and the checks a read
makes beside it (the chunk's crc32c, the sample's xxh3), on activation-like bf16 chunks (gaussian values of
log-normal channel scales, which compress as a trained model's states do) of the size a store of --hidden
would use. Each thread decodes its own chunks into its own buffer, in a loop for --seconds; every codec's
output is checked bit for bit first.

With CUDA and nvCOMP (``--gpu``), the same chunks decoded on the GPU as the Loader's ``decode="device"`` does
(``hsdata.torch.decoding.decode``: nvCOMP's batched zstd, the blocks unshuffled, the rows cut out), one batch of
--gpu-chunks chunks a call, for each blosc block size of --blocksizes: GB/s of decoded bytes, the whole decode
and nvCOMP's call alone, checked bit for bit against the CPU's blosc first.

    python benchmarks/decode_bench.py --hidden 4096 --threads 1 2 4 8 16
    python benchmarks/decode_bench.py --hidden 4096 --threads 1 --gpu --gpu-chunks 8 32 128 --blocksizes 262144 1048576
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
from hsdata.codecs.compression import PRESETS, Compression  # noqa: E402
from hsdata.reader import EncodedRows  # noqa: E402
from hsdata.shard import ChunkRun  # noqa: E402


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


def gpu_rows(chunks: list[np.ndarray], tensor, counts: list[int], blocksizes: list[int], seconds: float) -> list[dict]:
    """GB/s of decoded bytes on the GPU (``decoding.decode``, and nvCOMP's call alone) per blosc block size and
    chunks a batch."""
    from crc32c import crc32c as crc

    from hsdata.torch import decoding

    rows = []
    for blocksize in blocksizes:
        codec = Compression("zstd", 1, "shuffle", blocksize).codec(2)
        frames = [codec.encode(c) for c in chunks]
        size = sum(len(f) for f in frames) / sum(c.nbytes for c in chunks)
        for count in counts:
            picked = [frames[k % len(frames)] for k in range(count)]
            data = b"".join(f + crc(f).to_bytes(4, "little") for f in picked)
            nbytes = count * chunks[0].nbytes
            run = ChunkRun(0, 0, tuple(len(f) + 4 for f in picked), 0, nbytes)
            host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            states = decoding.EncodedStates.of_samples(host, [(0, EncodedRows(host, (run,), tensor))])
            device = host.cuda()
            want = np.concatenate([chunks[k % len(chunks)] for k in range(count)])
            assert np.array_equal(decoding.decode(states, device).cpu().numpy(), want), (blocksize, count)
            coded = states.stream_sizes != states.stream_lengths
            out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            calls = {"decode": lambda: decoding.decode(states, device),
                     "nvCOMP alone": lambda: decoding.decode_zstd(
                         device, (states.stream_offsets[coded], states.stream_sizes[coded]), out,
                         (states.stream_targets[coded], states.stream_lengths[coded]))}
            for what, call in calls.items():
                call()
                torch.cuda.synchronize()
                done, started = 0, time.perf_counter()
                while time.perf_counter() - started < seconds:
                    call()
                    done += nbytes
                torch.cuda.synchronize()
                rows.append({"work": f"GPU {what}, blocks of {blocksize >> 10} KiB", "size": round(size, 4),
                             "chunks": count, "batch_mb": round(nbytes / 1e6, 1),
                             "gb_s": round(done / (time.perf_counter() - started) / 1e9, 2)})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, os.cpu_count() or 1])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--gpu", action="store_true", help="also decode on the GPU (needs CUDA and nvCOMP)")
    parser.add_argument("--gpu-chunks", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--blocksizes", type=int, nargs="+", default=[PRESETS["zstd"].blocksize])
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device")
    if min(args.gpu_chunks) < 1 or min(args.blocksizes) < 1:
        parser.error("--gpu-chunks and --blocksizes must all be >= 1")
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
    if args.gpu:
        result["gpu"] = gpu_rows(chunks, aux, args.gpu_chunks, args.blocksizes, args.seconds)
        print("| GPU work | size | chunks a call | MB a call | GB/s |\n|---|---:|---:|---:|---:|")
        for r in result["gpu"]:
            print(f"| {r['work']} | {r['size']:.3f} | {r['chunks']} | {r['batch_mb']} | {r['gb_s']:.1f} |")
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
