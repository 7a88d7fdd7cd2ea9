"""Batches from Eagle3Dataset through DataLoader(pin_memory=True) onto a GPU: they arrive pinned, copy with
non_blocking=True bit-exact, and how the host-to-device copy compares with unpinned batches.

    python benchmarks/pinned_loader.py --dir /tmp/hsbench-pinned --gib 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

import hsdata
from hsdata.torch import Eagle3Dataset, ShardAwareSampler, collate_eagle3


def write_store(path: str, gib: float, hidden: int) -> None:
    """Random bf16 samples, lengths log-normal around 900 tokens (read_bench.py's, without its zarr import)."""
    rng = np.random.default_rng(0)
    budget, written = int(gib * 2**30 / (8 * hidden + 5)), 0
    with hsdata.create(path, hidden_size=hidden, aux_layers=[1, 2, 3], model="bench") as w:
        while written < budget:
            n = int(np.clip(rng.lognormal(np.log(900), 0.8), 32, 8192))
            w.add(f"s{written:09d}", input_ids=rng.integers(0, 150_000, n), loss_mask=rng.integers(0, 2, n),
                  aux_hidden_states=torch.randn(n, 3 * hidden, dtype=torch.bfloat16),
                  hidden_states=torch.randn(n, hidden, dtype=torch.bfloat16))
            written += n


def run(dataset, pin: bool, workers: int, check_every: int) -> dict:
    sampler = ShardAwareSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=collate_eagle3, num_workers=workers,
                        pin_memory=pin, multiprocessing_context="spawn" if workers else None)
    copy_s, nbytes, pinned, checked, started = 0.0, 0, True, 0, time.perf_counter()
    for step, batch in enumerate(loader):
        host = batch["aux_hidden_states"]
        pinned &= host.is_pinned()
        torch.cuda.synchronize()
        t = time.perf_counter()
        device = {k: v.cuda(non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        torch.cuda.synchronize()
        copy_s += time.perf_counter() - t
        nbytes += sum(v.numel() * v.element_size() for v in device.values())
        if step % check_every == 0:
            for b, sample_id in enumerate(batch["sample_id"]):
                n = min(4096, len(dataset.store.get(sample_id, fields=["input_ids"])["input_ids"]))
                want = dataset.store.get(sample_id)["aux_hidden_states"][:n]
                assert torch.equal(device["aux_hidden_states"][b, :n].view(torch.int16).cpu(), want.view(torch.int16))
                checked += 1
    total_s = time.perf_counter() - started
    return {"pin_memory": pin, "workers": workers, "all_pinned": bool(pinned), "samples_checked": checked,
            "seconds": total_s, "h2d_gb_per_s": nbytes / copy_s / 1e9, "h2d_seconds": copy_s, "batches": step + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    write_store(os.path.join(args.dir, "store"), args.gib, args.hidden)
    dataset = Eagle3Dataset(os.path.join(args.dir, "store"), max_length=4096)
    results = []
    for pin, workers in ((False, 0), (True, 0), (True, 2), (False, 0), (True, 0), (True, 2)):
        row = run(dataset, pin, workers, check_every=5)
        results.append(row)
        print(json.dumps(row))
    print(torch.cuda.get_device_name(), torch.__version__, hsdata.__version__)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
