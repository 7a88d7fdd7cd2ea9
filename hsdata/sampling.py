"""Sample orders as small pure functions: shard-aware shuffling, the split across ranks, held-out splits and
mixtures of sources.

An epoch's order is a function of (storage order, seed, epoch) alone, the same on every rank and for every world
size, so resuming is: recompute the order, skip what was consumed, split the rest among the ranks there are now.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import xxhash


def storage_order(parts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sample indices in the order their bytes lie on disk (part, then token offset)."""
    return np.lexsort((offsets, parts))


def shard_aware_order(storage: np.ndarray, *, seed: int, epoch: int, block_size: int, window: int) -> np.ndarray:
    """A shuffled epoch that keeps reads local.

    ``storage`` (sample indices in on-disk order) is cut into blocks of ``block_size`` neighbouring samples; the
    blocks are permuted, then samples are shuffled within each run of ``window`` consecutive blocks. So at any
    time the reads come from ``window`` blocks, and every sample can land anywhere inside its window.
    """
    if block_size < 1 or window < 1:
        raise ValueError(f"block_size and window must be >= 1, got {block_size} and {window}")
    rng = np.random.default_rng([seed, epoch])
    blocks = [storage[i : i + block_size] for i in range(0, len(storage), block_size)]
    order = [blocks[b] for b in rng.permutation(len(blocks))]
    out = [rng.permutation(np.concatenate(order[i : i + window])) for i in range(0, len(order), window)]
    return np.concatenate(out) if out else storage[:0]


def rank_indices(order: np.ndarray, *, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """This rank's share of ``order``: every ``world_size``-th sample from position ``rank``, all ranks equal.

    Interleaving means that after each rank took k samples, exactly the first ``k * world_size`` of ``order``
    were used, whatever the world size: that is what makes resuming on another world size exact. Equal counts
    come from dropping the tail (``drop_last``) or repeating the order's start.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    n = len(order)
    if drop_last:
        order = order[: n - n % world_size]
    elif n % world_size:
        order = np.concatenate([order, np.resize(order, world_size - n % world_size)]) if n else order
    return order[rank::world_size]


def adjacency_kept(storage: np.ndarray, order: np.ndarray) -> float:
    """Shuffle quality: the share of consecutive pairs in ``order`` that are also neighbours on disk
    (about 2/n for a uniform random permutation, 1.0 for no shuffle)."""
    if len(order) < 2:
        return 1.0
    position = np.empty(len(storage), dtype=np.int64)
    position[storage] = np.arange(len(storage))
    steps = np.abs(np.diff(position[order]))
    return float((steps == 1).mean())


def token_budget_batches(order: np.ndarray, lengths: np.ndarray, *, max_tokens: int, padded: bool,
                         sort_window: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Cut ``order`` into batches of at most ``max_tokens`` tokens, grouping samples of similar length.

    Each run of ``sort_window`` consecutive samples of ``order`` is sorted by length and cut greedily: a batch
    costs ``count * longest`` tokens when ``padded`` (padding collate) and ``sum(lengths)`` when packed. The
    batches of a run are then shuffled, so lengths do not rise steadily through the epoch. A sample longer than
    ``max_tokens`` forms a batch of its own. Deterministic per (seed, epoch).
    """
    if max_tokens < 1 or sort_window < 1:
        raise ValueError(f"max_tokens and sort_window must be >= 1, got {max_tokens} and {sort_window}")
    rng = np.random.default_rng([seed, epoch, 1])
    batches: list[np.ndarray] = []
    for start in range(0, len(order), sort_window):
        run = order[start : start + sort_window]
        run = run[np.argsort(lengths[run], kind="stable")]
        cut, first, longest, total = [], 0, 0, 0
        for k, n in enumerate(lengths[run].tolist()):
            longest, total = max(longest, n), total + n
            cost = (k - first + 1) * longest if padded else total
            if cost > max_tokens and k > first:
                cut.append(k)
                first, longest, total = k, n, n
        pieces = np.split(run, cut)
        batches += [pieces[b] for b in rng.permutation(len(pieces))]
    return batches


def held_out(sample_ids: list[str], fraction: float, *, seed: int) -> np.ndarray:
    """Which samples a ``fraction`` split holds out: xxh3-64 of the id (seeded) below ``fraction * 2**64``.

    A sample's side depends on its id and the seed alone, so it stays put when the store grows or is reordered.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the held-out fraction must be in [0, 1], got {fraction}")
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    hashes = np.fromiter((xxhash.xxh3_64_intdigest(s.encode(), seed) for s in sample_ids), dtype=np.uint64,
                         count=len(sample_ids))
    return hashes < np.uint64(min(int(fraction * 2**64), 2**64 - 1)) if fraction < 1.0 else np.ones(len(hashes), bool)


def mixture_counts(weights, total: int) -> np.ndarray:
    """Samples each source gives an epoch of ``total``: proportional to ``weights``, rounded by largest remainder
    (ties to the earlier source), so they sum to ``total`` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative finite numbers, not all zero, got {list(weights)}")
    if not isinstance(total, (int, np.integer)) or total < 0:
        raise ValueError(f"samples per epoch must be an int >= 0, got {total!r}")
    exact = w / w.sum() * int(total)
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: int(total) - int(counts.sum())]] += 1
    return counts


def stream_slice(pass_order: Callable[[int], np.ndarray], size: int, start: int, count: int) -> np.ndarray:
    """Positions ``[start, start + count)`` of the endless stream ``pass_order(0), pass_order(1), ...`` (each pass
    an order of ``size`` items): a source drawn ``count`` times an epoch sees every item before any repeats."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    first, last = start // size, (start + count - 1) // size
    stream = np.concatenate([pass_order(p) for p in range(first, last + 1)])
    return stream[start - first * size :][:count]


def interleave(counts: np.ndarray, *, seed: int, epoch: int) -> np.ndarray:
    """The source of each position of a mixed epoch: ``counts[k]`` times ``k``, spread uniformly at random."""
    rng = np.random.default_rng([seed, epoch, 2])
    return rng.permutation(np.repeat(np.arange(len(counts)), counts))


def source_seed(seed: int, source: int) -> int:
    """The seed of one source of a mixture: distinct sources get unrelated orders."""
    return int(np.random.SeedSequence([seed, source]).generate_state(1)[0])
