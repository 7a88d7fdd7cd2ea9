"""Loss masks added after the fact: Parquet tables in ``masks/`` that give a sample its ``loss_mask``.

The server hook stores hidden states without loss masks (the server cannot know which tokens are the
assistant's); the client that built the prompts adds them here, keyed by sample id, once the samples are
committed (``hsdata.add_loss_masks``, in repair.py, checks that). A mask named by a removal is skipped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import removals, tables
from .arrow import array_of, arrow_of, numpy_of, table_of
from .ids import IdIndex
from .io.storage import Storage

MASKS = "masks"
SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("loss_mask", pa.large_binary(), nullable=False),  # one byte per token, 0 or 1
])


@dataclass(frozen=True)
class Entry:
    mask_file: str  # the file's name in masks/
    sample_id: str
    mask: bytes


def write(storage: Storage, masks: dict[str, bytes]) -> str:
    """Commit ``{sample_id: one byte per token}`` as one atomic, write-once file; returns its key."""
    writer = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    table = table_of({"sample_id": list(masks), "loss_mask": list(masks.values())}, SCHEMA)
    return tables.write(storage, MASKS, writer, 0, table)


def entries(storage: Storage) -> list[Entry]:
    """Every added mask no removal names, verified, in file order then row order."""
    files: list[str] = []
    table = tables.load(storage, MASKS, SCHEMA, lambda name, rows, where: files.extend([name] * len(rows)))
    removed = removals.load(storage).masks
    return [Entry(f, i, m) for f, i, m in zip(files, table.column("sample_id").to_pylist(),
                                              table.column("loss_mask").to_pylist()) if (i, f) not in removed]


class AddedMasks:
    """The added mask of each sample id, as :func:`load` gives them, kept in the Arrow columns (no Python object
    per mask until one is asked for); the id index is built at the first lookup."""

    def __init__(self, ids: pa.ChunkedArray, masks: pa.ChunkedArray):
        self._ids, self._masks = ids, masks
        self._index: IdIndex | None = None

    def get(self, sample_id: str, default: bytes | None = None) -> bytes | None:
        if not len(self._ids):
            return default
        if self._index is None:
            self._index = IdIndex(self._ids)
        position = self._index.find(sample_id)  # of equal ids, the first: the first file's mask
        return default if position is None else self._masks[position].as_py()

    def __contains__(self, sample_id: object) -> bool:
        return self.get(sample_id) is not None  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(pc.unique(self._ids)) if len(self._ids) else 0


def load_lookup(storage: Storage, removed: frozenset[tuple[str, str]] | None = None) -> AddedMasks:
    """:func:`load` without a dict: every added mask no removal names (``removed``: the store's removal masks, read
    when not given), verified, looked up by id through an :class:`AddedMasks`."""
    counts: list[tuple[str, int]] = []
    table = tables.load(storage, MASKS, SCHEMA, lambda name, rows, where: counts.append((name, len(rows))))
    removed = removals.load(storage).masks if removed is None else removed
    ids, values = table.column("sample_id"), table.column("loss_mask")
    if removed and len(table):
        named = array_of(sorted({sample_id for sample_id, _ in removed}), pa.string())
        maybe = np.flatnonzero(numpy_of(pc.is_in(ids, value_set=named)))
        if len(maybe):
            files = [name for name, _ in counts]
            file_of = np.repeat(np.arange(len(counts)), [n for _, n in counts])[maybe]
            named_ids = ids.take(arrow_of(maybe)).to_pylist()
            gone = [k for k, sample_id, f in zip(maybe.tolist(), named_ids, file_of.tolist())
                    if (sample_id, files[f]) in removed]
            if gone:
                keep = np.ones(len(table), bool)
                keep[gone] = False
                kept = table.filter(arrow_of(keep))
                ids, values = kept.column("sample_id"), kept.column("loss_mask")
    return AddedMasks(ids, values)


def load(storage: Storage) -> dict[str, bytes]:
    """The added mask of each sample id: the first (in file order) that no removal names."""
    out: dict[str, bytes] = {}
    for entry in entries(storage):
        out.setdefault(entry.sample_id, entry.mask)
    return out
