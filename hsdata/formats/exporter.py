"""``hsdata export``: write a store's samples in a trainer's old layout, one file per sample, bit for bit.

Files are written under a temporary name and renamed when complete, so a rerun skips every file that exists
(resume) and a reader never sees half a file. Samples are read one at a time (bounded memory), each checked
against the manifest's xxh3 by the reader.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..reader import open as open_store
from . import get

# the kind of final state each trainer expects in the file
EXPECTED_FINAL = {"specforge": "post_norm", "modelopt": "post_norm", "speculators": "pre_norm"}


@dataclass
class ExportSummary:
    samples: int = 0
    written: int = 0
    skipped: int = 0  # already exported
    tokens: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # sample id -> why it was not exported
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"samples": self.samples, "written": self.written, "skipped": self.skipped, "tokens": self.tokens,
                "seconds": round(self.seconds, 3),
                "failed": [{"sample_id": s, "reason": r} for s, r in self.failed.items()]}


def run_export(fmt: str, store_url: str, dest: str, *, storage_options: dict | None = None,
               on_plan: Callable[[int], None] | None = None,
               on_sample: Callable[[int], None] | None = None) -> ExportSummary:
    """Export every sample of ``store_url`` to ``dest`` in format ``fmt``; ``on_plan(samples)`` once, then
    ``on_sample(tokens)`` per sample done (written or skipped)."""
    started = time.monotonic()
    exporter = get(fmt).Exporter(dest)
    summary = ExportSummary()
    with open_store(store_url, storage_options=storage_options) as store:
        want = EXPECTED_FINAL[fmt]
        if store.spec.final_hidden_state != want:
            raise ValueError(f"{store.url} holds {store.spec.final_hidden_state} final hidden states; {fmt} "
                             f"trainers expect {want} ones, so the export would train on the wrong states")
        summary.samples = len(store)
        if on_plan is not None:
            on_plan(len(store))
        names: set[str] = set()
        os.makedirs(dest, exist_ok=True)
        for i in range(len(store)):
            sample_id = store.sample_ids[i]
            meta = store.meta(i) or {}
            rel = exporter.name(i, meta)
            if rel in names:
                summary.failed[sample_id] = f"its file name {rel!r} is taken by another sample"
                continue
            names.add(rel)
            tokens = int(store.lengths[i])
            needs_rows = getattr(exporter, "needs_rows", False)
            if os.path.exists(os.path.join(dest, rel)):
                summary.skipped += 1
                if needs_rows:
                    light = store.read(i, ["input_ids", "loss_mask"])
                    exporter.row(i, light["input_ids"], light["loss_mask"])
            else:
                sample = store.read(i)
                if sample["loss_mask"] is None and exporter.requires_loss_mask:
                    summary.failed[sample_id] = f"has no loss mask, which {fmt} files must hold"
                    continue
                exporter.write(rel, sample, meta)
                if needs_rows:
                    exporter.row(i, sample["input_ids"], sample["loss_mask"])
                summary.written += 1
            summary.tokens += tokens
            if on_sample is not None:
                on_sample(tokens)
        if not summary.failed:
            exporter.finish()
    summary.seconds = time.monotonic() - started
    return summary
