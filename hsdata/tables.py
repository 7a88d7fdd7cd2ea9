"""Write-once Parquet tables in a folder, each named ``<writer>.<seq>.<xxh3>.parquet`` after its own bytes.

``<writer>`` is the writing process's unique name, ``<seq>`` its counter (8 digits) and ``<xxh3>`` the xxh3-64
of the file (16 hex digits), so a reader verifies every file before trusting it. Manifests, loss-mask tables and
removals are stored this way. In their folders, a visible (not dot-hidden) entry that is not a file of this name
is an error, never skipped; dot-hidden files are writes in progress. A table file is at most ``MAX_TABLE_BYTES``
on disk and decoded.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from .errors import CorruptDataError
from .io.storage import Storage

FILE_NAME = re.compile(r"^(?P<writer>[A-Za-z0-9_-]+)\.(?P<seq>\d{8})\.(?P<hash>[0-9a-f]{16})\.parquet$")
FILE_PATTERN = "<writer>.<8 digits>.<16 lower-case hex digits>.parquet (writer: letters, digits, '_', '-')"
DECODE_THREADS = min(4, os.cpu_count() or 1)
PARALLEL_DECODE_BYTES = 1 << 20  # fewer bytes of table files are decoded on the calling thread
MAX_TABLE_BYTES = 4 << 30  # per file, on disk and decoded: a manifest row is ~100 bytes, a mask 1 byte per token


def write(storage: Storage, folder: str, writer: str, seq: int, table: pa.Table) -> str:
    """Write ``table`` as one atomic, write-once file; returns its key."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    key = f"{folder}/{writer}.{seq:08d}.{xxhash.xxh3_64_hexdigest(data)}.parquet"
    storage.write_bytes(key, data)
    return key


def list_files(storage: Storage, folder: str) -> list[str]:
    """Names of the committed files in ``folder``, in (writer, seq) order. A visible name that does not fit
    :data:`FILE_NAME` raises :class:`CorruptDataError` (a store must never look emptier than it is)."""
    names = storage.list(folder)
    for name in names:
        if not FILE_NAME.match(name):
            raise CorruptDataError(f"{storage.describe(f'{folder}/{name}')}: not a table file name; every visible "
                                   f"file in {folder}/ must be named {FILE_PATTERN}")
    return names


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
        file = pq.ParquetFile(pa.BufferReader(copy.getvalue()))
        declared = sum(file.metadata.row_group(g).total_byte_size for g in range(file.metadata.num_row_groups))
        table = file.read(use_threads=False) if 0 <= declared <= MAX_TABLE_BYTES else None
    except (pa.ArrowException, OSError, MemoryError) as e:  # ArrowMemoryError is both
        raise CorruptDataError(f"{where}: unreadable Parquet: {type(e).__name__}: {e}") from None
    if table is None:
        raise CorruptDataError(f"{where}: its footer declares {declared:,} bytes of data; at most "
                               f"{MAX_TABLE_BYTES:,} are allowed")
    if not table.schema.equals(schema, check_metadata=False):
        raise CorruptDataError(f"{where}: schema differs from hsdata's:\n{table.schema}")
    return table


def load(storage: Storage, folder: str, schema: pa.Schema, check=None) -> pa.Table:
    """Every file of ``folder``, verified (and passed to ``check(name, table, where)``), concatenated in order.

    Several files are decoded on up to ``DECODE_THREADS`` Python threads (Parquet decoding releases the GIL),
    each decoding its own Arrow-owned copy synchronously (:func:`decode`); they are joined before this returns, and
    ``check`` runs on the calling thread, in file order."""
    names = list_files(storage, folder)
    keys = [f"{folder}/{n}" for n in names]
    datas = storage.read_many(keys, max_bytes=MAX_TABLE_BYTES)
    wheres = [storage.describe(key) for key in keys]
    jobs = list(zip(names, datas, [schema] * len(names), wheres))
    threads = min(DECODE_THREADS, len(jobs))
    tables = []
    if threads > 1 and sum(len(d) for d in datas) >= PARALLEL_DECODE_BYTES:
        with ThreadPoolExecutor(threads, thread_name_prefix="hsdata-decode") as pool:
            futures = [pool.submit(decode, *job) for job in jobs]
            del datas, jobs
            try:
                for name, future, where in zip(names, futures, wheres):  # failures raise in file order
                    tables.append(_checked(check, name, future.result(), where))
            finally:
                for future in futures:
                    future.cancel()
    else:
        tables = [_checked(check, name, decode(*job), where) for name, job, where in zip(names, jobs, wheres)]
    # not schema.empty_table(): it imports pandas (a second or so of a cold start, for a store without removals)
    return pa.concat_tables(tables) if tables else pa.Table.from_batches([], schema=schema)


def _checked(check, name: str, table: pa.Table, where: str) -> pa.Table:
    if check is not None:
        check(name, table, where)
    return table
