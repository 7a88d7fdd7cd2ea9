"""Host buffers recycled once nothing refers to them any more, optionally page-locked for CUDA.

Filling fresh memory costs a page fault per 4 KiB (about as much as the copy itself, more in VMs), and large
allocations go straight back to the kernel when freed, so every sample would pay it again; pinning memory costs
more still. Buffers are therefore anonymous mmaps kept in a pool: a tensor made from one keeps it referenced
(through its storage and every view), and a buffer whose only reference is the pool's is free to fill again.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING

from . import pinned as pinning

if TYPE_CHECKING:
    import torch

MIN_POOLED_BYTES = 1 << 20  # smaller unpinned buffers come from malloc, which recycles them itself
GRANULE = 1 << 20  # pooled sizes are rounded up to this, and above 8 granules to steps of 1/8 of a power of two
MAX_FIT = 2  # a free buffer serves a request of at least 1/MAX_FIT of its size
FREE_REFS = 3  # references to a free buffer while it is tested: the pool's list, the loop's name, the call's argument

_retired: list[tuple[mmap.mmap, bool]] = []  # (buffer, pinned) of closed pools that tensors still referred to
_retired_lock = threading.Lock()


class BufferPool:
    """Recycled host buffers, at most ``max_idle_bytes`` of them kept idle; ``pinned``: page-locked for CUDA in
    this process (a forked child's copy of the pool starts empty and unpinned)."""

    def __init__(self, max_idle_bytes: int, *, pinned: bool = False):
        self.max_idle_bytes = max_idle_bytes
        self.pinned = pinned
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _retire_all, self._buffers, pinned)  # unpinned, then unmapped

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes``: a recycled buffer when one is free, else a new one."""
        import torch

        if nbytes == 0 or (not self.pinned and (nbytes < MIN_POOLED_BYTES or self.max_idle_bytes <= 0)):
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's buffers and pins are not this process's
                self._finalizer.detach()
                self._buffers.clear()
                self.pinned, self._pid = False, os.getpid()
                self._finalizer = weakref.finalize(self, _retire_all, self._buffers, False)
            buffer = self._free_fit(nbytes) or self._new(nbytes)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)

    @property
    def held_bytes(self) -> int:
        """Bytes of all the pool's buffers, in use or idle."""
        return sum(len(b) for b in self._buffers)

    def close(self) -> None:
        """Release the idle buffers now and the others once no tensor refers to them."""
        with self._lock:
            if self._pid == os.getpid():
                _retire_all(self._buffers, self.pinned)
            self._buffers.clear()
        release_retired()

    def _free_fit(self, nbytes: int) -> mmap.mmap | None:
        free = [b for b in self._buffers if sys.getrefcount(b) == FREE_REFS]
        fits = [b for b in free if nbytes <= len(b) <= MAX_FIT * nbytes + GRANULE]
        if fits:
            return min(fits, key=len)
        idle = sum(len(b) for b in free)
        for old in sorted(free, key=len):  # make room: drop the smallest idle buffers first
            if idle + nbytes <= self.max_idle_bytes:
                break
            self._buffers.remove(old)
            idle -= len(old)
            _release(old, self.pinned)
        return None

    def _new(self, nbytes: int) -> mmap.mmap:
        buffer = mmap.mmap(-1, size_class(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fork: a copy
        if self.pinned:
            pinning.register(buffer)
        self._buffers.append(buffer)
        release_retired()
        return buffer


def shared_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in fresh shared memory, which torch sends between processes by handle."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to whole granules, and beyond 8 granules to the next 1/8 step of a power of two, so
    that requests of similar sizes share buffers."""
    granules = -(-nbytes // GRANULE)
    if granules > 8:
        step = 1 << (granules.bit_length() - 4)
        granules = -(-granules // step) * step
    return granules * GRANULE


def _retire_all(buffers: list[mmap.mmap], pinned: bool) -> None:
    while buffers:
        retire(buffers.pop(), pinned)


def _release(buffer: mmap.mmap, pinned: bool) -> None:
    if pinned:
        pinning.unregister(buffer)
    buffer.close()


def retire(buffer: mmap.mmap, pinned: bool) -> None:
    """Hand ``buffer`` over to be unpinned and unmapped once no tensor refers to it (at a later
    :func:`release_retired`); the caller keeps no reference."""
    with _retired_lock:
        _retired.append((buffer, pinned))


def release_retired() -> None:
    """Release every retired buffer that nothing refers to any more."""
    with _retired_lock:
        keep = []
        for buffer, pinned in _retired:  # references: the entry, ``buffer``, the call's argument
            if sys.getrefcount(buffer) == FREE_REFS:
                _release(buffer, pinned)
            else:
                keep.append((buffer, pinned))
        _retired[:] = keep
