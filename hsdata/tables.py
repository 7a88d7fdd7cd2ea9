"""Write-once Parquet tables in a folder, each named ``<writer>.<seq>.<xxh3>.parquet`` after its own bytes.

``<writer>`` is the writing process's unique name, ``<seq>`` its counter (8 digits) and ``<xxh3>`` the xxh3-64
of the file (16 hex digits), so a reader verifies every file before trusting it. Manifests and loss-mask tables
are stored this way.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from .errors import CorruptDataError
from .storage import Storage

FILE_NAME = re.compile(r"^(?P<writer>[A-Za-z0-9_-]+)\.(?P<seq>\d{8})\.(?P<hash>[0-9a-f]{16})\.parquet$")


def write(storage: Storage, folder: str, writer: str, seq: int, table: pa.Table) -> str:
    """Write ``table`` as one atomic, write-once file; returns its key."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    key = f"{folder}/{writer}.{seq:08d}.{xxhash.xxh3_64_hexdigest(data)}.parquet"
    storage.write_bytes(key, data)
    return key


def list_files(storage: Storage, folder: str) -> list[str]:
    """Names of the committed files in ``folder``, in (writer, seq) order; anything else is ignored."""
    return [n for n in storage.list(folder) if FILE_NAME.match(n)]


def decode(name: str, data: bytes, schema: pa.Schema, where: str) -> pa.Table:
    """Verify one file against its name and ``schema``; returns its rows."""
    match = FILE_NAME.match(name)
    computed = xxhash.xxh3_64_hexdigest(data)
    if computed != match["hash"]:
        raise CorruptDataError(f"{where}: checksum mismatch (name says {match['hash']}, bytes hash to {computed})")
    try:
        # Arrow must never hold the Python bytes: a worker thread dropping the last reference to them at
        # interpreter exit takes the GIL and aborts the process ("terminate called without an active exception",
        # apache/arrow#34314). So: an Arrow-owned copy, decoded on this thread (pq.read_table goes through the
        # async dataset scanner, whose threads outlive the call).
        copy = pa.BufferOutputStream()
        copy.write(data)
        table = pq.ParquetFile(pa.BufferReader(copy.getvalue())).read(use_threads=False)
    except (pa.ArrowException, OSError) as e:
        raise CorruptDataError(f"{where}: unreadable Parquet: {e}") from None
    if not table.schema.equals(schema, check_metadata=False):
        raise CorruptDataError(f"{where}: schema differs from hsdata's:\n{table.schema}")
    return table


def load(storage: Storage, folder: str, schema: pa.Schema, check=None) -> pa.Table:
    """Every file of ``folder``, verified (and passed to ``check(name, table, where)``), concatenated in order."""
    names = list_files(storage, folder)
    keys = [f"{folder}/{n}" for n in names]
    tables = []
    for name, key, data in zip(names, keys, storage.read_many(keys)):
        table = decode(name, data, schema, storage.describe(key))
        if check is not None:
            check(name, table, storage.describe(key))
        tables.append(table)
    return pa.concat_tables(tables) if tables else schema.empty_table()
