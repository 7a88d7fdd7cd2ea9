"""What the format modules share: the sample as a foreign file holds it, reading ``torch.save`` files safely,
checking tensors, and writing files atomically."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

HIDDEN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class BadSourceError(Exception):
    """A source file that cannot be imported as it is: unreadable, truncated or inconsistent (the message says
    why). It is listed, never replaced by another sample."""


@dataclass
class SourceSample:
    """One sample as a foreign file holds it, in hsdata's shapes: ``input_ids`` [T], ``loss_mask`` [T] or None
    (the file has none), ``aux_hidden_states`` [T, K*H] (or [T, K, H]), ``hidden_states`` [T, H]."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    aux_hidden_states: torch.Tensor
    hidden_states: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)  # kept in the sample's meta, for exports (dtypes, ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.hidden_states.shape[-1])

    @property
    def nbytes(self) -> int:
        tensors = (self.input_ids, self.loss_mask, self.aux_hidden_states, self.hidden_states)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def load_torch(path: str) -> dict[str, Any]:
    """A ``torch.save`` file (``.gz``: gzip-compressed) as a dict, with ``weights_only=True``: tensors and plain
    containers only, never arbitrary objects. Uncompressed files are memory-mapped; a ``.gz`` one is held in
    memory while it is read (one sample)."""
    try:
        if path.endswith(".gz"):  # decompressed once into memory: torch.load seeks, which a gzip stream does slowly
            with gzip.open(path, "rb") as f:
                data = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise BadSourceError(f"holds objects other than tensors and plain containers (refused by "
                                 f"torch.load(weights_only=True)): {first}") from None
        raise BadSourceError(f"not a readable torch.save file (truncated or corrupt?): {first}") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError, gzip.BadGzipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadSourceError(f"not a readable torch.save file (truncated or corrupt?): "
                             f"{type(e).__name__}: {first}") from None
    if not isinstance(data, dict):
        raise BadSourceError(f"holds a {type(data).__name__}, expected a dict of tensors")
    return data


def tensor(data: dict[str, Any], key: str, *, floating: bool) -> torch.Tensor:
    """``data[key]`` checked to be a dense CPU tensor of an allowed dtype (floats: float16, bfloat16, float32)."""
    if key not in data:
        raise BadSourceError(f"missing key {key!r} (has {sorted(map(str, data))})")
    value = data[key]
    if not isinstance(value, torch.Tensor):
        raise BadSourceError(f"{key!r} is a {type(value).__name__}, expected a tensor")
    if floating and value.dtype not in HIDDEN_DTYPES:
        raise BadSourceError(f"{key!r} is {str(value.dtype).removeprefix('torch.')}, expected float16, bfloat16 "
                             "or float32")
    if not floating and (value.is_floating_point() or value.is_complex()):
        raise BadSourceError(f"{key!r} is {str(value.dtype).removeprefix('torch.')}, expected integers")
    return value


def squeeze_batch(name: str, value: torch.Tensor, ndim: int) -> torch.Tensor:
    """``value`` with a leading batch dimension of 1 dropped, checked to have ``ndim`` dimensions then."""
    if value.ndim == ndim + 1 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != ndim:
        raise BadSourceError(f"{name!r} has shape {list(value.shape)}, expected {ndim} dimensions "
                             f"(or {ndim + 1} with a batch of 1)")
    return value


def check_sample(sample: SourceSample, num_aux: int) -> SourceSample:
    """Raise :class:`BadSourceError` unless the tensors agree: one length T, ``aux`` = ``num_aux`` x H wide,
    the hidden states of one dtype, 0/1 loss masks, at least one token."""
    t, h = sample.num_tokens, sample.hidden_size
    if t == 0:
        raise BadSourceError("empty sample (0 tokens)")
    if sample.input_ids.ndim != 1:
        raise BadSourceError(f"input_ids has shape {list(sample.input_ids.shape)}, expected [T]")
    if sample.loss_mask is not None:
        if list(sample.loss_mask.shape) != [t]:
            raise BadSourceError(f"loss_mask has shape {list(sample.loss_mask.shape)}, input_ids [{t}]")
        if sample.loss_mask.dtype != torch.bool and bool(((sample.loss_mask != 0) & (sample.loss_mask != 1)).any()):
            raise BadSourceError("loss_mask holds values other than 0 and 1")
    if sample.hidden_states.ndim != 2 or sample.hidden_states.shape[0] != t:
        raise BadSourceError(f"final hidden state has shape {list(sample.hidden_states.shape)}, expected [{t}, H]")
    aux = sample.aux_hidden_states
    width = aux.shape[-1] * (aux.shape[1] if aux.ndim == 3 else 1)
    if aux.shape[0] != t or aux.ndim not in (2, 3) or width != num_aux * h:
        raise BadSourceError(f"aux hidden states have shape {list(aux.shape)}, expected [{t}, {num_aux * h}] "
                             f"({num_aux} aux layers x hidden size {h})")
    if aux.dtype != sample.hidden_states.dtype:
        raise BadSourceError(f"aux hidden states are {aux.dtype}, the final state {sample.hidden_states.dtype}")
    if int(sample.input_ids.min()) < 0 or int(sample.input_ids.max()) > 2**31 - 1:
        raise BadSourceError("input_ids holds ids outside [0, 2^31 - 1]")
    return sample


def dtype_name(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise TypeError(f"not a torch dtype: {name!r}")
    return value


def save_atomic(path: str, write) -> None:
    """``write(temporary_path)`` then rename it to ``path``: a file under its final name is always complete. The
    temporary file has the final file's name, in a hidden folder beside it, so a writer that records its file's
    name (``torch.save`` names the zip's root after it) writes the same bytes as straight to ``path``, run after
    run."""
    folder, name = os.path.split(path)
    staging = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    os.makedirs(staging, exist_ok=True)
    temporary = os.path.join(staging, name)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
        os.rmdir(staging)


def walk(src: str, match) -> list[str]:
    """Relative paths of the files under ``src`` for which ``match(relative_path)`` is true, sorted; files
    whose name starts with ``.`` (in-progress writes) are left out."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"no such directory: {src}")
    found = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), src).replace(os.sep, "/")
            if not name.startswith(".") and match(rel):
                found.append(rel)
    return sorted(found)


def as_numpy(value: torch.Tensor) -> np.ndarray:
    return value.contiguous().numpy()
