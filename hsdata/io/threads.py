"""A thread pool that belongs to one process: made on first use, and made again in a forked child (whose copy
of the parent's pool has no threads)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class ProcessLocalPool:
    def __init__(self, threads: int, name: str):
        self.threads, self.name = threads, name
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def submit(self, fn: Callable, *args) -> Future:
        if self._executor is None or self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            self._pid = os.getpid()
        return self._executor.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        if self._executor is not None and self._pid == os.getpid():
            self._executor.shutdown(wait=wait, cancel_futures=not wait)
        self._executor = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_executor": None}
