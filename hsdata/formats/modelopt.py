"""NVIDIA Model-Optimizer's dump (``compute_hidden_states_hf.py``): ``{conversation_id}.pt``, one ``torch.save``
dict per sample: ``input_ids`` [T], ``hidden_states`` [T, H] (final, post-norm), ``aux_hidden_states`` [T, K*H],
``conversation_id`` and, in newer versions, ``loss_mask`` [T]."""

from __future__ import annotations

import os

import torch

from .common import (
    BadSourceError,
    SourceSample,
    check_sample,
    dtype_name,
    load_torch,
    save_atomic,
    squeeze_batch,
    tensor,
    torch_dtype,
    walk,
)

NAME = "modelopt"
FINAL_HIDDEN_STATE = "post_norm"


def find(src: str) -> list[str]:
    return walk(src, lambda rel: rel.endswith(".pt"))


class Reader:
    def __init__(self, src: str, num_aux: int):
        self.src, self.num_aux = src, num_aux

    def read(self, rel: str) -> SourceSample:
        data = load_torch(os.path.join(self.src, rel))
        ids = squeeze_batch("input_ids", tensor(data, "input_ids", floating=False), 1)
        mask = squeeze_batch("loss_mask", tensor(data, "loss_mask", floating=False), 1) if "loss_mask" in data \
            else None
        final = squeeze_batch("hidden_states", tensor(data, "hidden_states", floating=True), 2)
        aux = squeeze_batch("aux_hidden_states", tensor(data, "aux_hidden_states", floating=True), 2)
        conversation = data.get("conversation_id")
        if conversation is not None and not isinstance(conversation, (str, int)):
            raise BadSourceError(f"conversation_id is a {type(conversation).__name__}, expected a string or int")
        dtypes = {"input_ids": dtype_name(ids)}
        if mask is not None:
            dtypes["loss_mask"] = dtype_name(mask)
        meta = {"dtypes": dtypes, "conversation_id": conversation}
        return check_sample(SourceSample(ids, mask, aux, final, meta), self.num_aux)


def reader(src: str, num_aux: int) -> Reader:
    return Reader(src, num_aux)


class Exporter:
    """Writes ``{conversation_id}.pt`` (the imported file's name when the sample came from ModelOpt, else its
    position in the store, which is then also its ``conversation_id``)."""

    requires_loss_mask = False

    def __init__(self, dest: str):
        self.dest = dest

    def name(self, position: int, meta: dict) -> str:
        if meta.get("format") == NAME and meta.get("source", "").endswith(".pt"):
            return meta["source"]
        return f"{position}.pt"

    def write(self, rel: str, sample: dict, meta: dict) -> None:
        ours = meta.get("format") == NAME
        dtypes = meta.get("dtypes", {}) if ours else {}
        conversation = meta.get("conversation_id") if ours else int(rel.removesuffix(".pt"))
        data = {
            "input_ids": sample["input_ids"].to(torch_dtype(dtypes.get("input_ids", "int64"))),
            "hidden_states": sample["hidden_states"],
            "aux_hidden_states": sample["aux_hidden_states"],
            "conversation_id": conversation,
        }
        if sample["loss_mask"] is not None:
            data["loss_mask"] = sample["loss_mask"].to(torch_dtype(dtypes.get("loss_mask", "int64")))
        save_atomic(os.path.join(self.dest, rel), lambda path: torch.save(data, path))

    def finish(self) -> None:
        pass
