"""Warm Loader epochs to the GPU with ``to_device`` taking its batches one ahead on a thread of their own, against
the feeder taking them itself (the code before), for the uncompressed store and the zstd store decoded on the GPU
(needs CUDA and nvCOMP).

It reads the two stores ``loader_bench.py --formats --compression zstd`` leaves in its ``--dir`` (``hsdata`` and
``hsdata-zstd``). Rounds are paired: each round runs every setting both ways, in alternating order; each setting
is a fresh Loader, one untimed epoch, then the median of three. Reported: the GB/s of the decoded states, and per
round zstd GPU decoding against the uncompressed Loader of the same way, workers and batch.

    cd benchmarks && python loader_bench.py --dir /tmp/lbz --gib 8 --parts warm --formats --compression zstd \\
        --methods '^Loader, 0 workers$'
    python taken_ahead_ab.py /tmp/lbz --rounds 2 --json results/taken_ahead_ab_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import gpu_decode_sweep
import hsdata
import hsdata.torch.device as device

SETTINGS = ((0, 1), (0, 4), (8, 1), (8, 4))  # (workers, batch)
TAKEN_AHEAD = device._TakenAhead


def warm_epoch_s(path: str, workers: int, batch: int, decode: str, ahead_thread: bool) -> float:
    """gpu_decode_sweep's warm epoch (the default ``ahead``, bundles and streams), with the batches taken on a
    thread of their own or by the feeder."""
    device._TakenAhead = TAKEN_AHEAD if ahead_thread else (lambda batches: batches)
    try:
        return gpu_decode_sweep.warm_epoch_s(path, workers, batch, decode)
    finally:
        device._TakenAhead = TAKEN_AHEAD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="loader_bench.py's --dir, holding hsdata/ and hsdata-zstd/")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    store = hsdata.open(f"{args.dir}/hsdata")
    gb = store.num_tokens * store.spec.token_nbytes / 1e9
    rounds = []
    for r in range(args.rounds):
        seconds = {}
        for ahead_thread in ((True, False) if r % 2 == 0 else (False, True)):
            for workers, batch in SETTINGS:
                for name, root, decode in (("plain", "hsdata", "host"), ("zstd gpu", "hsdata-zstd", "device")):
                    key = f"{'thread' if ahead_thread else 'feeder'} {name} w{workers} b{batch}"
                    seconds[key] = warm_epoch_s(f"{args.dir}/{root}", workers, batch, decode, ahead_thread)
                    print(f"round {r}: {key}: {gb / seconds[key]:.2f} GB/s", flush=True)
        rounds.append(seconds)
    print(f"\n{gb:.2f} GB of states; median GB/s over {args.rounds} rounds; x = zstd GPU against plain, same way")
    print("| workers, batch | feeder: plain | feeder: zstd GPU (x) | thread: plain | thread: zstd GPU (x) |")
    print("|---|---:|---:|---:|---:|")
    for workers, batch in SETTINGS:
        cells = [f"{workers}, {batch}"]
        for way in ("feeder", "thread"):
            plain = statistics.median(gb / s[f"{way} plain w{workers} b{batch}"] for s in rounds)
            zstd = statistics.median(gb / s[f"{way} zstd gpu w{workers} b{batch}"] for s in rounds)
            ratios = ", ".join(f"{s[f'{way} plain w{workers} b{batch}'] / s[f'{way} zstd gpu w{workers} b{batch}']:.2f}"
                               for s in rounds)
            cells += [f"{plain:.2f}", f"{zstd:.2f} ({ratios})"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_gb": gb, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
