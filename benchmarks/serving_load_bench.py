"""A serving server under load with capture on and off: request latency and what the store holds.

Two real ``sglang.launch_server`` processes on this machine (the tiny Llama of tests/sglang_server.py, CPU),
one with the hsdata hook and one without, take turns: each round sends ``--streams`` concurrent client streams
to one of them for ``--round-s`` seconds, alternating, so the machine's drifts hit both alike. Every request is
a serving request (a prompt of 30-300 tokens, a greedy answer of ``--new-tokens`` tokens) under a unique rid
with the hook's prefix; the hooked server stores their prompts. Afterwards its store must hold exactly the
requests that were answered: 0 lost, 0 that the client did not send. Figures: requests per second and the
latency's p50 / p99 per server, and the hooked one's ratio against the other.

    python benchmarks/serving_load_bench.py --dir /tmp/hsbench-serving --streams 64 --rounds 10 --round-s 60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' real-server helper
from sglang_server import Server, make_model  # noqa: E402

import hsdata  # noqa: E402
from hsdata.validate import validate  # noqa: E402
from hsdata.extract.client import RID_PREFIX  # noqa: E402


def send(server: Server, rid: str, ids: list[int], new_tokens: int) -> float:
    body = json.dumps({"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": new_tokens,
                                                                          "temperature": 0.0}}).encode()
    request = urllib.request.Request(f"{server.url}/generate", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - started


def load_round(server: Server, name: str, streams: int, seconds: float, new_tokens: int, vocab: int,
               round_no: int) -> tuple[list[float], list[str], int]:
    """``streams`` threads sending back to back for ``seconds``: latencies, the rids answered, errors."""
    deadline = time.monotonic() + seconds
    latencies, answered, errors, lock = [], [], [0], threading.Lock()

    def stream(k: int) -> None:
        rng = random.Random(f"{name}-{round_no}-{k}")
        n = 0
        while time.monotonic() < deadline:
            rid = f"{RID_PREFIX}{name}-r{round_no}-s{k}-{n}"
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(30, 300))]
            try:
                latency = send(server, rid, ids, new_tokens)
            except Exception:  # noqa: BLE001 - counted; the bar is that there are none
                with lock:
                    errors[0] += 1
            else:
                with lock:
                    latencies.append(latency)
                    answered.append(rid[len(RID_PREFIX):])
            n += 1

    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(stream, range(streams)))
    return latencies, answered, errors[0]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10, help="rounds in all, alternating the two servers")
    parser.add_argument("--round-s", type=float, default=60.0)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = make_model(work / "tiny-llama")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    store = work / "store"
    servers = {"with hook": Server(model, store, work / "hooked.log", extra=["--max-running-requests", "64"]),
               "without hook": Server(model, store, work / "plain.log", hooked=False,
                                      extra=["--max-running-requests", "64"])}
    figures = {name: {"latencies": [], "answered": [], "errors": 0, "seconds": 0.0} for name in servers}
    try:
        for server in servers.values():
            server.start()
        for round_no in range(args.rounds):
            name = list(servers)[round_no % 2]
            started = time.monotonic()
            latencies, answered, errors = load_round(servers[name], name.replace(" ", "-"), args.streams,
                                                     args.round_s, args.new_tokens, vocab, round_no)
            figures[name]["seconds"] += time.monotonic() - started
            figures[name]["latencies"] += latencies
            figures[name]["answered"] += answered
            figures[name]["errors"] += errors
            print(f"round {round_no + 1}/{args.rounds} {name}: {len(latencies)} requests, "
                  f"p50 {percentile(latencies, 50) * 1e3:.0f} ms, p99 {percentile(latencies, 99) * 1e3:.0f} ms, "
                  f"{errors} errors", flush=True)
    finally:
        for server in servers.values():
            server.stop()  # SIGTERM: the hook commits what it holds
    stored = set(hsdata.open(str(store)).sample_ids)
    sent = set(figures["with hook"]["answered"])
    report = {"streams": args.streams, "rounds": args.rounds, "round_s": args.round_s, "new_tokens": args.new_tokens,
              "cpus": os.cpu_count(), "servers": {}}
    for name, f in figures.items():
        report["servers"][name] = {
            "requests": len(f["latencies"]), "errors": f["errors"], "seconds": round(f["seconds"], 1),
            "requests_per_s": len(f["latencies"]) / f["seconds"],
            "p50_ms": percentile(f["latencies"], 50) * 1e3, "p99_ms": percentile(f["latencies"], 99) * 1e3,
            "mean_ms": statistics.fmean(f["latencies"]) * 1e3}
    report["store"] = {"answered": len(sent), "stored": len(stored), "lost": len(sent - stored),
                       "not_sent": len(stored - sent), "valid": validate(str(store)).ok}
    hooked, plain = report["servers"]["with hook"], report["servers"]["without hook"]
    print("\n| server | requests | req/s | p50 ms | p99 ms | errors |\n|---|---:|---:|---:|---:|---:|")
    for name, r in report["servers"].items():
        print(f"| {name} | {r['requests']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{r['errors']} |")
    print(f"\nwith/without: req/s {hooked['requests_per_s'] / plain['requests_per_s']:.3f}x, "
          f"p50 {hooked['p50_ms'] / plain['p50_ms']:.3f}x, p99 {hooked['p99_ms'] / plain['p99_ms']:.3f}x")
    print(f"store: {report['store']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
