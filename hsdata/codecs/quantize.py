"""fp8 hidden states (format version 4): each stored row holds, for each layer of the tensor, the layer's
``hidden_size`` fp8 values followed by its float32 scale (little-endian), so a token's row is
``layers * (hidden_size + 4)`` bytes. A value ``v`` of layer ``l`` reads back as ``float32(v) * scale[l]``, rounded
to bfloat16. The writer and the capture path make these rows (on whichever device holds the states), the reader
turns them back, validate checks them: all through this module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import DTYPES

if TYPE_CHECKING:
    import torch

SCALE_BYTES = 4  # one float32 per token and layer
DEQUANTIZED = DTYPES["bfloat16"]  # what readers return
DEQUANTIZE_TOKENS = 32  # tokens (de)quantized at once on a CPU: the 32-bit temporaries stay in cache


def row_nbytes(layers: int, hidden_size: int) -> int:
    """Bytes of one token's row of a tensor of ``layers`` layers."""
    return layers * (hidden_size + SCALE_BYTES)


def quantize(states: torch.Tensor, layers: int, dtype: str) -> torch.Tensor:
    """Rows ``[T, layers * (H + 4)]`` (uint8, on ``states``' device) of states ``[T, layers * H]`` (a token
    holding NaN or Inf gets NaN values or scales: :func:`first_invalid`).

    Each token's layer slice is divided by ``scale = max |x| / fp8_max`` (float32; a slice whose scale is 0 gets
    scale 1 and stores zeros) and rounded to the nearest even fp8 value; the same on every device, bit for bit.
    """
    import torch

    fp8 = DTYPES[dtype]
    tokens = states.shape[0]
    x = states.reshape(tokens, layers, -1)
    hidden = x.shape[2]
    rows = torch.empty(tokens, layers, hidden + SCALE_BYTES, dtype=torch.uint8, device=states.device)
    step = DEQUANTIZE_TOKENS if states.device.type == "cpu" else max(1, tokens)  # CPU: temporaries in cache
    for start in range(0, tokens, step):
        wide = x[start : start + step].to(torch.float32, copy=True)  # divided in place below
        amax = wide.abs().amax(dim=2, keepdim=True)
        # divided by a tensor: CUDA turns division by a Python number into a product with its reciprocal, which
        # rounds differently from the CPU's division
        scale = amax.div_(torch.full_like(amax, fp8.fp8_max))
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        values = wide.div_(scale).clamp_(-fp8.fp8_max, fp8.fp8_max)  # x / scale may round just past fp8_max
        rows[start : start + step, :, :hidden] = values.to(fp8.torch).view(torch.uint8)
        rows[start : start + step, :, hidden:] = scale.view(torch.uint8)
    return rows.reshape(tokens, -1)


def split(rows: torch.Tensor, layers: int, hidden: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 values ``[T, layers, hidden]`` (a view of ``rows``) and float32 scales ``[T, layers]`` (a copy) of
    stored rows (``[T, layers * (hidden + 4)]`` uint8, or their flat bytes)."""
    import torch

    rows = rows.reshape(-1, layers, hidden + SCALE_BYTES)
    scales = rows[:, :, hidden:].contiguous().view(torch.float32).reshape(-1, layers)
    return rows[:, :, :hidden].view(DTYPES[dtype].torch), scales


def dequantize(rows: torch.Tensor, layers: int, hidden: int, dtype: str,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 states ``[T, layers * hidden]`` of stored rows, into ``out`` if given (its first ``len(out)``
    tokens, when it holds fewer than the rows). Each fp8 value is widened to float32 by moving its bits (exact,
    subnormals included, and several times faster on a CPU than torch's conversion), times its scale, rounded."""
    import torch

    values, scales = split(rows, layers, hidden, dtype)
    values = values.view(torch.uint8)
    if out is None:
        out = torch.empty(len(values), layers * hidden, dtype=DEQUANTIZED.torch, device=rows.device)
    target = out.view(-1, layers, hidden)
    shift, rebias = _WIDEN[dtype]
    step = DEQUANTIZE_TOKENS if rows.device.type == "cpu" else max(1, len(target))
    wide = torch.empty(min(step, len(target)), layers, hidden, dtype=torch.int32, device=rows.device)
    for start in range(0, len(target), step):
        end = min(start + step, len(target))
        bits = wide[: end - start]
        bits.copy_(values[start:end])
        sign = (bits & 0x80).bitwise_left_shift_(24)
        bits.bitwise_and_(0x7F).bitwise_left_shift_(shift).bitwise_or_(sign)  # a float32 of the value / rebias
        widened = bits.view(torch.float32).mul_(rebias)  # exact: a power of two
        target[start:end].copy_(widened.mul_(scales[start:end, :, None]))  # float32(v) * s, to nearest even
    return out


_WIDEN = {"float8_e4m3fn": (20, 2.0**120), "float8_e5m2": (21, 2.0**112)}  # mantissa shift, 2 ** (127 - bias)


def dequantize_bits(rows: np.ndarray, layers: int, hidden: int, dtype: str) -> np.ndarray:
    """:func:`dequantize` in numpy, bit for bit, for tools that do not load torch: the bfloat16 states' bit
    patterns (``uint16``, ``[T, layers * hidden]``) of stored rows."""
    rows = rows.reshape(-1, layers, hidden + SCALE_BYTES)
    scales = np.ascontiguousarray(rows[:, :, hidden:]).view("<f4")  # [T, layers, 1]
    bits = (_fp8_values(dtype)[rows[:, :, :hidden]] * scales).view(np.uint32)  # float32(v) * s, to nearest even
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to bfloat16, to nearest even
    return rounded.astype(np.uint16).reshape(len(rows), layers * hidden)


def _fp8_values(dtype: str) -> np.ndarray:
    """The float32 value of each of the 256 fp8 bit patterns, widened as :func:`dequantize` widens them."""
    bits = np.arange(256, dtype=np.uint32)
    shift, rebias = _WIDEN[dtype]
    return (((bits & 0x80) << 24) | ((bits & 0x7F) << shift)).view(np.float32) * np.float32(rebias)


def first_invalid(rows: np.ndarray, layers: int, hidden: int, dtype: str) -> tuple[int, str] | None:
    """The first token of stored rows (uint8, ``[T, layers * (hidden + 4)]`` or flat) that is invalid, and what
    is wrong with it, or None: an fp8 value that is NaN (or Inf), or a scale that is not finite and positive.
    States holding NaN or Inf quantize to rows like these, so this finds them too."""
    rows = rows.reshape(-1, layers, hidden + SCALE_BYTES)
    mask = DTYPES[dtype].exponent_mask
    nan_values = ((rows[:, :, :hidden] & mask) == mask).any(axis=2)
    scales = np.ascontiguousarray(rows[:, :, hidden:]).view("<f4").reshape(-1, layers)
    bad_scales = ~(np.isfinite(scales) & (scales > 0))
    tokens = np.flatnonzero((nan_values | bad_scales).any(axis=1))
    if not len(tokens):
        return None
    t = int(tokens[0])
    if nan_values[t].any():
        return t, "an fp8 value is NaN or Inf"
    return t, f"a scale is {float(scales[t][bad_scales[t]][0])!r}, not finite and positive"


def invalid(rows: np.ndarray, layers: int, hidden: int, dtype: str) -> str | None:
    """:func:`first_invalid` in words, or None."""
    found = first_invalid(rows, layers, hidden, dtype)
    return None if found is None else f"{found[1]} (token {found[0]} of these rows)"


__all__ = ["dequantize", "dequantize_bits", "first_invalid", "invalid", "quantize", "row_nbytes", "split"]
