"""Warm Loader epochs with ``decode="device"`` against the bundle size, ``ahead`` and the side streams, each as a
ratio to the uncompressed store's Loader at the same workers and batch (needs CUDA and nvCOMP).

It reads the two stores ``loader_bench.py --formats --compression zstd`` leaves in its ``--dir`` (``hsdata`` and
``hsdata-zstd``). Each setting is a fresh Loader: one untimed epoch, then the median of three. Settings are
``a<ahead>/<bundle MiB>M/<streams>``: ``1s`` is one side stream for every bundle (to_device before f6df0dc),
``ns`` a stream per bundle the GPU may hold (``ahead + 1``).

    cd benchmarks && python loader_bench.py --dir /tmp/lbz --gib 2 --parts warm --formats --compression zstd \\
        --methods '^Loader, 0 workers$'
    python gpu_decode_sweep.py /tmp/lbz
"""

from __future__ import annotations

import argparse
import statistics
import time

import loader_bench as lb
import hsdata.torch.device as device
import hsdata.torch.loader as loader_module
from hsdata.torch import Eagle3Dataset, Loader, ShardAwareSampler

SETTINGS = [(1, 256, 1), (1, 256, None), (2, 256, None), (3, 128, None), (2, 512, None), (4, 128, None),
            (7, 64, None)]  # (ahead, bundle MiB, side streams: None = one per bundle held)


def warm_epoch_s(path: str, workers: int, batch: int, decode: str, ahead: int = 1, bundle_mib: int = 256,
                 streams: int | None = None, repeat: int = 3) -> float:
    loader_module.DEVICE_DECODE_BYTES = bundle_mib << 20
    original = device._CudaPrefetch.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if streams:
            self._streams = streams

    device._CudaPrefetch.__init__ = init
    try:
        dataset = Eagle3Dataset(path)
        loader = Loader(dataset, batch_size=batch, sampler=ShardAwareSampler(dataset, seed=0), num_workers=workers,
                        threads=16, multiprocessing_context="fork" if workers else None,
                        persistent_workers=workers > 0, device="cuda", decode=decode, ahead=ahead)
        lb.epoch(loader)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            lb.epoch(loader)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        device._CudaPrefetch.__init__ = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="loader_bench.py's --dir, holding hsdata/ and hsdata-zstd/")
    root = parser.parse_args().dir
    for workers in (0, 8):
        for batch in (1, 4):
            base = warm_epoch_s(f"{root}/hsdata", workers, batch, "host")
            line = [f"w{workers} b{batch}: plain {base * 1e3:.0f} ms"]
            for ahead, bundle, streams in SETTINGS:
                seconds = warm_epoch_s(f"{root}/hsdata-zstd", workers, batch, "device", ahead, bundle, streams)
                line.append(f"a{ahead}/{bundle}M/{'1s' if streams else 'ns'} {base / seconds:.2f}x")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
