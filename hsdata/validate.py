"""Auditing a store: metadata, manifests, every checksum and value range, and what crashed writers left behind.

``validate`` streams the committed chunks of each (part, tensor) in file order, checking every shard index and
chunk crc32c, and recomputes every sample's xxh3 and value ranges from the same bytes, so each byte is read once.
Rows are bounded (manifest limits, then the array's shape) and only shard files that exist are read, so a hostile
store costs no more than a valid one of the same file sizes. One problem is reported per missing or damaged file,
with the samples it affects.
"""

from __future__ import annotations

import json
import random
import re
import threading
from bisect import bisect_left, bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
from crc32c import crc32c

from . import manifest, masks, removals, tables
from .arrow import array_of
from .errors import CorruptDataError
from .layout import (MANIFESTS, PARTS, array_document, array_node, group_document, load_spec, metadata_key,
                     part_node, read_document, shard_key)
from .masks import MASKS
from .removals import REMOVALS
from .codecs import quantize
from .codecs.blosc import blosc_streams, decode_into
from .codecs.compression import device_decodable
from .shard import (CRC_NBYTES, chunks_per_shard, decode_index, encoded_chunk_nbytes, index_nbytes, index_spans,
                    token_ranges)
from .spec import HIDDEN_TENSORS, MAX_INPUT_ID, TENSOR_NAMES, StoreSpec, TensorSpec
from .io.storage import Storage

BLOCK_BYTES = 64 << 20  # one read while streaming a shard
REFUSES_GC = ("manifest", "bounds")  # problems that leave what is committed unknown: gc deletes nothing
_TENSOR = "|".join(TENSOR_NAMES)
_SHARD = re.compile(rf"^{PARTS}/(?P<part>[A-Za-z0-9_-]+)/(?P<tensor>{_TENSOR})/c/(?P<shard>0|[1-9][0-9]*)(?P<inner>/0)?$")
_NODE = re.compile(rf"^{PARTS}/(?P<part>[A-Za-z0-9_-]+)(/({_TENSOR}))?/zarr\.json$")
NAMED_SAMPLES = 3  # samples a problem's line names before it gives a count
_PARTIAL = re.compile(r"(^|/)\.[^/]+\.partial$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a store, with everything known about where it is and the samples it affects."""

    kind: str  # manifest | duplicate | metadata | bounds | missing | index | checksum | values | non_finite | unreadable
    message: str
    sample_id: str | None = None  # the one sample affected, if exactly one
    part: str | None = None
    tensor: str | None = None
    key: str | None = None
    byte_range: tuple[int, int] | None = None
    samples: tuple[str, ...] = ()  # every sample affected

    def line(self) -> str:
        where = [f"sample {self.sample_id!r}" if self.sample_id is not None else None,
                 f"part {self.part}" if self.part else None, f"tensor {self.tensor}" if self.tensor else None,
                 self.key and (self.key + (f" bytes [{self.byte_range[0]}, {self.byte_range[1]})"
                                           if self.byte_range else ""))]
        count = f" ({len(self.samples):,} samples)" if len(self.samples) > 1 else ""
        return f"{self.kind}: " + ", ".join(w for w in where if w) + (": " if any(where) else "") + self.message + count


def _problem(kind: str, message: str, samples=(), **where) -> Problem:
    samples = tuple(samples)
    return Problem(kind, message, sample_id=samples[0] if len(samples) == 1 else None, samples=samples, **where)


@dataclass
class Report:
    url: str
    samples: int = 0
    samples_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # damage no committed sample's bytes lie in (not an error)

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


@dataclass
class _Rows:
    served: dict[str, list[_Row]]  # by part, sorted by offset: the rows readers serve (removals and winner rule)
    live: dict[str, list[tuple[int, int]]]  # by part: token ranges of every row not removed (gc keeps their shards)


def validate(url: str, *, storage_options: dict | None = None, workers: int = 4, sample: float | None = None,
             check_finite: bool = True, seed: int = 0,
             progress: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None) -> Report:
    """Audit the store at ``url``. Raises only if it is not a readable store at all (no or bad root metadata).

    ``sample`` checks a random subset of samples: a count (>= 1) or a fraction (< 1). ``check_finite``: report
    samples whose hidden states hold NaN or Inf (a pass over bytes already read: within the noise of validate's
    time). ``progress`` is called with the number of payload bytes as they are checked, after ``on_total`` got
    the total.
    """
    storage = Storage(url, storage_options)
    spec = load_spec(storage)
    report = Report(storage.url)
    rows = _load_rows(storage, report)
    report.samples = sum(len(r) for r in rows.served.values())
    tokens = {part: _check_metadata(storage, spec, part, part_rows, report)
              for part, part_rows in rows.served.items()}
    _check_added_masks(storage, rows.served, report)
    try:
        found = _find(storage)
    except (CorruptDataError, OSError) as e:
        report.problems.append(Problem("unreadable", f"cannot list the store's files, so no shard is checked: {e}"))
        return report
    report.leftovers = _leftovers(spec, rows, found)
    present = _present_shards(spec, found)
    selected = _select(rows.served, sample, seed)
    report.samples_checked = sum(len(r) for r in selected.values())
    streams = []
    for part, part_rows in selected.items():
        for tensor in spec.tensors:
            chosen = [r for r in part_rows if r.end <= tokens[part][tensor.name]]  # the rest: bounds problems
            if chosen:
                streams.append((part, tensor, chosen, present.get((part, tensor.name), [])))
    streams.sort(key=lambda s: -sum(r.length for r in s[2]) * s[1].row_nbytes)  # biggest first
    if on_total is not None:
        on_total(sum(_chunk_bytes(spec, t, rows, shards) for _, t, rows, shards in streams))
    lock = threading.Lock()

    def check(stream) -> None:
        part, tensor, stream_rows, shards = stream
        checker = _StreamCheck(storage, spec, part, tensor, stream_rows, shards, check_finite, progress)
        checker.run()
        with lock:
            report.problems.extend(checker.problems)
            report.notes.extend(checker.notes)
            report.bytes_checked += checker.bytes_checked

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="hsdata-validate") as pool:
        list(pool.map(check, streams))
    return report


