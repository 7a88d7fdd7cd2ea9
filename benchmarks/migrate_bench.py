"""Disk and time of moving a dump into hsdata and back: writes a SpecForge (or ModelOpt / speculators) dump of
random bf16 states, then times ``hsdata import`` (verification included) and ``hsdata export``.

    flock /tmp/hsdata-bench.lock .venv/bin/python benchmarks/migrate_bench.py --samples 32 --tokens 2048 \\
        --hidden 4096 [--format specforge] [--workdir /tmp/migrate-bench]

Prints one JSON document: source, store and export bytes on disk, seconds and MiB/s of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch


def disk_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_blocks * 512 for f in files)
    return total


def make_source(fmt: str, root: str, samples: int, tokens: int, hidden: int) -> int:
    g = torch.Generator().manual_seed(0)
    payload = 0
    for i in range(samples):
        ids = torch.randint(0, 100_000, (tokens,), generator=g)
        mask = torch.ones(tokens, dtype=torch.int64)
        aux = torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16)
        final = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        payload += (aux.numel() + final.numel()) * 2 + tokens * 16
        if fmt == "specforge":
            path = os.path.join(root, "rows_0-2000", f"data_{i}.ckpt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"input_ids": ids, "loss_mask": mask, "hidden_state": final[None], "aux_hidden_state": aux[None]},
                       path)
        elif fmt == "modelopt":
            os.makedirs(root, exist_ok=True)
            torch.save({"input_ids": ids, "hidden_states": final, "aux_hidden_states": aux, "loss_mask": mask,
                        "conversation_id": i}, os.path.join(root, f"{i}.pt"))
        else:
            raise SystemExit("this benchmark writes specforge or modelopt dumps")
    return payload


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="specforge", choices=["specforge", "modelopt"])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--workdir", default="/tmp/migrate-bench")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    src, store, out = (os.path.join(args.workdir, n) for n in ("src", "store", "out"))
    payload = make_source(args.format, src, args.samples, args.tokens, args.hidden)
    subprocess.run(["sync"], check=False)
    hsdata = [sys.executable, "-m", "hsdata"]
    import_s = timed([*hsdata, "import", "--from", args.format, src, store, "--aux-layers", "1", "15", "28"])
    resume_s = timed([*hsdata, "import", "--from", args.format, src, store, "--aux-layers", "1", "15", "28"])
    export_s = timed([*hsdata, "export", "--to", args.format, store, out])
    mib = payload / 2**20
    result = {
        "format": args.format, "samples": args.samples, "tokens_per_sample": args.tokens, "hidden": args.hidden,
        "payload_mib": round(mib, 1), "source_disk_mib": round(disk_bytes(src) / 2**20, 1),
        "store_disk_mib": round(disk_bytes(store) / 2**20, 1), "export_disk_mib": round(disk_bytes(out) / 2**20, 1),
        "import_s": round(import_s, 2), "import_mib_s": round(mib / import_s, 1),
        "resume_noop_s": round(resume_s, 2), "export_s": round(export_s, 2), "export_mib_s": round(mib / export_s, 1),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
