"""Read-ahead: the items of an announced order, read on background threads up to a byte budget."""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future
from typing import Any, Iterator

import numpy as np

from ..pool import ProcessLocalPool

THREADS = 4
GROUP_BYTES = 8 << 20  # neighbouring items read together, up to about this many bytes
GROUP_ITEMS = 64


class ReadAhead:
    """Items of an announced order, read on background threads up to a byte budget; tied to one process.

    Neighbouring items in the order are read together, up to ``GROUP_BYTES`` or ``GROUP_ITEMS`` at a time (so a
    remote store can merge their ranges into fewer requests)."""

    def __init__(self, read_many, sample_nbytes: np.ndarray, indices: Iterator[int], budget: int,
                 pool: ProcessLocalPool):
        self._read_many, self._nbytes, self._indices, self._budget, self._pool = (read_many, sample_nbytes, indices,
                                                                                  budget, pool)
        self._pending: collections.deque[tuple[int, Future, int]] = collections.deque()  # item, its group, place
        self._pending_bytes = 0
        self._pid = os.getpid()

    def expects(self, indices: list[int]) -> bool:
        """Whether ``indices`` come next in the announced order (as far as it has been read ahead)."""
        if self._pid != os.getpid():
            return False
        self._fill()
        ahead = [i for i, _, _ in list(self._pending)[: len(indices)]]
        return bool(ahead) and ahead == [int(i) for i in indices[: len(ahead)]]

    def take(self, i: int) -> dict[str, Any] | None:
        """Item ``i`` if it is the next announced one, else None."""
        if self._pid != os.getpid():
            return None  # inherited through fork: the threads are not here
        self._fill()
        if not self._pending or self._pending[0][0] != i:
            return None
        _, group, place = self._pending.popleft()
        self._pending_bytes -= int(self._nbytes[i])
        self._fill()
        return group.result()[place]

    def _fill(self) -> None:
        while not self._pending or self._pending_bytes < self._budget:
            group, nbytes = [], 0
            while len(group) < GROUP_ITEMS and nbytes < GROUP_BYTES:
                i = next(self._indices, None)
                if i is None:
                    break
                group.append(int(i))
                nbytes += int(self._nbytes[int(i)])
            if not group:
                return
            future = self._pool.submit(self._read_many, group)
            self._pending.extend((i, future, place) for place, i in enumerate(group))
            self._pending_bytes += nbytes

    def close(self) -> None:
        for _, future, _ in self._pending:
            future.cancel()
        self._pending.clear()
