"""The capture path over a long run whose states outgrow the staging bound (needs a CUDA GPU).

A transformers Llama model of Llama-3-8B shape (random bf16 weights, SDPA) prefills ``--forwards`` packed rows of
``--seq`` tokens: requests of log-normal lengths (256..8192) laid end to end, each row cut at ``--seq`` tokens so a
request that does not fit continues in the next forward (chunked prefill). Attention spans the whole row, which
changes no cost that matters here. Modes, interleaved over ``--rounds``:

  none    the forwards alone;
  hsdata  ``hsdata.extract.capture.Capture.add_forward`` for every forward, into a store under ``--store`` (use the local
          disk), as the SGLang hook calls it; the time runs until every sample is committed (the drain included);
  raw     the same number of bytes written to the same disk with plain ``write`` calls and one fsync at the end: the
          best of one sequential stream and one file per tensor on four threads (hsdata's layout);
  hsdata COMPRESSION   with ``--compression``: as hsdata, into a store of that compression.

Reported: tokens/s of the forwards with and without capture, the capture's share of throughput lost, the states'
production rate (bytes per second of forward time), the extraction rate (bytes per second until committed) and its
ratio to the raw write rate. After the first hsdata round every stored sample is read back and compared bit for
bit with copies of the GPU tensors kept on the GPU.

    python benchmarks/capture_bench.py --store /tmp/hs-capture --forwards 64 --rounds 2 [--compression zstd]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time

import numpy as np
import torch

import hsdata
from dtype_bench import disk_bytes
from hook_overhead_bench import AUX_LAYERS, build_model
from hsdata.extract.capture import Capture, Piece

VOCAB = 128256
RAW_BLOCK = 64 << 20


def plan_forwards(forwards: int, seq: int, seed: int = 0) -> tuple[list[list[Piece]], dict[str, int]]:
    """Pieces of each packed forward and each request's prompt length: requests end to end, cut at rows of ``seq``."""
    rng = np.random.default_rng(seed)
    lengths: dict[str, int] = {}
    plan: list[list[Piece]] = [[] for _ in range(forwards)]
    position, request = 0, 0  # global token position of the stream
    total = forwards * seq
    while position < total:
        n = int(np.clip(rng.lognormal(np.log(1500), 0.8), 256, 8192))
        sample_id = f"r{request:06d}"
        lengths[sample_id] = n
        done = 0
        while done < n and position < total:
            forward, row = divmod(position, seq)
            take = min(n - done, seq - row)
            plan[forward].append(Piece(sample_id, done, row, take))
            done, position = done + take, position + take
        request += 1
    return plan, lengths


def run(model, batches: list[torch.Tensor], plan, lengths, capture: Capture | None,
        keep: list | None) -> tuple[float, float]:
    """Seconds of the forwards, and until every sample is committed (the same without a capture)."""
    captured: list[torch.Tensor] = []
    handles = [model.layers[k].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)) for k in AUX_LAYERS] \
        if capture is not None else []
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        for ids, pieces in zip(batches, plan):
            captured.clear()
            final = model(input_ids=ids, use_cache=False).last_hidden_state[0]
            if capture is not None:
                aux = [a[0] for a in captured]
                capture.add_forward(pieces, [lengths[p.sample_id] for p in pieces], ids[0], aux, final)
                if keep is not None:
                    keep.append((torch.cat(aux, dim=-1).clone(), final.clone()))
    torch.cuda.synchronize()
    forwards = time.perf_counter() - started
    for h in handles:
        h.remove()
    if capture is not None:
        capture.close()
    return forwards, time.perf_counter() - started


