"""Manifests: Parquet files of committed sample rows. A sample exists once a manifest naming it is written.

Each file is write-once and named ``<part>.<seq>.<xxh3>.parquet``, where ``<xxh3>`` is the xxh3-64 of the
file's own bytes (16 hex digits), so a reader verifies every manifest before trusting it.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from .errors import CorruptDataError
from .layout import MANIFESTS
from .spec import TENSOR_NAMES
from .storage import Storage

FILE_NAME = re.compile(r"^(?P<part>[A-Za-z0-9_-]+)\.(?P<seq>\d{8})\.(?P<hash>[0-9a-f]{16})\.parquet$")


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


def encode(rows: list[Row]) -> bytes:
    columns = {
        "sample_id": [r.sample_id for r in rows],
        "part": [r.part for r in rows],
        "token_offset": [r.token_offset for r in rows],
        "num_tokens": [r.num_tokens for r in rows],
        **{hash_column(t): [r.hashes[t] for r in rows] for t in TENSOR_NAMES},
        "created": [r.created for r in rows],
        "meta": [r.meta for r in rows],
    }
    buf = io.BytesIO()
    pq.write_table(pa.table(columns, schema=SCHEMA), buf, compression="zstd", write_page_checksum=True)
    return buf.getvalue()


def file_name(part: str, seq: int, data: bytes) -> str:
    return f"{part}.{seq:08d}.{xxhash.xxh3_64_hexdigest(data)}.parquet"


def write(storage: Storage, part: str, seq: int, rows: list[Row]) -> str:
    """Commit ``rows``: one atomic, write-once manifest file. Returns its key."""
    data = encode(rows)
    key = f"{MANIFESTS}/{file_name(part, seq, data)}"
    storage.write_bytes(key, data)
    return key


def list_files(storage: Storage) -> list[str]:
    """Committed manifest file names, in (part, seq) order; anything else in the folder is ignored."""
    return [n for n in storage.list(MANIFESTS) if FILE_NAME.match(n)]


def decode(name: str, data: bytes, where: str) -> pa.Table:
    """Verify one manifest file against its name and schema; returns its rows."""
    match = FILE_NAME.match(name)
    computed = xxhash.xxh3_64_hexdigest(data)
    if computed != match["hash"]:
        raise CorruptDataError(f"{where}: manifest checksum mismatch (name says {match['hash']}, bytes hash to {computed})")
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as e:
        raise CorruptDataError(f"{where}: unreadable manifest: {e}") from None
    if not table.schema.equals(SCHEMA, check_metadata=False):
        raise CorruptDataError(f"{where}: manifest schema differs from hsdata's:\n{table.schema}")
    parts = table.column("part").unique().to_pylist()
    if parts not in ([], [match["part"]]):
        raise CorruptDataError(f"{where}: manifest rows name parts {parts}, file name says {match['part']!r}")
    return table


def load(storage: Storage) -> pa.Table:
    """All committed rows of the store, verified, in manifest-name order then row order."""
    names = list_files(storage)
    keys = [f"{MANIFESTS}/{n}" for n in names]
    contents = storage.fs.cat([storage.path(k) for k in keys]) if keys else {}
    tables = [decode(n, contents[storage.path(k)], storage.describe(k)) for n, k in zip(names, keys)]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def now() -> datetime:
    return datetime.now(timezone.utc)


def row_hashes(table: pa.Table) -> dict[str, np.ndarray]:
    """Hash columns as uint64 arrays (a missing loss mask's null reads 0: see :func:`has_loss_mask`)."""
    return {t: table.column(hash_column(t)).fill_null(0).to_numpy() for t in TENSOR_NAMES}


def has_loss_mask(table: pa.Table) -> np.ndarray:
    return table.column(hash_column("loss_mask")).is_valid().to_numpy(zero_copy_only=False)
