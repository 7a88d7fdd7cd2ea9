"""Keys and bytes over fsspec, with atomic writes and a zero-copy local read path.

Local paths get ``write to a hidden partial file, fsync, rename, fsync the directory`` and ``preadv`` straight
into the caller's buffers. Other filesystems (object stores) get write-once objects: an object becomes
visible only when its upload completes. Remote reads are retried on transient errors; ranges are fetched with a
bounded number of requests in flight, neighbouring ones merged, optionally through a local :class:`RangeCache`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Awaitable, BinaryIO, Callable, Iterator, Sequence, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from . import remote
from .cache import RangeCache
from .errors import MissingExtraError, RemoteReadError

MAX_OPEN_FILES = 256
RETRIES = 5  # attempts after the first, for transient errors of remote reads
RETRY_BASE_S = 0.2  # backoff before attempt k: RETRY_BASE_S * 2**k, +-50% jitter
MAX_REQUESTS = 32  # remote requests in flight per Storage, by default
MERGE_GAP = 1 << 20  # ranges of one object at most this far apart are fetched as one request

log = logging.getLogger("hsdata.storage")
T = TypeVar("T")


EXTRAS = {"http": "http", "https": "http", "s3": "s3", "s3a": "s3"}  # URL protocol -> hsdata extra


def _missing_extra(url: str, error: ImportError) -> str:
    """The one-line message for a URL whose filesystem is not installed, naming what to install."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in EXTRAS:
        return f"{url}: {protocol}:// needs an optional dependency: pip install 'hsdata[{EXTRAS[protocol]}]' ({error})"
    return f"{url}: {protocol}:// needs a filesystem package fsspec names: {error}"


