"""What nvCOMP's batched zstd decoding costs on a GPU, and why (needs CUDA and nvCOMP; a diagnostic for the
Loader's ``decode="device"``).

Parts (``--parts``):

  kernel    time a call (CUDA events, decoding only) against the blosc block size of the chunks (activation-like
            states, 1 MiB chunks as hsdata writes them) and the chunks a call; then the same byte-shuffled planes
            cut into pieces of one size and compressed by nvCOMP's own encoder and by plain zstd at levels -1, -5
            and 3, to tell what the time follows (the frames' sizes, or who wrote them; nvCOMP's encoder is
            its Python package's, ``nvidia-nvcomp-cu12`` or ``-cu13``);
  streams   calls of 8 chunks on 1-16 CUDA streams from one thread: do they decode at once?
  threads   the same from 1-32 threads, a stream each;
  host      does a call return before its stream's earlier work is done, and may other Python threads run
            while it waits (the GIL)?

    python benchmarks/nvcomp_diagnose.py --parts kernel streams threads host
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numcodecs
import numpy as np
import torch

import hsdata
from decode_bench import activation_chunk
from hsdata.codecs.blosc import blosc_streams
from hsdata.codecs.compression import Compression
from hsdata.torch import decoding

SPEC = hsdata.StoreSpec.new(4096, [1, 2, 3], compression="zstd")
AUX = SPEC.tensor("aux_hidden_states")


def chunks(count: int) -> list[np.ndarray]:
    return [activation_chunk(AUX.chunk_tokens, AUX.width, seed) for seed in range(count)]


def frames_of(chunk_list: list[np.ndarray], blocksize: int) -> tuple[bytes, tuple, tuple]:
    """The chunks' blosc frames end to end, and their zstd streams: (offsets, sizes), (targets, lengths)."""
    codec = Compression("zstd", 1, "shuffle", blocksize).codec(2)
    frames = [codec.encode(c) for c in chunk_list]
    sizes = np.array([len(f) for f in frames], np.int64)
    streams = blosc_streams(b"".join(frames), chunk_list[0].nbytes, (np.cumsum(sizes) - sizes, sizes))
    coded = streams.sizes != streams.lengths
    lengths = streams.lengths[coded]
    return b"".join(frames), (streams.offsets[coded], streams.sizes[coded]), (np.cumsum(lengths) - lengths, lengths)


def kernel_ms(data: bytes, frames: tuple, spots: tuple, reps: int = 5) -> float:
    """Milliseconds of GPU time a decode call takes (CUDA events around ``reps`` calls)."""
    device = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    out = torch.empty(int(spots[1].sum()), dtype=torch.uint8, device="cuda")
    decoding.decode_zstd(device, frames, out, spots)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        decoding.decode_zstd(device, frames, out, spots)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def cpu_gbs(streams: list[bytes]) -> float:
    zstd, done, started = numcodecs.Zstd(), 0, time.perf_counter()
    while time.perf_counter() - started < 0.3:
        for s in streams:
            done += len(zstd.decode(s))
    return done / (time.perf_counter() - started) / 1e9


