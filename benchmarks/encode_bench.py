"""CPU encoding of bf16 hidden-state chunks on 1 to all threads of one process: GB/s of chunk bytes, each thread
encoding and checksumming its own 1 MiB activation-like chunks (as ``decode_bench.py`` makes them) in a loop for
--seconds. Rows: hsdata's encoder as the writer calls it (``encode_zstd``, then crc32c of each part), the same with
--before's encoder (a folder holding an older hsdata as ``hsdata_old``), what it would cost with the planes'
verdicts known (no probe), with crc32c holding the GIL, with 8 chunks' planes in one zstd call, and c-blosc's own
zstd (numcodecs). How far one process's threads scale where each takes the GIL back after every call.

    python benchmarks/encode_bench.py --threads 1 4 8 16 --before DIR
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import numcodecs
import numpy as np
from crc32c import crc32c

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from decode_bench import activation_chunk, rate  # noqa: E402

from hsdata.codecs import blosc  # noqa: E402

CHUNK = 1 << 20
HEADER = blosc.BLOSC_HEADER.pack(2, 1, blosc.SHUFFLED | blosc.ZSTD_FORMAT << 5, 2, CHUNK, CHUNK, 0)


def planes(values: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    np.copyto(low, values, casting="unsafe")
    np.right_shift(values, 8, out=high, casting="unsafe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, os.cpu_count() or 1])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--before", help="folder holding an older hsdata as package hsdata_old")
    args = parser.parse_args()
    if min(args.threads) < 1 or args.seconds <= 0:
        parser.error("--threads must all be >= 1, --seconds > 0")
    chunks = [activation_chunk(CHUNK // 8192, 4096, seed) for seed in range(8)]
    batch, raw = np.concatenate(chunks), len(chunks) * CHUNK
    buffers: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def own(k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        return buffers.setdefault((k, n), (np.empty(n, np.uint8), np.empty(n, np.uint8)))

    def as_written(encode, together: int = 0):
        """``encode`` one chunk at a time, or ``together`` chunks a call, then crc32c of each frame's parts."""
        def work(k: int) -> int:
            frames = ([encode(chunk, 2, 1, True, CHUNK) for chunk in chunks] if not together else
                      [f for i in range(0, len(chunks), together)
                       for f in encode(chunks[i : i + together], 2, 1, True, CHUNK)])
            for frame in frames:
                crc = 0
                for part in frame:
                    crc = crc32c(part, crc)
            return raw
        return work

    def known_planes(gil_release_mode: int):
        def work(k: int) -> int:
            compressor, (low, high) = blosc.zstd_compressor(1), own(k, CHUNK // 2)
            for chunk in chunks:
                planes(chunk.view(np.uint16), low, high)
                coded = compressor.compress(high)
                head = HEADER + blosc.STREAM_SIZE.pack(20) + blosc.STREAM_SIZE.pack(len(low))
                crc = crc32c(head, 0, gil_release_mode)
                crc = crc32c(low, crc, gil_release_mode)
                crc32c(coded, crc32c(blosc.STREAM_SIZE.pack(len(coded)), crc, gil_release_mode), gil_release_mode)
            return raw
        return work

    def batched(k: int) -> int:
        compressor, (low, high), n = blosc.zstd_compressor(1), own(k, raw // 2), CHUNK // 2
        planes(batch.view(np.uint16), low, high)
        compressor.multi_compress_to_buffer([low[: blosc.PROBE_BYTES], high[: blosc.PROBE_BYTES]], threads=0)
        coded = compressor.multi_compress_to_buffer([high[i * n : (i + 1) * n] for i in range(len(chunks))], threads=0)
        for i, frame in enumerate(coded):
            crc = crc32c(low[i * n : (i + 1) * n], crc32c(HEADER))
            crc32c(frame, crc32c(blosc.STREAM_SIZE.pack(len(frame)), crc))
        return raw

    codec = numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE, CHUNK, 2)

    def c_blosc(k: int) -> int:
        for chunk in chunks:
            crc32c(codec.encode(chunk))
        return raw

    variants = {"encode_zstd + crc32c of its parts": as_written(lambda chunk, *a: blosc.encode_zstd([chunk], *a)[0]),
                "encode_zstd of 4 chunks at once + crc32c": as_written(blosc.encode_zstd, 4)}
    if args.before:
        sys.path.insert(0, args.before)
        old = importlib.import_module("hsdata_old.codecs.blosc")
        variants["--before's encode_zstd + crc32c"] = as_written(old.encode_zstd)
    variants |= {"the planes known (no probe)": known_planes(-1), "the same, crc32c holding the GIL": known_planes(0),
                 "8 chunks' planes in one zstd call": batched,
                 "c-blosc's own zstd (numcodecs) + crc32c": c_blosc}
    print("| variant | " + " | ".join(f"{n} thr GB/s" for n in args.threads) + " |")
    print("|---|" + "---:|" * len(args.threads))
    for name, work in variants.items():
        work(0)
        print(f"| {name} | " + " | ".join(f"{rate(work, n, args.seconds):.2f}" for n in args.threads) + " |",
              flush=True)


if __name__ == "__main__":
    main()