class Storage:
    """A store's root: ``url`` plus fsspec ``storage_options``; every method takes keys relative to it."""

    def __init__(self, url: str, storage_options: dict | None = None, *, max_requests: int = MAX_REQUESTS,
                 cache: RangeCache | None = None):
        """``max_requests``: remote requests in flight at a time (all threads together); ``cache``: keeps remote
        ranges read by :meth:`read_ranges` on a local disk."""
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.url = str(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except ImportError as e:
            raise MissingExtraError(_missing_extra(self.url, e)) from None
        self.root = self.root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.max_requests = max_requests
        self.cache = None if self.is_local else cache
        self._files = _FileCache() if self.is_local else None
        self._limit: tuple[int, asyncio.Semaphore] | None = None  # (pid, semaphore on fsspec's event loop)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def describe(self, key: str) -> str:
        """The key as a user-facing location (for error messages)."""
        return f"{self.url.rstrip('/')}/{key}"

    def read_bytes(self, key: str) -> bytes:
        return self._retrying(lambda: self.fs.cat_file(self.path(key)), key)

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Whole objects, fetched concurrently on remote filesystems."""
        return self._fetch([(key, None, None) for key in keys])

    def exists(self, key: str) -> bool:
        return self._retrying(lambda: self.fs.exists(self.path(key)), key)

    def list(self, prefix: str) -> list[str]:
        """Names of the visible (not dot-hidden) files directly under ``prefix``; empty if it does not exist."""
        try:
            entries = self._retrying(lambda: self.fs.ls(self.path(prefix), detail=True, refresh=True), prefix)
        except FileNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "file"]
        return sorted(n for n in names if not n.startswith("."))

    def write_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write a whole object atomically; with ``exclusive``, return False instead of replacing one."""
        if exclusive and not self.is_local and self.exists(key):
            return False
        writer = self.open_writer(key)
        try:
            writer.write(data)
            return writer.commit(exclusive=exclusive)
        except BaseException:
            writer.abort()
            raise

    def open_writer(self, key: str) -> AtomicWriter:
        return _LocalAtomicWriter(self.path(key)) if self.is_local else _RemoteWriter(self.fs, self.path(key))

    def size(self, key: str) -> int:
        return self._retrying(lambda: self.fs.size(self.path(key)), key)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return self._retrying(lambda: self.fs.cat_file(self.path(key), start=start, end=end), key)

    def read_into(self, requests: Sequence[tuple[str, int, Sequence[memoryview]]], *,
                  merge_up_to: int = 0) -> Iterator[None]:
        """Remote only: fill each ``(key, offset, buffers)`` with the object's bytes from ``offset`` on (like
        ``preadv``), yielding once per request, in order, as soon as it is filled. Requests come from the cache
        where it has them; the rest are fetched at once, at most ``max_requests`` in flight, those of one object
        at most ``MERGE_GAP`` apart sharing GETs of up to ``merge_up_to`` bytes. Closing the iterator cancels
        what is left; a response of the wrong length raises :class:`CorruptDataError`."""
        ranges = [(key, offset, offset + sum(len(b) for b in buffers)) for key, offset, buffers in requests]
        cached = [self.cache is not None and self.cache.get_into(self.describe(key), start, end, requests[k][2])
                  for k, (key, start, end) in enumerate(ranges)]
        missing = [k for k in range(len(requests)) if not cached[k]]
        gets = merge_ranges([ranges[k] for k in missing], max_gap=MERGE_GAP, max_bytes=merge_up_to)
        get_of = {missing[m]: g for g, (_, _, _, members) in enumerate(gets) for m in members}
        pending = [self._start_get_into(key, start, end, self._gather_buffers([missing[m] for m in members], ranges,
                                                                              requests))
                   for key, start, end, members in gets]
        try:
            for k, (key, start, end) in enumerate(ranges):
                if not cached[k]:
                    pending[get_of[k]].result()
                    if self.cache is not None:
                        self.cache.put_from(self.describe(key), start, end, requests[k][2])
                yield
        finally:
            for future in pending:
                future.cancel()

    @staticmethod
    def _gather_buffers(members: list[int], ranges, requests) -> list:
        """The buffers of one merged GET: each member's, with a throwaway buffer over each gap between them."""
        buffers: list = []
        for before, k in zip([None, *members], members):
            if before is not None and ranges[k][1] > ranges[before][2]:
                buffers.append(bytearray(ranges[k][1] - ranges[before][2]))
            buffers.extend(requests[k][2])
        return buffers

    def pread_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Local only: one ``preadv`` filling ``buffers`` from ``offset``; returns the bytes read."""
        with self._files.use(self.path(key)) as fd:
            return os.preadv(fd, buffers, offset)

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

    def _fetch(self, requests: Sequence[tuple[str, int | None, int | None]]) -> list[bytes]:
        """``(key, start, end)`` ranges (``None, None``: the whole object), at most ``max_requests`` in flight."""
        pending = self._submit(requests)
        try:
            return [future.result() for future in pending]
        finally:
            for future in pending:
                future.cancel()

    def _submit(self, requests: Sequence[tuple[str, int | None, int | None]]) -> list[Future]:
        """Start fetching every request on fsspec's event loop; a synchronous filesystem fetches them here."""
        if not self.fs.async_impl:
            done = []
            for key, start, end in requests:
                done.append(Future())
                done[-1].set_result(self._retrying(lambda: self.fs.cat_file(self.path(key), start=start, end=end), key))
            return done
        return [asyncio.run_coroutine_threadsafe(self._get(*request), self.fs.loop) for request in requests]

    async def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        async with self._requests_limit():
            return await self._retrying_async(lambda: self.fs._cat_file(self.path(key), start=start, end=end), key)

    def _start_get_into(self, key: str, start: int, end: int, buffers: list) -> Future:
        """Start filling ``buffers`` with bytes ``[start, end)`` of ``key`` (a synchronous filesystem: fill now)."""
        where = f"{self.describe(key)} bytes [{start}, {end})"
        if self.fs.async_impl:
            return asyncio.run_coroutine_threadsafe(self._get_into(key, start, end, buffers, where), self.fs.loop)
        done = Future()
        data = self._retrying(lambda: self.fs.cat_file(self.path(key), start=start, end=end), key)
        done.set_result(remote.fill(buffers, [data], where))
        return done

    async def _get_into(self, key: str, start: int, end: int, buffers: list, where: str) -> None:
        async with self._requests_limit():
            await self._retrying_async(lambda: remote.read_range_into(self.fs, self.path(key), start, end, buffers,
                                                                      where), key)

    def _requests_limit(self) -> asyncio.Semaphore:
        """The semaphore bounding this process's requests in flight (made on fsspec's loop; again after fork)."""
        if self._limit is None or self._limit[0] != os.getpid():
            self._limit = (os.getpid(), asyncio.Semaphore(self.max_requests))
        return self._limit[1]

    def _retrying(self, call: Callable[[], T], key: str) -> T:
        """``call()``, again after a backoff when a remote filesystem fails transiently (5xx, 429, timeouts,
        dropped connections); a missing object or a refusal is raised at once, and so is the last failure."""
        for attempt in itertools.count():
            try:
                return call()
            except Exception as e:
                time.sleep(self._retry_delay(e, attempt, key))
        raise AssertionError("unreachable")

    async def _retrying_async(self, call: Callable[[], Awaitable[T]], key: str) -> T:
        for attempt in itertools.count():
            try:
                return await call()
            except Exception as e:
                await asyncio.sleep(self._retry_delay(e, attempt, key))
        raise AssertionError("unreachable")

    def _retry_delay(self, error: Exception, attempt: int, key: str) -> float:
        """Seconds to wait before retrying after ``error``; raises ``error`` when a retry is not worth it."""
        if self.is_local or not _transient(error):
            raise error
        shown = error.__cause__ if not str(error) and error.__cause__ is not None else error  # fsspec's
        # FSTimeoutError() has an empty message; what it wraps says which timeout
        if attempt == RETRIES:
            raise RemoteReadError(f"reading {self.describe(key)} failed {attempt + 1} times; the last time: "
                                  f"{type(shown).__name__}: {shown}") from error
        delay = RETRY_BASE_S * 2**attempt * random.uniform(0.5, 1.5)
        log.warning("hsdata: reading %s failed (%s: %s); retry %d of %d in %.1f s", self.describe(key),
                    type(shown).__name__, str(shown)[:200], attempt + 1, RETRIES, delay)
        return delay


def merge_ranges(ranges: Sequence[tuple[str, int, int]], *, max_gap: int,
                 max_bytes: int) -> list[tuple[str, int, int, list[int]]]:
    """Group ``(key, start, end)`` ranges into requests ``(key, start, end, members)``: ranges of one key whose
    gap is at most ``max_gap`` (and that do not overlap) share a request while it stays within ``max_bytes`` (a
    single range may exceed it).
    ``members`` are positions in ``ranges``."""
    requests: list[tuple[str, int, int, list[int]]] = []
    for k in sorted(range(len(ranges)), key=lambda k: ranges[k]):
        key, start, end = ranges[k]
        if requests:
            last_key, last_start, last_end, members = requests[-1]
            if key == last_key and last_end <= start <= last_end + max_gap and end - last_start <= max_bytes:
                members.append(k)
                requests[-1] = (key, last_start, end, members)
                continue
        requests.append((key, start, end, [k]))
    return requests


def _transient(error: BaseException) -> bool:
    """Whether a remote read may succeed if tried again."""
    if isinstance(error, RemoteReadError):
        return False  # already retried RETRIES times
    if isinstance(error, FileNotFoundError) and error.__cause__ is not None:
        return _transient(error.__cause__)  # fsspec's HTTP info turns every failure into FileNotFoundError
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)  # aiohttp; s3fs wraps botocore's
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    return isinstance(error, (OSError, TimeoutError, ConnectionError)) or type(error).__module__.startswith(
        ("aiohttp", "botocore", "urllib3"))