def leftovers(url: str, *, storage_options: dict | None = None) -> list[str]:
    """Keys no committed sample needs, each of a name the layout gives (uncommitted shards and parts, in-progress
    ``.partial`` files): what ``gc`` may delete. Never a manifest, mask or removal.

    Raises :class:`CorruptDataError` when what is committed is unknown (an unreadable or unknown-named manifest,
    a row out of bounds): then nothing may be deleted.
    """
    storage = Storage(url, storage_options)
    spec = load_spec(storage)
    report = Report(storage.url)
    rows = _load_rows(storage, report)
    for part, part_rows in rows.served.items():
        _check_metadata(storage, spec, part, part_rows, report)
    refusing = [p for p in report.problems if p.kind in REFUSES_GC]
    if refusing:
        more = f" (and {len(refusing) - 1} more)" if len(refusing) > 1 else ""
        raise CorruptDataError(f"{storage.url}: not cleaning up, what is committed is unclear: {refusing[0].line()}"
                               f"{more}; run `hsdata validate` first")
    return _leftovers(spec, rows, _find(storage))


def _load_rows(storage: Storage, report: Report) -> _Rows:
    """Every committed row, removals applied; unreadable or unknown-named manifests, rows out of bounds and
    duplicate ids (the reader's winner rule decides which row is served) become problems."""
    try:
        names = storage.list(MANIFESTS)
    except (CorruptDataError, OSError) as e:
        report.problems.append(Problem("manifest", f"cannot list the manifests: {e}", key=MANIFESTS))
        names = []
    decoded = []
    for name in names:
        key = f"{MANIFESTS}/{name}"
        if not tables.FILE_NAME.match(name):
            report.problems.append(Problem("manifest", "not a manifest name (<part>.<seq>.<xxh3 in lowercase "
                                           "hex>.parquet): readers refuse the store", key=key))
            continue
        try:
            table = manifest.decode(name, storage.read_bytes(key), storage.describe(key))
        except (CorruptDataError, OSError) as e:
            report.problems.append(Problem("manifest", str(e), key=key))
            continue
        decoded.append(table.append_column("manifest", array_of([key] * len(table), pa.string())))
    rows = pa.concat_tables(decoded) if decoded else manifest.SCHEMA.append(
        pa.field("manifest", pa.string())).empty_table()
    try:
        rows = removals.load(storage).drop_rows(rows)
    except (CorruptDataError, OSError) as e:
        report.problems.append(Problem("manifest", f"removals not applied: {e}", key=REMOVALS))
    columns = [rows.column(c).to_pylist() for c in ("sample_id", "part", "token_offset", "num_tokens", "manifest")]
    bad = set(manifest.out_of_bounds(rows).tolist())
    for i in sorted(bad):
        sample_id, part, offset, length, key = (c[i] for c in columns)
        report.problems.append(_problem("bounds", manifest.bounds_message(offset, length), [sample_id], part=part,
                                        key=key))
    winners = manifest.winners(rows)
    is_winner = np.zeros(len(rows), bool)
    is_winner[winners] = True
    served_part = {columns[0][i]: columns[1][i] for i in winners.tolist()}
    hashes = manifest.row_hashes(rows)
    has_mask = manifest.has_loss_mask(rows)
    served: dict[str, list[_Row]] = {}
    live: dict[str, list[tuple[int, int]]] = {}
    for i, (sample_id, part, offset, length, key) in enumerate(zip(*columns)):
        if i in bad:
            continue
        live.setdefault(part, []).append((offset, offset + length))
        if not is_winner[i]:
            report.problems.append(_problem("duplicate", f"also committed in part {served_part[sample_id]}, whose "
                                            "row was committed first and is the one served", [sample_id], part=part,
                                            key=key))
            continue
        row_hashes = {t: None if t == "loss_mask" and not has_mask[i] else int(hashes[t][i]) for t in TENSOR_NAMES}
        served.setdefault(part, []).append(_Row(sample_id, offset, length, row_hashes))
    for part, part_rows in served.items():
        part_rows.sort(key=lambda r: r.offset)
        for before, after in zip(part_rows, part_rows[1:]):
            if after.offset < before.end:
                report.problems.append(_problem(
                    "bounds", f"tokens [{after.offset}, {after.end}) overlap sample {before.sample_id!r} "
                    f"[{before.offset}, {before.end})", [after.sample_id], part=part))
    return _Rows(served, live)


