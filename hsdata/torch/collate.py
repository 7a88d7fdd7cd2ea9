"""Batches from items: right-padded in hsdata's, SpecForge's or ModelOpt's layout, or packed into one row."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info

from ..io import segments
from ..io.segments import SharedBatch
from .batches import CONVENTIONS, BatchItems, Layout, collate

__all__ = ["CONVENTIONS", "collate_eagle3", "pack_eagle3"]


def collate_eagle3(items: list[dict[str, Any]], *, pad_to_multiple_of: int = 1,
                   convention: str = "hsdata") -> dict[str, Any]:
    """Right-pad every per-token tensor with zeros to the batch's longest sample (rounded up to
    ``pad_to_multiple_of``) and lay the batch out as ``convention`` expects (docs/training.md):

    - ``"hsdata"``: the item keys, batched: ``input_ids``, ``loss_mask``, ``attention_mask``, ``position_ids``
      [B, N], ``aux_hidden_states`` [B, N, K*H], ``hidden_states`` [B, N, H], ``sample_id`` (a list; and
      ``meta``, a list, from a dataset made with ``meta=True``);
    - ``"specforge"``: SpecForge's offline batch, ``input_ids``, ``attention_mask``, ``loss_mask`` (0 at each
      sample's last token, whose target is past its end), ``hidden_state`` (aux), ``target`` (final);
    - ``"modelopt"``: ModelOpt's offline EAGLE batch, ``input_ids``, ``attention_mask``, ``loss_mask``, ``labels``
      (input ids shifted left, -100 where nothing follows) and ``base_model_outputs`` holding
      ``base_model_hidden_states``, ``aux_hidden_states`` and ``base_hidden_prenorm`` (False: stores hold the
      post-norm state).

    No convention shifts a tensor: both trainers shift inside their training step. Items an ``Eagle3Dataset``
    read as one batch (a DataLoader with a batch size) already lie in their padded places: then the batch is
    returned without copying them when its width is the same; other items are copied. In a DataLoader worker the
    batch lies in shared memory the worker lends to the training process, which gets it without a copy.
    """
    layout = Layout(convention, pad_to_multiple_of)
    batch = items.batch(layout) if isinstance(items, BatchItems) else None
    if batch is None:
        batch = collate(layout, items, _block).batch()
    return _sent(batch, items)


def pack_eagle3(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Pack the items into one row with no padding, for attention that keeps documents apart.

    Per-token tensors are concatenated into [1, S] / [1, S, D] (S = total tokens); ``position_ids`` restart at 0
    in each sample, ``document_ids`` [1, S] give each token's item number, and ``cu_seqlens`` int32 [B + 1] are
    the sample boundaries (flash-attention's varlen layout). ``sample_id`` (and ``meta``) list the items in order.
    """
    return _sent(collate(Layout(pack=True), items, _block).batch(), items)


def _block(nbytes: int) -> torch.Tensor:
    return segments.take(nbytes) if get_worker_info() is not None else torch.empty(nbytes, dtype=torch.uint8)


def _sent(batch: dict[str, Any], items: list) -> dict[str, Any]:
    """In a DataLoader worker, the batch as a :class:`SharedBatch` (it pickles by its places in shared memory)."""
    if get_worker_info() is None:
        return batch
    return SharedBatch(batch, pin=items.pin if isinstance(items, BatchItems) else None)
