"""The streaming writer: ``hsdata.create`` returns a :class:`Writer` that owns one new part of the store.

``add`` validates on the caller's thread and hands the arrays (not copies) to a background thread through a
queue bounded in bytes; that thread streams them into shard files and commits a manifest each time a shard is
finished, on ``flush()`` and on ``close()``. Nothing becomes visible before its manifest is written.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any, Callable

from . import inputs, manifest, removals
from .errors import DuplicateSampleError, WriterError
from .layout import (MANIFESTS, PART_ATTRIBUTE, PARTS, PROVENANCE_ATTRIBUTE, ROOT_METADATA, SPEC_ATTRIBUTE,
                     array_document, array_node, check_provenance, encode_json, group_document, load_root,
                     metadata_key, part_node, shard_key)
from .shard import CHUNKS_PER_TASK, CompressedShardEncoder, ShardEncoder
from .spec import FINAL_HIDDEN_STATE, StoreSpec
from .io.storage import Storage

DEFAULT_MAX_PENDING_BYTES = 1 << 30
INLINE_BYTES = 1 << 20  # rows of a sample smaller than this are written on the writer thread itself
# a compressed store's chunks are compressed on this many threads; more than 8 write slower, not faster: each
# thread takes the GIL back after every zstd, crc32c and write call (benchmarks/RESULTS.md, "Eight compress threads")
COMPRESS_THREADS = min(8, os.cpu_count() or 1)


def create(url: str, hidden_size: int, aux_layers: list[int], model: str | None = None, *,
           dtype: Any = "bfloat16", compute_dtype: Any = None, vocab_size: int | None = None,
           shard_tokens: int | None = None, chunk_tokens: int | None = None, storage_options: dict | None = None,
           max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, provenance: dict | None = None,
           final_hidden_state: str = FINAL_HIDDEN_STATE, compression: Any = None) -> Writer:
    """Create a store at ``url`` (any fsspec URL), or join an existing one with the same spec as a new writer.

    ``aux_layers`` are "output of layer k" ids (HF ``hidden_states[k + 1]``). ``dtype`` is how the hidden states
    are stored and ``compute_dtype`` what the model computed them in (None: ``dtype``), each "bfloat16",
    "float16", "float32" or the torch dtype; float32 may be stored as bfloat16 or float16, converted by ``add``.
    ``dtype="float8_e4m3fn"`` (or ``"float8_e5m2"``) stores fp8 with a float32 scale per token and layer
    (``hsdata.codecs.quantize``; format version 4): ``add`` takes states in ``compute_dtype`` (None: bfloat16) and
    quantizes them on their device, refusing NaN and Inf; readers return bfloat16.
    Joining a store whose model facts or dtypes differ raises :class:`SpecMismatchError`; layout sizes left as
    None are taken from the store.

    ``provenance`` is free-form JSON about how the data was made (tokenizer, data source, command, ...; string
    keys, at most 64 KiB): recorded in the root metadata by the writer that creates the store (``Store.provenance``,
    ``hsdata info``), in this writer's part otherwise. Checked before anything is written (``ValueError``).
    ``final_hidden_state``: what ``hidden_states`` holds, ``"post_norm"`` (hsdata's extraction) or ``"pre_norm"``
    (dumps imported as they are). ``compression``: how the hidden states' chunks are compressed on disk (None,
    ``"zstd"``, ``"lz4"`` or a :class:`hsdata.Compression`; docs/format.md section 5a says what it costs); a
    writer joining a store with None takes the store's.

    Memory: ``add`` returns once the sample is queued, and blocks while the queued samples not yet written hold
    more than ``max_pending_bytes`` (1 GiB). A compressed writer also holds, per hidden tensor, up to
    ``COMPRESS_THREADS * CHUNKS_PER_TASK + 2`` (34) chunks being compressed and their encoded bytes (measured at
    H = 7168: 418 MiB with 34 chunks, 102 MiB on 2 threads; in one 1.5 GiB write at H = 7168, 91 MiB resident above
    the samples on 8 threads, 22 on 2; an uncompressed writer 11 MiB beyond the queued samples).
    """
    if max_pending_bytes <= 0:
        raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes}")
    provenance = None if provenance is None else check_provenance(provenance)
    requested = StoreSpec.new(hidden_size, aux_layers, model, dtype=dtype, compute_dtype=compute_dtype,
                              vocab_size=vocab_size, shard_tokens=shard_tokens, chunk_tokens=chunk_tokens,
                              final_hidden_state=final_hidden_state, compression=compression)
    storage = Storage(url, storage_options)
    if not storage.exists(ROOT_METADATA):
        attributes = {SPEC_ATTRIBUTE: requested.to_dict()}
        if provenance:
            attributes[PROVENANCE_ATTRIBUTE] = provenance
        root = group_document(attributes)
        storage.write_bytes(ROOT_METADATA, encode_json(root), exclusive=True)  # a concurrent creator may win
    spec, root_provenance = load_root(storage)
    explicit = {name for name, value in (("shard_tokens", shard_tokens), ("chunk_tokens", chunk_tokens),
                                         ("compression", compression)) if value is not None}
    spec.check_joinable(requested, explicit=explicit)
    committed = removals.load(storage).drop_rows(manifest.load(storage)).column("sample_id").to_pylist()
    part_provenance = provenance if provenance and provenance != root_provenance else None  # joined it
    return Writer(storage, spec, committed_ids=committed, max_pending_bytes=max_pending_bytes,
                  provenance=part_provenance)


class Writer:
    """Adds samples to one part of a store. Use as a context manager, or call ``close()``."""

    def __init__(self, storage: Storage, spec: StoreSpec, *, committed_ids: list[str], max_pending_bytes: int,
                 provenance: dict | None = None):
        """``provenance``: recorded in this writer's part (``hsdata_part.provenance``) at its first commit."""
        self.spec = spec
        self.part = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        self._ids = set(committed_ids)
        self._queue = _PendingQueue(max_pending_bytes)
        self._part = _PartWriter(storage, spec, self.part, provenance)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hsdata-writer-{self.part}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self._part.storage.url

    @property
    def num_committed(self) -> int:
        """Samples this writer has committed so far."""
        return self._part.num_committed

    def __contains__(self, sample_id: str) -> bool:
        """True if ``sample_id`` is committed in the store or was added to this writer."""
        return sample_id in self._ids

    def add(self, sample_id: str, *, input_ids: Any, loss_mask: Any, aux_hidden_states: Any, hidden_states: Any,
            meta: dict | None = None) -> None:
        """Queue one sample. Arrays are kept by reference until written: do not modify them afterwards.

        ``input_ids`` [T] ints, ``loss_mask`` [T] 0/1 (None: not known to this writer, e.g. the server hook;
        readers then get None), ``aux_hidden_states`` [T, K*H] (or [T, K, H]) and ``hidden_states`` [T, H]
        (post-norm) in the store's dtype (kept as given) or its compute dtype (converted), ``meta`` any
        JSON-serializable dict.
        """
        self._check_open()
        sample = inputs.prepare(self.spec, sample_id, input_ids=input_ids, loss_mask=loss_mask,
                                aux_hidden_states=aux_hidden_states, hidden_states=hidden_states, meta=meta)
        if sample_id in self._ids:
            try:
                require_root(self._part.storage, self.part)  # a removed store is a fault, not a duplicate
            except FileNotFoundError as e:
                raise WriterError(str(e)) from e
            raise DuplicateSampleError(f"sample {sample_id!r}: already in this store (committed or added earlier)")
        self._ids.add(sample_id)
        self._queue.put(("sample", sample), sample.nbytes)

    def flush(self) -> None:
        """Commit every sample added so far; returns once their manifest is durable."""
        self._check_open()
        self._request("flush")

    def close(self) -> None:
        """Commit everything and stop the background thread. Idempotent."""
        if not self._closed:
            self._closed = True
            self._request("close")
            self._thread.join()

    def abort(self) -> None:
        """Stop without committing what is not yet committed; its partial files stay for ``hsdata gc``."""
        if not self._closed:
            self._closed = True
            try:
                self._request("abort")
            except WriterError:
                pass
            self._thread.join()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise WriterError(f"writer of part {self.part} is closed")
        self._queue.raise_if_failed()

    def _request(self, what: str) -> None:
        done: Future = Future()
        self._queue.put((what, done), 0)
        try:
            done.result()
        except WriterError:
            raise
        except BaseException as e:
            raise WriterError(f"writing part {self.part} of {self.url} failed: {e}") from e

    def _run(self) -> None:
        request = None
        try:
            while True:
                (kind, payload), nbytes = self._queue.get()
                if kind == "sample":
                    self._part.append(payload, partial(self._queue.release, nbytes))
                    continue
                request = payload
                if kind == "abort":
                    self._part.abort()
                else:
                    self._part.flush()
                request.set_result(None)
                if kind != "flush":
                    self._part.shutdown()
                    return
                request = None
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the queue
            self._queue.fail(e)
            if request is not None:
                request.set_exception(e)
            self._part.abort()
            self._part.shutdown()


