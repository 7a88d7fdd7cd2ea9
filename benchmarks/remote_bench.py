"""Reading a remote store: hsdata vs raw parallel range GETs of the same bytes at the same concurrency, and vs the
same samples as one object per sample (``torch.save`` files, as today's tools write), over HTTP and S3.

``--backends``: ``http``, a static file server with Range support in its own process on loopback
(``os.sendfile``; ``--latency-ms`` delays every response's first byte, like an object store's time to first byte),
and ``s3``, moto's S3 server in its own process on loopback (the tests' server; no added latency). Every method
reads every sample once, in the order of ``ShardAwareSampler`` (shuffle on), ``--batch`` samples at a time, with
``--concurrency`` requests in flight in all (split among the worker processes where there are some), through
fsspec (aiohttp, s3fs):

  raw range GETs     fs.cat_ranges of each batch's byte ranges, one per tensor and shard, cut at 8 MiB like
                     hsdata's (the same bytes, nothing checked, nothing merged)
  hsdata read_many   Store.read_many(batch): ranges merged, xxh3 of every byte verified, torch tensors
  Dataset, W workers Eagle3Dataset through a DataLoader with collate_eagle3 (batch of --batch; 0 workers: reading
                     ahead in the training process)
  Loader, W workers  hsdata.torch.Loader (batch of --batch)
  per-sample objects fs.cat of the batch's torch.save files, then torch.load of each

Passes are interleaved (raw, then each method, ``--repeat`` times); ``x raw`` is the median over passes of the
raw pass's time divided by the method's pass time in the same round.

    python benchmarks/remote_bench.py --dir /tmp/hsbench-remote --gib 2 --latency-ms 0 20 --backends http s3
"""

from __future__ import annotations

import argparse
import http.server
import io
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import fsspec
import numpy as np
import torch
from torch.utils.data import DataLoader

import hsdata
from dataset_bench import TorchSaveDir, write_torch_save_dir
from hsdata.layout import shard_key
from hsdata.torch import Eagle3Dataset, Loader, ShardAwareSampler, collate_eagle3
from read_bench import build, make_lengths


class _RangeFiles(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as object stores do
    latency_s = 0.0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self):  # noqa: N802
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            return super().do_GET()
        time.sleep(self.latency_s)
        if not os.path.isfile(path):
            return self.send_error(404)
        size = os.path.getsize(path)
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        start, end = (int(match.group(1)), int(match.group(2) or size - 1) + 1) if match else (0, size)
        end = min(end, size)
        self.send_response(206 if match else 200)
        self.send_header("Content-Length", str(end - start))
        if match:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        with open(path, "rb") as f:
            sent = start
            while sent < end:
                sent += os.sendfile(self.wfile.fileno(), f.fileno(), sent, end - sent)


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024
    daemon_threads = True


def _serve(root: str, port, latency_s: float) -> None:
    _RangeFiles.latency_s = latency_s
    server = _Server(("127.0.0.1", 0), lambda *a, **k: _RangeFiles(*a, directory=root, **k))
    port.value = server.server_address[1]
    server.serve_forever()


def start_server(root: str, latency_s: float) -> tuple[multiprocessing.Process, str]:
    port = multiprocessing.Value("i", 0)
    process = multiprocessing.get_context("fork").Process(target=_serve, args=(root, port, latency_s), daemon=True)
    process.start()
    while not port.value:
        time.sleep(0.01)
    return process, f"http://127.0.0.1:{port.value}"


def sample_ranges(store: hsdata.Store, i: int, range_bytes: int) -> list[tuple[str, int, int]]:
    """The shard-file byte ranges holding sample ``i``: what hsdata reads, before merging."""
    part, offset, length = store.location(i)
    out = []
    for tensor in store.spec.tensors:
        for whole in hsdata.shard.token_ranges(store.spec, tensor, offset, length):
            for r in whole.split(range_bytes):
                out.append((shard_key(part, tensor, r.shard), r.file_start, r.file_end))
    return out


BUCKET = "hsbench"
S3_KEYS = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}