def _check_added_masks(storage: Storage, rows_by_part: dict[str, list[_Row]], report: Report) -> None:
    """Loss-mask tables must be intact, and each mask (no removal names) 0 or 1 and as long as its sample."""
    lengths = {r.sample_id: (part, r.length) for part, rows in rows_by_part.items() for r in rows}
    try:
        names = tables.list_files(storage, MASKS)
        removed = removals.load(storage).masks
    except (CorruptDataError, OSError) as e:
        report.problems.append(Problem("manifest", f"added loss masks not checked: {e}"))
        return
    for name in names:
        key = f"{MASKS}/{name}"
        try:
            table = tables.decode(name, storage.read_bytes(key), masks.SCHEMA, storage.describe(key))
        except (CorruptDataError, OSError) as e:
            report.problems.append(Problem("manifest", str(e), key=key))
            continue
        for sample_id, mask in zip(table.column("sample_id").to_pylist(), table.column("loss_mask").to_pylist()):
            if (sample_id, name) in removed:
                continue
            part, length = lengths.get(sample_id, (None, len(mask)))
            where = dict(part=part, tensor="loss_mask", key=key)
            if len(mask) != length:
                report.problems.append(_problem("bounds", f"added loss mask has {len(mask)} tokens, the sample "
                                                f"{length}", [sample_id], **where))
            values = np.frombuffer(mask, np.uint8)
            if len(values) and values.max() > 1:
                report.problems.append(_problem("values", f"added loss mask holds {int(values.max())}; a mask "
                                                "holds only 0 and 1", [sample_id], **where))


