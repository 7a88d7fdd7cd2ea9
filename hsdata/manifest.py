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
from .layout import MANIFESTS
from .spec import TENSOR_NAMES
from .storage import Storage


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
    return tables.write(storage, MANIFESTS, part, seq, pa.table(columns, schema=SCHEMA))


def list_files(storage: Storage) -> list[str]:
    return tables.list_files(storage, MANIFESTS)


def decode(name: str, data: bytes, where: str) -> pa.Table:
    """Verify one manifest file against its name and schema; returns its rows."""
    table = tables.decode(name, data, SCHEMA, where)
    _check_part(name, table, where)
    return table


def load(storage: Storage) -> pa.Table:
    """All committed rows of the store, verified, in manifest-name order then row order."""
    return tables.load(storage, MANIFESTS, SCHEMA, _check_part)


def _check_part(name: str, table: pa.Table, where: str) -> None:
    parts = table.column("part").unique().to_pylist()
    writer = tables.FILE_NAME.match(name)["writer"]
    if parts not in ([], [writer]):
        raise CorruptDataError(f"{where}: manifest rows name parts {parts}, file name says {writer!r}")


def now() -> datetime:
    return datetime.now(timezone.utc)


def row_hashes(table: pa.Table) -> dict[str, np.ndarray]:
    """Hash columns as uint64 arrays (a missing loss mask's null reads 0: see :func:`has_loss_mask`)."""
    return {t: table.column(hash_column(t)).fill_null(0).to_numpy() for t in TENSOR_NAMES}


def has_loss_mask(table: pa.Table) -> np.ndarray:
    return table.column(hash_column("loss_mask")).is_valid().to_numpy(zero_copy_only=False)
