"""vllm-project/speculators' dump: ``<data>/hidden_states/hs_{i}.safetensors`` with ``hidden_states`` [T, K+1, H]
(K aux layers, then the final state **before** the final norm) and ``token_ids`` [T], beside the Arrow dataset
(``datasets.save_to_disk``: ``state.json`` + ``data-*.arrow``) whose row i holds ``input_ids``, ``loss_mask`` and
``seq_len`` of ``hs_{i}``."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import torch

from .common import BadSourceError, SourceSample, check_sample, dtype_name, save_atomic, tensor, torch_dtype, walk

NAME = "speculators"
FINAL_HIDDEN_STATE = "pre_norm"
FILE = re.compile(r"(?:^|.*/)hs_(?P<idx>\d+)\.safetensors$")
ARROW_FILE = "data-00000-of-00001.arrow"


def find(src: str) -> list[str]:
    return sorted(walk(src, lambda rel: FILE.match(rel) is not None),
                  key=lambda rel: (os.path.dirname(rel), int(FILE.match(rel)["idx"])))


def load_dataset(src: str) -> pa.Table:
    """The Arrow dataset of ``src`` (``datasets.save_to_disk`` layout), memory-mapped: no row is read yet."""
    state = os.path.join(src, "state.json")
    try:
        if os.path.exists(state):
            with open(state) as f:
                names = [entry["filename"] for entry in json.load(f)["_data_files"]]
        else:
            names = sorted(n for n in os.listdir(src) if n.endswith(".arrow"))
        if not names:
            raise FileNotFoundError(f"{src}: no Arrow dataset (state.json or *.arrow) beside the hidden states")
        tables = [pa.ipc.open_stream(pa.memory_map(os.path.join(src, n))).read_all() for n in names]
    except (OSError, KeyError, ValueError, pa.ArrowException) as e:
        raise FileNotFoundError(f"{src}: cannot read the Arrow dataset of loss masks: {e}") from None
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if "loss_mask" not in table.column_names:
        raise FileNotFoundError(f"{src}: the Arrow dataset has no loss_mask column (has {table.column_names})")
    return table


class Reader:
    def __init__(self, src: str, num_aux: int):
        self.src, self.num_aux = src, num_aux
        self.dataset = load_dataset(src)

    def _row(self, column: str, index: int):
        return self.dataset.column(column)[index]

    def read(self, rel: str) -> SourceSample:
        from safetensors import SafetensorError, safe_open

        index = int(FILE.match(rel)["idx"])
        try:
            with safe_open(os.path.join(self.src, rel), framework="pt") as f:
                data = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open is no dict
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise BadSourceError(f"not a readable safetensors file (truncated or corrupt?): {e}") from None
        states = tensor(data, "hidden_states", floating=True)
        ids = tensor(data, "token_ids", floating=False)
        if states.ndim != 3 or states.shape[1] != self.num_aux + 1:
            raise BadSourceError(f"'hidden_states' has shape {list(states.shape)}, expected [T, {self.num_aux + 1}, "
                                 f"H] ({self.num_aux} aux layers and the final state)")
        if index >= self.dataset.num_rows:
            raise BadSourceError(f"no row {index} in the Arrow dataset ({self.dataset.num_rows} rows)")
        mask_values = self._row("loss_mask", index).values
        if mask_values is None:
            raise BadSourceError(f"row {index} of the Arrow dataset has no loss_mask")
        mask = torch.from_numpy(np.asarray(mask_values.to_numpy(zero_copy_only=False)).astype(np.int64))
        t = states.shape[0]
        if list(ids.shape) != [t]:
            raise BadSourceError(f"'token_ids' has shape {list(ids.shape)}, 'hidden_states' {t} tokens")
        if "input_ids" in self.dataset.column_names:
            want = self._row("input_ids", index).values
            if want is None or not np.array_equal(np.asarray(want.to_numpy(zero_copy_only=False)), ids.numpy()):
                raise BadSourceError(f"'token_ids' differ from input_ids of row {index} of the Arrow dataset")
        if "seq_len" in self.dataset.column_names and self._row("seq_len", index).as_py() != t:
            raise BadSourceError(f"seq_len of row {index} is {self._row('seq_len', index).as_py()}, the file has "
                                 f"{t} tokens")
        sample = SourceSample(ids, mask, states[:, :-1], states[:, -1], {"dtypes": {"token_ids": dtype_name(ids)},
                                                                           "index": index})
        return check_sample(sample, self.num_aux)


def reader(src: str, num_aux: int) -> Reader:
    return Reader(src, num_aux)


class Exporter:
    """Writes ``hidden_states/hs_{i}.safetensors``, i the sample's position in the store, and at the end the
    Arrow dataset (``input_ids``, ``loss_mask``, ``seq_len``) with row i for ``hs_{i}``."""

    requires_loss_mask = True
    needs_rows = True  # finish() writes a row for every sample, written now or before

    def __init__(self, dest: str):
        self.dest = dest
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def name(self, position: int, meta: dict) -> str:
        return f"hidden_states/hs_{position}.safetensors"

    def row(self, position: int, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        self.rows[position] = (input_ids.numpy().astype(np.int64), loss_mask.numpy().astype(np.int64))

    def write(self, rel: str, sample: dict, meta: dict) -> None:
        from safetensors.torch import save_file

        dtypes = meta.get("dtypes", {}) if meta.get("format") == NAME else {}
        t, h = sample["hidden_states"].shape
        states = torch.cat([sample["aux_hidden_states"].reshape(t, -1, h), sample["hidden_states"].reshape(t, 1, h)],
                           dim=1)
        data = {"hidden_states": states,
                "token_ids": sample["input_ids"].to(torch_dtype(dtypes.get("token_ids", "int64")))}
        save_atomic(os.path.join(self.dest, rel), lambda path: save_file(data, path))

    def finish(self) -> None:
        positions = sorted(self.rows)
        if positions != list(range(len(positions))):
            raise AssertionError("rows are missing")
        ids = [self.rows[p][0] for p in positions]
        masks = [self.rows[p][1] for p in positions]
        table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())),
                          "loss_mask": pa.array(masks, pa.list_(pa.int64())),
                          "seq_len": pa.array([len(i) for i in ids], pa.int64())})

        def write_arrow(path: str) -> None:
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as stream:
                stream.write_table(table)

        save_atomic(os.path.join(self.dest, ARROW_FILE), write_arrow)
        state = {"_data_files": [{"filename": ARROW_FILE}], "_fingerprint": None, "_format_columns": None,
                 "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
        info = {"features": {
            "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "seq_len": {"dtype": "int64", "_type": "Value"}}}
        for name, document in (("state.json", state), ("dataset_info.json", info)):
            save_atomic(os.path.join(self.dest, name), lambda path, d=document: _write_json(path, d))


def _write_json(path: str, document: dict) -> None:
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