def _check_metadata(storage: Storage, spec: StoreSpec, part: str, rows: list[_Row], report: Report) -> dict[str, int]:
    """Check a part's group and array documents; returns, per tensor, the tokens its array holds (-1: unknown).
    Rows beyond them are problems, and are not streamed."""
    def read(key: str):
        try:
            return read_document(storage, key)
        except FileNotFoundError:
            report.problems.append(_problem("metadata", "missing", [r.sample_id for r in rows], part=part,
                                            key=key))
        except (CorruptDataError, OSError) as e:
            report.problems.append(_problem("metadata", f"unreadable: {e}", [r.sample_id for r in rows], part=part,
                                            key=key))
        return None

    for node in (PARTS, part_node(part)):
        document = read(metadata_key(node))
        if document is not None and {k: document.get(k) for k in ("zarr_format", "node_type")} != \
                {k: group_document()[k] for k in ("zarr_format", "node_type")}:
            report.problems.append(Problem("metadata", "not a zarr v3 group", part=part,
                                           key=metadata_key(node)))
    tokens_of = {}
    for tensor in spec.tensors:
        key = metadata_key(array_node(part, tensor))
        where = dict(part=part, tensor=tensor.name, key=key)
        document = read(key)
        tokens_of[tensor.name] = -1
        if document is None:
            continue
        shape = document.get("shape")
        tokens = tokens_of[tensor.name] = shape[0] if isinstance(shape, list) and shape and type(shape[0]) is int \
            else -1
        beyond = [r for r in rows if r.end > tokens]
        if document.get("data_type") != tensor.data_type:
            report.problems.append(Problem("metadata", f"data_type is {document.get('data_type')!r}, the store's spec "
                                           f"stores this tensor as {tensor.data_type!r} ({tensor.logical_dtype})",
                                           **where))
        elif document != array_document(spec, tensor, tokens):
            needed = max(r.end for r in rows)
            report.problems.append(Problem("metadata", "array metadata differs from what the spec implies "
                                           f"(expected {json.dumps(array_document(spec, tensor, needed))})", **where))
        if beyond:
            report.problems.append(_problem("bounds", f"array holds {max(tokens, 0)} tokens, committed samples need "
                                            f"{max(r.end for r in beyond)}", [r.sample_id for r in beyond], **where))
    return tokens_of


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


def _find(storage: Storage) -> list[str]:
    """Every file under the store's folders (a symlink or FIFO anywhere there raises UnsafePathError)."""
    return [key for folder in (PARTS, MANIFESTS, MASKS, REMOVALS) for key in storage.find(folder)]


def _present_shards(spec: StoreSpec, found: list[str]) -> dict[tuple[str, str], list[int]]:
    """The shard files that exist, by (part, tensor): sorted shard numbers."""
    present: dict[tuple[str, str], list[int]] = {}
    for key in found:
        match = _SHARD.match(key)
        if match and _fits(spec, match):
            present.setdefault((match["part"], match["tensor"]), []).append(int(match["shard"]))
    return {k: sorted(v) for k, v in present.items()}


def _fits(spec: StoreSpec, shard: re.Match) -> bool:
    """A shard key's ``/0`` suffix is there exactly for 2-D tensors."""
    return (spec.tensor(shard["tensor"]).width is not None) == (shard["inner"] is not None)