class _PendingQueue:
    """FIFO between ``add`` and the writer thread, holding at most ``max_bytes`` of sample data (a larger
    sample is admitted alone). A failure wakes every waiter and fails every queued request."""

    def __init__(self, max_bytes: int):
        self._cond = threading.Condition()
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._max = max_bytes
        self._error: BaseException | None = None

    def put(self, item: tuple, nbytes: int) -> None:
        with self._cond:
            while self._error is None and self._bytes and self._bytes + nbytes > self._max:
                self._cond.wait()
            self.raise_if_failed()
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()

    def get(self) -> tuple:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._bytes -= nbytes
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            for (kind, payload), _ in self._items:
                if kind != "sample":
                    payload.set_exception(error)
            self._items.clear()
            self._cond.notify_all()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise WriterError(f"the writer's background I/O failed: {self._error!r}") from self._error


class _PartWriter:
    """Background-thread state of one part: the open shard, samples written but not committed, commits.

    Nothing here waits for the disk on the writer thread. Each tensor has a lane, one thread that runs that
    tensor's file work in the order it was submitted (rows, then the shard's finish and fsync, then the next
    shard's rows), so a large tensor's writes never wait for a small tensor's, nor one sample for the previous one.
    Large tensors are hashed on a pool beside their writes. Commits run in order on a committer thread once the
    files and hashes they cover are done; a sample's queued bytes are released once nothing reads them.
    """

    def __init__(self, storage: Storage, spec: StoreSpec, part: str, provenance: dict | None):
        self.storage = storage
        self.spec = spec
        self.part = part
        self.provenance = provenance
        self.num_committed = 0
        self._next_token = 0  # where the next sample starts in this part's arrays
        self._shard: int | None = None  # the shard being written
        self._files: dict[str, tuple] = {}  # tensor -> (AtomicWriter, ShardEncoder) of the open shard
        self._uncommitted: list[_PendingRow] = []
        self._closing: list[tuple] = []  # (AtomicWriter, its commit) of closed shards, until committed
        self._seq = 0
        self._array_tokens = 0  # shape last written to the arrays' zarr.json (committer thread only)
        self._lanes = {t.name: ThreadPoolExecutor(1, thread_name_prefix=f"hsdata-{t.name}-{part}")
                       for t in spec.tensors}
        self._last = {name: _DONE for name in self._lanes}  # each lane's latest task
        self._pool = ThreadPoolExecutor(len(spec.tensors), thread_name_prefix=f"hsdata-hash-{part}")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"hsdata-commit-{part}")
        compressed = spec.compression is not None
        self._compressor = ThreadPoolExecutor(COMPRESS_THREADS, f"hsdata-compress-{part}") if compressed else None
        self._last_commit: Future = _DONE
        self._row_nbytes = sum(t.row_nbytes for t in spec.tensors)  # one token of every tensor
        self._failure: BaseException | None = None

    def append(self, sample: inputs.Sample, on_written: Callable[[], None]) -> None:
        """Stream the sample's rows into the open shard(s) and return; ``on_written`` runs once nothing reads its
        rows any more (written, or compressed into frames the encoders write) and its hashes are done. A small
        sample is written on this thread when the lanes are idle (a hand-off costs more than the work). A full
        shard is closed and committed behind the writes."""
        self._raise_failure()
        start, total, shard_tokens = self._next_token, sample.num_tokens, self.spec.shard_tokens
        tasks: list[Future] = []
        hashes: dict[str, Any] = {} if sample.has_loss_mask else {"loss_mask": None}  # filled by the first piece
        self._uncommitted.append(_PendingRow(sample.sample_id, start, total, hashes, sample.meta, manifest.now()))
        done = 0
        while done < total:
            position = start + done
            shard = position // shard_tokens
            if self._shard is None:
                self._open_shard(shard)
            count = min(total - done, (shard + 1) * shard_tokens - position)
            first = done == 0
            inline = count * self._row_nbytes < INLINE_BYTES and all(task.done() for task in self._last.values())
            for name, array in sample.arrays.items():
                hash_it, read = first and name not in hashes, Future()
                tasks.append(read)
                if inline:
                    value = self._write_rows(self._files[name][1], array, done, count, hash_it, read)
                    if first:
                        hashes.setdefault(name, value)
                    continue
                small = count * self._row_nbytes < INLINE_BYTES  # hashed in its lane, not on the pool
                task = self._submit(name, self._write_rows, self._files[name][1], array, done, count,
                                    hash_it and small, read)
                tasks.append(task)
                if hash_it:
                    hashes[name] = task if small else self._pool.submit(manifest.content_hash, array)
                    tasks.append(hashes[name])
            done += count
            self._next_token = position + count
            if self._next_token % shard_tokens == 0:
                self._close_shard()
                self._commit()
        _when_all(tasks, on_written)

    @staticmethod
    def _write_rows(encoder: ShardEncoder | CompressedShardEncoder, array, first_row: int, count: int,
                    with_hash: bool, read: Future) -> int | None:
        """Write rows of ``array``; ``read`` is done once nothing reads them any more: at once, or once the
        compressions reading them are (the lane goes on to the next rows meanwhile)."""
        try:
            reading = encoder.write(memoryview(array[first_row : first_row + count]))
        except BaseException as e:
            read.set_exception(e)
            raise
        _when_all(reading, partial(read.set_result, None))
        return manifest.content_hash(array) if with_hash else None

    def flush(self) -> None:
        """Close the open shard, even if partly filled (the next sample starts in a new shard), commit, and wait
        until everything written so far is committed."""
        if self._shard is not None:
            self._next_token = (self._shard + 1) * self.spec.shard_tokens
            self._close_shard()
        self._commit()
        self._last_commit.result()
        self._raise_failure()

    def shutdown(self) -> None:
        for executor in (*self._lanes.values(), self._pool, self._committer,
                         self._compressor):
            if executor is not None:
                executor.shutdown(wait=True)

    def abort(self) -> None:
        """Discard the open shard's partial files, and those of closed shards that failed to commit, once no lane
        uses them (best effort: this runs after failures too). Committed shard files not yet in a manifest stay
        for ``hsdata gc``."""
        for task in (*self._last.values(), self._last_commit):
            task.exception()
        failed = [writer for writer, task in self._closing if task.exception() is not None]
        for _, encoder in self._files.values():
            try:
                encoder.settle()  # its chunks in flight write no more
            except Exception:
                pass
        for writer in (*failed, *(writer for writer, _ in self._files.values())):
            try:
                writer.abort()
            except OSError:
                pass
        self._closing = []
        self._files.clear()
        self._shard = None

    def _submit(self, lane: str, fn: Callable, *args) -> Future:
        task = self._lanes[lane].submit(self._unless_failed, fn, *args)
        task.add_done_callback(self._note_failure)
        self._last[lane] = task
        return task

    def _unless_failed(self, fn: Callable, *args):
        """Lane work runs only while nothing has failed: a shard whose writes failed is never committed."""
        self._raise_failure()
        return fn(*args)

    def _note_failure(self, task: Future) -> None:
        if task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _open_shard(self, shard: int) -> None:
        for tensor in self.spec.tensors:
            writer = self.storage.open_writer(shard_key(self.part, tensor, shard))
            if tensor.compression is None:
                encoder = ShardEncoder(writer, self.spec, tensor)
            else:  # a task's chunks in flight per thread: the threads stay busy while others write
                encoder = CompressedShardEncoder(writer, self.spec, tensor, self._compressor,
                                                 COMPRESS_THREADS * CHUNKS_PER_TASK)
            self._files[tensor.name] = (writer, encoder)
        self._shard = shard

    def _close_shard(self) -> None:
        """Finish and commit the shard's files, each in its tensor's lane after its writes: their fsyncs overlap
        (the disk sees every file's tail at once, as when the tensors were written)."""
        self._closing = [(writer, task) for writer, task in self._closing if not task.done() or task.exception()]
        for name, (writer, encoder) in self._files.items():
            self._closing.append((writer, self._submit(name, self._commit_file, writer, encoder)))
        self._files = {}
        self._shard = None

    @staticmethod
    def _commit_file(writer, encoder: ShardEncoder) -> None:
        encoder.finish()
        writer.commit()

    def _commit(self) -> None:
        """Hand every sample that lies in closed shards to the committer, with the file commits it waits for."""
        complete = [r for r in self._uncommitted if r.token_offset + r.num_tokens <= self._next_token]
        if not complete:
            return
        self._uncommitted = self._uncommitted[len(complete) :]
        files = [task for _, task in self._closing]  # those already committed cost nothing to wait for
        self._last_commit = self._committer.submit(self._commit_rows, complete, files)
        self._last_commit.add_done_callback(self._note_failure)

    def _commit_rows(self, pending: list[_PendingRow], files: list[Future]) -> None:
        """Make ``pending`` visible: their files and hashes done, array metadata next, the manifest last."""
        for task in files:
            task.result()
        rows = [row.resolve(self.part) for row in pending]
        self._raise_failure()  # a lane's failed writes are never made visible
        documents = {}  # key -> bytes, written (and fsynced) in parallel, all before the manifest
        if self._seq == 0:
            documents[metadata_key(PARTS)] = encode_json(group_document())
            info = {"created": manifest.now().isoformat(), "manifests": MANIFESTS}
            if self.provenance:
                info["provenance"] = self.provenance
            documents[metadata_key(part_node(self.part))] = encode_json(group_document({PART_ATTRIBUTE: info}))
        tokens = max(r.token_offset + r.num_tokens for r in rows)
        if tokens > self._array_tokens:
            for tensor in self.spec.tensors:
                document = array_document(self.spec, tensor, tokens)
                documents[metadata_key(array_node(self.part, tensor))] = encode_json(document)
        tasks = [self._pool.submit(self.storage.write_bytes, key, data) for key, data in documents.items()]
        for task in tasks:
            task.exception()  # every one finished before the manifest, or before an error is raised
        for task in tasks:
            task.result()
        self._array_tokens = max(tokens, self._array_tokens)
        require_root(self.storage, self.part)  # the folder removed under us: storage would recreate its path
        manifest.write(self.storage, self.part, self._seq, rows)
        self._seq += 1
        self.num_committed += len(rows)


