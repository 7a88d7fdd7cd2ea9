"""The store's spec: what every sample holds and how it is chunked. Written once into the root ``zarr.json``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .codecs import compression as compression_module
from .codecs import quantize
from .codecs.compression import Compression
from .dtypes import DTYPES, FP8_DTYPES, DType, check_pair, hidden_dtype
from .errors import SpecMismatchError, UnsupportedFormatError

FORMAT_VERSION = 2  # what an uncompressed store is written as, so that version 2 readers keep reading it
COMPRESSED_FORMAT_VERSION = 3  # version 2 plus ``compression``: the hidden states' chunks compressed
FP8_FORMAT_VERSION = 4  # hidden states in fp8 with a float32 scale per token and layer, compressed or not
READABLE_VERSIONS = (1, 2, 3, 4)  # version 1: bfloat16 only, no compute_dtype (docs/format.md section 2)
LAYER_CONVENTION = "output_of_layer"  # id k = output of decoder layer k (0-based) = HF hidden_states[k + 1]
FINAL_HIDDEN_STATE = "post_norm"  # the last layer's output after the model's final norm
# "pre_norm": the last layer's output before the final norm (vLLM/speculators dumps, kept as imported; version 2 only)
FINAL_HIDDEN_STATES = (FINAL_HIDDEN_STATE, "pre_norm")

# Sizing targets: docs/format.md section 9; the measurement behind them is in benchmarks/RESULTS.md.
CHUNK_TARGET_BYTES = 4 << 20
COMPRESSED_CHUNK_TARGET_BYTES = 1 << 20  # a compressed chunk is decoded whole: a sample's ends decode less
SHARD_TARGET_BYTES = 4 << 30
MAX_SHARD_TOKENS = 1 << 20

# Sane ranges (docs/format.md section 2): a spec outside them is refused, by writers and readers alike.
MAX_HIDDEN_SIZE = 1 << 20
MAX_LAYER_ID = 4095
MAX_AUX_LAYERS = 64

TENSOR_NAMES = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
HIDDEN_TENSORS = ("aux_hidden_states", "hidden_states")
MAX_INPUT_ID = 2**31 - 1


@dataclass(frozen=True)
class TensorSpec:
    """One per-token tensor, stored as a token-major zarr array ``[tokens]`` or ``[tokens, width]``."""

    name: str
    data_type: str  # zarr v3 data_type of the stored array
    logical_dtype: str  # what the values mean ("bfloat16" is stored as its uint16 bit pattern)
    width: int | None  # elements per token; None for a 1-D array
    chunk_tokens: int  # tokens per inner (checksummed) chunk
    compression: Compression | None = None  # how each inner chunk is compressed; None: stored as it is
    layers: int = 1  # layers a row holds (an fp8 row keeps a scale per layer; hsdata.codecs.quantize)

    @property
    def dtype(self) -> DType:
        return DTYPES[self.logical_dtype]

    @property
    def quantized(self) -> bool:
        """fp8 rows: each layer's values and its scale (``hsdata.codecs.quantize``); read back as bfloat16."""
        return self.logical_dtype in FP8_DTYPES

    @property
    def values_width(self) -> int | None:
        """Values per token as read: the width, less the scales' bytes of an fp8 row."""
        if not self.quantized:
            return self.width
        return self.width - quantize.SCALE_BYTES * self.layers

    @property
    def read_dtype(self) -> DType:
        """The dtype readers return (``.torch``: as a torch dtype)."""
        return quantize.DEQUANTIZED if self.quantized else self.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_nbytes(self) -> int:
        return self.itemsize * (self.width or 1)

    @property
    def chunk_nbytes(self) -> int:
        return self.row_nbytes * self.chunk_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "data_type": self.data_type,
            "logical_dtype": self.logical_dtype,
            "width": self.width,
            "chunk_tokens": self.chunk_tokens,
        }


