"""From packed prefill forwards to committed samples, off the forward's critical path.

A front end (the SGLang hook, an in-process engine) describes each prefill forward as :class:`Piece` s, one per
request: rows ``[row, row + length)`` of the packed tensors hold prompt positions ``[start, start + length)``.
:meth:`Capture.add_forward` takes just those rows (a copier thread moves them from a GPU to pinned host memory,
in small chunks on a side CUDA stream) and returns; a background thread reassembles requests across forwards
(chunked prefill), hands complete samples to the store's writer and commits at least every ``flush_interval_s``.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..codecs import quantize
from ..errors import InvalidSampleError
from ..writer import DEFAULT_MAX_PENDING_BYTES, Writer

log = logging.getLogger("hsdata.extract.capture")

QUANTIZE_ROWS = 2048  # rows of states quantized at once on a GPU (float32 temporaries: 8 bytes a value)
FAULT_LOG_INTERVAL_S = 60.0  # a write fault's cause is logged at most this often, with counts
REOPEN_BACKOFF_S = (1.0, 30.0)  # a failed store is tried again after 1 s, doubling up to 30 s
BACKPRESSURE = ("block", "drop")  # what a forward does when max_staged_bytes are waiting for the store
MAX_DROPPED_IDS = 1 << 16  # requests the forward thread remembers as dropped, to skip their later pieces
RADIX_CACHE_FIX = ("its hidden states were never computed: run the server with --disable-radix-cache, or send "
                   "each request a unique cache_salt")


@dataclass(frozen=True)
class Piece:
    """One request's rows in one packed forward."""

    sample_id: str
    start: int  # prompt position of the piece's first row
    row: int  # first row in the packed tensors
    length: int  # rows


@dataclass(frozen=True)
class Completed:
    sample_id: str
    input_ids: torch.Tensor  # [T]
    aux_hidden_states: torch.Tensor  # [T, K*H]
    hidden_states: torch.Tensor  # [T, H]


@dataclass
class _Partial:
    prompt_length: int
    filled: int = 0
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)


class Assembler:
    """Reassembles requests from pieces in arrival order; pure, single-threaded, host tensors only.

    A request is complete when positions ``[0, prompt_length)`` are covered. A piece starting at 0 again (a
    retracted request prefilled anew) replaces what was there, rows past the prompt (decode, generated tokens)
    are ignored, and a request whose first piece starts past 0 (its prefix came from the prefix cache) or leaves
    a gap is refused: its states were never computed. Completed requests are not remembered: the same request
    again (a client's retry, a re-prefill after it finished) completes again, and the writer, which knows what
    its store holds, refuses a duplicate.
    """

    def __init__(self):
        self._partial: dict[str, _Partial] = {}
        self._dropped: set[str] = set()  # requests dropped under backpressure: their later pieces are ignored
        self.refused: set[str] = set()
        self._warned = False

    @property
    def in_progress(self) -> int:
        return len(self._partial)

    def add(self, piece: Piece, prompt_length: int, input_ids: torch.Tensor, aux: torch.Tensor,
            final: torch.Tensor) -> Completed | None:
        """Take a piece's rows (already sliced, owned by the caller); return the request once complete."""
        sample_id, start = piece.sample_id, piece.start
        if sample_id in self._dropped:
            if start > 0:
                return None
            self._dropped.discard(sample_id)  # sent again: a new prefill from its first token
        if start >= prompt_length:
            return None
        keep = min(piece.length, prompt_length - start)
        partial = self._partial.get(sample_id)
        if start == 0:
            partial = self._partial[sample_id] = _Partial(prompt_length)
            self.refused.discard(sample_id)
        elif partial is None or start > partial.filled:
            self._refuse(sample_id, f"its first {start} prompt tokens were not computed in this server's forwards")
            return None
        elif start < partial.filled:  # re-prefill from the middle: drop what it recomputes
            while partial.starts and partial.starts[-1] >= start:
                partial.starts.pop()
                partial.pieces.pop()
            partial.filled = start
            if partial.pieces:
                last_start = partial.starts[-1]
                ids, a, f = partial.pieces[-1]
                cut = start - last_start
                partial.pieces[-1] = (ids[:cut], a[:cut], f[:cut])
        partial.pieces.append((input_ids[:keep], aux[:keep], final[:keep]))
        partial.starts.append(start)
        partial.filled = start + keep
        if partial.filled < prompt_length:
            return None
        del self._partial[sample_id]
        ids, a, f = (copy_rows(parts, axis=0) if len(parts) > 1 else parts[0] for parts in zip(*partial.pieces))
        return Completed(sample_id, ids, a, f)

    def drop(self, sample_id: str) -> None:
        """Forget a request's rows and ignore its later pieces, until it is prefilled again from its first
        token."""
        self._partial.pop(sample_id, None)
        self._dropped.add(sample_id)

    def _refuse(self, sample_id: str, why: str) -> None:
        self._partial.pop(sample_id, None)
        self.refused.add(sample_id)
        if not self._warned:
            self._warned = True
            log.warning("hsdata: not storing request %r: %s; %s (warned once)", sample_id, why, RADIX_CACHE_FIX)
        else:
            log.debug("hsdata: not storing request %r: %s", sample_id, why)


