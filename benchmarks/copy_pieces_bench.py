"""The GPU decoder's copy of a bundle's raw planes: ``decoding.copy_pieces``' way off the CPU (one gather and one
scatter for all the pieces of each length) against one slice copy per piece (its way on the CPU, and what
``decode_many`` did everywhere before), for bundles of
--pieces pieces (hsdata's encoder stores each 1 MiB chunk's mantissa plane raw: a 256 MiB bundle holds about 256
such pieces, of two lengths, the aux and the final states' chunks). Reports the calling thread's time a bundle,
best of --repeat; on ``cuda`` the copies are synchronized too, and the result is checked against the slice
copies. On ``meta`` no bytes move: the figure is the Python and dispatch work alone, which is what the Loader's
feeder thread spends under the GIL.

    python benchmarks/copy_pieces_bench.py --device meta
    python benchmarks/copy_pieces_bench.py --device cuda --pieces 64 256 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hsdata.torch import decoding  # noqa: E402

AUX_PLANE, FINAL_PLANE = 1 << 19, 3 << 17  # bytes of a raw plane of a 1 MiB chunk, and of a 768 KiB one


def bundle(pieces: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets, targets and lengths of a bundle's raw planes: three of four from the aux states, packed."""
    lengths = np.array([AUX_PLANE] * (pieces * 3 // 4) + [FINAL_PLANE] * (pieces - pieces * 3 // 4), np.int64)
    targets = np.cumsum(lengths) - lengths
    return targets * 2, targets, lengths  # the planes lie every other plane apart in the decoder's input


def timed(copy, device: torch.device, repeat: int, *args) -> float:
    def once() -> float:
        start = time.perf_counter()
        copy(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    once()
    return min(once() for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="meta", help="meta (dispatch work alone), cuda or cpu")
    parser.add_argument("--pieces", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}; ms a bundle, best of {args.repeat}")
    print("| pieces | MB | one copy a piece | by length | x |")
    print("|---:|---:|---:|---:|---:|")
    for pieces in args.pieces:
        offsets, targets, lengths = bundle(pieces)
        source = torch.empty(int(2 * lengths.sum()), dtype=torch.uint8, device=device)
        if device.type != "meta":
            source.random_(0, 256)
        want = torch.zeros(int(lengths.sum()), dtype=torch.uint8, device=device)
        got = torch.zeros_like(want)
        before = timed(decoding._copy_each, device, args.repeat, source, offsets, want, targets, lengths)
        after = timed(decoding._copy_by_length, device, args.repeat, source, offsets, got, targets, lengths)
        if device.type != "meta" and not torch.equal(want, got):
            raise SystemExit(f"the copies by length differ from the slice copies at {pieces} pieces")
        print(f"| {pieces} | {lengths.sum() / 1e6:.0f} | {before * 1e3:.3f} | {after * 1e3:.3f} | {before / after:.2f} |")


if __name__ == "__main__":
    main()
