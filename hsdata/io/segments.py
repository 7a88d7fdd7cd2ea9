"""Shared memory that a DataLoader worker lends to the training process, and gets back when no tensor uses it.

A worker reads batches into blocks of a shared ring (:func:`take`: :class:`~hsdata.io.ring.Ring` over ``memfd``
arenas). A batch returned as a :class:`SharedBatch` pickles each tensor lying in the ring as its place there; the
first times an arena (and the worker) is seen, its file descriptors travel too (``multiprocessing``'s ``DupFd``,
as torch sends its own shared memory). Unpickling in the training process (:func:`_unpack`, on whichever thread
receives the batch) maps each arena once, page-locks it for CUDA once where asked, and makes the tensors over
the mapping. Each time a batch arrives, blocks that no tensor refers to any more go back to their worker over a
pipe the worker made, and the worker's ring takes them again. So a batch crosses processes without a copy, the
same pages serve epoch after epoch, and nothing is set up before the workers start (any start method, a plain
``DataLoader`` or :class:`hsdata.torch.Loader`). A worker that exits takes its memory with it: nothing is left
in ``/dev/shm``.
"""

from __future__ import annotations

import copy
import mmap
import os
import select
import struct
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd
from typing import Any

import torch

from . import pinned as pinning
from .buffers import release_retired, retire
from .ring import Arena, Block, Ring

UNUSED_REFS = 2  # references to an unused view while it is tested: the borrower's, the call's argument
MESSAGE = struct.Struct("<bqqq")  # kind, worker pid, arena number, block offset: one atomic pipe write
BACK, HELLO = 1, 2


# ---- in the worker ----

class Lender:
    """A worker process's ring, and the pipe the training process gives blocks back on."""

    def __init__(self):
        self.ring = Ring(shared=True)
        self._mapped: set[int] = set()  # arenas the training process has mapped (it gave a block back)
        self._lock = threading.Lock()  # batches pickle on the queue's feeder thread
        self._back, self._back_end = os.pipe()
        os.set_blocking(self._back, False)
        self._linked = False  # the training process has the pipe's write end
        self._pending = b""

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._collect_messages()
        return self.ring.take(nbytes)

    def parcel(self, blocks: list[tuple[Arena, Block]]) -> _Parcel:
        """What the training process needs to map ``blocks``, which are being lent to it now."""
        with self._lock:
            arenas = {arena.number: arena for arena, _ in blocks}
            self.ring.set_lent([block for _, block in blocks], True)
            parcel = _Parcel(os.getpid(),
                             [(n, a.size, None if n in self._mapped else DupFd(a.fd)) for n, a in arenas.items()],
                             [(arena.number, block.offset, block.nbytes) for arena, block in blocks],
                             None if self._linked else DupFd(self._back_end), self.ring.retired)
            self.ring.retired = []
            return parcel

    def _collect_messages(self) -> None:
        try:
            data = self._pending + os.read(self._back, 1 << 16)
        except BlockingIOError:
            return
        whole = len(data) - len(data) % MESSAGE.size
        self._pending = data[whole:]
        for offset in range(0, whole, MESSAGE.size):
            kind, _, number, block_offset = MESSAGE.unpack_from(data, offset)
            if kind == HELLO:
                self._linked = True
                continue
            if self.ring.give_back(number, block_offset):
                self._mapped.add(number)


class _PerProcess:
    """One object of ``make()`` per process, made at first use (a forked child makes its own)."""

    def __init__(self, make):
        self._make, self._value, self._pid = make, None, 0

    def get(self):
        with _lock:
            if self._value is None or self._pid != os.getpid():
                self._value, self._pid = self._make(), os.getpid()
            return self._value

    def made(self):
        """This process's object if it has one, else None."""
        return self._value if self._pid == os.getpid() else None


def _new_lock() -> None:
    global _lock
    _lock = threading.Lock()


_new_lock()
os.register_at_fork(after_in_child=_new_lock)  # a lock a parent's thread held at fork would never open
_lenders = _PerProcess(Lender)


def lender() -> Lender:
    """This process's :class:`Lender`."""
    return _lenders.get()


