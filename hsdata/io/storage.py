"""Keys and bytes over fsspec, with atomic writes and a zero-copy local read path.

Local paths get ``write to a hidden partial file, fsync, rename, fsync the directory`` and ``preadv`` straight
into the caller's buffers. Other filesystems (object stores) get write-once objects: an object becomes
visible only when its upload completes. Remote reads are retried on transient errors; ranges are fetched with a
bounded number of requests in flight, neighbouring ones merged, optionally through a local :class:`RangeCache`.

Every key is checked before use: no absolute keys, no ``..``, ``.`` or empty components; locally its resolved
path must lie under the store's resolved root (a symlink may point inside the store, never out of it), and only
regular files are read, listed or deleted, opened without blocking. Anything else is :class:`UnsafePathError`.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import logging
import os
import random
import stat
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime
from typing import Awaitable, Callable, Iterator, Sequence, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from . import remote
from .cache import RangeCache
from ..errors import CorruptDataError, HsdataError, MissingExtraError, RemoteReadError, UnsafePathError

MAX_OPEN_FILES = 256
RETRIES = 5  # attempts after the first, for transient errors of remote reads
RETRY_BASE_S = 0.2  # backoff before attempt k: RETRY_BASE_S * 2**k, +-50% jitter
MAX_REQUESTS = 32  # remote requests in flight per Storage, by default
MERGE_GAP = 1 << 20  # ranges of one object at most this far apart are fetched as one request
SMALL_WRITE_BYTES = 256 << 10  # local writes smaller than this are gathered before a system call
IOV_MAX = 1024  # buffers per writev (Linux's UIO_MAXIOV)
WRITEBACK_BYTES = 32 << 20  # a local file being written has its writeback started every this many bytes

log = logging.getLogger("hsdata.io.storage")
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
        self._options = dict(storage_options or {})
        try:
            self._fs, self.root = fsspec.core.url_to_fs(self.url, **self._options)
        except ImportError as e:
            raise MissingExtraError(_missing_extra(self.url, e)) from None
        self._fs_pid = os.getpid()
        self.root = self.root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.max_requests = max_requests
        self.cache = None if self.is_local else cache
        self._real_root = os.path.realpath(self.root) if self.is_local else None
        self._files = _FileCache(self._open_regular) if self.is_local else None
        self._limit: tuple[int, asyncio.Semaphore] | None = None  # (pid, semaphore on fsspec's event loop)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem of this process: a forked child (a DataLoader worker) makes its own, since an async
        filesystem is tied to the event loop of the process that made it."""
        if self._fs_pid != os.getpid():
            self._fs = fsspec.core.url_to_fs(self.url, **self._options)[0]
            self._fs_pid = os.getpid()
        return self._fs

    def path(self, key: str) -> str:
        """The filesystem path of ``key`` as fsspec spells it (the key is checked, not resolved)."""
        _check_key(key, self)
        return f"{self.root}/{key}" if key else self.root

    def describe(self, key: str) -> str:
        """The key as a user-facing location (for error messages)."""
        return f"{self.url.rstrip('/')}/{key}"

    def read_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        """The whole object; with ``max_bytes``, a larger one raises :class:`CorruptDataError` before more than
        ``max_bytes + 1`` of it is read (remotely: one ranged GET of that many bytes)."""
        if self.is_local:
            return self._read_local(key, None, None, max_bytes)
        end = None if max_bytes is None else max_bytes + 1
        data = self._retrying(lambda: self.fs.cat_file(self.path(key), start=None if end is None else 0, end=end), key)
        return self._within(key, data, max_bytes)

    def read_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[bytes]:
        """Whole objects, fetched concurrently on remote filesystems; ``max_bytes`` as for :meth:`read_bytes`."""
        if self.is_local or not self.fs.async_impl:
            return [self.read_bytes(key, max_bytes) for key in keys]
        ranges = [(key, None, None) if max_bytes is None else (key, 0, max_bytes + 1) for key in keys]
        return [self._within(key, data, max_bytes) for key, data in zip(keys, self._fetch(ranges))]

    def exists(self, key: str) -> bool:
        if self.is_local:
            return os.path.lexists(self._local_path(key))
        return self._retrying(lambda: self.fs.exists(self.path(key)), key)

    def list(self, prefix: str) -> list[str]:
        """Names of the visible (not dot-hidden) files directly under ``prefix``; empty if it does not exist.

        A visible entry that is not a regular file (a folder, a FIFO, a symlink leading out of the store) raises
        :class:`UnsafePathError`: what belongs in the folder must never be skipped silently."""
        if self.is_local:
            return self._list_local(prefix)
        try:
            entries = self._retrying(lambda: self.fs.ls(self.path(prefix), detail=True, refresh=True), prefix)
        except FileNotFoundError:
            return []
        names = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("."):
                continue
            if entry["type"] != "file":
                raise UnsafePathError(f"{self.describe(f'{prefix}/{name}')} is a {entry['type']}, not a file")
            names.append(name)
        return sorted(names)

    def find(self, prefix: str) -> list[str]:
        """Keys of every file under ``prefix``, recursively, dot-hidden ones included; [] if it is absent.

        Locally no symlink is followed: a symlink, FIFO or other entry that is not a folder or a regular file
        raises :class:`UnsafePathError`."""
        if not self.is_local:
            try:
                found = self._retrying(lambda: self.fs.find(self.path(prefix)), prefix)
            except FileNotFoundError:
                return []
            root, under = self.root + "/", f"{self.root}/{prefix}/" if prefix else self.root + "/"
            for path in found:
                if not path.startswith(under):
                    raise UnsafePathError(f"{self.describe(prefix)}: listing names {path}, outside the folder")
            return sorted(path[len(root):] for path in found)
        self._local_path(prefix)  # confined
        top = self._unresolved(prefix)
        if not self._is_folder(prefix, top):
            return []
        keys = []

        def fail(error: OSError):
            raise error

        for directory, folders, files in os.walk(top, onerror=fail, followlinks=False):
            relative = os.path.relpath(directory, self._real_root).replace(os.sep, "/")
            for name in folders + files:
                key = name if relative == "." else f"{relative}/{name}"
                mode = os.lstat(os.path.join(directory, name)).st_mode
                if stat.S_ISREG(mode):
                    keys.append(key)
                elif not stat.S_ISDIR(mode):
                    raise UnsafePathError(f"{self.describe(key)} is {_kind(mode)}; a store holds only folders "
                                          "and regular files")
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Delete one regular file (locally: never through a symlink)."""
        if not self.is_local:
            self._retrying(lambda: self.fs.rm_file(self.path(key)), key)
            return
        path = self._local_path(key)
        mode = os.lstat(self._unresolved(key)).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"{self.describe(key)} is {_kind(mode)}, not a regular file: not deleted")
        os.unlink(path)

    def modified(self, key: str) -> float:
        """Modification time of ``key``, in seconds since the epoch (0.0 if the filesystem does not say)."""
        if self.is_local:
            return os.stat(self._regular_path(key)).st_mtime
        return _mtime(self._retrying(lambda: self.fs.info(self.path(key)), key))

    def disk_usage(self) -> int:
        """Bytes of the regular files under the root (locally: symlinks are neither followed nor counted)."""
        if not self.is_local:
            return self._retrying(lambda: self.fs.du(self.root, total=True), "")
        total = 0
        for directory, _, files in os.walk(self._real_root, followlinks=False):
            for name in files:
                st = os.lstat(os.path.join(directory, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        return total

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
        if self.is_local:
            return _LocalAtomicWriter(self._local_path(key))  # checked before its folder is made
        return _RemoteWriter(self.fs, self.path(key))

    def size(self, key: str) -> int:
        if self.is_local:
            return os.stat(self._regular_path(key)).st_size
        return self._retrying(lambda: self.fs.size(self.path(key)), key)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (fewer where the object ends before ``end``)."""
        if self.is_local:
            return self._read_local(key, start, end, None)
        return self._retrying(lambda: self.fs.cat_file(self.path(key), start=start, end=end), key)

    def read_exact(self, key: str, start: int, end: int) -> bytes | bytearray:
        """Bytes ``[start, end)`` of ``key``, exactly, else :class:`CorruptDataError` (truncated); remote ones
        through the cache and streamed as they arrive (a server that ignores the Range header is refused before
        its body is read)."""
        if not self.is_local:
            buffer = bytearray(end - start)
            for _ in self.read_into([(key, start, [memoryview(buffer)])]):
                pass
            return buffer
        data = self.read_range(key, start, end)
        if len(data) != end - start:
            raise CorruptDataError(f"{self.describe(key)} bytes [{start}, {end}): got {len(data)} bytes (truncated?)")
        return data

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
        with self._files.use(key) as fd:
            return os.preadv(fd, buffers, offset)

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

    def _local_path(self, key: str) -> str:
        """The resolved path of a local ``key``; raises :class:`UnsafePathError` unless it lies under the root."""
        _check_key(key, self)
        path = os.path.realpath(self._unresolved(key))
        if path != self._real_root and not path.startswith(self._real_root.rstrip(os.sep) + os.sep):
            raise UnsafePathError(f"{self.describe(key)} leads out of the store (to {path}); refused")
        return path

    def _unresolved(self, key: str) -> str:
        """The local path of a checked ``key`` under the resolved root, its own symlinks not resolved."""
        return os.path.join(self._real_root, *key.split("/")) if key else self._real_root

    def _regular_path(self, key: str) -> str:
        """:meth:`_local_path`, which must be a regular file (stat only: nothing is opened)."""
        path = self._local_path(key)
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"{self.describe(key)} is {_kind(mode)}, not a regular file")
        return path

    def _open_regular(self, key: str) -> int:
        """A read-only descriptor of a local regular file (checked before and after opening, which never blocks)."""
        return self._checked_fd(key, os.open(self._regular_path(key), os.O_RDONLY | os.O_NONBLOCK))

    def _checked_fd(self, key: str, fd: int) -> int:
        """``fd``, if it is a regular file's; else it is closed and :class:`UnsafePathError` raised."""
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise UnsafePathError(f"{self.describe(key)} is {_kind(mode)}, not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _read_local(self, key: str, start: int | None, end: int | None, max_bytes: int | None) -> bytes:
        def opener(path: str, flags: int) -> int:
            return self._checked_fd(key, os.open(path, flags | os.O_NONBLOCK))

        with open(self._regular_path(key), "rb", buffering=0, opener=opener) as f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is not None:
                self._check_size(key, size, max_bytes)
            start = 0 if start is None else start
            end = size if end is None else min(end, size)
            pieces, at = [], start
            while at < end:  # a file may shrink while read: stop at its end
                piece = os.pread(f.fileno(), end - at, at)
                if not piece:
                    break
                pieces.append(piece)
                at += len(piece)
            return b"".join(pieces)

    def _list_local(self, prefix: str) -> list[str]:
        folder = self._local_path(prefix)
        if not self._is_folder(prefix, folder):
            return []
        entries = list(os.scandir(folder))
        names = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = f"{prefix}/{entry.name}" if prefix else entry.name
            if entry.is_symlink():
                self._regular_path(key)  # a symlink to a regular file inside the store is fine
            elif not entry.is_file(follow_symlinks=False):
                raise UnsafePathError(f"{self.describe(key)} is {_kind(entry.stat(follow_symlinks=False).st_mode)}, "
                                      "not a regular file")
            names.append(entry.name)
        return sorted(names)

    def _is_folder(self, prefix: str, path: str) -> bool:
        """Whether ``path`` (of ``prefix``) is a folder; False if absent or under a file, UnsafePathError if it is
        anything else."""
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISDIR(mode):
            raise UnsafePathError(f"{self.describe(prefix)} is {_kind(mode)}, not a folder")
        return True

    def _check_size(self, key: str, size: int, max_bytes: int) -> None:
        if size > max_bytes:
            raise CorruptDataError(f"{self.describe(key)} is {size:,} bytes, more than the {max_bytes:,} allowed")

    def _within(self, key: str, data: bytes, max_bytes: int | None) -> bytes:
        """``data`` read remotely with a limit: ``max_bytes + 1`` bytes mean the object is larger."""
        if max_bytes is not None and len(data) > max_bytes:
            raise CorruptDataError(f"{self.describe(key)} is more than the {max_bytes:,} bytes allowed")
        return data

    def _fetch(self, requests: Sequence[tuple[str, int | None, int | None]]) -> list[bytes]:
        """Async filesystems: ``(key, start, end)`` ranges (``None, None``: the whole object), fetched on fsspec's
        event loop, at most ``max_requests`` in flight."""
        pending = [asyncio.run_coroutine_threadsafe(self._get(*request), self.fs.loop) for request in requests]
        try:
            return [future.result() for future in pending]
        finally:
            for future in pending:
                future.cancel()

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
        wrapped = not str(error) or isinstance(error, FileNotFoundError)  # fsspec's FSTimeoutError() has an empty
        # message, its HTTP info turns every failure into FileNotFoundError(url): what they wrap says what failed
        shown = error.__cause__ if wrapped and error.__cause__ is not None else error
        if attempt == RETRIES:
            raise RemoteReadError(f"reading {self.describe(key)} failed {attempt + 1} times; the last time: "
                                  f"{type(shown).__name__}: {shown}") from error
        delay = RETRY_BASE_S * 2**attempt * random.uniform(0.5, 1.5)
        log.warning("hsdata: reading %s failed (%s: %s); retry %d of %d in %.1f s", self.describe(key),
                    type(shown).__name__, str(shown)[:200], attempt + 1, RETRIES, delay)
        return delay


def _check_key(key: str, storage: Storage) -> None:
    """Refuse keys that could name something outside the store: absolute, ``..``, ``.`` or empty parts, NUL."""
    if not isinstance(key, str) or (key and (key.startswith("/") or "\0" in key or "\\" in key or any(
            part in ("", ".", "..") for part in key.split("/")))):
        raise UnsafePathError(f"{storage.describe(str(key))}: not a key inside the store "
                              "(absolute, or with '..', '.', empty parts, backslashes or NUL); refused")


def _kind(mode: int) -> str:
    """What a file mode says an entry is, for error messages."""
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return kind
    return "not a regular file"


def _mtime(info: dict) -> float:
    """Modification time of an fsspec ``info`` entry, across filesystems' spellings."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    return 0.0


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
    if isinstance(error, HsdataError):
        return False  # a verdict on the answer (wrong length, Range ignored) or already retried RETRIES times
    if isinstance(error, FileNotFoundError) and error.__cause__ is not None:
        return _transient(error.__cause__)  # fsspec's HTTP info turns every failure into FileNotFoundError
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)  # aiohttp; s3fs wraps botocore's
    response = getattr(error, "response", None)
    if status is None and isinstance(response, dict):  # botocore's ClientError (a missing key: 404, NoSuchKey)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    return isinstance(error, (OSError, TimeoutError, ConnectionError)) or type(error).__module__.startswith(
        ("aiohttp", "botocore", "urllib3"))


class AtomicWriter:
    """A file being written; invisible at its key until ``commit``."""

    def write(self, data) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    positional = False  # whether ``write_at`` works: the file's bytes may be written at any offset, from any thread

    def writev(self, buffers) -> None:  # pragma: no cover - interface
        """Append each of ``buffers`` in order (one gathered write where the storage has them)."""
        raise NotImplementedError

    def write_at(self, buffers, offset: int) -> None:  # pragma: no cover - interface
        """Write ``buffers`` one after another from byte ``offset`` (only where ``positional``)."""
        raise NotImplementedError

    def commit(self, *, exclusive: bool = False) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def abort(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _LocalAtomicWriter(AtomicWriter):
    """A local file written through its descriptor: large buffers go to ``pwritev`` as they are (no copy in user
    space), small appended ones are gathered into ``SMALL_WRITE_BYTES`` first, so that neither a 4-byte crc32c
    trailer nor a 16-byte sample costs a system call of its own. ``write_at`` may be called from several threads
    at once (a compressed shard's frames, at offsets assigned in order); a file is written by ``writev`` or by
    ``write_at``, not both."""

    positional = True

    def __init__(self, path: str):
        self.path = path
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        self._partial = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.partial")
        self._fd: int | None = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self._small = bytearray()  # gathered small writes, written before anything that follows them
        self._lock = threading.Lock()  # guards the counts below (write_at's threads)
        self._end = 0  # the end of the bytes written so far: where writev appends
        self._written = 0  # bytes handed to the kernel so far
        self._flushed = 0  # of which writeback has been started (sync_file_range) ...
        self._flushed_end = 0  # ... up to this offset

    def write(self, data) -> None:
        self.writev((data,))

    def writev(self, buffers) -> None:
        """Append ``buffers`` (bytes-like, C-contiguous) in order, with as few system calls as it takes."""
        out = []
        for data in buffers:
            view = memoryview(data).cast("B")
            if view.nbytes < SMALL_WRITE_BYTES:
                self._small += view
                if len(self._small) >= SMALL_WRITE_BYTES:
                    out.append(self._take_small())
            else:
                if self._small:
                    out.append(self._take_small())
                out.append(view)
        if out:
            self._write_all(out, self._end)

    def write_at(self, buffers, offset: int) -> None:
        self._write_all([memoryview(data).cast("B") for data in buffers], offset)

    def _take_small(self) -> memoryview:
        small, self._small = self._small, bytearray()
        return memoryview(small)

    def _write_all(self, views: list, offset: int) -> None:
        """``pwritev`` the views from ``offset``, resumed where a write stops short; the writeback of what was
        written is started every ``WRITEBACK_BYTES``."""
        total, at = sum(v.nbytes for v in views), offset
        while views:
            batch = views[:IOV_MAX]
            written = os.pwritev(self._fd, batch, at)
            if not written:
                raise OSError(errno.ENOSPC, "no progress writing", self._partial)
            at += written
            done = 0
            while done < len(batch) and written >= batch[done].nbytes:  # a short write resumes where it stopped
                written -= batch[done].nbytes
                done += 1
            views = views[done:]
            if written:
                views[0] = views[0][written:]
        with self._lock:
            self._written += total
            self._end = max(self._end, offset + total)
            start, end = self._flushed_end, self._end
            if self._written - self._flushed < WRITEBACK_BYTES or end == start:  # (0 bytes: to the file's end)
                return
            self._flushed, self._flushed_end = self._written, end
        _start_writeback(self._fd, start, end - start)  # a range another thread has not filled yet: only a hint

    def commit(self, *, exclusive: bool = False) -> bool:
        self._flush_small()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        if exclusive:
            try:
                os.link(self._partial, self.path)  # fails if the target exists: an atomic create-if-absent
            except FileExistsError:
                return False
            finally:
                os.unlink(self._partial)
        else:
            os.replace(self._partial, self.path)
        fsync_dir(os.path.dirname(self.path))
        return True

    def _flush_small(self) -> None:
        if self._small:
            self._write_all([self._take_small()], self._end)

    def abort(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            os.unlink(self._partial)
        except FileNotFoundError:
            pass


class _RemoteWriter(AtomicWriter):
    def __init__(self, fs, path: str):
        self._file = fs.open(path, "wb")
        self.write = self._file.write

    def writev(self, buffers) -> None:
        for data in buffers:
            self._file.write(data)

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


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Callable | None | bool = False  # False: not looked up yet; None: not available


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the disk now (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the disk works while later bytes are prepared and the
    commit's fsync waits only for the tail. Only a hint: durability still comes from fsync, failures are ignored."""
    global _sync_file_range
    if _sync_file_range is False:
        try:
            function = ctypes.CDLL("libc.so.6", use_errno=True).sync_file_range  # glibc on Linux; else none
            function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            function.restype = ctypes.c_int
            _sync_file_range = function
        except (OSError, AttributeError):
            _sync_file_range = None
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_fork_lock() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()


_new_fork_lock()
os.register_at_fork(after_in_child=_new_fork_lock)  # a lock held by a parent's thread at fork would never open


class _FileCache:
    """Read-only file descriptors kept open across reads; idle ones beyond the limit are closed (LRU).

    A descriptor is never closed while a read uses it. A forked child drops the parent's table (and lock).
    """

    def __init__(self, opener: Callable[[str], int]):
        self._open = opener  # key -> descriptor, checked (confined, a regular file) once per open
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._fds: OrderedDict[str, list[int]] = OrderedDict()  # key -> [fd, readers using it]
        self._pid = os.getpid()

    @contextmanager
    def use(self, key: str) -> Iterator[int]:
        if self._pid != os.getpid():
            with _fork_lock:  # once, however many of the child's threads arrive together
                if self._pid != os.getpid():
                    for fd, _ in self._fds.values():
                        os.close(fd)  # the child's copies; the parent's stay open
                    self._reset()
        with self._lock:
            entry = self._fds.get(key)
            if entry is None:
                entry = self._fds[key] = [self._open(key), 0]
            self._fds.move_to_end(key)
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
