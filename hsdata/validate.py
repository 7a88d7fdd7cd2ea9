"""Auditing a store: metadata, manifests, every checksum, and what crashed writers left behind.

``validate`` streams the committed chunks of each (part, tensor) in file order, checking every shard index and
chunk crc32c, and recomputes every sample's xxh3 from the same bytes, so each byte is read once.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
from crc32c import crc32c

from . import manifest, masks, tables
from .errors import CorruptDataError
from .masks import MASKS
from .layout import (MANIFESTS, PARTS, array_document, array_node, group_document, load_spec, metadata_key,
                     part_node, shard_key)
from .shard import (CRC_NBYTES, chunks_per_shard, decode_index, encode_index, encoded_chunk_nbytes, index_nbytes,
                    token_ranges)
from .spec import HIDDEN_TENSORS, StoreSpec, TensorSpec
from .storage import Storage

BLOCK_BYTES = 64 << 20  # one read while streaming a shard


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a store, with everything known about where it is."""

    kind: str  # manifest | duplicate | metadata | bounds | missing | index | checksum | non_finite | unreadable
    message: str
    sample_id: str | None = None
    part: str | None = None
    tensor: str | None = None
    key: str | None = None
    byte_range: tuple[int, int] | None = None

    def line(self) -> str:
        where = [f"sample {self.sample_id!r}" if self.sample_id is not None else None,
                 f"part {self.part}" if self.part else None, f"tensor {self.tensor}" if self.tensor else None,
                 self.key and (self.key + (f" bytes [{self.byte_range[0]}, {self.byte_range[1]})"
                                           if self.byte_range else ""))]
        return f"{self.kind}: " + ", ".join(w for w in where if w) + (": " if any(where) else "") + self.message


@dataclass
class Report:
    url: str
    samples: int = 0
    samples_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "problems"}, "ok": self.ok,
                "problems": [{**asdict(p), "line": p.line()} for p in self.problems]}


@dataclass
class _Row:
    sample_id: str
    offset: int
    length: int
    hashes: dict[str, int | None]

    @property
    def end(self) -> int:
        return self.offset + self.length


def validate(url: str, *, storage_options: dict | None = None, workers: int = 4, sample: float | None = None,
             check_finite: bool = False, seed: int = 0,
             progress: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None) -> Report:
    """Audit the store at ``url``. Raises only if it is not a readable store at all (no or bad root metadata).

    ``sample`` checks a random subset of samples: a count (>= 1) or a fraction (< 1). ``progress`` is called
    with the number of payload bytes as they are checked, after ``on_total`` got the total.
    """
    storage = Storage(url, storage_options)
    spec = load_spec(storage)
    report = Report(storage.url)
    rows_by_part = _load_rows(storage, report)
    report.samples = sum(len(rows) for rows in rows_by_part.values())
    for part, rows in rows_by_part.items():
        _check_metadata(storage, spec, part, rows, report)
    _check_added_masks(storage, rows_by_part, report)
    report.leftovers = _leftovers(storage, spec, rows_by_part)
    selected = _select(rows_by_part, sample, seed)
    report.samples_checked = sum(len(rows) for rows in selected.values())
    streams = [(part, tensor, rows) for part, rows in selected.items() for tensor in spec.tensors if rows]
    streams.sort(key=lambda s: -sum(r.length for r in s[2]) * s[1].row_nbytes)  # biggest first
    if on_total is not None:
        on_total(sum(_chunk_bytes(spec, t, rows) for _, t, rows in streams))
    lock = threading.Lock()

    def check(stream) -> None:
        part, tensor, rows = stream
        checker = _StreamCheck(storage, spec, part, tensor, rows, check_finite, progress)
        checker.run()
        with lock:
            report.problems.extend(checker.problems)
            report.bytes_checked += checker.bytes_checked

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="hsdata-validate") as pool:
        list(pool.map(check, streams))
    return report


