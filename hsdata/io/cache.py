"""A bounded local cache of byte ranges of remote objects, for reading a remote store again in later epochs.

Each range is one file in the cache directory, named by a hash of ``(location, start, end)`` and written
atomically. When the files exceed ``max_bytes``, the least recently used go until 80% of it is left. Several
processes may share a directory (DataLoader workers, ranks on a node). Cached bytes are verified against the
manifest's checksums like fetched ones; hsdata objects are never rewritten, so a cached range never goes stale.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid

import xxhash

EVICT_TO = 0.8  # fraction of max_bytes left after an eviction
STALE_PARTIAL_S = 3600  # a partial file this old was left by a process that died writing it


class RangeCache:
    def __init__(self, directory: str, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"cache max_bytes must be >= 1, got {max_bytes}")
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.max_bytes = max_bytes
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._bytes = sum(size for _, size, _ in self._entries())

    def get_into(self, location: str, start: int, end: int, buffers) -> bool:
        """Fill ``buffers`` with the cached range; False (buffers untouched or partly written) if it is absent."""
        path = self._path(location, start, end)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not block
        except FileNotFoundError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != end - start or os.readv(fd, buffers) != end - start:
                return False
        finally:
            os.close(fd)
        os.utime(path)  # recently used
        return True

    def put_from(self, location: str, start: int, end: int, buffers) -> None:
        path = self._path(location, start, end)
        partial = f"{path}.{uuid.uuid4().hex[:12]}.partial"
        with open(partial, "wb") as f:
            for buffer in buffers:
                f.write(buffer)
        os.replace(partial, path)
        with self._lock:
            self._bytes += end - start
            if self._bytes > self.max_bytes:
                self._evict()

    def _evict(self) -> None:
        entries = sorted(self._entries(), key=lambda e: e[2])  # oldest use first
        total = sum(size for _, size, _ in entries)
        for path, size, last_use in entries:
            partial = path.endswith(".partial")
            if partial and last_use > time.time() - STALE_PARTIAL_S:
                continue  # being written by another process
            if total <= EVICT_TO * self.max_bytes and not partial:
                break
            try:
                os.unlink(path)  # a process reading it keeps its open file
            except FileNotFoundError:
                pass  # another process evicted it
            total -= size
        self._bytes = total

    def _entries(self) -> list[tuple[str, int, float]]:
        """``(path, size, last use)`` of every file in the cache, partial ones of any process included."""
        out = []
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            out.append((entry.path, st.st_size, st.st_mtime))
        return out

    def _path(self, location: str, start: int, end: int) -> str:
        return os.path.join(self.directory, xxhash.xxh3_128_hexdigest(f"{location}\0{start}\0{end}".encode()))
