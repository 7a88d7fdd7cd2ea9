"""Keys and bytes over fsspec, with atomic writes and a zero-copy local read path.

Local paths get ``write to a hidden partial file, fsync, rename, fsync the directory`` and ``preadv`` straight
into the caller's buffers. Other filesystems (object stores) get write-once objects: an object becomes
visible only when its upload completes.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from typing import BinaryIO, Callable, Iterator, Sequence, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

MAX_OPEN_FILES = 256
RETRIES = 5  # attempts after the first, for transient errors of remote reads
RETRY_BASE_S = 0.2  # backoff before attempt k: RETRY_BASE_S * 2**k, +-50% jitter

log = logging.getLogger("hsdata.storage")
T = TypeVar("T")


class Storage:
    """A store's root: ``url`` plus fsspec ``storage_options``; every method takes keys relative to it."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self._files = _FileCache() if self.is_local else None

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def describe(self, key: str) -> str:
        """The key as a user-facing location (for error messages)."""
        return f"{self.url.rstrip('/')}/{key}"

    def read_bytes(self, key: str) -> bytes:
        return self._retrying(lambda: self.fs.cat_file(self.path(key)), key)

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Whole objects, fetched concurrently on async filesystems; a failed one is fetched again alone."""
        paths = [self.path(k) for k in keys]
        got = self.fs.cat(paths, on_error="return") if paths else {}
        return [self.read_bytes(key) if isinstance(got[path], BaseException) and _transient(got[path]) else
                _raise_if_error(got[path]) for key, path in zip(keys, paths)]

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

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """Several ranges at once (concurrently on async filesystems); a failed range is fetched again alone."""
        paths = [self.path(k) for k in keys]
        got = self.fs.cat_ranges(paths, list(starts), list(ends), on_error="return")
        return [self.read_range(key, start, end) if isinstance(data, BaseException) and _transient(data) else
                _raise_if_error(data) for key, start, end, data in zip(keys, starts, ends, got)]

    def pread_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Local only: one ``preadv`` filling ``buffers`` from ``offset``; returns the bytes read."""
        with self._files.use(self.path(key)) as fd:
            return os.preadv(fd, buffers, offset)

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

    def _retrying(self, call: Callable[[], T], key: str) -> T:
        """``call()``, again after a backoff when a remote filesystem fails transiently (5xx, 429, timeouts,
        dropped connections); a missing object or a refusal is raised at once, and so is the last failure."""
        for attempt in range(RETRIES + 1):
            try:
                return call()
            except Exception as e:
                if self.is_local or attempt == RETRIES or not _transient(e):
                    raise
                delay = RETRY_BASE_S * 2**attempt * random.uniform(0.5, 1.5)
                log.warning("hsdata: reading %s failed (%s: %s); retry %d of %d in %.1f s", self.describe(key),
                            type(e).__name__, str(e)[:200], attempt + 1, RETRIES, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


def _transient(error: BaseException) -> bool:
    """Whether a remote read may succeed if tried again."""
    if isinstance(error, FileNotFoundError) and error.__cause__ is not None:
        return _transient(error.__cause__)  # fsspec's HTTP info turns every failure into FileNotFoundError
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)  # aiohttp; s3fs wraps botocore's
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    return isinstance(error, (OSError, TimeoutError, ConnectionError)) or type(error).__module__.startswith(
        ("aiohttp", "botocore", "urllib3"))


def _raise_if_error(data):
    if isinstance(data, BaseException):
        raise data
    return data


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
        discard = getattr(self._file, "discard", None)
        if discard is not None:
            discard()


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
