"""The Parquet tables behind manifests and loss masks."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from hsdata.arrow import table_of

READ_THEN_EXIT = """
import io, threading
import pyarrow as pa, pyarrow.parquet as pq
from hsdata import tables
table = pa.table({"a": list(range(1000)), "b": [str(i) for i in range(1000)]})
buf = io.BytesIO()
pq.write_table(table, buf, compression="zstd")
data = buf.getvalue()
name = "w.00000000." + __import__("xxhash").xxh3_64_hexdigest(data) + ".parquet"
def hold_the_gil():
    while True:
        pass
threading.Thread(target=hold_the_gil, daemon=True).start()
for _ in range(50):
    assert tables.decode(name, data, table.schema, "test").num_rows == 1000
"""


def test_a_process_that_read_tables_exits_cleanly():
    """A busy interpreter that read tables must exit 0. Decoding with pq.read_table(BytesIO) left Arrow threads
    holding the Python bytes, and 8 exits in 20 of this script aborted at finalization (SIGABRT, "terminate called
    without an active exception"; seen in `hsdata extract` and DataLoader workers)."""
    for _ in range(5):
        result = subprocess.run([sys.executable, "-c", READ_THEN_EXIT], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr


def test_tables_built_over_buffers_equal_pyarrows_own_conversion():
    schema = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("note", pa.string()),
                        pa.field("offset", pa.int64(), nullable=False), pa.field("hash", pa.uint64()),
                        pa.field("at", pa.timestamp("us", tz="UTC"), nullable=False),
                        pa.field("mask", pa.large_binary())])
    columns = {"id": ["a", "ü/ß", "", "日本"], "note": [None, "x", None, ""],
               "offset": [0, -1, 2**63 - 1, -(2**63)], "hash": [2**64 - 1, None, 0, 7],
               "at": [datetime(2026, 12, 2, 1, 2, 3, 456789, tzinfo=timezone.utc),
                      datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=timezone.utc),  # before the epoch
                      datetime(2026, 12, 2, 3, 0, tzinfo=timezone(timedelta(hours=2))),  # converted to UTC
                      datetime(2000, 1, 1, tzinfo=timezone.utc)],
               "mask": [b"\x00\x01", None, b"", bytes(1000)]}
    built = table_of(columns, schema)
    built.validate(full=True)
    assert built.equals(pa.table(columns, schema=schema))
    assert table_of({name: [] for name in schema.names}, schema).equals(schema.empty_table())


@pytest.mark.parametrize("columns, error", [
    ({"id": [None], "n": [1], "at": [datetime.now(timezone.utc)]}, "'id' holds nulls"),
    ({"id": ["a"], "n": [2**63], "at": [datetime.now(timezone.utc)]}, "does not fit int64"),
    ({"id": ["a"], "n": [1], "at": [datetime(2026, 1, 1)]}, "timezone-aware"),
    ({"id": ["a"], "n": [1]}, "do not match the schema"),
])
def test_tables_built_over_buffers_refuse_what_the_schema_does_not_hold(columns, error):
    schema = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("n", pa.int64()),
                        pa.field("at", pa.timestamp("us", tz="UTC"))])
    with pytest.raises(ValueError, match=error):
        table_of(columns, schema)


WRITE_READ_REPAIR = """
import sys, numpy as np, torch
sys.path.insert(0, "tests")
import hsdata
from conftest import SPEC, make_sample
path = sys.argv[1]
with hsdata.create(path, **SPEC) as w:
    for i in range(3):
        sample = make_sample(20, seed=i)
        if i == 2:
            sample["loss_mask"] = None  # added afterwards
        w.add(f"s{i}", **sample, meta={"i": i} if i else None)
store = hsdata.open(path)
assert store.get("s1")["input_ids"].shape == (20,)
hsdata.add_loss_masks(path, {"s2": np.ones(20, np.int8)})
hsdata.remove_samples(path, ["s0"], reason="test")
from hsdata.validate import validate
assert validate(path).ok
print("pandas" in sys.modules)
"""


def test_writing_reading_and_repairing_a_store_never_import_pandas(tmp_path):
    """pyarrow imports pandas on its first conversion of Python objects: 0.25-0.35 s, the whole of a fresh writer
    process's first-commit cost on a 2-core VM (benchmarks/RESULTS.md). hsdata's tables are built over buffers."""
    result = subprocess.run([sys.executable, "-c", WRITE_READ_REPAIR, str(tmp_path / "store")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
