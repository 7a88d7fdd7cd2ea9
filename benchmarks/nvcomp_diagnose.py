"""What nvCOMP's batched zstd decoding costs on a GPU, and why (needs CUDA and nvCOMP; a diagnostic for the
Loader's ``decode="device"``).

Parts (``--parts``):

  kernel    time a call (CUDA events, decoding only) against the blosc block size of the chunks (activation-like
            states, 1 MiB chunks as hsdata writes them) and the chunks a call; then the same byte-shuffled planes
            cut into pieces of one size and compressed by nvCOMP's own encoder and by plain zstd at levels -1, -5
            and 3, to tell what the time follows (the frames' sizes, or who wrote them);
  streams   calls of 8 chunks on 1-16 CUDA streams from one thread: do they decode at once?
  threads   the same from 1-32 threads, a stream each;
  host      does a call return before its stream's earlier work is done, and may other Python threads run
            while it waits (the GIL)?
  capi      the same decoding through nvCOMP's C API (``nvcompBatchedZstdDecompressAsync`` by ctypes, which lets
            go of the GIL; the pointer and size arrays made on the host and copied over): bit-exact against the
            Python binding, host time a call, GB/s at 8-512 chunks a call and on 1-8 streams, and the GIL check.

    python benchmarks/nvcomp_diagnose.py --parts kernel streams threads host capi
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
from hsdata.compression import Compression, blosc_streams
from hsdata.torch import decoding

SPEC = hsdata.StoreSpec.new(4096, [1, 2, 3], compression="zstd")
AUX = SPEC.tensor("aux_hidden_states")


def chunks(count: int) -> list[np.ndarray]:
    return [activation_chunk(AUX.chunk_tokens, AUX.width, seed) for seed in range(count)]


def frames_of(chunk_list: list[np.ndarray], blocksize: int) -> tuple[bytes, tuple, tuple]:
    """The chunks' blosc frames end to end, and their zstd streams: (offsets, sizes), (targets, lengths)."""
    codec = Compression("zstd", 1, "shuffle", blocksize).codec(2)
    frames = [codec.encode(c) for c in chunk_list]
    streams = [blosc_streams(memoryview(f), c.nbytes) for f, c in zip(frames, chunk_list)]
    starts = np.cumsum([0] + [len(f) for f in frames])[:-1]
    coded = [(o + s0, n, length) for s, s0 in zip(streams, starts)
             for o, n, length in zip(s.offsets, s.sizes, s.lengths) if n != length]
    offsets, sizes, lengths = (np.array(v, np.int64) for v in zip(*coded))
    return b"".join(frames), (offsets, sizes), (np.cumsum(lengths) - lengths, lengths)


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