def leftovers(url: str, *, storage_options: dict | None = None) -> list[str]:
    """Keys that no committed manifest needs: uncommitted shards, parts and in-progress (``.partial``) files.

    Raises :class:`CorruptDataError` if a manifest cannot be read, since then what is needed is unknown.
    """
    storage = Storage(url, storage_options)
    spec = load_spec(storage)
    report = Report(storage.url)
    rows_by_part = _load_rows(storage, report)
    if any(p.kind == "manifest" for p in report.problems):
        raise CorruptDataError(f"{storage.url}: unreadable manifests; run `hsdata validate` first")
    return _leftovers(storage, spec, rows_by_part)


def _load_rows(storage: Storage, report: Report) -> dict[str, list[_Row]]:
    """Every committed row by part, sorted by offset; unreadable manifests and duplicate ids become problems."""
    names = manifest.list_files(storage)
    by_part: dict[str, list[_Row]] = {}
    seen: dict[str, str] = {}
    for name in names:
        key = f"{MANIFESTS}/{name}"
        try:
            table = manifest.decode(name, storage.read_bytes(key), storage.describe(key))
        except (CorruptDataError, OSError) as e:
            report.problems.append(Problem("manifest", str(e), key=key))
            continue
        hashes = manifest.row_hashes(table)
        hashes["loss_mask"] = [h if ok else None for h, ok in zip(hashes["loss_mask"], manifest.has_loss_mask(table))]
        columns = [table.column(c).to_pylist() for c in ("sample_id", "part", "token_offset", "num_tokens")]
        for i, (sample_id, part, offset, length) in enumerate(zip(*columns)):
            if sample_id in seen:
                report.problems.append(Problem("duplicate", f"also committed in part {seen[sample_id]}",
                                               sample_id=sample_id, part=part, key=key))
                continue
            seen[sample_id] = part
            if offset < 0 or length < 1:
                report.problems.append(Problem("bounds", f"token_offset {offset}, num_tokens {length}",
                                               sample_id=sample_id, part=part, key=key))
                continue
            row_hashes = {t: None if h[i] is None else int(h[i]) for t, h in hashes.items()}
            by_part.setdefault(part, []).append(_Row(sample_id, offset, length, row_hashes))
    for part, rows in by_part.items():
        rows.sort(key=lambda r: r.offset)
        for before, after in zip(rows, rows[1:]):
            if after.offset < before.end:
                report.problems.append(Problem(
                    "bounds", f"tokens [{after.offset}, {after.end}) overlap sample {before.sample_id!r} "
                    f"[{before.offset}, {before.end})", sample_id=after.sample_id, part=part))
    return by_part


def _check_added_masks(storage: Storage, rows_by_part: dict[str, list[_Row]], report: Report) -> None:
    """Loss-mask tables must be intact, and each mask as long as its committed sample."""
    lengths = {r.sample_id: (part, r.length) for part, rows in rows_by_part.items() for r in rows}
    for name in tables.list_files(storage, MASKS):
        key = f"{MASKS}/{name}"
        try:
            table = tables.decode(name, storage.read_bytes(key), masks.SCHEMA, storage.describe(key))
        except (CorruptDataError, OSError) as e:
            report.problems.append(Problem("manifest", str(e), key=key))
            continue
        for sample_id, mask in zip(table.column("sample_id").to_pylist(), table.column("loss_mask").to_pylist()):
            part, length = lengths.get(sample_id, (None, len(mask)))
            if len(mask) != length:
                report.problems.append(Problem("bounds", f"added loss mask has {len(mask)} tokens, the sample {length}",
                                               sample_id=sample_id, part=part, key=key))


