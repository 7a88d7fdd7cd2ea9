"""``hsdata convert``: the samples of a store written again into a new one with another stored dtype (fp8, say)
or compression, without rerunning the model. Every sample is read verified, one at a time (bounded memory); a
rerun into the same destination skips the samples it already holds (resume)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import __version__
from .dtypes import DTYPES
from .reader import open as open_store
from .writer import create


@dataclass
class ConvertSummary:
    samples: int = 0
    converted: int = 0
    skipped: int = 0  # already in the destination
    tokens: int = 0
    source_bytes: int = 0  # payload of the converted samples, as stored in the source and in the destination
    dest_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"samples": self.samples, "converted": self.converted, "skipped": self.skipped,
                "tokens": self.tokens, "source_bytes": self.source_bytes, "dest_bytes": self.dest_bytes,
                "seconds": round(self.seconds, 3)}


def convert(src: str, dest: str, *, dtype: Any, compression: Any = None, storage_options: dict | None = None,
            dest_storage_options: dict | None = None, provenance: dict | None = None,
            on_plan: Callable[[int], None] | None = None,
            on_sample: Callable[[int], None] | None = None) -> ConvertSummary:
    """Write every sample of ``src`` into ``dest`` with its hidden states stored as ``dtype`` (any stored dtype
    the source's compute dtype may be stored in: ``hsdata.create``) and ``compression``; ``on_plan(samples)``
    once, then ``on_sample(tokens)`` per sample (converted or skipped)."""
    started = time.monotonic()
    summary = ConvertSummary()
    with open_store(src, storage_options=storage_options) as store:
        spec = store.spec
        compute = spec.compute_dtype or spec.dtype  # what the states are given to the new writer in
        recorded = {"converted_from": store.url, "source_dtype": spec.dtype, "hsdata_version": __version__,
                    **(provenance or {}), "source_provenance": store.provenance}
        with create(dest, spec.hidden_size, list(spec.aux_layers), spec.model, dtype=dtype, compute_dtype=compute,
                    vocab_size=spec.vocab_size, final_hidden_state=spec.final_hidden_state,
                    compression=compression, storage_options=dest_storage_options, provenance=recorded) as writer:
            given = DTYPES[compute].torch
            summary.samples = len(store)
            if on_plan is not None:
                on_plan(len(store))
            for i in range(len(store)):
                sample_id, tokens = store.sample_ids[i], int(store.lengths[i])
                if sample_id in writer:
                    summary.skipped += 1
                else:
                    sample = store.read(i)
                    writer.add(sample_id, input_ids=sample["input_ids"], loss_mask=sample["loss_mask"],
                               aux_hidden_states=sample["aux_hidden_states"].to(given),
                               hidden_states=sample["hidden_states"].to(given), meta=store.meta(i))
                    summary.converted += 1
                    summary.source_bytes += tokens * spec.token_nbytes
                    summary.dest_bytes += tokens * writer.spec.token_nbytes
                summary.tokens += tokens
                if on_sample is not None:
                    on_sample(tokens)
    summary.seconds = time.monotonic() - started
    return summary
