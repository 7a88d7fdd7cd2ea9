"""Loss masks added after the fact: Parquet tables in ``masks/`` that give a sample its ``loss_mask``.

The server hook stores hidden states without loss masks (the server cannot know which tokens are the
assistant's); the client that built the prompts adds them here, keyed by sample id, once the samples are
committed (``hsdata.add_loss_masks``, in repair.py, checks that). A mask named by a removal is skipped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import pyarrow as pa

from . import removals, tables
from .storage import Storage

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
    table = pa.table({"sample_id": list(masks), "loss_mask": list(masks.values())}, schema=SCHEMA)
    return tables.write(storage, MASKS, writer, 0, table)


def entries(storage: Storage) -> list[Entry]:
    """Every added mask no removal names, verified, in file order then row order."""
    files: list[str] = []
    table = tables.load(storage, MASKS, SCHEMA, lambda name, rows, where: files.extend([name] * len(rows)))
    removed = removals.load(storage).masks
    return [Entry(f, i, m) for f, i, m in zip(files, table.column("sample_id").to_pylist(),
                                              table.column("loss_mask").to_pylist()) if (i, f) not in removed]


def load(storage: Storage) -> dict[str, bytes]:
    """The added mask of each sample id: the first (in file order) that no removal names."""
    out: dict[str, bytes] = {}
    for entry in entries(storage):
        out.setdefault(entry.sample_id, entry.mask)
    return out
