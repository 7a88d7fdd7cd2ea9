"""The one table of dtypes: for each logical dtype of a stored tensor, its zarr v3 ``data_type``, the torch dtype
readers return and the numpy dtype of the stored array. Writer, reader and validate all look dtypes up here.

Torch dtypes are named here and looked up when first used, so what only reads metadata (the command line's
``info``, ``validate``, ``gc``, ``remove``) does not import torch."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # logical dtype, as the spec and the arrays' attributes name it (= numpy's name, ml_dtypes' for bf16)
    data_type: str  # zarr v3 data_type of the stored array
    torch_name: str  # the torch dtype readers return
    stored: np.dtype  # numpy dtype of the stored array: bfloat16 is kept as its uint16 bit pattern
    stored_torch_name: str  # the torch dtype of that array (uint16 for bfloat16)
    exponent_mask: int | None = None  # floats: bits all set in NaN and Inf (the exponent; e4m3fn: its NaN, 0x7F)
    fp8_max: float | None = None  # fp8: the largest finite magnitude, what a token's largest value is scaled to

    @property
    def torch(self) -> torch.dtype:
        """What readers return."""
        import torch

        return getattr(torch, self.torch_name)

    @property
    def stored_torch(self) -> torch.dtype:
        """The torch dtype of the stored array (``torch.uint16`` for bfloat16)."""
        import torch

        return getattr(torch, self.stored_torch_name)

    @property
    def itemsize(self) -> int:
        return self.stored.itemsize

    @property
    def bits(self) -> np.dtype:
        """Unsigned integer dtype of the same width, to test bit patterns."""
        return np.dtype(f"<u{self.itemsize}")


DTYPES = {d.name: d for d in (
    DType("int32", "int32", "int32", np.dtype("<i4"), "int32"),
    DType("uint8", "uint8", "uint8", np.dtype("u1"), "uint8"),
    DType("bfloat16", "uint16", "bfloat16", np.dtype("<u2"), "uint16", 0x7F80),
    DType("float16", "float16", "float16", np.dtype("<f2"), "float16", 0x7C00),
    DType("float32", "float32", "float32", np.dtype("<f4"), "float32", 0x7F800000),
    # fp8 states are stored as their bit patterns with a float32 scale per token and layer (hsdata.codecs.quantize);
    # ``torch`` is the element dtype of the stored values, readers return them dequantized to bfloat16.
    DType("float8_e4m3fn", "uint8", "float8_e4m3fn", np.dtype("u1"), "uint8", 0x7F, 448.0),
    DType("float8_e5m2", "uint8", "float8_e5m2", np.dtype("u1"), "uint8", 0x7C, 57344.0),
)}
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")  # what the hidden-state tensors may be computed in
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
STORED_HIDDEN_DTYPES = HIDDEN_DTYPES + FP8_DTYPES  # what they may be stored in
CONVERSIONS = {("float32", "bfloat16"), ("float32", "float16")} | {
    (compute, fp8) for compute in HIDDEN_DTYPES for fp8 in FP8_DTYPES}  # (compute, stored) pairs the writer converts


def hidden_dtype(what: str, value: Any, *, stored: bool = False) -> str:
    """The name of a hidden-state dtype given as a name (``"float32"``) or a torch dtype (``torch.float32``);
    ``stored``: a stored dtype, fp8 included."""
    torch = sys.modules.get("torch")  # a torch dtype can only come from a caller that imported torch
    name = str(value).removeprefix("torch.") if torch is not None and isinstance(value, torch.dtype) else value
    allowed = STORED_HIDDEN_DTYPES if stored else HIDDEN_DTYPES
    if name not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)} (a name or torch dtype), got {value!r}")
    return name


def check_pair(dtype: str, compute_dtype: str | None) -> None:
    """Raise unless states computed in ``compute_dtype`` (None: unknown) may be stored as ``dtype``."""
    if compute_dtype not in (None, dtype) and (compute_dtype, dtype) not in CONVERSIONS:
        raise ValueError(f"cannot store {compute_dtype} hidden states as {dtype}: the stored dtype must be the "
                         "compute dtype, float32 stored as bfloat16 or float16, or any of them as fp8")
