"""The Parquet tables behind manifests and loss masks."""

from __future__ import annotations

import subprocess
import sys

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
