"""Checking and converting what ``Writer.add`` is given into the stored arrays, copying only when needed."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .codecs import quantize
from .dtypes import DTYPES
from .errors import InvalidSampleError
from .spec import MAX_INPUT_ID, StoreSpec

if TYPE_CHECKING:
    import torch

# Every manifest holds at most shard_tokens (<= 2**20) rows, so these keep its sample_id column under 1 GiB
# (one Arrow string array) and a sample's meta far below Arrow's 2 GiB per value.
MAX_SAMPLE_ID_BYTES = 1024
MAX_META_BYTES = 1 << 20


@dataclass(frozen=True)
class Sample:
    """A validated sample: C-contiguous arrays in stored dtypes, shapes ``[T]`` or ``[T, width]``."""

    sample_id: str
    arrays: dict[str, np.ndarray]
    meta: str | None
    has_loss_mask: bool = True  # False: the caller had none; the stored rows are zeros and carry no hash

    @property
    def num_tokens(self) -> int:
        return len(self.arrays["input_ids"])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def prepare(spec: StoreSpec, sample_id: Any, *, input_ids: Any, loss_mask: Any, aux_hidden_states: Any,
            hidden_states: Any, meta: Any = None) -> Sample:
    """Validate one sample against ``spec``; raise :class:`InvalidSampleError` naming the sample and the problem."""
    check_sample_id(sample_id)

    def fail(message: str) -> InvalidSampleError:
        return InvalidSampleError(f"sample {sample_id!r}: {message}")

    ids = integers(input_ids, "input_ids", fail)
    if ids.dtype == np.bool_:
        raise fail("input_ids must hold integers, got dtype bool")
    if ids.ndim != 1:
        raise fail(f"input_ids must have shape [T], got {list(ids.shape)}")
    num_tokens = len(ids)
    if num_tokens == 0:
        raise fail("empty sample (0 tokens)")
    limit = MAX_INPUT_ID if spec.vocab_size is None else spec.vocab_size - 1
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > limit:
        bad = lo if lo < 0 else hi
        raise fail(f"input_ids holds {bad}, outside [0, {limit}]" + ("" if spec.vocab_size is None else " (vocab_size)"))

    mask = np.zeros(num_tokens, np.uint8) if loss_mask is None else integers(loss_mask, "loss_mask", fail)
    if mask.shape != (num_tokens,):
        raise fail(f"loss_mask must have shape [{num_tokens}] like input_ids, got {list(mask.shape)}")
    if mask.dtype != np.bool_ and ((mask != 0) & (mask != 1)).any():
        raise fail("loss_mask must hold only 0 and 1")

    aux = _hidden(spec, aux_hidden_states, "aux_hidden_states", fail, num_tokens)
    final = _hidden(spec, hidden_states, "hidden_states", fail, num_tokens)

    if meta is not None:
        if not isinstance(meta, dict):
            raise fail(f"meta must be a dict (a JSON object), got {type(meta).__name__}")
        try:
            meta = json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise fail(f"meta must be JSON-serializable: {e}") from None
        if len(meta) > MAX_META_BYTES:  # ASCII: json.dumps escapes the rest
            raise fail(f"meta is {len(meta):,} bytes as JSON, more than the {MAX_META_BYTES:,} a sample may carry")
    arrays = {
        "input_ids": ids.astype(np.int32),
        "loss_mask": mask.astype(np.uint8, copy=False),
        "aux_hidden_states": aux,
        "hidden_states": final,
    }
    return Sample(sample_id, arrays, meta, has_loss_mask=loss_mask is not None)


def check_sample_id(sample_id: Any) -> None:
    """Raise :class:`InvalidSampleError` unless ``sample_id`` is an id a manifest can hold: a non-empty string
    of at most ``MAX_SAMPLE_ID_BYTES`` bytes of UTF-8."""
    if not isinstance(sample_id, str) or not sample_id:
        raise InvalidSampleError(f"sample_id must be a non-empty string, got {sample_id!r}")
    try:
        encoded = sample_id.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidSampleError(f"sample {sample_id!r}: the id is not valid UTF-8 text ({e.reason} at "
                                 f"position {e.start})") from None
    if len(encoded) > MAX_SAMPLE_ID_BYTES:
        raise InvalidSampleError(f"sample {sample_id[:40]!r}...: the id is {len(encoded):,} bytes of UTF-8, more "
                                 f"than the {MAX_SAMPLE_ID_BYTES:,} allowed")


def integers(value: Any, name: str, fail) -> np.ndarray:
    """An integer (or bool) torch tensor, numpy array or sequence as a host numpy array; ``fail(message)`` makes
    the error to raise."""
    if _is_tensor(value):
        array = _host_array(value, name, fail)
    else:
        array = _numpy(value, name, fail)
    if array.dtype.kind not in "iub":
        raise fail(f"{name} must hold integers, got dtype {_dtype_name(value, array)}")
    return array


def _hidden(spec: StoreSpec, value: Any, name: str, fail, num_tokens: int) -> np.ndarray:
    """A hidden-state torch tensor or numpy array (ml_dtypes for bfloat16) of ``num_tokens`` tokens as the stored
    rows: without copying when it is in the stored dtype (for fp8, uint8 rows of ``hsdata.codecs.quantize.quantize``,
    checked); else converted from the compute dtype on the tensor's
    device before it is copied to the host (``torch.Tensor.to``, round to nearest even; to fp8 rows by
    :func:`hsdata.codecs.quantize.quantize`, refusing NaN and Inf)."""
    tensor = spec.tensor(name)
    stored, compute = tensor.dtype, DTYPES[spec.compute_dtype or spec.dtype]
    layers, hidden = tensor.layers, spec.hidden_size
    if _is_tensor(value):
        value = _dense(value, name, fail)
    else:
        value = _numpy(value, name, fail)
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
    shape = tuple(value.shape)
    if tensor.quantized and str(value.dtype).removeprefix("torch.") == "uint8" and shape == (num_tokens, tensor.width):
        return _fp8_rows(value, tensor, hidden, name, fail)
    if name == "aux_hidden_states" and shape == (num_tokens, layers, hidden):
        value, shape = value.reshape(num_tokens, layers * hidden), (num_tokens, layers * hidden)
    if shape != (num_tokens, layers * hidden):
        also = f" or [{num_tokens}, {layers}, {hidden}]" if name == "aux_hidden_states" else ""
        parts = f" ({layers} layers x hidden size {hidden})" if name == "aux_hidden_states" else ""
        raise fail(f"{name} must have shape [{num_tokens}, {layers * hidden}]{parts}{also}, got {list(shape)}")
    got = str(value.dtype).removeprefix("torch.")
    if got not in (stored.name, compute.name) or (tensor.quantized and got != compute.name):
        takes = stored.name if compute is stored else f"{stored.name}, or {compute.name} (converted)"
        raise fail(f"{name} is {got}, this store takes {compute.name if tensor.quantized else takes}")
    if isinstance(value, np.ndarray):
        if got == stored.name:
            return np.ascontiguousarray(value).view(stored.stored)
        value = _torch_of(value)
    if tensor.quantized:  # checked on the rows (half the bytes): NaN or Inf states give NaN values or scales
        rows = _host_array(quantize.quantize(value, layers, stored.name), name, fail)
        bad = quantize.first_invalid(rows, layers, hidden, stored.name)
        if bad is not None:
            raise fail(f"{name} holds NaN or Inf (first at token {bad[0]}): fp8 stores take finite states only")
        return rows
    if got != stored.name:
        value = value.to(stored.torch)  # on the tensor's device, before it is copied to the host
    return _host_array(value.view(stored.stored_torch), name, fail)


def _fp8_rows(value: Any, tensor, hidden: int, name: str, fail) -> np.ndarray:
    """Rows already quantized (``hsdata.codecs.quantize.quantize``, e.g. on the GPU by the capture path), checked."""
    rows = _host_array(value, name, fail) if _is_tensor(value) else np.ascontiguousarray(value)
    problem = quantize.invalid(rows, tensor.layers, hidden, tensor.logical_dtype)
    if problem is not None:  # NaN or Inf states quantize to a NaN or infinite scale
        raise fail(f"{name} holds NaN or Inf, or is not fp8 rows: {problem}")
    return rows


def _torch_of(array: np.ndarray) -> torch.Tensor:
    """A numpy array (ml_dtypes' bfloat16 included) as a torch tensor of the same values."""
    import torch

    array = np.require(array, requirements="CW")  # W: torch wants a writable array
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _dense(tensor: torch.Tensor, name: str, fail) -> torch.Tensor:
    """``tensor`` with its data resolved (a negated view), or ``fail`` if it has no dense data to read."""
    import torch

    if tensor.layout != torch.strided or tensor.is_nested:
        layout = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        raise fail(f"{name} is a {layout} tensor: hsdata takes dense (strided) tensors (use .to_dense())")
    if tensor.device.type == "meta":
        raise fail(f"{name} is on the meta device: it has no data")
    return tensor.resolve_neg()


def _host_array(tensor: torch.Tensor, name: str, fail) -> np.ndarray:
    tensor = _dense(tensor, name, fail).detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    try:
        return tensor.contiguous().numpy()
    except (RuntimeError, TypeError) as e:  # dtypes numpy lacks (quantized, ...), tensor subclasses
        raise fail(f"{name} ({tensor.dtype}) cannot be read as a host array: {e}") from None


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (without loading torch: a tensor means it is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _numpy(value: Any, name: str, fail) -> np.ndarray:
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise fail(f"{name} is not an array: {e}") from None


def _dtype_name(value: Any, array: np.ndarray) -> str:
    return str(value.dtype) if _is_tensor(value) else str(array.dtype)
