"""Loss masks added after the fact: Parquet tables in ``masks/`` that give a sample its ``loss_mask``.

The server hook stores hidden states without loss masks (the server cannot know which tokens are the
assistant's); the client that built the prompts adds them here, keyed by sample id. A mask may be added before
or after its sample is committed; readers apply it once both exist.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import torch

from . import tables
from .errors import InvalidSampleError
from .storage import Storage

MASKS = "masks"
SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("loss_mask", pa.large_binary(), nullable=False),  # one byte per token, 0 or 1
])


def add_loss_masks(url: str, masks: Mapping[str, Any], *, storage_options: dict | None = None) -> str | None:
    """Store ``{sample_id: [T] 0/1 mask}`` for samples written without one; one atomic file. Returns its key."""
    ids, packed = [], []
    for sample_id, mask in masks.items():
        values = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
        if values.ndim != 1 or not len(values) or values.dtype.kind not in "iub" or ((values != 0) & (values != 1)).any():
            raise InvalidSampleError(f"sample {sample_id!r}: a loss mask must be a non-empty [T] array of 0 and 1")
        ids.append(str(sample_id))
        packed.append(values.astype(np.uint8).tobytes())
    if not ids:
        return None
    writer = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    table = pa.table({"sample_id": ids, "loss_mask": packed}, schema=SCHEMA)
    return tables.write(Storage(url, storage_options), MASKS, writer, 0, table)


def load(storage: Storage) -> dict[str, bytes]:
    """Every added mask by sample id; the first in file order wins if one was added twice."""
    table = tables.load(storage, MASKS, SCHEMA)
    out: dict[str, bytes] = {}
    for sample_id, mask in zip(table.column("sample_id").to_pylist(), table.column("loss_mask").to_pylist()):
        out.setdefault(sample_id, mask)
    return out
