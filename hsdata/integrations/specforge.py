"""SpecForge's trainer reading a store in place, with no export to ``.ckpt`` files (docs/training.md).

SpecForge (checked against 0.2.0) trains offline from a feature store and a list of sample refs:
``specforge.launch.build_disagg_offline_runtime(feature_store=..., refs=...)`` builds its own loader over them.
:class:`HsdataFeatureStore` is such a store over an hsdata store, and :meth:`HsdataFeatureStore.refs` gives the
refs, one per sample. A fetched sample is what SpecForge's own reader takes out of a ``.ckpt`` file: ``input_ids``
int64 [T], ``loss_mask`` int64 [T], ``hidden_state`` [1, T, H] (the final, post-norm state) and
``aux_hidden_state`` [1, T, K*H], in the store's dtype; so SpecForge's normalizer, collator and step run unchanged.
Every read is checked against the sample's checksums (``verify=False`` to :func:`hsdata.open` turns that off).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import torch

from ..errors import MissingExtraError
from ..reader import Store
from ..reader import open as open_store

try:
    from specforge.runtime.contracts import SCHEMA_VERSION, FeatureHandle, FeatureSpec, SampleRef
    from specforge.runtime.data_plane.feature_store import FeatureStore
except ImportError as e:
    raise MissingExtraError(f"hsdata.integrations.specforge needs SpecForge ({e}): pip install specforge (checked "
                            "with 0.2.0), see docs/training.md") from e

# SpecForge's offline EAGLE-3 feature name -> the store's tensor name
FIELDS = {"input_ids": "input_ids", "loss_mask": "loss_mask", "hidden_state": "hidden_states",
          "aux_hidden_state": "aux_hidden_states"}
# The stored target is the final hidden state: SpecForge's step re-runs the target's lm_head on it. Its loader
# passes each ref's metadata["target_repr"] to the step, which needs "hidden_state" for that.
TARGET_REPR = "hidden_state"


class HsdataFeatureStore(FeatureStore):
    """A read-only SpecForge ``FeatureStore`` over the store at ``store`` (a path, an fsspec URL or an open
    :class:`hsdata.Store`; ``open_options`` go to :func:`hsdata.open`). Thread-safe (SpecForge's loader fetches
    on threads with ``dataloader_num_workers > 0``)."""

    def __init__(self, store: Store | str, **open_options: Any):
        self.store = store if isinstance(store, Store) else open_store(store, **open_options)
        if self.store.spec.final_hidden_state != "post_norm":
            raise ValueError(f"{self.store.url} holds {self.store.spec.final_hidden_state} final states; SpecForge "
                             "runs the target's lm_head on them and needs post-norm ones (extract them with hsdata)")
        self._leases = itertools.count()

    def refs(self, sample_ids: Iterable[str] | None = None, *, run_id: str = "hsdata", strategy: str = "eagle3",
             ttt_length: int = 7, max_len: int = 2048) -> list[SampleRef]:
        """One ``SampleRef`` per sample, in the store's order (or that of ``sample_ids``), for
        ``build_disagg_offline_runtime(feature_store=self, refs=...)``: its ``sample_id`` is the store's, its
        specs come from the manifest (no sample is read), its metadata holds ``target_repr="hidden_state"``.
        Pass the builder's ``ttt_length`` and ``max_len``; ``strategy`` must be the algorithm's name."""
        spec = self.store.spec
        ids = list(self.store.sample_ids if sample_ids is None else sample_ids)
        lengths = self.store.lengths[self.store.indices(ids)].tolist() if ids else []  # KeyError names missing ids
        aux_size = len(spec.aux_layers) * spec.hidden_size
        dtype = spec.dtype
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        metadata = {"format": "hsdata", "target_repr": TARGET_REPR, "schema_version": SCHEMA_VERSION,
                    "ttt_length": ttt_length, "max_len": max_len}
        refs = []
        for sample_id, n in zip(ids, lengths):
            refs.append(SampleRef(
                sample_id=sample_id, run_id=run_id, source_task_id=None,
                feature_store_uri=f"hsdata:{self.store.url}#{quote(sample_id, safe='')}",
                feature_keys={name: name for name in FIELDS},
                feature_specs={
                    "input_ids": FeatureSpec("input_ids", (n,), "int64"),
                    "loss_mask": FeatureSpec("loss_mask", (n,), "int64"),
                    "hidden_state": FeatureSpec("hidden_state", (1, n, spec.hidden_size), dtype),
                    "aux_hidden_state": FeatureSpec("aux_hidden_state", (1, n, aux_size), dtype),
                },
                strategy=strategy, schema_version=SCHEMA_VERSION, target_model_version=spec.model or "unknown",
                num_tokens=n, estimated_bytes=n * (16 + (spec.hidden_size + aux_size) * itemsize),
                metadata=dict(metadata)))
        return refs

    def get(self, sample_ref: SampleRef, *, device: torch.device | str = "cpu",
            names: list[str] | None = None) -> tuple[dict[str, torch.Tensor], FeatureHandle]:
        """The sample's features (all four, or ``names``), read and verified now; ``KeyError`` for an id not in
        the store, ``ValueError`` for a sample stored without a loss mask (``hsdata.add_loss_masks``)."""
        wanted = list(names or sample_ref.feature_keys)
        unknown = [name for name in wanted if name not in FIELDS]
        if unknown:
            raise KeyError(f"sample {sample_ref.sample_id!r}: no features {unknown} (a store has {list(FIELDS)})")
        sample = self.store.get(sample_ref.sample_id, fields=[FIELDS[name] for name in wanted])
        tensors = {}
        for name in wanted:
            value = sample[FIELDS[name]]
            if name == "loss_mask":
                if value is None:
                    raise ValueError(f"sample {sample_ref.sample_id!r} has no loss mask; add it with "
                                     "hsdata.add_loss_masks")
                value = value.to(torch.int64)
            elif name != "input_ids":
                value = value.unsqueeze(0)  # [1, T, D], as SpecForge saves them
            tensors[name] = value if str(device) == "cpu" else value.to(device)
        handle = FeatureHandle(sample_id=sample_ref.sample_id, generation=0,
                               lease_token=f"{sample_ref.sample_id}:0:{next(self._leases)}")
        return tensors, handle

    def release(self, handle: FeatureHandle, *, reason: str = "consumed") -> None:
        """Nothing to free: a fetched sample's tensors are the caller's."""

    def abort(self, sample_id: str, *, reason: str = "aborted") -> None:
        """Nothing to evict (``hsdata.remove_samples`` removes samples from a store)."""

    def put(self, tensors: dict[str, torch.Tensor], *, sample_id: str, metadata: dict[str, Any]) -> SampleRef:
        raise TypeError("HsdataFeatureStore is read-only: write samples with hsdata.create(...).add(...)")

    def health(self) -> dict[str, Any]:
        return {"store_id": self.store.url, "resident_samples": 0, "active_leases": 0, "resident_bytes": 0,
                "release_pending": 0, "samples": len(self.store)}


__all__ = ["FIELDS", "TARGET_REPR", "HsdataFeatureStore"]
