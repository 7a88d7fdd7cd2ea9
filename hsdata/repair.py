"""Changing what a committed store holds without rewriting a file: adding loss masks, removing samples or masks.

Each function checks every id against the store as committed (manifest rows and added masks, removals applied)
before it writes anything, and writes one write-once file (masks/ or removals/) or nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from . import inputs, manifest, masks, removals
from .errors import InvalidSampleError
from .layout import load_spec
from .io.storage import Storage

SHOWN = 5  # refused ids named in an error message; the rest are counted


def add_loss_masks(url: str, loss_masks: Mapping[str, Any], *, storage_options: dict | None = None) -> str | None:
    """Add ``{sample_id: [T] 0/1 mask}`` for committed samples stored without one, as one atomic file; returns
    its key (None: no masks given). Refused, writing nothing, unless every id is a committed sample with no
    stored or added mask (remove a wrong one first: :func:`remove_loss_masks`) and each mask is as long."""
    if not loss_masks:
        return None
    storage = Storage(url, storage_options)
    load_spec(storage)  # NotAStoreError for a path that holds no store
    rows = _live_rows(storage)
    lengths = _by_id(rows, rows.column("num_tokens").to_pylist())
    own = _by_id(rows, manifest.has_loss_mask(rows).tolist())
    added = {e.sample_id: e.mask_file for e in reversed(masks.entries(storage))}  # the first file of each id
    packed, problems = {}, []
    for sample_id, mask in loss_masks.items():
        try:
            values = _mask_values(sample_id, mask)
        except InvalidSampleError as e:
            problems.append(str(e))
            continue
        if sample_id not in lengths:
            problems.append(f"sample {sample_id!r}: not a committed sample of the store")
        elif any(own[sample_id]):
            problems.append(f"sample {sample_id!r}: has its own loss mask, stored with the sample")
        elif sample_id in added:
            problems.append(f"sample {sample_id!r}: already has an added loss mask ({masks.MASKS}/"
                            f"{added[sample_id]}); remove it first (hsdata.remove_loss_masks)")
        elif any(n != len(values) for n in lengths[sample_id]):
            problems.append(f"sample {sample_id!r}: the mask has {len(values)} tokens, the sample "
                            f"{lengths[sample_id][0]}")
        else:
            packed[sample_id] = values.astype(np.uint8).tobytes()
    _refuse(storage, problems, len(loss_masks), "loss masks")
    return masks.write(storage, packed)


def remove_samples(url: str, sample_ids: Iterable[str], *, reason: str | None = None,
                   storage_options: dict | None = None) -> str | None:
    """Take every committed manifest row of ``sample_ids`` and their added masks out of the store, by one
    removal file; returns its key (None: no ids given). The ids may then be committed again. Refused, writing
    nothing, if an id is not a committed sample."""
    storage = Storage(url, storage_options)
    load_spec(storage)
    wanted = _ids(sample_ids)
    rows = _live_rows(storage)
    keys = _by_id(rows, list(zip(rows.column("part").to_pylist(), rows.column("token_offset").to_pylist())))
    _refuse(storage, [f"sample {i!r}: not a committed sample of the store" for i in wanted if i not in keys],
            len(wanted), "sample removals")
    added = [(e.sample_id, e.mask_file) for e in masks.entries(storage) if e.sample_id in wanted]
    return removals.write(storage, rows=[(i, p, o) for i in wanted for p, o in keys[i]], masks=added,
                          reason=reason)


def remove_loss_masks(url: str, sample_ids: Iterable[str], *, reason: str | None = None,
                      storage_options: dict | None = None) -> str | None:
    """Take the added loss masks of ``sample_ids`` out of the store, by one removal file, so that a correct
    one can be added; returns its key (None: no ids given). Refused, writing nothing, if an id has no added
    mask."""
    storage = Storage(url, storage_options)
    load_spec(storage)
    wanted = _ids(sample_ids)
    added = [(e.sample_id, e.mask_file) for e in masks.entries(storage) if e.sample_id in wanted]
    having = {i for i, _ in added}
    _refuse(storage, [f"sample {i!r}: has no added loss mask" for i in wanted if i not in having],
            len(wanted), "loss mask removals")
    return removals.write(storage, masks=list(dict.fromkeys(added)), reason=reason)


def _live_rows(storage: Storage) -> pa.Table:
    """The store's manifest rows that no removal names."""
    return removals.load(storage).drop_rows(manifest.load(storage))


def _by_id(rows: pa.Table, values: list) -> dict[str, list]:
    """``values`` (one per row) grouped by the rows' sample ids (an id may have several rows)."""
    out: dict[str, list] = {}
    for sample_id, value in zip(rows.column("sample_id").to_pylist(), values):
        out.setdefault(sample_id, []).append(value)
    return out


def _ids(sample_ids: Iterable[str]) -> dict[str, None]:
    """The ids without repeats, in order (a dict: quick to test membership)."""
    if isinstance(sample_ids, str):
        raise TypeError(f"sample_ids must be a list of ids, not the string {sample_ids!r}")
    return dict.fromkeys(sample_ids)


def _mask_values(sample_id: Any, mask: Any) -> np.ndarray:
    def fail(message: str) -> InvalidSampleError:
        return InvalidSampleError(f"sample {sample_id!r}: {message}")

    if not isinstance(sample_id, str):
        raise fail("sample ids are strings")
    values = inputs.integers(mask, "loss mask", fail)
    if values.ndim != 1 or not len(values) or ((values != 0) & (values != 1)).any():
        raise fail("a loss mask must be a non-empty [T] array of 0 and 1")
    return values


def _refuse(storage: Storage, problems: list[str], total: int, what: str) -> None:
    if problems:
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise InvalidSampleError(f"{storage.url}: {len(problems)} of {total} {what} refused, nothing written: "
                                 + "; ".join(problems[:SHOWN]) + more)