class CaptureEvents:
    """What a capture reports as it goes (the server hook publishes it on SGLang's /metrics); no-ops here."""

    def committed(self, samples: int) -> None:
        """``samples`` more are committed."""

    def failed(self, cause: str, samples: int) -> None:
        """``samples`` were lost to a write fault of this cause (``_fault_cause``'s words)."""

    def dropped(self, samples: int) -> None:
        """``samples`` were dropped under backpressure."""


@dataclass(frozen=True)
class _Dropped:
    """A forward the store had no room for: its requests are dropped, in order with the forwards around it."""

    sample_ids: tuple[str, ...]
    nbytes: int = 0


@dataclass
class _Staged:
    """One forward's rows: on the GPU until the copier has moved them to host memory."""

    pieces: Sequence[Piece]
    requests: Sequence[int]  # each piece's index into prompt_lengths
    prompt_lengths: torch.Tensor
    input_ids: torch.Tensor
    final: torch.Tensor
    aux: list[torch.Tensor]  # as the model passed them: one packed [rows, K*H] or K [rows, H]
    nbytes: int
    ready: torch.cuda.Event | None = None  # recorded after the forward on its stream

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.prompt_lengths, self.input_ids, self.final, *self.aux]


class Capture:
    """Stages prefill rows on the forward's thread, assembles and writes them on its own thread.

    Rows on a GPU are copied to pinned host memory by a copier thread, ``copy_chunk_bytes`` at a time with at
    most two chunks queued. One large copy would hold the GPU's device-to-host copy engine for ~10 ms, and any
    small copy the server makes meanwhile (a sampled token, an ``.item()``) would wait behind it and stall the
    next forward: on an H200 that cost 1.4% of prefill throughput with one 512 MB copy per forward, 0.06% paced
    in 8 MiB chunks (benchmarks/RESULTS.md).
    """

    def __init__(self, writer: Writer, *, flush_interval_s: float = 5.0, max_staged_bytes: int = 4 << 30,
                 loss_masks: Mapping[str, Any] | None = None, copy_chunk_bytes: int = 8 << 20,
                 reopen: Callable[[], Writer] | None = None, on_backpressure: str = "block",
                 max_wait_s: float | None = None, events: CaptureEvents | None = None):
        """``loss_masks`` gives samples their mask when the front end knows it (an in-process engine); the
        server hook does not, and its client adds masks to the store instead.

        ``reopen``: a write fault (a full disk, the store's folder gone, an object store's errors) fails only the
        samples it touches (those not yet committed, and those completed until the store takes writes again):
        the failed writer is aborted and ``reopen()`` (a writer of a fresh part) is tried after 1 s, backing off
        to 30 s, so capture resumes by itself; ``samples_failed`` counts what was lost. Without it (an
        extraction that should stop at its first fault), a fault stops the capture.

        Backpressure, once ``max_staged_bytes`` of rows wait for the store (it is slower than the model):
        ``on_backpressure="block"`` makes the forward wait for room (nothing is lost), for at most ``max_wait_s``
        if given; ``"drop"`` never makes it wait. A forward not staged drops its requests (their earlier and
        later pieces too), counted in ``samples_dropped`` and logged once a minute at most.

        ``events`` hears of commits, failures and drops as they happen."""
        if flush_interval_s <= 0 or max_staged_bytes <= 0 or copy_chunk_bytes <= 0:
            raise ValueError("flush_interval_s, max_staged_bytes and copy_chunk_bytes must be positive")
        if on_backpressure not in BACKPRESSURE:
            raise ValueError(f"on_backpressure must be one of {BACKPRESSURE}, got {on_backpressure!r}")
        if max_wait_s is not None and (isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float))
                                       or not 0 <= max_wait_s < float("inf")):
            raise ValueError(f"max_wait_s must be None or a finite number of seconds >= 0, got {max_wait_s!r}")
        self.on_backpressure = on_backpressure
        self.max_wait_s = 0.0 if on_backpressure == "drop" else max_wait_s
        self.writer = writer
        self.loss_masks = loss_masks or {}
        self.flush_interval_s = flush_interval_s
        self.max_staged_bytes = max_staged_bytes
        self.copy_chunk_bytes = copy_chunk_bytes
        self._fp8 = writer.spec.dtype if writer.spec.tensor("hidden_states").quantized else None
        self.assembler = Assembler()
        self.samples_written = 0  # added to a writer and not lost: committed, once close() returns
        self.samples_failed = 0  # lost to write faults
        self.samples_dropped = 0  # dropped under backpressure
        self.peak_staged_bytes = 0  # the most host memory staged rows held at once
        self._dropped: dict[str, None] = {}  # the forward thread's recently dropped requests, oldest first
        self._reopen = reopen
        self._added = 0  # samples added to the current writer (those past its num_committed are uncommitted)
        self._reported = 0  # the writer's num_committed last told to events
        self._last_fault = "writes fail"  # the cause of the last write fault
        self.events = events or CaptureEvents()
        self._next_reopen = 0.0
        self._backoff = REOPEN_BACKOFF_S[0]
        self._faults = _FaultLog()
        self._cond = threading.Condition()
        self._on_device: collections.deque[_Staged | _Dropped] = collections.deque()
        self._staged: collections.deque[_Staged | _Dropped] = collections.deque()
        self._staged_bytes = 0
        self._closing = False
        self._copied_all = False
        self._error: BaseException | None = None
        self._copier: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, name="hsdata-capture", daemon=True)
        self._thread.start()

    def add_forward(self, pieces: Sequence[Piece], prompt_lengths: torch.Tensor | Sequence[int],
                    input_ids: torch.Tensor, aux: torch.Tensor | Sequence[torch.Tensor],
                    final: torch.Tensor, *, requests: Sequence[int] | None = None) -> None:
        """Stage the rows ``pieces`` cover (padding rows beyond them are never copied) and return.

        ``prompt_lengths[requests[i]]`` is the whole prompt length of ``pieces[i]``'s request (``requests``
        defaults to ``0, 1, ...``; it lets a front end skip requests without indexing a GPU tensor); ``aux`` is
        packed ``[rows, K*H]`` or a list of K ``[rows, H]`` tensors. On a GPU this only records an event: the tensors
        stay referenced (so the allocator cannot reuse them) until the copier has moved them. Waits only when
        ``max_staged_bytes`` are staged and not yet written (the disk is slower than the model), logging when it
        does.
        """
        if self._error is not None or not pieces:
            return
        requests = list(range(len(pieces))) if requests is None else list(requests)
        if self._dropped:  # the later pieces of dropped requests are not staged; a new prefill from 0 is
            for p in pieces:
                if p.start == 0:
                    self._dropped.pop(p.sample_id, None)
            kept = [(p, r) for p, r in zip(pieces, requests) if p.sample_id not in self._dropped]
            if not kept:
                return
            pieces, requests = [p for p, _ in kept], [r for _, r in kept]
        rows = max(p.row + p.length for p in pieces)
        aux_parts = [aux] if isinstance(aux, torch.Tensor) else list(aux)
        width = sum(a.shape[-1] for a in aux_parts)
        if not torch.is_tensor(prompt_lengths):
            prompt_lengths = torch.tensor(list(prompt_lengths), dtype=torch.int64)
        nbytes = rows * (width + final.shape[-1]) * final.element_size() + rows * 8
        if not self._reserve(nbytes):
            self._drop(pieces, on_device=final.is_cuda)
            return
        if final.is_cuda:
            staged = _Staged(pieces, requests, prompt_lengths.clone(), input_ids[:rows], final[:rows],
                             [a[:rows] for a in aux_parts], nbytes, ready=torch.cuda.Event())
            staged.ready.record(torch.cuda.current_stream(final.device))
            if self._copier is None:
                self._copier = threading.Thread(target=self._copy_loop, args=(final.device,), name="hsdata-d2h",
                                                daemon=True)
                self._copier.start()
            queue = self._on_device
        else:
            staged = _Staged(pieces, requests, prompt_lengths.clone(), input_ids[:rows].clone(), final[:rows].clone(),
                             [a[:rows].clone() for a in aux_parts], nbytes)
            queue = self._staged
        with self._cond:
            queue.append(staged)
            self._cond.notify_all()

    def _copy_loop(self, device: torch.device) -> None:
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device)
                while True:
                    with self._cond:
                        while not self._on_device and not self._closing:
                            self._cond.wait()
                        if not self._on_device:
                            return
                        on_device = self._on_device.popleft()
                    staged = on_device if isinstance(on_device, _Dropped) else self._copy_paced(on_device, stream)
                    with self._cond:
                        self._staged.append(staged)
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by the capture thread's handler
            self._fail(e)

    def _copy_paced(self, on_device: _Staged, stream: torch.cuda.Stream) -> _Staged:
        """Copy into new pinned buffers (one DMA per chunk; a strided destination would copy synchronously); an
        fp8 store's states are quantized first, on this side stream, so the copy moves half the bytes."""
        stream.wait_event(on_device.ready)
        hosts = []
        queued: collections.deque[torch.cuda.Event] = collections.deque()
        with torch.cuda.stream(stream):
            for k, source in enumerate(on_device.tensors):
                if not source.is_cuda:  # prompt lengths, already a host copy
                    hosts.append(source)
                    continue
                if self._fp8 is not None and k >= 2:  # the final state, then the aux parts
                    source = self._quantized(source)
                host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
                step = max(1, self.copy_chunk_bytes // (source[:1].numel() * source.element_size()))
                for row in range(0, source.shape[0], step):
                    host[row:row + step].copy_(source[row:row + step], non_blocking=True)
                    done = torch.cuda.Event(blocking=True)  # waiting on it sleeps rather than spins
                    done.record(stream)
                    queued.append(done)
                    if len(queued) > 2:
                        queued.popleft().synchronize()
                hosts.append(host)
        for done in queued:
            done.synchronize()
        prompt_lengths, input_ids, final, *aux = hosts
        return _Staged(on_device.pieces, on_device.requests, prompt_lengths, input_ids, final, aux, on_device.nbytes)

    def _quantized(self, states: torch.Tensor) -> torch.Tensor:
        """fp8 rows of states ``[rows, L*H]``, ``QUANTIZE_ROWS`` at a time (their float32 temporaries stay small on
        a GPU that serves)."""
        layers = states.shape[-1] // self.writer.spec.hidden_size
        rows = torch.empty(states.shape[0], quantize.row_nbytes(layers, self.writer.spec.hidden_size),
                           dtype=torch.uint8, device=states.device)
        for start in range(0, states.shape[0], QUANTIZE_ROWS):
            rows[start:start + QUANTIZE_ROWS] = quantize.quantize(states[start:start + QUANTIZE_ROWS], layers,
                                                                   self._fp8)
        return rows

    def _reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes`` more staged rows: waits as ``on_backpressure`` and ``max_wait_s`` say; False if
        there was none in time."""
        with self._cond:
            waited = time.monotonic()
            deadline = None if self.max_wait_s is None else waited + self.max_wait_s
            while self._staged_bytes and self._staged_bytes + nbytes > self.max_staged_bytes:
                left = 10.0 if deadline is None else min(10.0, deadline - time.monotonic())
                if left <= 0:
                    return False
                if not self._cond.wait(timeout=left) and left == 10.0:
                    log.warning("hsdata: %.0f s waiting for the store to take %.1f GiB of staged hidden states: "
                                "the disk is slower than the model", time.monotonic() - waited,
                                self._staged_bytes / 2**30)
            self._staged_bytes += nbytes
            self.peak_staged_bytes = max(self.peak_staged_bytes, self._staged_bytes)
            return True

    def _drop(self, pieces: Sequence[Piece], on_device: bool) -> None:
        """Drop a forward's requests: remembered here to skip their later pieces, and sent in order with the
        forwards before it so that the capture thread drops their earlier pieces."""
        sample_ids = tuple(dict.fromkeys(p.sample_id for p in pieces))
        for sample_id in sample_ids:
            self._dropped[sample_id] = None
        while len(self._dropped) > MAX_DROPPED_IDS:  # a forgotten one's late pieces are ignored by the assembler
            del self._dropped[next(iter(self._dropped))]
        with self._cond:
            (self._on_device if on_device else self._staged).append(_Dropped(sample_ids))
            self._cond.notify_all()

    def close(self) -> None:
        """Write what is staged, commit, and stop. Requests still incomplete are dropped (logged)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._copier is not None:
            self._copier.join()
        with self._cond:
            self._copied_all = True
            self._cond.notify_all()
        self._thread.join()
        if self.assembler.in_progress:
            log.warning("hsdata: %d request(s) still incomplete at shutdown were not stored",
                        self.assembler.in_progress)
        if self.writer is not None and self._error is not None:
            self.writer.abort()
        elif self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:  # noqa: BLE001 - with reopen, a fault at the last commit fails its samples only
                if self._reopen is None:
                    raise
                self._broken(e)
            else:
                self._report_committed()
        self._faults.flush(force=True)

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_interval_s
        unflushed = 0
        try:
            while True:
                with self._cond:
                    while not self._staged and not self._copied_all:
                        if not self._cond.wait(timeout=max(0.0, next_flush - time.monotonic())):
                            break
                    staged = self._staged.popleft() if self._staged else None
                    if staged is None and self._copied_all:
                        return
                if staged is not None:
                    unflushed += self._write(staged) if isinstance(staged, _Staged) else self._write_dropped(staged)
                    with self._cond:
                        self._staged_bytes -= staged.nbytes
                        self._cond.notify_all()
                if time.monotonic() >= next_flush:
                    if unflushed:
                        self._flush()
                        unflushed = 0
                    next_flush = time.monotonic() + self.flush_interval_s
        except BaseException as e:  # noqa: BLE001 - the server keeps running; captures stop, loudly
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        log.error("hsdata: capture stopped, no more samples will be stored: %r", error)
        with self._cond:
            self._on_device.clear()
            self._staged.clear()
            self._staged_bytes = 0
            self._cond.notify_all()

    def _write(self, staged: _Staged) -> int:
        written = 0
        lengths = staged.prompt_lengths.tolist()
        for piece, request in zip(staged.pieces, staged.requests):
            prompt_length = lengths[request]
            rows = slice(piece.row, piece.row + piece.length)
            aux = copy_rows([a[rows] for a in staged.aux], axis=-1)  # copies: the staging buffers are reused
            done = self.assembler.add(piece, int(prompt_length), copy_rows([staged.input_ids[rows]]), aux,
                                      copy_rows([staged.final[rows]]))
            if done is None:
                continue
            writer = self._writer()
            if writer is None:  # the store takes no writes yet: the sample fails (sent again, it is taken)
                self._faults.add("the store takes no writes yet", 1, level=logging.WARNING)
                self.samples_failed += 1
                self.events.failed(self._last_fault, 1)
                continue
            try:
                writer.add(done.sample_id, input_ids=done.input_ids, loss_mask=self.loss_masks.get(done.sample_id),
                           aux_hidden_states=done.aux_hidden_states, hidden_states=done.hidden_states)
            except InvalidSampleError as e:  # e.g. a request id already committed: that sample stays as it was
                self._faults.add(f"requests not stored: {type(e).__name__}", 0, str(e), logging.WARNING)
                continue
            except Exception as e:  # noqa: BLE001 - a write fault: with reopen, it fails these samples only
                if self._reopen is None:
                    raise
                self._broken(e, adding=True)
                continue
            self._added += 1
            self.samples_written += 1
            written += 1
        return written

    def _write_dropped(self, dropped: _Dropped) -> int:
        for sample_id in dropped.sample_ids:
            self.assembler.drop(sample_id)
        count = len(dropped.sample_ids)
        self.samples_dropped += count
        self.events.dropped(count)
        self._faults.add(f"the store is slower than the model: requests dropped (on_backpressure="
                         f"{self.on_backpressure!r}, max_staged_bytes {self.max_staged_bytes})", count,
                         level=logging.WARNING)
        return 0

    def _flush(self) -> None:
        if self.writer is None:  # it failed since: what it held is counted failed already
            return
        try:
            self.writer.flush()
        except Exception as e:  # noqa: BLE001 - see _write
            if self._reopen is None:
                raise
            self._broken(e)
            return
        self._report_committed()

    def _report_committed(self) -> None:
        committed = self.writer.num_committed
        if committed > self._reported:
            self.events.committed(committed - self._reported)
            self._reported = committed

    def _writer(self) -> Writer | None:
        """The writer, or after a fault a fresh one once the store takes writes again (None until then)."""
        if self.writer is not None or time.monotonic() < self._next_reopen:
            return self.writer
        try:
            self.writer = self._reopen()
        except Exception as e:  # noqa: BLE001 - still failing: tried again later
            self._faults.add(_fault_cause(e), 0, f"reopening the store: {e!r}")
            self._next_reopen = time.monotonic() + self._backoff
            self._backoff = min(2 * self._backoff, REOPEN_BACKOFF_S[1])
            return None
        self._backoff = REOPEN_BACKOFF_S[0]
        self._faults.add("capture resumed in a fresh part", 0, f"part {self.writer.part}, {self.samples_failed} "
                         "sample(s) failed in all", logging.WARNING)
        return self.writer

    def _broken(self, error: BaseException, adding: bool = False) -> None:
        """A write fault: the writer's uncommitted samples fail (and, when ``adding``, the one being added), it
        is aborted, and a fresh one follows once the store takes writes again."""
        uncommitted = self._added - self.writer.num_committed
        lost = uncommitted + adding
        self.samples_written -= uncommitted
        self.samples_failed += lost
        self._report_committed()
        self._added = self._reported = 0
        self._last_fault = _fault_cause(error)
        self.events.failed(self._last_fault, lost)
        self._faults.add(self._last_fault, lost, repr(error))
        try:
            self.writer.abort()
        except Exception:  # noqa: BLE001 - it has failed already; nothing it wrote after its last commit shows
            pass
        self.writer = None
        self._next_reopen = time.monotonic() + self._backoff


class _FaultLog:
    """Write faults by cause, each logged at once and then at most every ``FAULT_LOG_INTERVAL_S`` with the counts
    gathered meanwhile (``flush(force=True)`` logs what is pending, at close)."""

    def __init__(self):
        self._pending: dict[str, list] = {}  # cause: [level, times, samples failed, latest detail]
        self._logged: dict[str, float] = {}

    def add(self, cause: str, samples: int, detail: str = "", level: int = logging.ERROR) -> None:
        entry = self._pending.setdefault(cause, [level, 0, 0, ""])
        entry[1] += 1
        entry[2] += samples
        entry[3] = detail
        self.flush()

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        for cause in list(self._pending):
            if force or now - self._logged.get(cause, -FAULT_LOG_INTERVAL_S) >= FAULT_LOG_INTERVAL_S:
                level, times, samples, detail = self._pending.pop(cause)
                lost = f", {samples} sample(s) not stored" if samples else ""
                log.log(level, "hsdata: %s (%d time(s)%s since last said)%s", cause, times, lost,
                        f"; latest: {detail}" if detail else "")
                self._logged[cause] = now


def _fault_cause(error: BaseException) -> str:
    """What a fault is, without what varies between its occurrences (a part's name): an object store's answer
    under it (HTTP status and error code), else the errno's name of the OSError under it, else the innermost
    exception's type. (s3fs turns a 503 SlowDown into OSError(EBUSY): "Device or resource busy" would mislead.)"""
    answer = _store_answer(error)
    if answer is not None:
        return f"writes fail: the store answers {answer}"
    seen = error
    while True:
        if isinstance(seen, OSError) and seen.errno:
            return f"writes fail: {os.strerror(seen.errno)} ({errno.errorcode.get(seen.errno, seen.errno)})"
        inner = seen.__cause__ or seen.__context__
        if inner is None:
            return f"writes fail: {type(seen).__name__}"
        seen = inner


def _store_answer(error: BaseException) -> str | None:
    """``HTTP 503 SlowDown``: the answer of a remote store that an exception in ``error``'s chain carries
    (botocore's ClientError, which s3fs puts under its OSError; aiohttp's ``status``), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(response.get("Error", {}).get("Code") or "")
            if isinstance(status, int):
                return f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
        status = getattr(error, "status", None)
        if isinstance(status, int) and 400 <= status < 600:
            return f"HTTP {status}"
        error = error.__cause__ or error.__context__
    return None


def copy_rows(tensors: Sequence[torch.Tensor], axis: int = -1) -> torch.Tensor:
    """Host tensors joined along ``axis`` into a new one (one tensor: copied), by numpy. A torch copy on this
    background thread would start an OpenMP team of its own, whose spinning workers take the cores of the
    server's compute: a CPU server's throughput fell to 0.56x with torch copies here (benchmarks/RESULTS.md)."""
    dtype = tensors[0].dtype
    bits = [t.view(_SAME_WIDTH[t.element_size()]).numpy() if t.is_floating_point() else t.numpy() for t in tensors]
    joined = np.concatenate(bits, axis=axis) if len(bits) > 1 else bits[0].copy()
    return torch.from_numpy(joined).view(dtype)


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy views of any dtype's bits


def writer_queue_bytes(max_staged_bytes: int) -> int:
    """The writer's queue for a capture that stages ``max_staged_bytes``: a quarter of it, at most the writer's
    default (1 GiB), so that the host memory capture holds stays within 1.25x ``max_staged_bytes``."""
    return max(1, min(DEFAULT_MAX_PENDING_BYTES, max_staged_bytes // 4))


def provenance(engine: str, engine_version: str) -> dict[str, str]:
    """What every extraction records in the store's provenance: the engine and its version, torch's and hsdata's
    versions, when (UTC) and on which host."""
    from .. import __version__

    return {"engine": engine, "engine_version": engine_version, "torch_version": torch.__version__,
            "hsdata_version": __version__, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname()}


def vocab_size(model: torch.nn.Module) -> int | None:
    """The model's vocabulary size from its config (transformers and SGLang models have one), else None."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
