"""Batches moved to a GPU ahead of the training step, on a side stream."""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import torch


def to_device(batches: Iterable[Any], device: torch.device | str, *, ahead: int = 1,
              transform: Callable[[Any], Any] | None = None) -> Iterator[Any]:
    """``batches`` (dicts, lists and tuples of tensors and other values) with every tensor moved to ``device``.

    On a CUDA device a thread takes the batches from ``batches``, one ahead, and a feeder thread copies them on
    side streams, so waiting for a batch (its reads, a worker) and issuing its copies happen while the step runs,
    side by side, and the copies run on the copy engine; the step's stream waits for batch ``k``'s copy (nothing
    on the host does). Each of the ``ahead + 1`` batches the GPU may hold has a side stream of its own, so one
    batch's ``transform`` (a bundle's decoding, say) does not hold back the next one's copy. The GPU holds the
    batch in use plus up to ``ahead`` more; the host keeps each batch until its copy is done, so pinned
    buffers (``Loader``'s) are reused only then. Copies from pinned memory are asynchronous; from pageable memory
    CUDA stages them, which is correct but slower. Any other device: each batch is moved as it comes.
    ``transform(batch)``: what the loop gets of each moved batch, made on the device (on the side stream: an fp8
    batch's states dequantized there, say).
    """
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    device = torch.device(device)
    if device.type != "cuda":
        for batch in batches:
            moved = _move(batch, device, non_blocking=False)
            yield moved if transform is None else transform(moved)
        return
    yield from _CudaPrefetch(_TakenAhead(iter(batches)), device, ahead, transform)


class _CudaPrefetch:
    """The feeder thread and the loop's side of it: ``ahead + 1`` slots, one per batch on the GPU not yet done
    with; the loop frees one each time it asks for the next batch. ``batches`` (a :class:`_TakenAhead`) is
    closed when the feeder stops."""

    def __init__(self, batches: _TakenAhead, device: torch.device, ahead: int,
                 transform: Callable[[Any], Any] | None):
        self._batches, self._device, self._transform = batches, device, transform
        self._slots = threading.Semaphore(ahead + 1)
        self._streams = ahead + 1
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (moved, copied), _END or a _Failure
        self._stop = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        feeder = threading.Thread(target=self._feed, name="hsdata-to-device", daemon=True)
        feeder.start()
        try:
            while True:
                item = self._ready.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                moved, copied = item
                compute = torch.cuda.current_stream(self._device)
                compute.wait_event(copied)
                _record_stream(moved, compute)
                yield moved
                del moved, item
                self._slots.release()  # the loop is done with the batch it had
        finally:
            self._stop.set()
            self._slots.release()
            feeder.join()

    def _feed(self) -> None:
        copying: collections.deque[tuple[Any, torch.cuda.Event]] = collections.deque()  # host batches being read
        with torch.cuda.device(self._device):
            streams = [torch.cuda.Stream(self._device) for _ in range(self._streams)]
            try:
                for stream in itertools.cycle(streams):
                    if not self._take_slot():
                        break
                    host = next(self._batches, _END)
                    if host is _END:
                        break
                    with torch.cuda.stream(stream):
                        moved = _move(host, self._device, non_blocking=True)
                        if self._transform is not None:
                            moved = self._transform(moved)
                        copied = torch.cuda.Event()
                        copied.record(stream)
                    copying.append((host, copied))
                    del host
                    while copying and copying[0][1].query():
                        copying.popleft()
                    self._ready.put((moved, copied))
                    del moved
                self._ready.put(_END)
            except BaseException as error:  # the loop raises it
                self._ready.put(_Failure(error))
            finally:
                for stream in streams:  # no copy may outlive the host buffers it reads
                    stream.synchronize()
                copying.clear()
                self._batches.close()

    def _take_slot(self) -> bool:
        self._slots.acquire()
        return not self._stop.is_set()


class _TakenAhead:
    """``batches`` taken on a thread of their own, one batch ahead of the feeder: the host's work for the next
    batch (waiting for its reads or a worker, its frame headers, in Python) runs while the feeder issues the
    copies and the transform of this one (Python too, between CUDA calls that let go of the GIL), instead of
    after them. ``close`` stops the thread, then closes ``batches``."""

    def __init__(self, batches: Iterator[Any]):
        self._batches = batches
        self._taken: queue.Queue = queue.Queue(maxsize=1)  # a batch, _END or a _Failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._take, name="hsdata-host-batches", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        try:
            for batch in self._batches:
                if not self._hand_over(batch):
                    return
                del batch
            self._hand_over(_END)
        except BaseException as error:  # the feeder raises it
            self._hand_over(_Failure(error))

    def _hand_over(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._taken.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._taken.get()
        if item is _END:
            self._taken.put(_END)  # (asked again, it is still the end)
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        while not self._taken.empty():
            self._taken.get()
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


def _move(value: Any, device: torch.device, *, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, dict):
        return type(value)((k, _move(v, device, non_blocking=non_blocking)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        return type(value)(_move(v, device, non_blocking=non_blocking) for v in value)
    return value


def _record_stream(value: Any, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``stream`` uses the batch, so its memory is not reused (by the copy stream)
    before the work queued there so far is done."""
    if isinstance(value, torch.Tensor):
        value.record_stream(stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_stream(v, stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record_stream(v, stream)