def _check_metadata(storage: Storage, spec: StoreSpec, part: str, rows: list[_Row], report: Report) -> None:
    def read_json(key: str):
        try:
            return json.loads(storage.read_bytes(key))
        except FileNotFoundError:
            report.problems.append(Problem("metadata", "missing", part=part, key=key))
        except (OSError, ValueError) as e:
            report.problems.append(Problem("metadata", f"unreadable: {e}", part=part, key=key))
        return None

    for node in (PARTS, part_node(part)):
        document = read_json(metadata_key(node))
        if document is not None and {k: document.get(k) for k in ("zarr_format", "node_type")} != \
                {k: group_document()[k] for k in ("zarr_format", "node_type")}:
            report.problems.append(Problem("metadata", "not a zarr v3 group", part=part, key=metadata_key(node)))
    needed = max(r.end for r in rows)
    for tensor in spec.tensors:
        key = metadata_key(array_node(part, tensor))
        document = read_json(key)
        if document is None:
            continue
        shape = document.get("shape") if isinstance(document, dict) else None
        tokens = shape[0] if isinstance(shape, list) and shape and isinstance(shape[0], int) else -1
        if isinstance(document, dict) and document.get("data_type") != tensor.data_type:
            report.problems.append(Problem("metadata", f"data_type is {document.get('data_type')!r}, the store's spec "
                                           f"stores this tensor as {tensor.data_type!r} ({tensor.logical_dtype})",
                                           part=part, tensor=tensor.name, key=key))
        elif document != array_document(spec, tensor, tokens):
            report.problems.append(Problem("metadata", "array metadata differs from what the spec implies "
                                           f"(expected {json.dumps(array_document(spec, tensor, needed))})",
                                           part=part, tensor=tensor.name, key=key))
        elif tokens < needed:
            report.problems.append(Problem("bounds", f"array holds {tokens} tokens, committed samples need {needed}",
                                           part=part, tensor=tensor.name, key=key))


def _select(rows_by_part: dict[str, list[_Row]], sample: float | None, seed: int) -> dict[str, list[_Row]]:
    if sample is None:
        return rows_by_part
    everything = [(part, r) for part, rows in rows_by_part.items() for r in rows]
    count = int(sample) if sample >= 1 else max(1, round(sample * len(everything))) if everything else 0
    chosen = random.Random(seed).sample(everything, min(count, len(everything)))
    selected: dict[str, list[_Row]] = {}
    for part, r in chosen:
        selected.setdefault(part, []).append(r)
    return {part: sorted(rows, key=lambda r: r.offset) for part, rows in selected.items()}


def _chunk_runs(spec: StoreSpec, tensor: TensorSpec, rows: list[_Row]) -> list[tuple[int, int, int]]:
    """``(shard, first_chunk, end_chunk)`` runs of local chunks holding ``rows``, merged and in file order."""
    ct, per_shard = tensor.chunk_tokens, chunks_per_shard(spec, tensor)
    runs: list[list[int]] = []
    for r in rows:
        first, end = r.offset // ct, -(-r.end // ct)
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([first, end])
    out = []
    for first, end in runs:
        while first < end:
            shard = first // per_shard
            stop = min(end, (shard + 1) * per_shard)
            out.append((shard, first - shard * per_shard, stop - shard * per_shard))
            first = stop
    return out


def _chunk_bytes(spec: StoreSpec, tensor: TensorSpec, rows: list[_Row]) -> int:
    return sum(end - first for _, first, end in _chunk_runs(spec, tensor, rows)) * tensor.chunk_nbytes