def start_s3(root: str) -> tuple[subprocess.Popen, str, dict]:
    """moto's S3 server in its own process, holding ``root``'s files under s3://hsbench/; its storage options."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    client = boto3.client("s3", endpoint_url=endpoint)
    for _ in range(100):
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:  # not listening yet
            time.sleep(0.1)
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            client.upload_file(path, BUCKET, os.path.relpath(path, root))
    return server, f"s3://{BUCKET}", {"endpoint_url": endpoint, **S3_KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied)")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--concurrency", type=int, default=hsdata.reader.REMOTE_CONCURRENCY)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0], help="http only")
    parser.add_argument("--backends", nargs="+", choices=["http", "s3"], default=["http", "s3"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    lengths = make_lengths(np.random.default_rng(0), int(args.gib * 2**30 / (8 * args.hidden + 5)))
    built = build(args.dir, lengths, args.hidden, 3, [None], 0)
    os.rename(built["stores"][None], os.path.join(args.dir, "store"))
    os.remove(built["flat"])
    write_torch_save_dir(os.path.join(args.dir, "torch-save"), lengths, args.hidden, 0)
    local = hsdata.open(os.path.join(args.dir, "store"))
    order = [int(i) for i in ShardAwareSampler(Eagle3Dataset(local), seed=0).epoch_order()]
    batches = [order[k : k + args.batch] for k in range(0, len(order), args.batch)]
    ranges = {i: sample_ranges(local, i, hsdata.reader.DEFAULT_RANGE_BYTES) for i in order}
    gb = built["bytes"] / 1e9
    raw_bytes = sum(e - s for r in ranges.values() for _, s, e in r)
    print(f"{len(lengths)} samples, {sum(lengths)} tokens, {gb:.2f} GB, hidden {args.hidden}; "
          f"{np.mean([len(r) for r in ranges.values()]):.2f} ranges per sample; concurrency {args.concurrency}, "
          f"batch {args.batch}")
    results = []
    runs = [("http", ms) for ms in args.latency_ms if "http" in args.backends] + \
        ([("s3", 0.0)] if "s3" in args.backends else [])
    for backend, latency_ms in runs:
        if backend == "http":
            server, base = start_server(args.dir, latency_ms / 1000)
            options: dict | None = None
            fs = fsspec.filesystem("http")
        else:
            server, base, options = start_s3(args.dir)
            fs = fsspec.filesystem("s3", **options)
        url = f"{base}/store"

        def raw() -> int:
            total = 0
            for batch in batches:
                wanted = [r for i in batch for r in ranges[i]]
                got = fs.cat_ranges([f"{url}/{k}" for k, _, _ in wanted], [s for _, s, _ in wanted],
                                    [e for _, _, e in wanted], batch_size=args.concurrency)
                total += sum(len(d) for d in got)
            return total

        store = hsdata.open(url, storage_options=options, concurrency=args.concurrency)

        def hsdata_read_many() -> int:
            return sum(sum(t.nbytes for t in s.values() if isinstance(t, torch.Tensor)) - 4 * len(s["input_ids"])
                       for batch in batches for s in store.read_many(batch))  # input_ids come back as int64

        def state_bytes(batch: dict) -> int:
            return int(batch["attention_mask"].sum()) * local.spec.token_nbytes

        def dataset_epoch(workers: int):
            dataset = Eagle3Dataset(url, storage_options=options, concurrency=max(1, args.concurrency // max(1, workers)))
            loader = DataLoader(dataset, batch_size=args.batch, sampler=ShardAwareSampler(dataset, seed=0),
                                collate_fn=collate_eagle3, num_workers=workers, persistent_workers=workers > 0,
                                multiprocessing_context="fork" if workers else None)
            return lambda: sum(state_bytes(b) for b in loader)

        def loader_epoch(workers: int):
            dataset = Eagle3Dataset(url, storage_options=options, concurrency=max(1, args.concurrency // max(1, workers)))
            loader = Loader(dataset, batch_size=args.batch, sampler=ShardAwareSampler(dataset, seed=0),
                            num_workers=workers, persistent_workers=workers > 0, multiprocessing_context="fork")
            return lambda: sum(state_bytes(b) for b in loader)

        saves = TorchSaveDir(f"{base}/torch-save", len(lengths))

        def per_sample_objects() -> int:
            total = 0
            for batch in batches:
                got = fs.cat([saves.paths[i] for i in batch], batch_size=args.concurrency)
                for data in got.values():
                    item = torch.load(io.BytesIO(data), weights_only=False)
                    total += len(item["input_ids"]) * local.spec.token_nbytes
            return total

        methods = {"raw range GETs": raw, "hsdata read_many": hsdata_read_many,
                   "Dataset, 0 workers": dataset_epoch(0), f"Dataset, {args.workers} workers": dataset_epoch(args.workers),
                   "Loader, 0 workers": loader_epoch(0), f"Loader, {args.workers} workers": loader_epoch(args.workers),
                   "per-sample objects": per_sample_objects}
        for run in methods.values():
            run()  # warm the server's page cache and the connections
        times = {name: [] for name in methods}
        for _ in range(args.repeat):
            for name, run in methods.items():
                started = time.perf_counter()
                nbytes = run()
                times[name].append(time.perf_counter() - started)
                want = raw_bytes if name == "raw range GETs" else built["bytes"]  # raw ranges hold crc32c trailers
                assert nbytes == want, (name, nbytes, want)
        for name, t in times.items():
            seconds = float(np.median(t))
            ratios = [r / x for r, x in zip(times["raw range GETs"], t)]  # each pass against the raw one before it
            row = {"backend": backend, "latency_ms": latency_ms, "method": name, "seconds": seconds,
                   "gb_per_s": gb / seconds, "samples_per_s": len(order) / seconds, "x_raw": float(np.median(ratios)),
                   "all_seconds": t}
            results.append(row)
            print(f"{backend} latency {latency_ms:4.0f} ms  {name:20} {seconds:6.2f} s  {row['gb_per_s']:5.2f} GB/s  "
                  f"{row['samples_per_s']:6.1f} samples/s  x raw {row['x_raw']:4.2f}  (all {[round(x, 2) for x in t]})")
        del methods
        store.close()
        server.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": len(order), "bytes": built["bytes"], "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