class AtomicWriter:
    """A file being written; invisible at its key until ``commit``."""

    def write(self, data) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def commit(self, *, exclusive: bool = False) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def abort(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _LocalAtomicWriter(AtomicWriter):
    def __init__(self, path: str):
        self.path = path
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        self._partial = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.partial")
        self._file: BinaryIO = open(self._partial, "wb", buffering=1 << 20)
        self.write = self._file.write

    def commit(self, *, exclusive: bool = False) -> bool:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if exclusive:
            try:
                os.link(self._partial, self.path)  # fails if the target exists: an atomic create-if-absent
            except FileExistsError:
                return False
            finally:
                os.unlink(self._partial)
        else:
            os.replace(self._partial, self.path)
        _fsync_dir(os.path.dirname(self.path))
        return True

    def abort(self) -> None:
        try:
            self._file.close()  # may fail flushing its buffer (a full disk): the file is discarded anyway
        except OSError:
            pass
        try:
            os.unlink(self._partial)
        except FileNotFoundError:
            pass


class _RemoteWriter(AtomicWriter):
    def __init__(self, fs, path: str):
        self._file = fs.open(path, "wb")
        self.write = self._file.write

    def commit(self, *, exclusive: bool = False) -> bool:
        self._file.close()
        return True

    def abort(self) -> None:
        try:
            discard = getattr(self._file, "discard", None)
            if discard is not None:
                discard()
        finally:
            if isinstance(self._file, AbstractBufferedFile):
                self._file.closed = True  # so that no close(), not even at garbage collection, uploads (or fails
                # flushing the buffer discard() dropped)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _FileCache:
    """Read-only file descriptors kept open across reads; idle ones beyond the limit are closed (LRU).

    A descriptor is never closed while a read uses it. A forked child drops the parent's table (and lock).
    """

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._fds: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd, readers using it]
        self._pid = os.getpid()

    @contextmanager
    def use(self, path: str) -> Iterator[int]:
        if self._pid != os.getpid():
            for fd, _ in self._fds.values():
                os.close(fd)  # the child's copies; the parent's stay open
            self._reset()
        with self._lock:
            entry = self._fds.get(path)
            if entry is None:
                entry = self._fds[path] = [os.open(path, os.O_RDONLY), 0]
            self._fds.move_to_end(path)
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                idle = [p for p, (_, users) in self._fds.items() if users == 0]
                for p in idle[: max(0, len(self._fds) - MAX_OPEN_FILES)]:
                    os.close(self._fds.pop(p)[0])

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for fd, _ in self._fds.values():
                    os.close(fd)
            self._fds.clear()
