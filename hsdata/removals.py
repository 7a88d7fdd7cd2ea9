"""Removals: write-once Parquet tables in ``removals/`` that take committed rows and added masks out of a store.

Store files are never rewritten. To repair a store (a sample that should not be there, a wrong added loss
mask), a removal names exactly what it takes out: a manifest row by ``(sample_id, part, token_offset)``, an
added mask by ``(sample_id, mask_file)``. Readers, ``validate`` and ``gc`` apply every removal before anything
else; what a removal names stays on disk until ``hsdata gc`` finds shards no remaining row needs. A sample id whose rows are all
removed may be committed again; a removed mask may be replaced by adding a new one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import tables
from .errors import CorruptDataError
from .arrow import array_of, arrow_of, numpy_of, table_of, valid_of
from .io.storage import Storage

REMOVALS = "removals"
SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("part", pa.string()),  # with token_offset: the manifest row removed; else null
    pa.field("token_offset", pa.int64()),
    pa.field("mask_file", pa.string()),  # the masks/ file name whose mask for sample_id is removed; else null
    pa.field("reason", pa.string()),
    pa.field("created", pa.timestamp("us", tz="UTC"), nullable=False),
])


@dataclass(frozen=True)
class Removals:
    rows: frozenset[tuple[str, str, int]]  # (sample_id, part, token_offset)
    masks: frozenset[tuple[str, str]]  # (sample_id, mask_file)

    def drop_rows(self, rows: pa.Table) -> pa.Table:
        """``rows`` (manifest rows) without the removed ones."""
        if not self.rows or not len(rows):
            return rows
        # vectorized: only rows whose id some removal names are compared as (id, part, offset) tuples
        named = array_of(sorted({sample_id for sample_id, _, _ in self.rows}), pa.string())
        maybe = np.flatnonzero(numpy_of(pc.is_in(rows.column("sample_id"), value_set=named)))
        if not len(maybe):
            return rows
        some = rows.select(["sample_id", "part", "token_offset"]).take(arrow_of(maybe))
        keys = zip(some.column("sample_id").to_pylist(), some.column("part").to_pylist(),
                   some.column("token_offset").to_pylist())
        gone = maybe[np.fromiter((key in self.rows for key in keys), bool, len(maybe))]
        if not len(gone):
            return rows
        keep = np.ones(len(rows), bool)
        keep[gone] = False
        return rows.filter(arrow_of(keep))


def write(storage: Storage, *, rows: list[tuple[str, str, int]] = (), masks: list[tuple[str, str]] = (),
          reason: str | None = None) -> str | None:
    """Commit one removal file taking out ``rows`` ``(sample_id, part, token_offset)`` and ``masks``
    ``(sample_id, mask_file)``; returns its key (None: nothing to remove)."""
    entries = [(i, p, o, None) for i, p, o in rows] + [(i, None, None, f) for i, f in masks]
    if not entries:
        return None
    created = datetime.now(timezone.utc)
    table = table_of({"sample_id": [e[0] for e in entries], "part": [e[1] for e in entries],
                      "token_offset": [e[2] for e in entries], "mask_file": [e[3] for e in entries],
                      "reason": [reason] * len(entries), "created": [created] * len(entries)}, SCHEMA)
    writer = f"{created:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    return tables.write(storage, REMOVALS, writer, 0, table)


def load(storage: Storage) -> Removals:
    """Every removal of the store, verified."""
    table = tables.load(storage, REMOVALS, SCHEMA, _check_entries)
    ids, parts = table.column("sample_id").to_pylist(), table.column("part").to_pylist()
    offsets, files = table.column("token_offset").to_pylist(), table.column("mask_file").to_pylist()
    return Removals(rows=frozenset((i, p, o) for i, p, o in zip(ids, parts, offsets) if p is not None),
                    masks=frozenset((i, f) for i, f in zip(ids, files) if f is not None))


def _check_entries(name: str, table: pa.Table, where: str) -> None:
    """Each entry names a manifest row (part and token_offset) or an added mask (mask_file), not both."""
    row = valid_of(table.column("part"))
    offset = valid_of(table.column("token_offset"))
    mask = valid_of(table.column("mask_file"))
    if (row != offset).any() or (row == mask).any():
        raise CorruptDataError(f"{where}: a removal must name either a manifest row (part and token_offset) "
                               "or an added mask (mask_file)")
