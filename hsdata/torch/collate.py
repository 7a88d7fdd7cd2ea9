"""Batches from items: right-padded in hsdata's, SpecForge's or ModelOpt's layout, or packed into one row."""

from __future__ import annotations

from typing import Any

import torch

CONVENTIONS = ("hsdata", "specforge", "modelopt")
IGNORE_INDEX = -100  # labels of positions that predict nothing (ModelOpt's IGNORE_TOKEN_ID)
PER_TOKEN = ("input_ids", "loss_mask", "attention_mask", "position_ids", "aux_hidden_states", "hidden_states")


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

    No convention shifts a tensor: both trainers shift inside their training step.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; expected one of {list(CONVENTIONS)}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    batch = _per_sample(items)
    lengths = [len(item["input_ids"]) for item in items]
    width = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    for name in PER_TOKEN:
        first = items[0][name]
        out = first.new_zeros((len(items), width, *first.shape[1:]))
        for b, item in enumerate(items):
            out[b, : lengths[b]] = item[name]
        batch[name] = out
    if convention == "specforge":
        loss_mask = batch["loss_mask"]
        loss_mask[torch.arange(len(items)), torch.tensor(lengths) - 1] = 0
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "loss_mask": loss_mask,
                "hidden_state": batch["aux_hidden_states"], "target": batch["hidden_states"]}
    if convention == "modelopt":
        labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        for b, n in enumerate(lengths):
            labels[b, : n - 1] = batch["input_ids"][b, 1:n]
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                "loss_mask": batch["loss_mask"], "labels": labels,
                "base_model_outputs": {"base_model_hidden_states": batch["hidden_states"],
                                       "aux_hidden_states": batch["aux_hidden_states"],
                                       "base_hidden_prenorm": False}}
    return batch


def pack_eagle3(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Pack the items into one row with no padding, for attention that keeps documents apart.

    Per-token tensors are concatenated into [1, S] / [1, S, D] (S = total tokens); ``position_ids`` restart at 0
    in each sample, ``document_ids`` [1, S] give each token's item number, and ``cu_seqlens`` int32 [B + 1] are
    the sample boundaries (flash-attention's varlen layout). ``sample_id`` (and ``meta``) list the items in order.
    """
    batch = _per_sample(items)
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    for name in PER_TOKEN:
        batch[name] = torch.cat([item[name] for item in items]).unsqueeze(0)
    batch["document_ids"] = torch.repeat_interleave(torch.arange(len(items)), lengths).unsqueeze(0)
    batch["cu_seqlens"] = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return batch


def _per_sample(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch's lists of per-sample values: ``sample_id``, and ``meta`` when the items carry it."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    batch: dict[str, Any] = {"sample_id": [item["sample_id"] for item in items]}
    if "meta" in items[0]:
        batch["meta"] = [item["meta"] for item in items]
    return batch