def require_root(storage: Storage, part: str) -> None:
    """FileNotFoundError unless the store's root document is still there."""
    if not storage.exists(ROOT_METADATA):
        raise FileNotFoundError(errno.ENOENT, f"{storage.describe(ROOT_METADATA)} is gone: the store was removed "
                                f"while part {part} was written")


@dataclass
class _PendingRow:
    """A written sample's manifest row, its hashes possibly still being computed."""

    sample_id: str
    token_offset: int
    num_tokens: int
    hashes: dict[str, Any]  # tensor -> hash, None (no loss mask) or the Future computing it
    meta: str | None
    created: datetime

    def resolve(self, part: str) -> manifest.Row:
        hashes = {name: value.result() if isinstance(value, Future) else value for name, value in self.hashes.items()}
        return manifest.Row(self.sample_id, part, self.token_offset, self.num_tokens, hashes, self.meta, self.created)


def _done_future() -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


_DONE = _done_future()


def _when_all(tasks: list[Future], callback: Callable[[], None]) -> None:
    """Run ``callback`` once every task is done (at once if there are none), on the thread finishing the last."""
    if not tasks:
        callback()
        return
    remaining = [len(tasks)]
    lock = threading.Lock()

    def one_done(_task: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for task in tasks:
        task.add_done_callback(one_done)
