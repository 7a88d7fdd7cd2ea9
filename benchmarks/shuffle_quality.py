"""How well ShardAwareSampler's order mixes, against a full random permutation, and what it keeps local.

For an epoch of ``--samples`` samples in on-disk order, three orders: storage order (no shuffle), hsdata's
shard-aware order (blocks of ``--block-size`` neighbours permuted, then shuffled within windows of ``--window``
blocks) and a uniform random permutation. Measures:
  adjacency kept     share of consecutive pairs that are also on-disk neighbours (1.0 unshuffled, ~2/n random);
  mean displacement  mean |new position - old position| / n (1/3 for a uniform permutation);
  rank correlation   Spearman correlation of new and old positions (1 unshuffled, ~0 random);
  blocks per 1,024   distinct on-disk blocks of 64 samples touched by 1,024 consecutive reads (the read
                     locality the block shuffle keeps; 1,024 / 64 = 16 is perfectly sequential).

    python benchmarks/shuffle_quality.py --samples 300000
"""

from __future__ import annotations

import argparse

import numpy as np

from hsdata import sampling


def measures(storage: np.ndarray, order: np.ndarray) -> dict[str, float]:
    n = len(storage)
    position = np.empty(n, dtype=np.int64)
    position[storage] = np.arange(n)
    old = position[order]
    new = np.arange(n)
    blocks = old // 64
    windows = [len(np.unique(blocks[i : i + 1024])) for i in range(0, n - 1023, 1024)]
    return {
        "adjacency kept": sampling.adjacency_kept(storage, order),
        "mean displacement": float(np.abs(old - new).mean() / n),
        "rank correlation": float(np.corrcoef(old, new)[0, 1]),  # positions are ranks: Pearson = Spearman
        "blocks per 1,024 reads": float(np.mean(windows)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300_000)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--window", type=int, default=16)
    args = parser.parse_args()
    storage = np.arange(args.samples)
    orders = {
        "storage order (no shuffle)": storage,
        f"shard-aware (block {args.block_size}, window {args.window})": sampling.shard_aware_order(
            storage, seed=0, epoch=0, block_size=args.block_size, window=args.window),
        "uniform random permutation": np.random.default_rng(0).permutation(args.samples),
    }
    rows = {name: measures(storage, order) for name, order in orders.items()}
    keys = list(next(iter(rows.values())))
    print("| order | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.4f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