class CApi:
    """nvCOMP's batched zstd decoding through its C API (``nvcomp/zstd.h`` of nvCOMP 6): asynchronous, nothing
    waited for on the host."""

    def __init__(self):
        import ctypes

        from nvidia import libnvcomp

        class Options(ctypes.Structure):  # nvcompBatchedZstdDecompressOpts_t
            _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]

        self.ctypes, self.options = ctypes, Options(0)
        self.lib = libnvcomp.load_library()
        size, pointer = ctypes.c_size_t, ctypes.c_void_p
        self.lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [size, size, Options, ctypes.POINTER(size), size,
                                                                    pointer]
        self.lib.nvcompBatchedZstdDecompressAsync.argtypes = [pointer, pointer, pointer, pointer, size, pointer, size,
                                                              pointer, Options, pointer, pointer]
        self.lib.nvcompBatchedZstdDecompressGetTempSize.restype = ctypes.c_int
        self.lib.nvcompBatchedZstdDecompressAsync.restype = ctypes.c_int

    def decode(self, data: torch.Tensor, frames: tuple, out: torch.Tensor, spots: tuple):
        """Queue the decoding of ``frames`` of ``data`` into ``spots`` of ``out`` on the current stream; returns
        (statuses, decoded lengths), on the device."""
        (offsets, sizes), (targets, lengths) = frames, spots
        stream = torch.cuda.current_stream(data.device).cuda_stream
        table = np.stack([data.data_ptr() + offsets, sizes, lengths, out.data_ptr() + targets]).astype(np.int64)
        arrays = torch.from_numpy(table).pin_memory().to(data.device, non_blocking=True)
        temp_bytes = self.ctypes.c_size_t()
        status = self.lib.nvcompBatchedZstdDecompressGetTempSize(len(sizes), int(lengths.max()), self.options,
                                                                  self.ctypes.byref(temp_bytes), int(lengths.sum()),
                                                                  stream)
        if status != 0:
            raise RuntimeError(f"nvcompBatchedZstdDecompressGetTempSize: status {status}")
        temp = torch.empty(max(1, temp_bytes.value), dtype=torch.uint8, device=data.device)
        decoded = torch.empty(len(sizes), dtype=torch.int64, device=data.device)
        statuses = torch.empty(len(sizes), dtype=torch.int32, device=data.device)
        status = self.lib.nvcompBatchedZstdDecompressAsync(
            arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr(), decoded.data_ptr(), len(sizes),
            temp.data_ptr(), temp_bytes.value, arrays[3].data_ptr(), self.options, statuses.data_ptr(), stream)
        if status != 0:
            raise RuntimeError(f"nvcompBatchedZstdDecompressAsync: status {status}")
        return statuses, decoded


def capi() -> None:
    api, pool = CApi(), chunks(16)
    nbytes = pool[0].nbytes
    for count in (8, 128, 512):
        data, frames, spots = frames_of([pool[k % 16] for k in range(count)], 1 << 20)
        device = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
        want = torch.empty(int(spots[1].sum()), dtype=torch.uint8, device="cuda")
        decoding.decode_zstd(device, frames, want, spots)
        out = torch.zeros_like(want)
        statuses, decoded = api.decode(device, frames, out, spots)
        torch.cuda.synchronize()
        exact = torch.equal(out, want) and not statuses.any() and decoded.cpu().numpy().tolist() == spots[1].tolist()
        host, started = [], torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        started.record()
        for _ in range(5):
            t = time.perf_counter()
            api.decode(device, frames, out, spots)
            host.append(time.perf_counter() - t)
        end.record()
        torch.cuda.synchronize()
        ms = started.elapsed_time(end) / 5
        print(f"C API, {count} chunks a call: bit-exact {exact}, {ms:.2f} ms a call on the GPU "
              f"({count * nbytes / ms / 1e6:.1f} GB/s), {np.median(host) * 1e3:.2f} ms on the host", flush=True)
    data, frames, spots = frames_of(pool[:8], 1 << 20)
    device = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    for n in (1, 2, 4, 8):
        lanes = [torch.cuda.Stream() for _ in range(n)]
        outs = [torch.empty(8 * nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(6):
            for lane, out in zip(lanes, outs):
                with torch.cuda.stream(lane):
                    api.decode(device, frames, out, spots)
        torch.cuda.synchronize()
        print(f"C API, 8 chunks a call on {n} streams: {6 * n * 8 * nbytes / (time.perf_counter() - started) / 1e9:.1f}"
              " GB/s", flush=True)
    out = torch.empty(8 * nbytes, dtype=torch.uint8, device="cuda")

    def calls() -> None:
        for _ in range(20):
            api.decode(device, frames, out, spots)

    took, rate = behind_queued_work(calls)
    print(f"C API: 20 calls behind queued work returned after {took * 1e3:.1f} ms; another Python thread ran "
          f"{rate:.2f} of its rate until they were done", flush=True)


def main() -> None:
    parts = {"kernel": kernel, "streams": streams, "threads": threads, "host": host, "capi": capi}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(parts), default=list(parts))
    args = parser.parse_args()
    if not (torch.cuda.is_available() and decoding.nvcomp_available()):
        parser.error("needs a CUDA device and nvCOMP")
    for name in args.parts:
        parts[name]()


if __name__ == "__main__":
    main()