def _chunk_runs(spec: StoreSpec, tensor: TensorSpec, rows: list[_Row],
                shards: list[int]) -> list[tuple[int, int, int]]:
    """``(shard, first_chunk, end_chunk)`` runs of local chunks holding ``rows`` in the existing ``shards``
    (sorted), merged and in file order: never more runs than rows and shard files."""
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
        k = bisect_left(shards, first // per_shard)
        while k < len(shards) and shards[k] * per_shard < end:
            shard = shards[k]
            out.append((shard, max(first, shard * per_shard) - shard * per_shard,
                        min(end, (shard + 1) * per_shard) - shard * per_shard))
            k += 1
    return out


def _missing_shards(spec: StoreSpec, rows: list[_Row], shards: list[int]) -> list[tuple[int, int]]:
    """``[first, last]`` runs of shard numbers that ``rows`` need and that do not exist."""
    st = spec.shard_tokens
    spans: list[list[int]] = []
    for r in rows:
        first, last = r.offset // st, (r.end - 1) // st
        if spans and first <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    missing = []
    for first, last in spans:
        k = bisect_left(shards, first)
        at = first
        while k < len(shards) and shards[k] <= last:
            if shards[k] > at:
                missing.append((at, shards[k] - 1))
            at = shards[k] + 1
            k += 1
        if at <= last:
            missing.append((at, last))
    return missing


def _chunk_bytes(spec: StoreSpec, tensor: TensorSpec, rows: list[_Row], shards: list[int]) -> int:
    return sum(end - first for _, first, end in _chunk_runs(spec, tensor, rows, shards)) * tensor.chunk_nbytes


class _StreamCheck:
    """Checks one tensor of one part: shard files, indexes, chunk crc32c, and the selected samples' xxh3 and
    value ranges."""

    def __init__(self, storage: Storage, spec: StoreSpec, part: str, tensor: TensorSpec, rows: list[_Row],
                 shards: list[int], check_finite: bool, progress: Callable[[int], None] | None):
        self.storage, self.spec, self.part, self.tensor, self.rows = storage, spec, part, tensor, rows
        self.shards = shards
        self.check_finite = check_finite and tensor.name in HIDDEN_TENSORS
        self.progress = progress
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        self.bytes_checked = 0
        self._offsets = [r.offset for r in rows]
        self._max_ends = list(accumulate((r.end for r in rows), max))
        self._next = 0  # first row not yet finished
        self._hasher = manifest.content_hasher()
        self._broken: set[str] = set()  # rows with a problem found already: no hash verdict for them
        self._in_bad_chunks: set[str] = set()  # rows in a chunk failing its crc32c: their xxh3 says if they are hit
        self._hash_failed: set[str] = set()  # of those, the ones whose xxh3 differs
        self._bad_chunk_problems: list[tuple[str, str, tuple, list[str], int]] = []  # reported once verdicts are in
        self._non_finite: set[str] = set()
        self._bad_values: list[str] = []  # samples whose values are out of range, and the first such value
        self._bad_value: int | None = None
        self._compressed = tensor.compression is not None
        self._streams = self._compressed and device_decodable(tensor.compression)  # frames a GPU decodes too
        self._chunk: memoryview | None = None  # a compressed chunk's payload, decoded (_decompressed)
        self._scratch: np.ndarray | None = None  # _holds_non_finite's
        ids_limit = MAX_INPUT_ID + 1 if spec.vocab_size is None else spec.vocab_size  # negative ids: always
        self._limit = {"loss_mask": 2, "input_ids": ids_limit}.get(tensor.name)  # values must be >= 0 and < this

    def run(self) -> None:
        st = self.spec.shard_tokens
        for first, last in _missing_shards(self.spec, self.rows, self.shards):
            key = shard_key(self.part, self.tensor, first)
            message = "shard file missing" if first == last else \
                f"shard files {first} to {last} missing ({last - first + 1:,} files)"
            self._fail_rows(first * st, (last + 1) * st, "missing", message, key)
        runs = _chunk_runs(self.spec, self.tensor, self.rows, self.shards)
        for shard in sorted({s for s, _, _ in runs}):
            self._check_shard(shard, [(a, b) for s, a, b in runs if s == shard])
        if self._bad_values:
            self._add("values", f"{self.tensor.name} holds {self._bad_value}, outside [0, {self._limit})",
                      None, samples=self._bad_values)
        unhashed = {r.sample_id for r in self.rows if r.hashes[self.tensor.name] is None}
        for what, key, byte_range, affected, lost in self._bad_chunk_problems:
            damaged = [s for s in affected if s in self._hash_failed or s in self._broken or s in unhashed]
            message = _bad_chunk_message(what, affected, damaged, lost)
            if damaged:  # its xxh3 differs, or cannot say (the chunk does not decode, the tensor has no hash)
                self._add("checksum", message, key, byte_range, damaged)
            else:  # every sample reads back intact: nothing to repair, nothing training would see
                self.notes.append(f"part {self.part}, tensor {self.tensor.name}, {self.storage.describe(key)} "
                                  f"bytes [{byte_range[0]}, {byte_range[1]}): {message}")

    def _add(self, kind: str, message: str, key: str | None, byte_range=None, samples=()) -> None:
        self.problems.append(_problem(kind, message, samples, part=self.part, tensor=self.tensor.name,
                                      key=key and self.storage.describe(key), byte_range=byte_range))

    def _rows_in(self, first_token: int, end_token: int) -> list[_Row]:
        lo, hi = bisect_right(self._max_ends, first_token), bisect_left(self._offsets, end_token)
        return [r for r in self.rows[lo:hi] if r.end > first_token]

    def _check_shard(self, shard: int, runs: list[tuple[int, int]]) -> None:
        key = shard_key(self.part, self.tensor, shard)
        chunk_size, per_shard = encoded_chunk_nbytes(self.tensor), chunks_per_shard(self.spec, self.tensor)
        base, ct, st = shard * self.spec.shard_tokens, self.tensor.chunk_tokens, self.spec.shard_tokens
        try:
            size = self.storage.size(key)
            raw_index = self.storage.read_exact(key, max(0, size - index_nbytes(per_shard)), size)
        except FileNotFoundError:
            return self._fail_rows(base, base + st, "missing", "shard file missing", key)
        except (CorruptDataError, OSError) as e:
            return self._fail_rows(base, base + st, "unreadable", str(e), key)
        try:
            spans = index_spans(decode_index(raw_index, per_shard, where="shard index"), size, self.tensor)
        except CorruptDataError as e:
            self._add("index", str(e), key, samples=[r.sample_id for r in self._rows_in(base, base + st)])
            if self._compressed:
                return self._fail_rows(base, base + st, "unreadable", "a compressed shard's chunks cannot be found "
                                       "without its index", key)
            written = min(per_shard, max(0, (size - index_nbytes(per_shard)) // chunk_size))
            spans = np.stack([np.arange(written) * chunk_size, np.full(written, chunk_size)], axis=1)
        written = len(spans)
        bad_chunks: list[int] = []
        undecodable: list[tuple[int, str]] = []  # compressed chunks whose crc32c holds but that do not decompress
        for first, end in runs:
            if end > written:
                self._fail_rows(base + max(first, written) * ct, base + end * ct, "missing",
                                f"chunks {max(first, written)}..{end - 1} are not in the shard", key)
                end = max(first, written)
            done = first  # chunks checked so far
            try:
                for a, b, block in self._blocks(key, spans, first, end):
                    self._check_block(base, a, b, block, spans, bad_chunks, undecodable)
                    done = b
            except (CorruptDataError, OSError) as e:
                return self._fail_rows(base + done * ct, base + end * ct, "unreadable", str(e), key)
        if bad_chunks:
            what = f"chunk {bad_chunks[0]}" if len(bad_chunks) == 1 else \
                f"{len(bad_chunks):,} chunks ({', '.join(map(str, bad_chunks[:5]))}{', ...' if len(bad_chunks) > 5 else ''})"
            affected = {r.sample_id: r for j in bad_chunks for r in self._rows_in(base + j * ct, base + (j + 1) * ct)}
            lost = len(bad_chunks) if self._compressed else 0
            self._bad_chunk_problems.append((what, key, (int(spans[bad_chunks[0], 0]), int(spans[bad_chunks[-1]].sum())),
                                             list(affected), lost))
        if undecodable:
            (j, why), more = undecodable[0], f" (and {len(undecodable) - 1} more chunks)" if len(undecodable) > 1 else ""
            affected = {r.sample_id: r for j, _ in undecodable for r in self._rows_in(base + j * ct, base + (j + 1) * ct)}
            self._add("checksum", f"chunk {j} does not decompress: {why}{more}", key,
                      (int(spans[j, 0]), int(spans[j].sum())), list(affected))

    def _blocks(self, key: str, spans: np.ndarray, first: int, end: int) -> Iterator[tuple[int, int, bytes]]:
        """Chunks ``[first, end)`` as ``(a, b, bytes of chunks [a, b))`` blocks, the next block read while the
        current one is checked."""
        per_block = max(1, BLOCK_BYTES // encoded_chunk_nbytes(self.tensor))
        starts = list(range(first, end, per_block))
        with ThreadPoolExecutor(1) as reader:
            def read(a: int):
                b = min(end, a + per_block)
                return a, b, self.storage.read_exact(key, int(spans[a, 0]), int(spans[b - 1].sum()))

            pending = reader.submit(read, starts[0]) if starts else None
            try:
                for k in range(len(starts)):
                    block = pending.result()
                    pending = reader.submit(read, starts[k + 1]) if k + 1 < len(starts) else None
                    yield block
            finally:
                if pending is not None:
                    pending.cancel()

    def _check_block(self, base: int, first: int, end: int, block: bytes, spans: np.ndarray,
                     bad_chunks: list[int], undecodable: list[tuple[int, str]]) -> None:
        payload, ct = self.tensor.chunk_nbytes, self.tensor.chunk_tokens
        view, start = memoryview(block), int(spans[first, 0])
        for j in range(first, end):
            at, encoded = int(spans[j, 0]) - start, int(spans[j, 1])
            data = view[at : at + encoded - CRC_NBYTES]
            stored = int.from_bytes(view[at + encoded - CRC_NBYTES : at + encoded], "little")
            t0, t1 = base + j * ct, base + (j + 1) * ct
            intact = crc32c(data) == stored
            if not intact:  # in an uncompressed chunk its samples' xxh3 tell which of them the damage hits;
                bad_chunks.append(j)  # readers refuse a compressed one whole (section 5b): all its samples are lost
                if self._compressed:
                    self._broken.update(r.sample_id for r in self._rows_in(t0, t1))
                    data = self._zeros()
                else:
                    self._in_bad_chunks.update(r.sample_id for r in self._rows_in(t0, t1))
            elif self._compressed:
                data, why = self._decompressed(data)
                if why is not None:  # its samples' bytes are lost
                    undecodable.append((j, why))
                    self._broken.update(r.sample_id for r in self._rows_in(t0, t1))
            self._feed(data, t0, t1)
            self.bytes_checked += payload
            if self.progress is not None:
                self.progress(payload)

    def _decompressed(self, data: memoryview) -> tuple[memoryview, str | None]:
        """A compressed chunk's payload (zeros if it does not decompress), and why it does not (None: it does).
        The payload is this checker's one chunk buffer, valid until the next call (a fresh one per chunk paid its
        page faults)."""
        try:
            decode_into(data, self._buffer())
            if self._streams:  # what a device decoder reads of it (docs/format.md section 5c)
                blosc_streams(data, self.tensor.chunk_nbytes)
        except ValueError as e:
            return self._zeros(), str(e)
        return self._chunk, None

    def _zeros(self) -> memoryview:
        self._buffer()[:] = bytes(self.tensor.chunk_nbytes)
        return self._chunk

    def _buffer(self) -> memoryview:
        if self._chunk is None:
            self._chunk = memoryview(bytearray(self.tensor.chunk_nbytes))
        return self._chunk

    def _feed(self, data: memoryview, t0: int, t1: int) -> None:
        """Hash (and range-check) the selected rows' bytes of chunk tokens ``[t0, t1)``; finish rows ending in it."""
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
            hit = r.sample_id in self._broken or r.sample_id in self._in_bad_chunks  # reported as such
            if self._limit is not None and r.hashes[self.tensor.name] is not None and not hit:
                self._check_values(r.sample_id, piece)
            if self.tensor.quantized and r.sample_id not in self._non_finite:  # always: fp8 rows carry scales
                problem = quantize.invalid(np.frombuffer(piece, np.uint8), self.tensor.layers, self.spec.hidden_size,
                                           self.tensor.logical_dtype)
                if problem is not None:
                    self._non_finite.add(r.sample_id)
                    self._add("non_finite", problem, None, samples=[r.sample_id])
            elif self.check_finite and r.sample_id not in self._non_finite and self._holds_non_finite(piece):
                self._non_finite.add(r.sample_id)
                self._add("non_finite", "holds NaN or Inf", None, samples=[r.sample_id])
            if r.end > t1:
                return
            computed = self._hasher.intdigest()
            expected = r.hashes[self.tensor.name]
            if expected is not None and computed != expected and r.sample_id in self._in_bad_chunks:
                self._hash_failed.add(r.sample_id)  # named by its chunk's crc32c problem
            elif expected is not None and computed != expected and r.sample_id not in self._broken:
                ranges = token_ranges(self.spec, self.tensor, r.offset, r.length)
                more = f" (and {len(ranges) - 1} more shard(s))" if len(ranges) > 1 else ""
                key = shard_key(self.part, self.tensor, ranges[0].shard)
                dense_range = (ranges[0].file_start, ranges[0].file_end) if not self._compressed else None
                self._add("checksum", f"xxh3 {computed:016x} differs from the manifest's {expected:016x}{more}",
                          key, dense_range, [r.sample_id])
            self._next += 1
            self._hasher = manifest.content_hasher()

    def _holds_non_finite(self, piece: memoryview) -> bool:
        """Whether a float piece holds NaN or Inf: its largest magnitude bit pattern (sign cleared) reaches the
        exponent mask's (one pass, into a scratch buffer kept for the next piece)."""
        dtype = self.tensor.dtype
        values = np.frombuffer(piece, dtype.bits)
        if self._scratch is None or len(self._scratch) < len(values):
            self._scratch = np.empty(len(values), dtype.bits)
        magnitudes = np.bitwise_and(values, dtype.bits.type((1 << (8 * dtype.itemsize - 1)) - 1),
                                    out=self._scratch[: len(values)])
        return len(values) > 0 and int(magnitudes.max()) >= dtype.exponent_mask

    def _check_values(self, sample_id: str, piece: memoryview) -> None:
        """``input_ids`` in ``[0, vocab_size)``, ``loss_mask`` 0 or 1 (a sample stored without a mask is skipped)."""
        if self._bad_values and self._bad_values[-1] == sample_id:
            return
        values = np.frombuffer(piece, self.tensor.dtype.stored.newbyteorder('<'))
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= self._limit:
            self._bad_values.append(sample_id)
            if self._bad_value is None:
                self._bad_value = low if low < 0 else high

    def _fail_rows(self, t0: int, t1: int, kind: str, message: str, key: str, byte_range=None) -> None:
        """One problem for every selected sample with tokens in ``[t0, t1)`` (or naming no sample)."""
        rows = self._rows_in(t0, t1)
        self._broken.update(r.sample_id for r in rows)
        self._add(kind, message, key, byte_range, [r.sample_id for r in rows])


def _bad_chunk_message(what: str, affected: list[str], damaged: list[str], lost: int) -> str:
    """What a crc32c failure damages: the samples named (a few, then a count), or none; ``lost``: how many of the
    chunks are compressed ones, which readers refuse whole."""
    if not damaged:
        return (f"crc32c mismatch in {what}, but no committed sample's bytes are damaged (the {len(affected):,} "
                f"samples it holds read back intact by their xxh3: the damage lies in padding, an unused tail or a "
                f"removed sample)")
    named = ", ".join(repr(s) for s in damaged[:NAMED_SAMPLES])
    more = f" and {len(damaged) - NAMED_SAMPLES:,} more" if len(damaged) > NAMED_SAMPLES else ""
    intact = len(affected) - len(damaged)
    chunks = "it" if lost == 1 else f"those {lost:,} chunks"
    whole = f"; readers refuse a compressed chunk that fails its crc32c, so all samples of {chunks} are lost" if lost \
        else ""
    return (f"crc32c mismatch in {what}: damages sample{'s' if len(damaged) > 1 else ''} {named}{more}"
            f"{f' ({intact:,} other samples in it intact)' if intact else ''}{whole}")


def _leftovers(spec: StoreSpec, rows: _Rows, found: list[str]) -> list[str]:
    """Of ``found``, the keys of layout names that no row not removed needs."""
    st = spec.shard_tokens
    spans = {part: _merged((o // st, (e - 1) // st) for o, e in ranges) for part, ranges in rows.live.items()}
    out = []
    for key in found:
        if _PARTIAL.search(key):
            out.append(key)
        elif node := _NODE.match(key):
            if node["part"] not in spans:
                out.append(key)
        elif (shard := _SHARD.match(key)) and _fits(spec, shard):
            part_spans = spans.get(shard["part"], [])
            k = bisect_right(part_spans, (int(shard["shard"]), float("inf"))) - 1
            if k < 0 or part_spans[k][1] < int(shard["shard"]):
                out.append(key)
    return sorted(out)


def _merged(spans) -> list[tuple[int, int]]:
    """``[first, last]`` spans, sorted and merged where they overlap or touch."""
    out: list[list[int]] = []
    for first, last in sorted(spans):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return [(a, b) for a, b in out]
