"""fp8 hidden states (format version 4): each stored row holds, for each layer of the tensor, the layer's
``hidden_size`` fp8 values followed by its float32 scale (little-endian), so a token's row is
``layers * (hidden_size + 4)`` bytes. A value ``v`` of layer ``l`` reads back as ``float32(v) * scale[l]``, rounded
to bfloat16. The writer and the capture path make these rows (on whichever device holds the states), the reader
turns them back, validate checks them: all through this module."""

from __future__ import annotations

import numpy as np
import torch

from .dtypes import DTYPES

SCALE_BYTES = 4  # one float32 per token and layer
DEQUANTIZED = torch.bfloat16  # what readers return
DEQUANTIZE_TOKENS = 32  # tokens (de)quantized at once on a CPU: the 32-bit temporaries stay in cache


def row_nbytes(layers: int, hidden_size: int) -> int:
    """Bytes of one token's row of a tensor of ``layers`` layers."""
    return layers * (hidden_size + SCALE_BYTES)


def first_non_finite(states: torch.Tensor) -> int | None:
    """The first token (row) of ``states`` holding NaN or Inf, or None."""
    bad = ~torch.isfinite(states).reshape(states.shape[0], -1).all(dim=1)
    found = torch.nonzero(bad)
    return int(found[0, 0]) if len(found) else None


def quantize(states: torch.Tensor, layers: int, dtype: str) -> torch.Tensor:
    """Rows ``[T, layers * (H + 4)]`` (uint8, on ``states``' device) of finite states ``[T, layers * H]``.

    Each token's layer slice is divided by ``scale = max |x| / fp8_max`` (float32; a slice whose scale is 0 gets
    scale 1 and stores zeros) and rounded to the nearest even fp8 value; the same on every device, bit for bit.
    """
    fp8 = DTYPES[dtype]
    tokens = states.shape[0]
    x = states.reshape(tokens, layers, -1)
    hidden = x.shape[2]
    rows = torch.empty(tokens, layers, hidden + SCALE_BYTES, dtype=torch.uint8, device=states.device)
    step = DEQUANTIZE_TOKENS if states.device.type == "cpu" else max(1, tokens)  # CPU: temporaries in cache
    for start in range(0, tokens, step):
        wide = x[start : start + step].to(torch.float32, copy=True)  # divided in place below
        scale = wide.abs().amax(dim=2, keepdim=True).div_(fp8.fp8_max)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        values = wide.div_(scale).clamp_(-fp8.fp8_max, fp8.fp8_max)  # x / scale may round just past fp8_max
        rows[start : start + step, :, :hidden] = values.to(fp8.torch).view(torch.uint8)
        rows[start : start + step, :, hidden:] = scale.view(torch.uint8)
    return rows.reshape(tokens, -1)


def split(rows: torch.Tensor, layers: int, hidden: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 values ``[T, layers, hidden]`` (a view of ``rows``) and float32 scales ``[T, layers]`` (a copy) of
    stored rows (``[T, layers * (hidden + 4)]`` uint8, or their flat bytes)."""
    rows = rows.reshape(-1, layers, hidden + SCALE_BYTES)
    scales = rows[:, :, hidden:].contiguous().view(torch.float32).reshape(-1, layers)
    return rows[:, :, :hidden].view(DTYPES[dtype].torch), scales


def dequantize(rows: torch.Tensor, layers: int, hidden: int, dtype: str,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 states ``[T, layers * hidden]`` of stored rows, into ``out`` if given (its first ``len(out)``
    tokens, when it holds fewer than the rows). Each fp8 value is widened to float32 by moving its bits (exact,
    subnormals included, and several times faster on a CPU than torch's conversion), times its scale, rounded."""
    values, scales = split(rows, layers, hidden, dtype)
    values = values.view(torch.uint8)
    if out is None:
        out = torch.empty(len(values), layers * hidden, dtype=DEQUANTIZED, device=rows.device)
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


def invalid(rows: np.ndarray, layers: int, hidden: int, dtype: str) -> str | None:
    """What is wrong with stored rows (uint8, ``[T, layers * (hidden + 4)]`` or flat), or None: an fp8 value
    that is NaN (or Inf), or a scale that is not finite and positive."""
    rows = rows.reshape(-1, layers, hidden + SCALE_BYTES)
    mask = DTYPES[dtype].exponent_mask
    bad = np.flatnonzero(((rows[:, :, :hidden] & mask) == mask).any(axis=(1, 2)))
    if len(bad):
        return f"an fp8 value is NaN or Inf (token {int(bad[0])} of these rows)"
    scales = np.ascontiguousarray(rows[:, :, hidden:]).view("<f4").reshape(-1, layers)
    bad = np.flatnonzero(~(np.isfinite(scales) & (scales > 0)).all(axis=1))
    if len(bad):
        return f"a scale is {float(scales[bad[0]][~(np.isfinite(scales[bad[0]]) & (scales[bad[0]] > 0))][0])!r}, " \
               f"not finite and positive (token {int(bad[0])} of these rows)"
    return None


__all__ = ["dequantize", "first_non_finite", "invalid", "quantize", "row_nbytes", "split"]
