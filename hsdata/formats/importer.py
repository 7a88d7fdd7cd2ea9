"""``hsdata import``: copy a SpecForge, ModelOpt or speculators dump into an hsdata store, verified.

Each source file is one sample whose id is its path relative to the source folder, so a rerun skips what is
committed (resume) and ``shard=(k, n)`` picks the files whose index in the sorted listing is k modulo n
(several processes, one store). Samples are committed in batches of about ``commit_bytes``; after each commit
the batch is read back (the reader checks every byte against the manifest's xxh3) and the manifest's hashes are
compared with hashes computed from the source tensors: only then is a sample counted. A sample that fails is
taken out again (``hsdata.remove_samples``) and listed. A rerun re-verifies each earlier part's last batch, the
one an interruption may have left unverified.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import manifest
from ..dtypes import DTYPES
from ..errors import HsdataError, NotAStoreError
from ..layout import ROOT_METADATA, load_root
from ..reader import open as open_store
from ..repair import remove_samples
from ..spec import TENSOR_NAMES
from ..io.storage import Storage
from ..writer import DEFAULT_MAX_PENDING_BYTES, Writer, create
from . import get
from .common import BadSourceError, SourceSample, dtype_name

DEFAULT_COMMIT_BYTES = 1 << 30
MAX_PENDING_BYTES = 256 << 20


@dataclass
class ImportSummary:
    files: int = 0  # source files this process is responsible for
    skipped: int = 0  # already in the store (and verified)
    imported: int = 0  # written and verified in this run
    tokens: int = 0
    bytes: int = 0  # source tensor bytes imported
    bad: dict[str, str] = field(default_factory=dict)  # source file -> why it was not imported
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"files": self.files, "skipped": self.skipped, "imported": self.imported, "tokens": self.tokens,
                "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "bad": [{"file": f, "reason": r} for f, r in self.bad.items()]}


@dataclass
class _Pending:
    rel: str
    hashes: dict[str, int | None]
    tokens: int
    nbytes: int


def source_hashes(sample: SourceSample, stored_dtype: str) -> dict[str, int | None]:
    """xxh3 of each tensor as the store must hold it (docs/format.md 3, 6), computed from the source tensors."""
    stored = DTYPES[stored_dtype]

    def bits(value: torch.Tensor) -> int:
        return manifest.content_hash(value.contiguous().view(stored.stored_torch).numpy())

    mask = sample.loss_mask
    return {
        "input_ids": manifest.content_hash(np.ascontiguousarray(sample.input_ids.numpy(), dtype=np.int32)),
        "loss_mask": None if mask is None else manifest.content_hash(
            np.ascontiguousarray(mask.numpy(), dtype=np.uint8)),
        "aux_hidden_states": bits(sample.aux_hidden_states),
        "hidden_states": bits(sample.hidden_states),
    }


def run_import(fmt: str, src: str, dest: str, *, aux_layers: list[int], model: str | None = None,
               vocab_size: int | None = None, shard: tuple[int, int] = (0, 1), storage_options: dict | None = None,
               commit_bytes: int = DEFAULT_COMMIT_BYTES, provenance: dict | None = None, compression: Any = None,
               on_plan: Callable[[int, int], None] | None = None,
               on_sample: Callable[[int], None] | None = None) -> ImportSummary:
    """Import the ``fmt`` dump at ``src`` into the store ``dest`` (created, or joined: resume). Bad source files
    are listed in the summary, never imported; the caller decides what they mean for the exit status.

    ``on_plan(files, already_done)`` is called once before the first file is read; ``on_sample(tokens)`` after
    each verified sample. ``compression``: of a store created here (``hsdata.create``)."""
    started = time.monotonic()
    module = get(fmt)
    k, n = shard
    if not 0 <= k < n:
        raise ValueError(f"shard must be K/N with 0 <= K < N, got {k}/{n}")
    summary = ImportSummary()
    mine = [rel for i, rel in enumerate(module.find(src)) if i % n == k]
    summary.files = len(mine)
    reader = module.reader(src, len(aux_layers))
    storage = Storage(dest, storage_options)
    try:
        store = open_store(dest, storage_options=storage_options)
    except NotAStoreError:
        store = None
    done, recheck = _committed(store, fmt, set(mine))
    batch = _next_batch(store)
    if store is not None:
        store.close()
    if on_plan is not None:
        on_plan(len(mine), len(done) - len(recheck))
    session = _Session(module, reader, dest, storage, storage_options, summary, commit_bytes, on_sample,
                       {"aux_layers": list(aux_layers), "model": model, "vocab_size": vocab_size,
                        "compression": compression}, provenance, batch)
    try:
        for rel in recheck:
            session.recheck(rel)
        failed = session.verify()
        done -= failed  # taken out again: imported anew below
        summary.skipped = len(done)
        for rel in mine:
            if rel not in done:
                session.add(rel)
        session.close()
    except BaseException:
        session.abort()
        raise
    summary.seconds = time.monotonic() - started
    return summary


def _committed(store, fmt: str, mine: set[str]) -> tuple[set[str], list[str]]:
    """The files of ``mine`` already in the store, and those of them in the last import batch of their part (an
    interrupted run may have committed them without verifying them)."""
    if store is None:
        return set(), []
    ids = store.manifest.column("sample_id").to_pylist()
    parts = store.manifest.column("part").to_pylist()
    metas = store.manifest.column("meta").to_pylist()
    done = {sid for sid in ids if sid in mine}
    last: dict[str, int] = {}
    batches = []
    for sid, part, meta in zip(ids, parts, metas):
        batch = _batch_of(meta, fmt) if sid in mine else None
        batches.append(batch)
        if batch is not None:
            last[part] = max(last.get(part, -1), batch)
    recheck = [sid for sid, part, batch in zip(ids, parts, batches) if batch is not None and batch == last[part]]
    return done, recheck


def _batch_of(meta: str | None, fmt: str) -> int | None:
    try:
        value = json.loads(meta) if meta else None
    except ValueError:
        return None
    if isinstance(value, dict) and value.get("format") == fmt and isinstance(value.get("import_batch"), int):
        return value["import_batch"]
    return None


def _next_batch(store) -> int:
    """A batch number larger than any in the store: batches count up across runs, so "the last batch of a part"
    is well defined even for parts of earlier runs."""
    if store is None:
        return 0
    numbers = [b for m in store.manifest.column("meta").to_pylist() if (b := _any_batch(m)) is not None]
    return max(numbers, default=-1) + 1


def _any_batch(meta: str | None) -> int | None:
    try:
        value = json.loads(meta) if meta else None
    except ValueError:
        return None
    return value.get("import_batch") if isinstance(value, dict) and isinstance(value.get("import_batch"), int) \
        else None


class _Session:
    """One process's writer and the samples it committed but has not verified yet."""

    def __init__(self, module, reader, dest, storage, storage_options, summary, commit_bytes, on_sample,
                 spec_args, provenance, batch):
        self.module, self.reader, self.dest, self.storage = module, reader, dest, storage
        self.storage_options, self.summary, self.commit_bytes = storage_options, summary, commit_bytes
        self.on_sample, self.spec_args, self.provenance = on_sample, spec_args, provenance
        self.batch = batch
        self.writer: Writer | None = None
        self.pending: dict[str, _Pending] = {}
        self.pending_bytes = 0
        self.rechecked: dict[str, dict] = {}  # committed samples to verify again: sample id -> source hashes

    def _open_writer(self, sample: SourceSample) -> Writer:
        """``hsdata.create`` with the format's kind of final state. An existing store's hidden size and dtype win
        over the first sample's (which is then checked like every other)."""
        hidden, dtype = sample.hidden_size, dtype_name(sample.hidden_states)
        if self.storage.exists(ROOT_METADATA):
            spec = load_root(self.storage)[0]
            hidden, dtype = spec.hidden_size, spec.dtype
        return create(self.dest, hidden, self.spec_args["aux_layers"], self.spec_args["model"], dtype=dtype,
                      vocab_size=self.spec_args["vocab_size"], storage_options=self.storage_options,
                      max_pending_bytes=min(MAX_PENDING_BYTES, DEFAULT_MAX_PENDING_BYTES),
                      provenance=self.provenance, final_hidden_state=self.module.FINAL_HIDDEN_STATE,
                      compression=self.spec_args["compression"])

    def _read(self, rel: str) -> SourceSample | None:
        try:
            return self.reader.read(rel)
        except BadSourceError as e:
            self.summary.bad[rel] = str(e)
            return None

    def _fits(self, rel: str, sample: SourceSample) -> bool:
        spec = self.writer.spec
        problems = []
        if sample.hidden_size != spec.hidden_size:
            problems.append(f"hidden size {sample.hidden_size}, the store's is {spec.hidden_size}")
        if dtype_name(sample.hidden_states) != spec.dtype:
            problems.append(f"dtype {dtype_name(sample.hidden_states)}, the store's is {spec.dtype}")
        if spec.vocab_size is not None and int(sample.input_ids.max()) >= spec.vocab_size:
            problems.append(f"input id {int(sample.input_ids.max())} >= vocab_size {spec.vocab_size}")
        if problems:
            self.summary.bad[rel] = "inconsistent with the other files: " + "; ".join(problems)
        return not problems

    def add(self, rel: str) -> None:
        sample = self._read(rel)
        if sample is None:
            return
        if self.writer is None:
            self.writer = self._open_writer(sample)
        if not self._fits(rel, sample):
            return
        meta = {"format": self.module.NAME, "source": rel, "import_batch": self.batch, **sample.meta}
        hashes = source_hashes(sample, self.writer.spec.dtype)
        try:
            self.writer.add(rel, input_ids=sample.input_ids, loss_mask=sample.loss_mask,
                            aux_hidden_states=sample.aux_hidden_states, hidden_states=sample.hidden_states,
                            meta=meta)
        except HsdataError as e:
            if not isinstance(e, ValueError):
                raise
            self.summary.bad[rel] = str(e)
            return
        self.pending[rel] = _Pending(rel, hashes, sample.num_tokens, sample.nbytes)
        self.pending_bytes += sample.nbytes
        if self.pending_bytes >= self.commit_bytes:
            self.writer.flush()
            self.verify()

    def recheck(self, rel: str) -> None:
        """Verify an already committed sample again, against its source file."""
        sample = self._read(rel)
        if sample is not None:
            spec = load_root(self.storage)[0]
            if dtype_name(sample.hidden_states) != spec.dtype:
                self.summary.bad[rel] = f"dtype {dtype_name(sample.hidden_states)}, the store's is {spec.dtype}"
                self.rechecked[rel] = {"hashes": None, "tokens": 0}
                return
            self.rechecked[rel] = {"hashes": source_hashes(sample, spec.dtype), "tokens": sample.num_tokens}
        else:
            self.rechecked[rel] = {"hashes": None, "tokens": 0}

    def verify(self) -> set[str]:
        """Read back every committed, unverified sample and compare its hashes with the source's; count the good
        ones, take the others out of the store and list them. Returns the ids taken out."""
        todo = {**{rel: (p.hashes, True) for rel, p in self.pending.items()},
                **{rel: (r["hashes"], False) for rel, r in self.rechecked.items()}}
        if not todo:
            return set()
        store = open_store(self.dest, storage_options=self.storage_options)
        columns = {t: store.manifest.column(manifest.hash_column(t)) for t in TENSOR_NAMES}
        failed: dict[str, str] = {}
        for rel, (want, new) in todo.items():
            if want is None:
                failed[rel] = self.summary.bad.pop(rel, "source unreadable") + " (it was committed without " \
                    "being verified: taken out of the store)"
                continue
            try:
                i = store.index(rel)
                got = {t: columns[t][i].as_py() for t in TENSOR_NAMES}
                if got != want:
                    differ = [t for t in want if got[t] != want[t]]
                    raise ValueError(f"written {', '.join(differ)} differ from the source")
                store.read(i)  # every byte checked against the manifest's xxh3
            except (KeyError, ValueError, OSError, HsdataError) as e:
                failed[rel] = f"verification after writing failed: {e} (removed from the store)"
                continue
            if new:
                pending = self.pending[rel]
                self.summary.imported += 1
                self.summary.tokens += pending.tokens
                self.summary.bytes += pending.nbytes
                if self.on_sample is not None:
                    self.on_sample(pending.tokens)
            elif self.on_sample is not None:
                self.on_sample(self.rechecked[rel]["tokens"])
        committed = [rel for rel in failed if rel in store]
        store.close()
        if committed:
            remove_samples(self.dest, committed, reason="hsdata import: verification against the source failed",
                           storage_options=self.storage_options)
        for rel, why in failed.items():
            if todo[rel][0] is None or todo[rel][1]:  # unreadable source, or a new sample: listed
                self.summary.bad[rel] = why
        self.pending, self.pending_bytes, self.rechecked = {}, 0, {}
        self.batch += 1
        return set(failed)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.verify()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