def kernel() -> None:
    pool = chunks(16)
    nbytes = pool[0].nbytes
    print("| frames by | piece KiB | size | CPU 1 thr GB/s | chunks a call | streams | ms a call | GB/s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for blocksize in (16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20):
        data, frames, spots = frames_of(pool, blocksize)
        size = len(data) / (16 * nbytes)
        cpu = cpu_gbs([data[o:o + n] for o, n in zip(*(a[:64].tolist() for a in frames))])
        for count in (8, 32, 128, 512):
            data, frames, spots = frames_of([pool[k % 16] for k in range(count)], blocksize)
            ms = kernel_ms(data, frames, spots)
            print(f"| blosc | {blocksize >> 10} | {size:.4f} | {cpu:.2f} | {count} | {len(frames[0])} | {ms:.2f} | "
                  f"{count * nbytes / ms / 1e6:.1f} |", flush=True)
    planes = np.concatenate([np.ascontiguousarray(c.view(np.uint8).reshape(-1, 2).T).reshape(-1) for c in pool])
    for piece in (16 << 10, 64 << 10, 256 << 10):
        for who in ("nvcomp", "zstd -1", "zstd -5", "zstd 3"):
            if who == "nvcomp":
                from nvidia import nvcomp

                encoder = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, uncomp_chunk_size=piece)
                source = torch.from_numpy(planes).cuda()
                encoded = encoder.encode(nvcomp.as_arrays(source, list(range(0, len(planes), piece)),
                                                          [piece] * (len(planes) // piece)))
                torch.cuda.synchronize()
                pieces = [bytes(torch.as_tensor(encoded[i], device="cuda").cpu().numpy()) for i in range(len(encoded))]
            else:
                zstd = numcodecs.Zstd(int(who.split()[1]))
                pieces = [zstd.encode(planes[i:i + piece]) for i in range(0, len(planes), piece)]
            size = sum(len(p) for p in pieces) / len(planes)
            cpu = cpu_gbs(pieces[:64])
            for count in (8, 128, 512):
                picked = [pieces[k % len(pieces)] for k in range(nbytes // piece * count)]
                sizes = np.array([len(p) for p in picked], np.int64)
                lengths = np.full(len(picked), piece, np.int64)
                ms = kernel_ms(b"".join(picked), (np.cumsum(sizes) - sizes, sizes), (np.cumsum(lengths) - lengths,
                                                                                      lengths))
                print(f"| {who} | {piece >> 10} | {size:.4f} | {cpu:.2f} | {count} | {len(picked)} | {ms:.2f} | "
                      f"{count * nbytes / ms / 1e6:.1f} |", flush=True)


def eight_chunks() -> tuple[torch.Tensor, tuple, tuple, int]:
    data, frames, spots = frames_of(chunks(8), 1 << 20)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda(), frames, spots, int(spots[1].sum())


def streams() -> None:
    data, frames, spots, nbytes = eight_chunks()
    for n in (1, 2, 4, 8, 16):
        lanes = [torch.cuda.Stream() for _ in range(n)]
        outs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]

        def calls(reps: int) -> None:
            for _ in range(reps):
                for lane, out in zip(lanes, outs):
                    with torch.cuda.stream(lane):
                        decoding.decode_zstd(data, frames, out, spots)

        calls(1)
        torch.cuda.synchronize()
        started = time.perf_counter()
        calls(6)
        host = time.perf_counter() - started
        torch.cuda.synchronize()
        total = time.perf_counter() - started
        print(f"{n} streams, one thread: {6 * n * nbytes / total / 1e9:.1f} GB/s, "
              f"{host * 1e3 / (6 * n):.2f} ms of host time a call", flush=True)


def threads() -> None:
    data, frames, spots, nbytes = eight_chunks()
    local = threading.local()

    def calls(reps: int) -> None:
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream()
            local.out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(local.stream):
            for _ in range(reps):
                decoding.decode_zstd(data, frames, local.out, spots)
        local.stream.synchronize()

    for n in (1, 4, 8, 16, 32):
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(calls, [1] * n))
            started = time.perf_counter()
            list(pool.map(calls, [6] * n))
            total = time.perf_counter() - started
        print(f"{n} threads, a stream each: {6 * n * nbytes / total / 1e9:.1f} GB/s", flush=True)


def behind_queued_work(call) -> tuple[float, float]:
    """Seconds ``call()`` takes with about half a second of GPU work queued before it on its stream, and how fast
    another Python thread ran until that stream was done, against its rate alone (1.00: the GIL was free)."""
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.2)
    before, started = count[0], time.perf_counter()
    time.sleep(0.5)
    idle = (count[0] - before) / (time.perf_counter() - started)
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(int(1e9))
        before, started = count[0], time.perf_counter()
        call()
        took = time.perf_counter() - started
        torch.cuda.current_stream().synchronize()
    busy = (count[0] - before) / (time.perf_counter() - started)
    stop[0] = True
    spinner.join()
    return took, busy / idle


def host() -> None:
    data, frames, spots, nbytes = eight_chunks()
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    took, rate = behind_queued_work(lambda: decoding.decode_zstd(data, frames, out, spots))
    print(f"a call behind queued work returned after {took * 1e3:.0f} ms; another Python thread ran {rate:.2f} of "
          "its rate meanwhile", flush=True)


def main() -> None:
    parts = {"kernel": kernel, "streams": streams, "threads": threads, "host": host}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(parts), default=list(parts))
    args = parser.parse_args()
    if not (torch.cuda.is_available() and decoding.nvcomp_available()):
        parser.error("needs a CUDA device and nvCOMP")
    for name in args.parts:
        parts[name]()


if __name__ == "__main__":
    main()
