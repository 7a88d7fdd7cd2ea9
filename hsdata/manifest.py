"""Manifests: Parquet files of committed sample rows. A sample exists once a manifest naming it is written.

Each file is write-once and named ``<part>.<seq>.<xxh3>.parquet`` (see tables.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import xxhash

from . import tables
from .errors import CorruptDataError
from .arrow import arrow_of, numpy_of, table_of, valid_of
from .ids import collision_candidates, hash_ids
from .layout import MANIFESTS
from .spec import TENSOR_NAMES
from .io.storage import Storage

MAX_TOKENS = 2**48  # bound on token_offset + num_tokens: sums of many rows stay exact in int64 (section 10)


def hash_column(tensor: str) -> str:
    return f"xxh3_{tensor}"


SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("part", pa.string(), nullable=False),
        pa.field("token_offset", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),
        *(pa.field(hash_column(t), pa.uint64(), nullable=t == "loss_mask") for t in TENSOR_NAMES),
        pa.field("created", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("meta", pa.string()),
    ]
)


def content_hash(data) -> int:
    """The per-sample hash of a tensor: xxh3-64 (seed 0) of its stored bytes (little-endian, C order)."""
    return xxhash.xxh3_64_intdigest(data)


def content_hasher() -> xxhash.xxh3_64:
    """A streaming form of :func:`content_hash`: ``update`` with the bytes in order, then ``intdigest()``."""
    return xxhash.xxh3_64()


@dataclass(frozen=True)
class Row:
    sample_id: str
    part: str
    token_offset: int
    num_tokens: int
    hashes: dict[str, int | None]  # None only for loss_mask: the sample has none
    meta: str | None
    created: datetime


def write(storage: Storage, part: str, seq: int, rows: list[Row]) -> str:
    """Commit ``rows``: one atomic, write-once manifest file. Returns its key."""
    columns = {
        "sample_id": [r.sample_id for r in rows],
        "part": [r.part for r in rows],
        "token_offset": [r.token_offset for r in rows],
        "num_tokens": [r.num_tokens for r in rows],
        **{hash_column(t): [r.hashes[t] for r in rows] for t in TENSOR_NAMES},
        "created": [r.created for r in rows],
        "meta": [r.meta for r in rows],
    }
    return tables.write(storage, MANIFESTS, part, seq, table_of(columns, SCHEMA))


def list_files(storage: Storage) -> list[str]:
    return tables.list_files(storage, MANIFESTS)


def decode(name: str, data: bytes, where: str) -> pa.Table:
    """Verify one manifest file against its name and schema; returns its rows (bounds not checked)."""
    table = tables.decode(name, data, SCHEMA, where)
    check_part(name, table, where)
    return table


def load(storage: Storage) -> pa.Table:
    """All committed rows of the store, verified (also each row's bounds), in manifest-name order then row order."""
    return tables.load(storage, MANIFESTS, SCHEMA, _check)


def check_part(name: str, table: pa.Table, where: str) -> None:
    parts = table.column("part").unique().to_pylist()
    writer = tables.FILE_NAME.match(name)["writer"]
    if parts not in ([], [writer]):
        raise CorruptDataError(f"{where}: manifest rows name parts {parts}, file name says {writer!r}")


def out_of_bounds(table: pa.Table) -> np.ndarray:
    """Positions of rows whose token range cannot be: token_offset < 0, num_tokens < 1, or an end beyond
    :data:`MAX_TOKENS`."""
    offset, length = numpy_of(table.column("token_offset")), numpy_of(table.column("num_tokens"))
    room = MAX_TOKENS - np.clip(offset, 0, MAX_TOKENS)
    return np.flatnonzero((offset < 0) | (offset > MAX_TOKENS) | (length < 1) | (length > room))


def bounds_message(token_offset: int, num_tokens: int) -> str:
    return (f"token_offset {token_offset}, num_tokens {num_tokens}: a row needs token_offset >= 0, "
            f"num_tokens >= 1 and token_offset + num_tokens <= 2**48")


def _check(name: str, table: pa.Table, where: str) -> None:
    check_part(name, table, where)
    bad = out_of_bounds(table)
    if len(bad):
        row = table.slice(int(bad[0]), 1).to_pylist()[0]
        more = f" (and {len(bad) - 1} more row(s))" if len(bad) > 1 else ""
        raise CorruptDataError(f"{where}: row {int(bad[0])} (sample {row['sample_id']!r}): "
                               f"{bounds_message(row['token_offset'], row['num_tokens'])}{more}")


def winners(rows: pa.Table) -> np.ndarray:
    """Positions (ascending) of the rows that serve their sample id: of rows sharing an id (writers raced on it),
    the earliest ``created`` wins, ties going to the earlier row (files in name order, rows in file order)."""
    return winners_and_hashes(rows)[0]


def winners_and_hashes(rows: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`winners`, and what finding them computed: every row's id hash (:func:`hsdata.ids.hash_ids`) and,
    when no id repeats, their :func:`hsdata.ids.sorted_keys` (else None); an :class:`hsdata.ids.IdIndex` reuses
    them. Vectorized: only rows whose id hash another row shares are compared as strings."""
    ids = rows.column("sample_id")
    hashes = hash_ids(ids)
    keys, candidates = collision_candidates(hashes)
    if not len(candidates):
        return np.arange(len(ids)), hashes, keys
    maybe = np.array(ids.take(arrow_of(candidates)).to_pylist(), dtype=object)  # str objects for these rows only
    created = numpy_of(rows.column("created").take(arrow_of(candidates)).cast(pa.int64()))
    by_time = np.lexsort((candidates, created))
    _, first = np.unique(maybe[by_time], return_index=True)
    if len(first) == len(candidates):  # hash prefixes collided, ids did not
        return np.arange(len(ids)), hashes, keys
    losers = np.setdiff1d(candidates, candidates[by_time[first]], assume_unique=True)
    return np.setdiff1d(np.arange(len(ids)), losers, assume_unique=True), hashes, None


def now() -> datetime:
    return datetime.now(timezone.utc)


def row_hashes(table: pa.Table) -> dict[str, np.ndarray]:
    """Hash columns as uint64 arrays (a missing loss mask's null reads 0: see :func:`has_loss_mask`)."""
    return {t: numpy_of(table.column(hash_column(t)), null_as=0) for t in TENSOR_NAMES}


def has_loss_mask(table: pa.Table) -> np.ndarray:
    return valid_of(table.column(hash_column("loss_mask")))