class _StreamCheck:
    """Checks one tensor of one part: shard files, indexes, chunk crc32c, and the selected samples' xxh3."""

    def __init__(self, storage: Storage, spec: StoreSpec, part: str, tensor: TensorSpec, rows: list[_Row],
                 check_finite: bool, progress: Callable[[int], None] | None):
        self.storage, self.spec, self.part, self.tensor, self.rows = storage, spec, part, tensor, rows
        self.check_finite = check_finite and tensor.name in HIDDEN_TENSORS
        self.progress = progress
        self.problems: list[Problem] = []
        self.bytes_checked = 0
        self._next = 0  # first row not yet finished
        self._hasher = manifest.content_hasher()
        self._broken: set[str] = set()  # rows with a problem found already: no hash verdict for them
        self._non_finite: set[str] = set()

    def run(self) -> None:
        runs = _chunk_runs(self.spec, self.tensor, self.rows)
        for shard in sorted({s for s, _, _ in runs}):
            self._check_shard(shard, [(a, b) for s, a, b in runs if s == shard])

    def _problem(self, kind: str, message: str, key: str, byte_range=None, sample_id=None) -> None:
        self.problems.append(Problem(kind, message, sample_id=sample_id, part=self.part, tensor=self.tensor.name,
                                     key=self.storage.describe(key), byte_range=byte_range))

    def _rows_in(self, first_token: int, end_token: int) -> list[_Row]:
        return [r for r in self.rows if r.offset < end_token and r.end > first_token]

    def _check_shard(self, shard: int, runs: list[tuple[int, int]]) -> None:
        key = shard_key(self.part, self.tensor, shard)
        chunk_size, per_shard = encoded_chunk_nbytes(self.tensor), chunks_per_shard(self.spec, self.tensor)
        base, ct = shard * self.spec.shard_tokens, self.tensor.chunk_tokens
        try:
            size = self.storage.size(key)
            index = decode_index(self.storage.read_range(key, max(0, size - index_nbytes(per_shard)), size),
                                 per_shard, where="shard index")
            written = int((index[:, 0] != 2**64 - 1).sum())
            if encode_index(written, per_shard, chunk_size)[:-CRC_NBYTES] != index.tobytes():
                raise CorruptDataError("shard index does not describe a dense shard (docs/format.md section 5)")
            if size != written * chunk_size + index_nbytes(per_shard):
                raise CorruptDataError(f"file is {size} bytes, its index implies "
                                       f"{written * chunk_size + index_nbytes(per_shard)} (truncated?)")
        except FileNotFoundError:
            return self._fail_rows(base, base + self.spec.shard_tokens, "missing", "shard file missing", key)
        except CorruptDataError as e:
            self._problem("index", str(e), key)
            written = min(per_shard, max(0, (self._safe_size(key) - index_nbytes(per_shard)) // chunk_size))
        except OSError as e:
            return self._fail_rows(base, base + self.spec.shard_tokens, "unreadable", str(e), key)
        for first, end in runs:
            if end > written:
                self._fail_rows(base + max(first, written) * ct, base + end * ct, "missing",
                                f"chunks {max(first, written)}..{end - 1} are not in the shard", key)
                end = max(first, written)
            for block_first, block in self._blocks(key, first, end):
                self._check_block(key, base, block_first, block)

    def _safe_size(self, key: str) -> int:
        try:
            return self.storage.size(key)
        except OSError:
            return 0

    def _blocks(self, key: str, first: int, end: int) -> Iterator[tuple[int, bytes]]:
        """Chunks ``[first, end)`` in blocks, the next block read while the current one is checked."""
        chunk_size = encoded_chunk_nbytes(self.tensor)
        per_block = max(1, BLOCK_BYTES // chunk_size)
        starts = list(range(first, end, per_block))
        with ThreadPoolExecutor(1) as reader:
            def read(a: int):
                b = min(end, a + per_block)
                return self.storage.read_range(key, a * chunk_size, b * chunk_size)

            pending = reader.submit(read, starts[0]) if starts else None
            for k, a in enumerate(starts):
                data = pending.result()
                pending = reader.submit(read, starts[k + 1]) if k + 1 < len(starts) else None
                yield a, data

    def _check_block(self, key: str, base: int, first: int, block: bytes) -> None:
        chunk_size, payload, ct = encoded_chunk_nbytes(self.tensor), self.tensor.chunk_nbytes, self.tensor.chunk_tokens
        view = memoryview(block)
        for k in range(len(block) // chunk_size):
            j = first + k
            data = view[k * chunk_size : k * chunk_size + payload]
            stored = int.from_bytes(view[k * chunk_size + payload : (k + 1) * chunk_size], "little")
            t0, t1 = base + j * ct, base + (j + 1) * ct
            if crc32c(data) != stored:
                self._fail_rows(t0, t1, "checksum", f"chunk {j} crc32c mismatch", key,
                                (j * chunk_size, (j + 1) * chunk_size))
            self._feed(data, t0, t1)
            self.bytes_checked += payload
            if self.progress is not None:
                self.progress(payload)
        if len(block) % chunk_size:
            self._problem("missing", "short read", key)

    def _feed(self, data: memoryview, t0: int, t1: int) -> None:
        """Hash the selected rows' bytes of chunk tokens ``[t0, t1)``; finish rows that end in it."""
        row_nbytes = self.tensor.row_nbytes
        while self._next < len(self.rows):
            r = self.rows[self._next]
            if r.offset >= t1:
                return
            if r.end <= t0:  # its chunks were skipped (missing): no verdict
                self._next += 1
                self._hasher = manifest.content_hasher()
                continue
            piece = data[(max(r.offset, t0) - t0) * row_nbytes : (min(r.end, t1) - t0) * row_nbytes]
            self._hasher.update(piece)
            if self.check_finite and r.sample_id not in self._non_finite:
                mask = self.tensor.dtype.exponent_mask
                if ((np.frombuffer(piece, self.tensor.dtype.bits) & mask) == mask).any():
                    self._non_finite.add(r.sample_id)
                    self.problems.append(Problem("non_finite", "holds NaN or Inf", sample_id=r.sample_id,
                                                 part=self.part, tensor=self.tensor.name))
            if r.end > t1:
                return
            computed = self._hasher.intdigest()
            expected = r.hashes[self.tensor.name]
            if expected is not None and computed != expected and r.sample_id not in self._broken:
                ranges = token_ranges(self.spec, self.tensor, r.offset, r.length)
                more = f" (and {len(ranges) - 1} more shard(s))" if len(ranges) > 1 else ""
                key = shard_key(self.part, self.tensor, ranges[0].shard)
                self._problem("checksum", f"xxh3 {computed:016x} differs from the manifest's {expected:016x}{more}",
                              key, (ranges[0].file_start, ranges[0].file_end), r.sample_id)
            self._next += 1
            self._hasher = manifest.content_hasher()

    def _fail_rows(self, t0: int, t1: int, kind: str, message: str, key: str, byte_range=None) -> None:
        """One problem per selected sample with tokens in ``[t0, t1)`` (or one naming no sample)."""
        rows = self._rows_in(t0, t1)
        for r in rows:
            self._broken.add(r.sample_id)
            self._problem(kind, message, key, byte_range, r.sample_id)
        if not rows:
            self._problem(kind, message, key, byte_range)


def _leftovers(storage: Storage, spec: StoreSpec, rows_by_part: dict[str, list[_Row]]) -> list[str]:
    needed = {metadata_key(PARTS)} | {f"{MANIFESTS}/{n}" for n in manifest.list_files(storage)}
    needed |= {f"{MASKS}/{n}" for n in tables.list_files(storage, MASKS)}
    for part, rows in rows_by_part.items():
        needed.add(metadata_key(part_node(part)))
        for tensor in spec.tensors:
            needed.add(metadata_key(array_node(part, tensor)))
            needed.update(shard_key(part, tensor, s) for s, _, _ in _chunk_runs(spec, tensor, rows))
    found = []
    for prefix in (PARTS, MANIFESTS, MASKS):
        try:
            found += storage.fs.find(storage.path(prefix))
        except FileNotFoundError:
            pass
    root = storage.root + "/"
    return sorted(k for k in (p[len(root):] if p.startswith(root) else p for p in found) if k not in needed)
