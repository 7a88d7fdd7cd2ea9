"""SpecForge's offline dump: ``<out>/rows_{g}-{g+2000}/data_{idx}.ckpt`` (``.ckpt.gz`` with ``--compress``), one
``torch.save`` dict per sample: ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``hidden_state`` [1, T, H]
(final, post-norm) and ``aux_hidden_state`` [1, T, K*H], in the target's dtype."""

from __future__ import annotations

import os
import re

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

NAME = "specforge"
FINAL_HIDDEN_STATE = "post_norm"
GROUP_SIZE = 2000  # samples per rows_* folder that the export writes
FILE = re.compile(r"(?:^|.*/)rows_\d+-\d+/data_(?P<idx>\d+)\.ckpt(?:\.gz)?$")
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")  # in the order SpecForge saves them


def find(src: str) -> list[str]:
    return sorted(walk(src, lambda rel: FILE.match(rel) is not None),
                  key=lambda rel: (os.path.dirname(rel), int(FILE.match(rel)["idx"]), rel))


class Reader:
    def __init__(self, src: str, num_aux: int):
        self.src, self.num_aux = src, num_aux

    def read(self, rel: str) -> SourceSample:
        data = load_torch(os.path.join(self.src, rel))
        batched = []
        values = {}
        for key, ndim in (("input_ids", 1), ("loss_mask", 1), ("hidden_state", 2), ("aux_hidden_state", 2)):
            value = tensor(data, key, floating=key.endswith("hidden_state"))
            if value.ndim == ndim + 1:
                batched.append(key)
            values[key] = squeeze_batch(key, value, ndim)
        meta = {"dtypes": {k: dtype_name(values[k]) for k in ("input_ids", "loss_mask")}, "batched": batched}
        sample = SourceSample(values["input_ids"], values["loss_mask"], values["aux_hidden_state"],
                              values["hidden_state"], meta)
        return check_sample(sample, self.num_aux)


def reader(src: str, num_aux: int) -> Reader:
    return Reader(src, num_aux)


class Exporter:
    """Writes ``rows_{g}-{g+2000}/data_{idx}.ckpt``: the imported file's own name and index when the sample came
    from SpecForge, else its position in the store."""

    requires_loss_mask = True

    def __init__(self, dest: str):
        self.dest = dest

    def name(self, position: int, meta: dict) -> str:
        source = meta.get("source", "") if meta.get("format") == NAME else ""
        match = FILE.match(source)
        if match:
            return source.removesuffix(".gz")
        g = position // GROUP_SIZE * GROUP_SIZE
        return f"rows_{g}-{g + GROUP_SIZE}/data_{position}.ckpt"

    def write(self, rel: str, sample: dict, meta: dict) -> None:
        dtypes = meta.get("dtypes", {}) if meta.get("format") == NAME else {}
        batched = meta.get("batched", ["hidden_state", "aux_hidden_state"]) if meta.get("format") == NAME else \
            ["hidden_state", "aux_hidden_state"]
        values = {
            "input_ids": sample["input_ids"].to(torch_dtype(dtypes.get("input_ids", "int64"))),
            "loss_mask": sample["loss_mask"].to(torch_dtype(dtypes.get("loss_mask", "int64"))),
            "hidden_state": sample["hidden_states"],
            "aux_hidden_state": sample["aux_hidden_states"],
        }
        data = {k: values[k].unsqueeze(0) if k in batched else values[k] for k in KEYS}
        save_atomic(os.path.join(self.dest, rel), lambda path: torch.save(data, path))

    def finish(self) -> None:
        pass


__all__ = ["BadSourceError", "Exporter", "find", "reader"]
