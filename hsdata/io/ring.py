"""Memory for batches: blocks taken from one large mapping (an *arena*) and reused once nothing refers to them.

Each block goes in the lowest gap of the arena that holds it. Batches are made and dropped in about the order
they are read, so the blocks behind the newest ones keep coming free, whatever their sizes, and the pages in use
stay those of about what is in flight; a batch kept alive for long is stepped around, holding its own bytes and
no more. Steady state touches no fresh page (no page faults) and pins nothing anew. A block is in use while any
tensor made over it (or a view of one) lives: each block is a memoryview of the arena that its tensors hold, and
its reference count says when it is free. When no gap fits, a larger arena takes over and the old one goes once
unused.
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch

from . import pinned as pinning
from .buffers import release_retired, retire

ALIGN = 4096  # blocks start on page boundaries
MIN_ARENA_BYTES = 16 << 20
GROWTH = 2  # a new arena holds twice what was in flight when the last one filled, with the new block
FIRST_BLOCKS = 8  # the first arena holds this many blocks of the first size asked for: a batch queue's worth
# (a new arena costs its pages' first faults, and pinning it: growth should be rare)
FREE_REFS = 2  # references to an unused block's view while it is tested: the block's, the call's argument


@dataclass(eq=False)
class Block:
    offset: int
    nbytes: int
    view: memoryview
    lent: bool = False  # held by another process (hsdata.io.segments): not free, whatever its references here

    def free(self) -> bool:
        return not self.lent and sys.getrefcount(self.view) == FREE_REFS


@dataclass(eq=False)
class Arena:
    number: int
    buffer: mmap.mmap
    fd: int | None  # the memfd behind a shared arena
    pinned: bool
    address: int
    blocks: list[Block] = field(default_factory=list)  # in use, by offset

    @property
    def size(self) -> int:
        return len(self.buffer)

    def reclaim(self) -> None:
        self.blocks = [block for block in self.blocks if not block.free()]

    def place(self, nbytes: int) -> int | None:
        """The first gap from the start of the arena that holds ``nbytes``, or None."""
        need, start = _aligned(nbytes), 0
        for block in self.blocks:
            if block.offset - start >= need:
                return start
            start = block.offset + _aligned(block.nbytes)
        return start if self.size - start >= need else None

    def take(self, offset: int, nbytes: int) -> Block:
        block = Block(offset, nbytes, memoryview(self.buffer)[offset : offset + nbytes])
        bisect.insort(self.blocks, block, key=lambda b: b.offset)
        return block

    def unused(self) -> bool:
        return all(block.free() for block in self.blocks)

    def release(self) -> None:
        """Hand the mapping over to be unpinned and unmapped once no tensor refers to it any more."""
        self.blocks.clear()
        retire(self.buffer, self.pinned)
        self.buffer = None
        if self.fd is not None:
            os.close(self.fd)
        release_retired()


class Ring:
    """Batch memory taken in turn from an arena; ``pinned``: page-locked for CUDA in this process; ``shared``: a
    memfd mapped shared, which :mod:`hsdata.io.segments` lends to another process."""

    def __init__(self, *, pinned: bool = False, shared: bool = False, min_arena_bytes: int = MIN_ARENA_BYTES):
        self.pinned, self.shared, self.min_arena_bytes = pinned, shared, min_arena_bytes
        self._arenas: list[Arena] = []  # the last one takes new blocks; earlier ones go once unused
        self._count = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release_all, self._arenas)  # unpinned, then unmapped
        self.retired: list[int] = []  # numbers of shared arenas released since a lender last looked

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes``."""
        return self.take_block(nbytes)[1]

    def take_block(self, nbytes: int) -> tuple[Arena, torch.Tensor]:
        """The arena a new block of ``nbytes`` lies in, and a uint8 tensor over the block."""
        if nbytes == 0:
            return None, torch.empty(0, dtype=torch.uint8)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's arenas and pins are not this process's
                self._finalizer.detach()
                self._arenas.clear()
                self.pinned, self._pid = False, os.getpid()
                self._finalizer = weakref.finalize(self, _release_all, self._arenas)
            arena = self._arenas[-1] if self._arenas else None
            offset = None
            if arena is not None:
                arena.reclaim()
                offset = arena.place(nbytes)
            if offset is None:
                arena = self._new_arena(nbytes, arena)
                offset = 0
            self._release_unused()
            block = arena.take(offset, nbytes)
        return arena, torch.frombuffer(block.view, dtype=torch.uint8)

    def trim(self) -> None:
        """Let earlier arenas that no block uses any more go now (rather than at the next take)."""
        with self._lock:
            if self._pid == os.getpid():
                self._release_unused()

    @property
    def held_bytes(self) -> int:
        """Bytes of the arenas held: the one taking blocks, and earlier ones that blocks still use."""
        return sum(a.size for a in self._arenas)

    def locate(self, address: int) -> tuple[Arena, Block] | None:
        """The arena and block holding ``address``, if any."""
        with self._lock:
            for arena in self._arenas:
                if arena.address <= address < arena.address + arena.size:
                    offset = address - arena.address
                    for block in arena.blocks:
                        if block.offset <= offset < block.offset + block.nbytes:
                            return arena, block
            return None

    def set_lent(self, blocks: list[Block], lent: bool) -> None:
        with self._lock:
            for block in blocks:
                block.lent = lent

    def give_back(self, number: int, offset: int) -> bool:
        """Mark the block at ``offset`` of arena ``number`` as no longer lent; False if there is none."""
        with self._lock:
            arena = next((a for a in self._arenas if a.number == number), None)
            for block in arena.blocks if arena is not None else ():
                if block.offset == offset:
                    block.lent = False
                    return True
            return False

    def _new_arena(self, nbytes: int, last: Arena | None) -> Arena:
        if last is None:
            size = _aligned(max(self.min_arena_bytes, FIRST_BLOCKS * nbytes))
        else:
            live = sum(_aligned(b.nbytes) for b in last.blocks)  # in flight, and kept
            size = _aligned(max(self.min_arena_bytes, GROWTH * (live + nbytes)))
        fd = None
        if self.shared:
            fd = os.memfd_create("hsdata-batches", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        else:  # shared, not private: fork copies a private mapping's pinned pages into the child at once
            buffer = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        if self.pinned:
            pinning.register(buffer)
        arena = Arena(self._count, buffer, fd, self.pinned, torch.frombuffer(buffer, dtype=torch.uint8).data_ptr())
        self._count += 1
        self._arenas.append(arena)
        return arena

    def _release_unused(self) -> None:
        for arena in self._arenas[:-1]:
            if arena.unused():
                self._arenas.remove(arena)
                arena.release()
                self.retired.append(arena.number)


def _release_all(arenas: list[Arena]) -> None:
    while arenas:
        arenas.pop().release()  # unpinned and unmapped once no tensor refers to it any more


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
