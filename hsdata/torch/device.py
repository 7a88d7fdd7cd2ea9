"""Batches moved to a GPU ahead of the training step, on a side stream."""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator

import torch


def to_device(batches: Iterable[Any], device: torch.device | str, *, ahead: int = 1) -> Iterator[Any]:
    """``batches`` (dicts, lists and tuples of tensors and other values) with every tensor moved to ``device``.

    On a CUDA device the copies run on a side stream: when the loop receives batch ``k``, the copies of the next
    ``ahead`` batches have been issued, so they run on the copy engine while step ``k`` computes; the step's
    stream waits for batch ``k``'s copy (nothing on the host does). The GPU holds the batch the loop uses plus
    ``ahead`` more; the host keeps each batch until its copy is done, so pinned buffers (``Loader``'s) are
    reused only then. Copies from pinned memory are asynchronous; from pageable memory CUDA stages them, which
    is correct but slower. Any other device: each batch is moved as it comes.
    """
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    device = torch.device(device)
    if device.type != "cuda":
        for batch in batches:
            yield _move(batch, device, non_blocking=False)
        return
    yield from _CudaPrefetch(iter(batches), device, ahead)


class _CudaPrefetch:
    def __init__(self, batches: Iterator[Any], device: torch.device, ahead: int):
        self._batches, self._device, self._ahead = batches, device, ahead
        self._stream = torch.cuda.Stream(device)
        self._queued: collections.deque[tuple[Any, Any, torch.cuda.Event]] = collections.deque()  # host, moved
        self._copying: list[tuple[Any, torch.cuda.Event]] = []  # host batches whose copy may still be reading them
        self._done = False

    def __iter__(self) -> Iterator[Any]:
        try:
            while self._issue() and len(self._queued) <= self._ahead:
                pass
            while self._queued:
                host, moved, copied = self._queued.popleft()
                compute = torch.cuda.current_stream(self._device)
                compute.wait_event(copied)
                _record_stream(moved, compute)
                self._copying.append((host, copied))
                del host
                self._copying = [(h, e) for h, e in self._copying if not e.query()]
                self._issue()
                yield moved
                del moved
        finally:
            self._stream.synchronize()  # no copy may outlive the host buffers it reads
            self._queued.clear()
            self._copying.clear()

    def _issue(self) -> bool:
        """Start copying the next batch; False when there is none."""
        if self._done:
            return False
        host = next(self._batches, _END)
        if host is _END:
            self._done = True
            return False
        with torch.cuda.stream(self._stream):
            moved = _move(host, self._device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._queued.append((host, moved, copied))
        return True


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
