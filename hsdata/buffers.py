"""Output buffers recycled once nothing refers to them any more.

Filling fresh memory costs a page fault per 4 KiB (about as much as the copy itself, more in VMs), and large
allocations go straight back to the kernel when freed, so every sample would pay it again. Large read buffers
are therefore anonymous mmaps kept in a pool: a tensor made from one keeps it referenced (through its storage and
every view), and a buffer whose only reference is the pool's is free to fill again.
"""

from __future__ import annotations

import mmap
import sys
import threading

import torch

MIN_POOLED_BYTES = 1 << 20  # smaller buffers come from malloc, which recycles them itself
GRANULE = 1 << 20  # pooled sizes are rounded up to this


class BufferPool:
    def __init__(self, max_idle_bytes: int):
        self.max_idle_bytes = max_idle_bytes
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes``: a recycled buffer when one is free, else a new one."""
        if nbytes < MIN_POOLED_BYTES or self.max_idle_bytes <= 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            free = [b for b in self._buffers if sys.getrefcount(b) == 3]  # the pool's list, b, the call
            fits = [b for b in free if len(b) >= nbytes]
            buffer = min(fits, key=len) if fits else None
            if buffer is None:
                idle = sum(len(b) for b in free)
                for old in sorted(free, key=len):  # make room: drop the smallest idle buffers first
                    if idle + nbytes <= self.max_idle_bytes:
                        break
                    self._buffers.remove(old)
                    idle -= len(old)
                size = -(-nbytes // GRANULE) * GRANULE
                buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a forked child: a copy
                self._buffers.append(buffer)
            return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