def take(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in this worker's shared ring (:class:`SharedBatch` sends it by place)."""
    return lender().take(nbytes)


class SharedBatch(dict):
    """A batch (a dict of tensors, nested dicts, lists and other values) that pickles the tensors lying in this
    worker's shared ring as their places there; ``pin``: whether the training process page-locks the memory
    (None: where CUDA is present). Anything else pickles as usual."""

    def __init__(self, batch: dict, *, pin: bool | None = None):
        super().__init__(batch)
        self.pin = pin

    def __copy__(self) -> SharedBatch:
        return SharedBatch(self, pin=self.pin)

    def __deepcopy__(self, memo: dict) -> dict:
        return copy.deepcopy(dict(self), memo)  # copies of the tensors: nothing in the ring any more

    def __reduce__(self):
        owner = _lenders.made()
        used: dict[tuple[int, int], tuple[Arena, Block]] = {}
        structure = _describe(dict(self), owner, used)
        if not used:
            return (dict, (structure,))
        return (_unpack, (owner.parcel(list(used.values())), structure, self.pin))


@dataclass(frozen=True)
class _Place:
    """Where a tensor lies: its block (arena number, block offset), its byte offset in the block, dtype, shape
    and strides (in elements)."""

    arena: int
    block: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Parcel:
    pid: int
    arenas: list[tuple[int, int, Any]]  # number, size, DupFd of its memfd (None: mapped already)
    blocks: list[tuple[int, int, int]]  # arena number, offset, bytes
    back: Any  # DupFd of the worker's pipe write end (None: the training process has it)
    retired: list[int] = field(default_factory=list)  # arenas the worker let go of


def _describe(value: Any, owner: Lender | None, used: dict) -> Any:
    if isinstance(value, torch.Tensor):
        found = (owner.ring.locate(value.data_ptr()) if owner is not None and value.device.type == "cpu"
                 and value.numel() else None)
        if found is None:
            return value
        arena, block = found
        used[arena.number, block.offset] = found
        offset = value.data_ptr() - arena.address - block.offset
        return _Place(arena.number, block.offset, offset, value.dtype, tuple(value.shape), value.stride())
    if isinstance(value, dict):
        return {k: _describe(v, owner, used) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        return type(value)(_describe(v, owner, used) for v in value)
    return value


# ---- in the training process ----

class Borrower:
    """This process's mappings of the arenas workers lent it, and the pipes to give blocks back on."""

    def __init__(self):
        self._mapped: dict[tuple[int, int], tuple[mmap.mmap, bool]] = {}  # (pid, arena) -> mapping, pinned
        self._lent: dict[tuple[int, int, int], memoryview] = {}  # (pid, arena, offset) -> the block's view
        self._pipes: dict[int, int] = {}  # worker pid -> write end of its pipe
        self._unsent: dict[int, bytes] = {}  # worker pid -> messages its full pipe did not take yet
        self._lock = threading.Lock()

    def unpack(self, parcel: _Parcel, structure: Any, pin: bool | None) -> Any:
        pid = parcel.pid
        with self._lock:
            try:
                self._link(parcel)
                for number in parcel.retired:
                    self._retire(pid, number)
                for number, size, fd in parcel.arenas:
                    if fd is not None:
                        self._map(pid, number, size, fd.detach(), pinning.available() if pin is None else pin)
            except (OSError, EOFError) as e:  # its file descriptors come from the worker, which must be alive
                raise RuntimeError(f"DataLoader worker (pid {pid}) exited before its batch's shared memory reached "
                                   f"the training process ({type(e).__name__}: {e})") from e
            views = {}
            for number, offset, nbytes in parcel.blocks:
                views[number, offset] = self._lent[pid, number, offset] = \
                    memoryview(self._mapped[pid, number][0])[offset : offset + nbytes]
            value = _rebuild(structure, views)
            del views
            self._give_back()
        release_retired()
        return value

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the arenas mapped here, of workers alive when last looked at."""
        return sum(len(buffer) for buffer, _ in self._mapped.values())

    def _link(self, parcel: _Parcel) -> None:
        if parcel.back is None:
            return
        fd = parcel.back.detach()
        if parcel.pid in self._pipes:
            os.close(fd)
            return
        os.set_blocking(fd, False)
        self._pipes[parcel.pid] = fd
        self._send(parcel.pid, MESSAGE.pack(HELLO, 0, 0, 0))

    def _map(self, pid: int, number: int, size: int, fd: int, pin: bool) -> None:
        try:
            if (pid, number) in self._mapped:
                return  # sent again before this process had said it mapped it
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if pin:
            pinning.register(buffer)
        self._mapped[pid, number] = (buffer, pin)

    def _give_back(self) -> None:
        """Blocks no tensor refers to go back to their workers; the memory of workers that exited is let go."""
        for key in [k for k in self._lent if sys.getrefcount(self._lent[k]) == UNUSED_REFS]:
            if self._lent.pop(key, None) is not None:  # (a forgotten worker's are gone)
                self._send(key[0], MESSAGE.pack(BACK, *key))
        for pid in [p for p, fd in self._pipes.items() if _reader_gone(fd)]:
            self._forget(pid)

    def _send(self, pid: int, message: bytes) -> None:
        if pid not in self._pipes:  # a worker that never linked its pipe: its memory cannot go back
            self._forget(pid)
            return
        data = self._unsent.pop(pid, b"") + message
        try:
            sent = os.write(self._pipes[pid], data)
        except BlockingIOError:
            sent = 0
        except BrokenPipeError:
            self._forget(pid)
            return
        if sent < len(data):
            self._unsent[pid] = data[sent:]

    def _forget(self, pid: int) -> None:
        if pid in self._pipes:
            os.close(self._pipes.pop(pid))
        self._unsent.pop(pid, None)
        for key in [k for k in self._lent if k[0] == pid]:
            del self._lent[key]
        for key in [k for k in self._mapped if k[0] == pid]:
            self._retire(*key)

    def _retire(self, pid: int, number: int) -> None:
        entry = self._mapped.pop((pid, number), None)
        if entry is not None:
            retire(*entry)


def _reader_gone(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


_borrowers = _PerProcess(Borrower)


def borrower() -> Borrower:
    """This process's :class:`Borrower`."""
    return _borrowers.get()


def _unpack(parcel: _Parcel, structure: Any, pin: bool | None) -> Any:
    if parcel.pid == os.getpid():
        raise RuntimeError("a SharedBatch was unpickled in the process that lent it")
    return borrower().unpack(parcel, structure, pin)


def _rebuild(value: Any, views: dict[tuple[int, int], memoryview]) -> Any:
    if isinstance(value, _Place):
        span = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride))
        flat = torch.frombuffer(views[value.arena, value.block], dtype=torch.uint8, offset=value.offset,
                                count=span * value.dtype.itemsize)
        return flat.view(value.dtype).as_strided(value.shape, value.stride)
    if isinstance(value, dict):
        return {k: _rebuild(v, views) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (_Place, dict, list, tuple)) for v in value):
        return type(value)(_rebuild(v, views) for v in value)
    return value
