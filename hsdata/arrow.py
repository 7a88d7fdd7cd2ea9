"""Arrow arrays to and from numpy and Python lists, built over their buffers.

pyarrow imports pandas the first time ``pa.array``, ``pa.table`` or ``to_numpy`` converts anything (0.25-0.35 s
of a process's first store open or first commit on a 2-core VM, more than the rest of either), so the store's own
tables go through these instead: :func:`table_of` to write them, :func:`numpy_of` and :func:`valid_of` to read
their columns, :func:`arrow_of` for ``take`` and ``filter`` indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


def table_of(columns: dict[str, Sequence], schema: pa.Schema) -> pa.Table:
    """``{name: values}`` (Python objects, None for null) as a table of ``schema``, its columns in schema order.
    A null in a non-nullable field, a value out of its type's range or a missing column raises ValueError."""
    if set(columns) != set(schema.names):
        raise ValueError(f"columns {sorted(columns)} do not match the schema's {sorted(schema.names)}")
    arrays = []
    for field in schema:
        array = array_of(columns[field.name], field.type)
        if array.null_count and not field.nullable:
            raise ValueError(f"column {field.name!r} holds nulls but its field is not nullable")
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=schema)


def array_of(values: Sequence, kind: pa.DataType) -> pa.Array:
    """A list of ``str`` / ``bytes`` / ``int`` / timezone-aware ``datetime`` (and None) as an Arrow array of
    ``kind``: string, binary (each also large), an integer type, or a timestamp in microseconds."""
    n = len(values)
    valid = np.fromiter((v is not None for v in values), bool, n)
    nulls = n - int(valid.sum())
    validity = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        encoded = [b"" if v is None else v.encode("utf-8") if text else v for v in values]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, n), out=offsets[1:])
        if not (pa.types.is_large_string(kind) or pa.types.is_large_binary(kind)):
            if offsets[-1] > np.iinfo(np.int32).max:
                raise ValueError(f"{offsets[-1]:,} bytes do not fit one {kind} array (at most 2 GiB)")
            offsets = offsets.astype(np.int32)
        data = pa.py_buffer(b"".join(encoded))
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(offsets), data], null_count=nulls)
    if pa.types.is_timestamp(kind) and kind.unit == "us":
        storage = np.array([0 if v is None else _microseconds(v) for v in values], np.int64)
    elif pa.types.is_integer(kind):
        dtype = np.dtype(f"<{'u' if pa.types.is_unsigned_integer(kind) else 'i'}{kind.bit_width // 8}")
        try:
            storage = np.array([0 if v is None else v for v in values], dtype)
        except OverflowError as e:
            raise ValueError(f"a value does not fit {kind}: {e}") from None
    else:
        raise TypeError(f"array_of takes string, binary, integer or timestamp[us] arrays, got {kind}")
    return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(storage)], null_count=nulls)


def _microseconds(moment: datetime) -> int:
    if moment.tzinfo is None:
        raise ValueError(f"timestamps must be timezone-aware, got {moment.isoformat()}")
    return (moment - _EPOCH) // _MICROSECOND


def numpy_of(values: pa.Array | pa.ChunkedArray, null_as: int | None = None) -> np.ndarray:
    """A column of integers, timestamps (as int64) or bools as one numpy array (read-only when it is a view of a
    single chunk). Nulls raise ValueError, or read as ``null_as`` when it is given."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    kind = values.type
    if pa.types.is_boolean(kind):
        pieces = [np.unpackbits(np.frombuffer(c.buffers()[1], np.uint8), bitorder="little")[c.offset: c.offset + len(c)]
                  .view(bool) for c in chunks if len(c)]
        dtype = np.dtype(bool)
    else:
        if pa.types.is_timestamp(kind) or pa.types.is_integer(kind):
            unsigned = pa.types.is_unsigned_integer(kind)
            dtype = np.dtype(f"<{'u' if unsigned else 'i'}{kind.bit_width // 8}")
        else:
            raise TypeError(f"numpy_of takes integer, timestamp or bool columns, got {kind}")
        pieces = [np.frombuffer(c.buffers()[1], dtype, len(c), c.offset * dtype.itemsize) for c in chunks if len(c)]
    out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    if any(c.null_count for c in chunks):
        if null_as is None:
            raise ValueError("the column holds nulls")
        out = out.copy()
        out[~valid_of(values)] = null_as
    return out


def valid_of(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Which entries are not null, as a numpy bool array."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    pieces = []
    for c in chunks:
        if not c.null_count or c.buffers()[0] is None:
            pieces.append(np.full(len(c), c.null_count == 0))
        else:
            bits = np.unpackbits(np.frombuffer(c.buffers()[0], np.uint8), bitorder="little")
            pieces.append(bits[c.offset: c.offset + len(c)].view(bool))
    return np.concatenate(pieces) if pieces else np.zeros(0, bool)


def arrow_of(values: np.ndarray) -> pa.Array:
    """An int64 or bool numpy array as an Arrow array (for ``take`` and ``filter``)."""
    if values.dtype == bool:
        bits = np.packbits(values, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])