@dataclass(frozen=True)
class StoreSpec:
    """Model facts and layout of a store; equal specs mean writers may share the store."""

    hidden_size: int
    aux_layers: tuple[int, ...]
    model: str | None
    vocab_size: int | None
    dtype: str  # stored dtype of the hidden states
    compute_dtype: str | None  # dtype the model computed them in; None: unknown (version 1 stores)
    shard_tokens: int
    tensors: tuple[TensorSpec, ...] = field(repr=False)
    format_version: int = FORMAT_VERSION
    layer_convention: str = LAYER_CONVENTION
    final_hidden_state: str = FINAL_HIDDEN_STATE
    compression: Compression | None = None  # of the hidden-state tensors (version 3)

    @classmethod
    def new(
        cls,
        hidden_size: int,
        aux_layers: list[int] | tuple[int, ...],
        model: str | None = None,
        *,
        dtype: Any = "bfloat16",
        compute_dtype: Any = None,
        vocab_size: int | None = None,
        shard_tokens: int | None = None,
        chunk_tokens: int | None = None,
        final_hidden_state: str = FINAL_HIDDEN_STATE,
        compression: Any = None,
    ) -> StoreSpec:
        """Build a spec, deriving chunk and shard sizes from the byte targets unless given.

        ``dtype``: how the hidden states are stored; ``compute_dtype``: what the model computed them in (None: the
        same; bfloat16 for an fp8 store). Both are names or torch dtypes; float32 states may be stored as bfloat16
        or float16, and any of the three as ``float8_e4m3fn`` or ``float8_e5m2`` (format version 4).
        ``final_hidden_state``: what ``hidden_states`` holds, one of ``FINAL_HIDDEN_STATES``.
        ``compression``: how the hidden states' chunks are compressed (``hsdata.codecs.compression.parse``: None, a
        preset name or a :class:`Compression`); a compressed store is format version 3.
        """
        compression = compression_module.parse(compression)
        if final_hidden_state not in FINAL_HIDDEN_STATES:
            raise ValueError(f"final_hidden_state must be one of {', '.join(FINAL_HIDDEN_STATES)}, "
                             f"got {final_hidden_state!r}")
        dtype = hidden_dtype("dtype", dtype, stored=True)
        fp8 = dtype in FP8_DTYPES
        if compute_dtype is None:
            compute_dtype = "bfloat16" if fp8 else dtype
        compute_dtype = hidden_dtype("compute_dtype", compute_dtype)
        check_pair(dtype, compute_dtype)
        _check_positive_int("hidden_size", hidden_size, MAX_HIDDEN_SIZE)
        aux = tuple(aux_layers)
        if not 0 < len(aux) <= MAX_AUX_LAYERS:
            raise ValueError(f"aux_layers must be a non-empty list of at most {MAX_AUX_LAYERS} layer ids, "
                             f"got {aux_layers!r}")
        if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LAYER_ID for k in aux):
            raise ValueError(f"aux_layers must be a non-empty list of layer ids in [0, {MAX_LAYER_ID}], "
                             f"got {aux_layers!r}")
        if len(set(aux)) != len(aux):
            raise ValueError(f"aux_layers has repeated ids: {aux_layers!r}")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"model must be a string or None, got {model!r}")
        if vocab_size is not None:
            _check_positive_int("vocab_size", vocab_size)
            if vocab_size > MAX_INPUT_ID + 1:
                raise ValueError(f"vocab_size {vocab_size} does not fit int32 token ids")
        layers = {"aux_hidden_states": len(aux), "hidden_states": 1}
        widths = {
            "input_ids": None,
            "loss_mask": None,
            **{n: quantize.row_nbytes(k, hidden_size) if fp8 else k * hidden_size for n, k in layers.items()},
        }
        logical = {"input_ids": "int32", "loss_mask": "uint8", "aux_hidden_states": dtype, "hidden_states": dtype}
        row_nbytes = {n: (w or 1) * DTYPES[logical[n]].itemsize for n, w in widths.items()}
        if shard_tokens is None:
            shard_tokens = min(MAX_SHARD_TOKENS, _pow2_floor(SHARD_TARGET_BYTES // max(row_nbytes.values())))
        _check_positive_int("shard_tokens", shard_tokens, MAX_SHARD_TOKENS)
        tensors = []
        for name, width in widths.items():
            if name in HIDDEN_TENSORS and chunk_tokens is not None:
                _check_positive_int("chunk_tokens", chunk_tokens)
                if shard_tokens % chunk_tokens:
                    raise ValueError(f"shard_tokens ({shard_tokens}) must be a multiple of chunk_tokens ({chunk_tokens})")
                ct = chunk_tokens
            else:
                target = CHUNK_TARGET_BYTES if compression is None or name not in HIDDEN_TENSORS else \
                    COMPRESSED_CHUNK_TARGET_BYTES
                ct = min(shard_tokens, _pow2_floor(max(1, target // row_nbytes[name])))
                while shard_tokens % ct:
                    ct //= 2
            tensors.append(TensorSpec(name, DTYPES[logical[name]].data_type, logical[name], width, ct,
                                      compression if name in HIDDEN_TENSORS else None, layers.get(name, 1)))
        _check_power_of_two("shard_tokens", shard_tokens)
        version = FP8_FORMAT_VERSION if fp8 else FORMAT_VERSION if compression is None else COMPRESSED_FORMAT_VERSION
        return cls(hidden_size, aux, model, vocab_size, dtype, compute_dtype, shard_tokens, tuple(tensors),
                   format_version=version, final_hidden_state=final_hidden_state, compression=compression)

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r}; this store has {', '.join(TENSOR_NAMES)}")

    @property
    def token_nbytes(self) -> int:
        """Payload bytes per token over all tensors."""
        return sum(t.row_nbytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """The root attributes; a version 1 spec (read from an old store) has no ``compute_dtype``; ``compression``
        is there in version 3, and in version 4 when the store is compressed."""
        dtypes = {"dtype": self.dtype, "compute_dtype": self.compute_dtype}
        if self.format_version == 1:
            del dtypes["compute_dtype"]
        compressed = {"compression": self.compression.to_dict()} if self.compression is not None else {}
        return {
            "format_version": self.format_version,
            "model": self.model,
            "hidden_size": self.hidden_size,
            "aux_layers": list(self.aux_layers),
            "layer_convention": self.layer_convention,
            "final_hidden_state": self.final_hidden_state,
            **dtypes,
            "vocab_size": self.vocab_size,
            "shard_tokens": self.shard_tokens,
            "tensors": {t.name: t.to_dict() for t in self.tensors},
            **compressed,
        }

    @classmethod
    def from_dict(cls, d: Any) -> StoreSpec:
        """Parse the root attributes strictly: the version first, then every field against what it implies."""
        if not isinstance(d, dict):
            raise UnsupportedFormatError(f"hsdata attributes must be a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise UnsupportedFormatError(f"Unsupported hsdata format version {version!r}. Expected one of "
                                         f"{', '.join(map(str, READABLE_VERSIONS))}.")
        compressed = version == COMPRESSED_FORMAT_VERSION or (version == FP8_FORMAT_VERSION and "compression" in d)
        template = cls.new(1, [0], compression="zstd" if compressed else None,
                           dtype=FP8_DTYPES[0] if version == FP8_FORMAT_VERSION else "bfloat16")
        expected_keys = set(replace(template, format_version=version).to_dict())
        if set(d) != expected_keys:
            missing, extra = sorted(expected_keys - set(d)), sorted(set(d) - expected_keys)
            raise UnsupportedFormatError(f"hsdata attributes: missing keys {missing}, unknown keys {extra}")
        fixed = {"layer_convention": LAYER_CONVENTION}
        if version == 1:
            fixed["dtype"] = "bfloat16"
            fixed["final_hidden_state"] = FINAL_HIDDEN_STATE
        for key, want in fixed.items():
            if d[key] != want:
                raise UnsupportedFormatError(f"hsdata attributes: {key} is {d[key]!r}, expected {want!r}")
        if d["final_hidden_state"] not in FINAL_HIDDEN_STATES:
            raise UnsupportedFormatError(f"hsdata attributes: final_hidden_state is {d['final_hidden_state']!r}, "
                                         f"expected one of {', '.join(map(repr, FINAL_HIDDEN_STATES))}")
        try:
            dtype = hidden_dtype("dtype", d["dtype"], stored=True)
            if (dtype in FP8_DTYPES) != (version == FP8_FORMAT_VERSION):
                raise ValueError(f"dtype {dtype} in a version {version} store (fp8 dtypes are version "
                                 f"{FP8_FORMAT_VERSION}'s, and only its)")
            compute = None if d.get("compute_dtype") is None else hidden_dtype("compute_dtype", d["compute_dtype"])
            check_pair(dtype, compute)
            chunks = {n: d["tensors"][n]["chunk_tokens"] for n in TENSOR_NAMES}
            compression = Compression.from_dict(d["compression"]) if compressed else None
            spec = cls.new(d["hidden_size"], d["aux_layers"], d["model"], dtype=dtype, vocab_size=d["vocab_size"],
                           shard_tokens=d["shard_tokens"], chunk_tokens=chunks["hidden_states"],
                           compression=compression)
            tensors = tuple(replace(t, chunk_tokens=chunks[t.name]) for t in spec.tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise UnsupportedFormatError(f"hsdata attributes are invalid: {e}") from None
        spec = replace(spec, compute_dtype=compute, tensors=tensors, format_version=version,
                       final_hidden_state=d["final_hidden_state"])
        if spec.to_dict() != d:
            raise UnsupportedFormatError(f"hsdata attributes are inconsistent: {d!r}")
        for t in tensors:
            try:
                _check_positive_int(f"tensors.{t.name}.chunk_tokens", t.chunk_tokens, spec.shard_tokens)
                _check_power_of_two(f"tensors.{t.name}.chunk_tokens", t.chunk_tokens)
            except ValueError as e:
                raise UnsupportedFormatError(f"hsdata attributes are invalid: {e}") from None
        return spec

    def check_joinable(self, requested: StoreSpec, *, explicit: set[str]) -> None:
        """Raise unless a writer asking for ``requested`` may join a store with this spec.

        Model facts (the kind of final state too) and dtypes must be equal (a store that does not record its
        compute dtype, version 1, takes states in its stored dtype; a vocab_size recorded on one side only is no
        difference); layout fields (shard/chunk sizes, compression) only when the caller set them explicitly.
        """
        diffs = []
        for f in ("hidden_size", "aux_layers", "model", "dtype", "final_hidden_state"):
            if getattr(self, f) != getattr(requested, f):
                diffs.append(f"{f}: store has {getattr(self, f)!r}, requested {getattr(requested, f)!r}")
        if None not in (self.vocab_size, requested.vocab_size) and self.vocab_size != requested.vocab_size:
            diffs.append(f"vocab_size: store has {self.vocab_size}, requested {requested.vocab_size}")
        if (self.compute_dtype or self.dtype) != requested.compute_dtype:
            diffs.append(f"compute_dtype: store has {self.compute_dtype!r}, requested {requested.compute_dtype!r}")
        if "shard_tokens" in explicit and self.shard_tokens != requested.shard_tokens:
            diffs.append(f"shard_tokens: store has {self.shard_tokens}, requested {requested.shard_tokens}")
        if "chunk_tokens" in explicit:
            have, want = self.tensor("hidden_states").chunk_tokens, requested.tensor("hidden_states").chunk_tokens
            if have != want:
                diffs.append(f"chunk_tokens: store has {have}, requested {want}")
        if "compression" in explicit and self.compression != requested.compression:
            diffs.append(f"compression: store has {_describe(self.compression)}, requested "
                         f"{_describe(requested.compression)}")
        if diffs:
            raise SpecMismatchError("cannot join the existing store, its spec differs: " + "; ".join(diffs))


def _describe(compression: Compression | None) -> str:
    return "none" if compression is None else str(compression)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _check_positive_int(name: str, value: Any, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")


def _check_power_of_two(name: str, value: int) -> None:
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")


__all__ = ["COMPRESSED_FORMAT_VERSION", "FINAL_HIDDEN_STATES", "FORMAT_VERSION", "FP8_FORMAT_VERSION", "READABLE_VERSIONS", "StoreSpec", "TensorSpec", "TENSOR_NAMES"]