def raw_write(directory: str, nbytes: int, streams: list[float]) -> float:
    """Seconds to write ``nbytes`` split over files by the ``streams`` shares, one thread each, fsync included."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    block = np.random.default_rng(0).integers(0, 255, RAW_BLOCK, dtype=np.uint8).tobytes()

    def write(k: int, size: int) -> None:
        fd = os.open(os.path.join(directory, f"stream{k}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left > 0:
                left -= os.write(fd, block[: min(left, RAW_BLOCK)])
            os.fsync(fd)
        finally:
            os.close(fd)

    started = time.perf_counter()
    threads = [threading.Thread(target=write, args=(k, int(nbytes * share))) for k, share in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    shutil.rmtree(directory)
    return seconds


def check_every_sample(store_path: str, plan, keep) -> int:
    """Compare every stored sample with the GPU rows its pieces came from; returns how many were checked."""
    rows: dict[str, list[tuple[int, Piece]]] = {}
    for forward, pieces in enumerate(plan):
        for piece in pieces:
            rows.setdefault(piece.sample_id, []).append((forward, piece))
    store = hsdata.open(store_path)
    for sample_id in store.sample_ids:
        got = store.get(sample_id, fields=["aux_hidden_states", "hidden_states"])
        parts = sorted(rows[sample_id], key=lambda fp: fp[1].start)
        aux = torch.cat([keep[f][0][p.row:p.row + p.length] for f, p in parts]).cpu()
        final = torch.cat([keep[f][1][p.row:p.row + p.length] for f, p in parts]).cpu()
        if not (torch.equal(got["aux_hidden_states"].view(torch.int16), aux.view(torch.int16))
                and torch.equal(got["hidden_states"].view(torch.int16), final.view(torch.int16))):
            raise AssertionError(f"sample {sample_id} differs from the GPU's states")
    return len(store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="a folder on the disk to measure (removed between rounds)")
    parser.add_argument("--forwards", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compression", choices=["zstd", "lz4"], help="also capture into a store of this compression")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    model = build_model()
    plan, lengths = plan_forwards(args.forwards, args.seq)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, VOCAB, (1, args.seq), device="cuda", generator=g) for _ in range(args.forwards)]
    run(model, batches[:2], plan[:2], lengths, None, None)  # warm-up
    complete = {p.sample_id for pieces in plan for p in pieces if p.start + p.length == lengths[p.sample_id]}
    tensor_nbytes = [len(AUX_LAYERS) * 4096 * 2, 4096 * 2, 4, 1]  # per token: aux, final, input ids, loss mask
    token_nbytes = sum(tensor_nbytes)
    stored_tokens = sum(lengths[s] for s in complete)
    produced = args.forwards * args.seq * token_nbytes
    times: dict[str, list] = {"none": [], "hsdata_forwards": [], "hsdata_committed": [], "raw_1_stream": [],
                              "raw_4_streams": []}
    if args.compression:
        times.update({f"hsdata_{args.compression}_forwards": [], f"hsdata_{args.compression}_committed": []})
    checked = 0
    for r in range(args.rounds):
        times["none"].append(run(model, batches, plan, lengths, None, None)[0])
        shutil.rmtree(args.store, ignore_errors=True)
        writer = hsdata.create(args.store, hidden_size=4096, aux_layers=AUX_LAYERS, model="random/llama-3-8b")
        keep = [] if r == 0 else None
        forwards, committed = run(model, batches, plan, lengths, Capture(writer), keep)
        times["hsdata_forwards"].append(forwards)
        times["hsdata_committed"].append(committed)
        if keep is not None:
            checked = check_every_sample(args.store, plan, keep)
            del keep
        shutil.rmtree(args.store, ignore_errors=True)
        if args.compression:
            c = args.compression
            writer = hsdata.create(args.store, hidden_size=4096, aux_layers=AUX_LAYERS, model="random/llama-3-8b",
                                   compression=c)
            forwards, committed = run(model, batches, plan, lengths, Capture(writer), None)
            times[f"hsdata_{c}_forwards"].append(forwards)
            times[f"hsdata_{c}_committed"].append(committed)
            compressed_size = disk_bytes(args.store)
            shutil.rmtree(args.store, ignore_errors=True)
        nbytes = stored_tokens * token_nbytes
        raw_dir = args.store.rstrip("/") + "-raw"
        times["raw_1_stream"].append(raw_write(raw_dir, nbytes, [1.0]))
        times["raw_4_streams"].append(raw_write(raw_dir, nbytes, [n / token_nbytes for n in tensor_nbytes]))
    median = {k: float(np.median(v)) for k, v in times.items()}
    raw_best = min(median["raw_1_stream"], median["raw_4_streams"])
    stored = stored_tokens * token_nbytes
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "forwards": args.forwards, "seq": args.seq,
        "requests_stored": len(complete), "samples_checked_bit_exact": checked, "bytes_stored": stored,
        "seconds": times,
        "tokens_per_s": {"none": args.forwards * args.seq / median["none"],
                         "hsdata": args.forwards * args.seq / median["hsdata_forwards"]},
        "throughput_lost": 1 - median["none"] / median["hsdata_forwards"],
        "production_GBps": produced / median["none"] / 1e9,
        "extraction_GBps": stored / median["hsdata_committed"] / 1e9,
        "raw_write_GBps": {"1_stream": stored / median["raw_1_stream"] / 1e9,
                           "4_streams": stored / median["raw_4_streams"] / 1e9},
        "extraction_vs_raw_best": raw_best / median["hsdata_committed"],
    }
    if args.compression:
        c = args.compression
        result[f"{c}_size"] = compressed_size / stored
        result["tokens_per_s"][c] = args.forwards * args.seq / median[f"hsdata_{c}_forwards"]
        result[f"throughput_lost_{c}"] = 1 - median["none"] / median[f"hsdata_{c}_forwards"]
        result[f"extraction_GBps_{c}"] = stored / median[f"hsdata_{c}_committed"] / 1e9
        result[f"extraction_{c}_vs_uncompressed"] = median["hsdata_committed"] / median[f"hsdata_{c}_committed"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
