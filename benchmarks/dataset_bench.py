"""Samples through a torch DataLoader: hsdata's Eagle3Dataset vs per-sample ``torch.save`` files read the way
SpecForge's offline dataset reads them (``torch.load`` of one file per sample), vs raw reads of the same bytes.

The same samples in the same random order for all; batch size 1. hsdata runs twice: in the training process
(``num_workers=0``, reading ahead on threads once told the order) and with ``--workers`` worker processes, like
the ``torch.save`` files. Raw reads run sample after sample on one thread, and with ``--workers`` threads per
sample in 8 MiB ranges. Cold passes drop the page cache first (root); warm passes follow an untimed pass.
Ratios are medians over rounds of (raw pass time / method pass time), each round's passes run back to back.

    python benchmarks/dataset_bench.py --dir /tmp/hsbench-dataset --gib 3 --workers 4
    python benchmarks/dataset_bench.py --dir /tmp/hsbench-dataset --gib 3 --repeat 7 --modes cold --in-process-only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hsdata.torch import Eagle3Dataset
from read_bench import build, interleaved_times, make_lengths, read_raw, read_raw_parallel, sample_arrays


class TorchSaveDir(Dataset):
    """SpecForge-style offline data: ``rows_<g>-<g+2000>/data_<i>.ckpt`` holding one sample's dict."""

    def __init__(self, root: str, count: int):
        self.paths = [os.path.join(root, f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}", f"data_{i}.ckpt")
                      for i in range(count)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        return torch.load(self.paths[i], weights_only=False)


def write_torch_save_dir(root: str, lengths: list[int], hidden: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**16, 2 * max(lengths) * 3 * hidden, dtype=np.uint16)
    for i, n in enumerate(lengths):
        s = sample_arrays(pool, rng, n, hidden, 3)
        path = TorchSaveDir(root, i + 1).paths[i]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"input_ids": s["input_ids"].long(), "loss_mask": s["loss_mask"].long(),
                    "aux_hidden_state": s["aux_hidden_states"].unsqueeze(0).clone(),
                    "hidden_state": s["hidden_states"].unsqueeze(0).clone()}, path)


def through_loader(dataset: Dataset, order, workers: int) -> int:
    if isinstance(dataset, Eagle3Dataset):
        dataset.expect(order)  # what ShardAwareSampler does; used only by the process that reads
    loader = DataLoader(dataset, batch_size=None, sampler=[int(i) for i in order], num_workers=workers)
    total = 0
    for item in loader:
        total += sum(v.numel() * v.element_size() for v in item.values() if isinstance(v, torch.Tensor))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    parser.add_argument("--in-process-only", action="store_true",
                        help="only the raw reads and hsdata in the training process (no workers, no torch.save files)")
    parser.add_argument("--json", help="also write results here")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    lengths = make_lengths(np.random.default_rng(0), int(args.gib * 2**30 / (8 * args.hidden + 5)))
    built = build(args.dir, lengths, args.hidden, 3, [None], 0)
    saves = os.path.join(args.dir, "torch-save")
    if not args.in_process_only:
        write_torch_save_dir(saves, lengths, args.hidden, 0)
    order = np.random.default_rng(1).permutation(len(lengths))
    methods = {
        "raw pread (same bytes)": lambda: read_raw(built["flat"], built["ranges"], order),
        f"raw pread, {args.workers} threads": lambda: read_raw_parallel(built["flat"], built["ranges"], order,
                                                                        args.workers, 8 << 20),
        "hsdata Eagle3Dataset, in process": lambda: through_loader(Eagle3Dataset(built["stores"][None]), order, 0),
        f"hsdata Eagle3Dataset, {args.workers} workers": lambda: through_loader(
            Eagle3Dataset(built["stores"][None]), order, args.workers),
        f"torch.save per sample, {args.workers} workers": lambda: through_loader(
            TorchSaveDir(saves, len(lengths)), order, args.workers),
    }
    if args.in_process_only:
        methods = {name: run for name, run in methods.items() if "workers" not in name}
    gb = built["bytes"] / 1e9
    print(f"{len(lengths)} samples, {sum(lengths)} tokens, {gb:.2f} GB, hidden {args.hidden}")
    raw_names = ("raw pread (same bytes)", f"raw pread, {args.workers} threads")
    rows = []
    for mode in args.modes:
        times = interleaved_times(methods, mode=mode, repeat=args.repeat)
        for name, t in times.items():
            seconds = float(np.median(t))
            paired = [float(np.median([r / x for r, x in zip(times[raw], t)])) for raw in raw_names]
            print(f"{mode:4} {name:38} {seconds:6.2f} s  {len(lengths) / seconds:7.1f} samples/s  "
                  f"{gb / seconds:5.2f} GB/s  x raw 1 thread {paired[0]:4.2f}  x raw {args.workers} threads "
                  f"{paired[1]:4.2f}   (all {[round(x, 2) for x in t]})")
            rows.append({"mode": mode, "method": name, "s": seconds, "samples_per_s": len(lengths) / seconds,
                         "GB_per_s": gb / seconds, "x_raw_1_thread": paired[0],
                         f"x_raw_{args.workers}_threads": paired[1], "all_s": t})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": len(lengths), "tokens": int(sum(lengths)), "GB": gb,
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
