"""Where things live in a store and the zarr v3 metadata documents that describe them.

    zarr.json                                root group; attributes["hsdata"] = StoreSpec.to_dict(),
                                             attributes["hsdata_provenance"]: the creator's free-form facts
    parts/zarr.json                          group holding one subgroup per writer
    parts/<part>/zarr.json                   group of one writer (attributes["hsdata_part"]: when, and the
                                             provenance of a writer that did not create the store)
    parts/<part>/<tensor>/zarr.json          token-major sharded array
    parts/<part>/<tensor>/c/<s>[/0]          shard s of that array (see shard.py)
    manifests/<part>.<seq>.<xxh3>.parquet    committed sample rows (see manifest.py)
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .errors import CorruptDataError, NotAStoreError, UnsupportedFormatError
from .spec import StoreSpec, TensorSpec

ROOT_METADATA = "zarr.json"
PARTS = "parts"
MANIFESTS = "manifests"
SPEC_ATTRIBUTE = "hsdata"
PART_ATTRIBUTE = "hsdata_part"
PROVENANCE_ATTRIBUTE = "hsdata_provenance"
MAX_METADATA_BYTES = 1 << 20  # hsdata writes < 4 KiB plus any provenance; a larger one is refused before it is read
MAX_JSON_DEPTH = 32  # nesting of arrays and objects in a zarr.json (hsdata's are 6 deep)
MAX_PROVENANCE_BYTES = 64 << 10  # provenance as encode_json writes it: root and part documents stay < 1 MiB
MAX_PROVENANCE_DEPTH = MAX_JSON_DEPTH - 3  # so that it fits a part's zarr.json (attributes.hsdata_part.provenance)


def metadata_key(node: str) -> str:
    return f"{node}/{ROOT_METADATA}" if node else ROOT_METADATA


def part_node(part: str) -> str:
    return f"{PARTS}/{part}"


def array_node(part: str, tensor: TensorSpec) -> str:
    return f"{PARTS}/{part}/{tensor.name}"


def shard_key(part: str, tensor: TensorSpec, shard: int) -> str:
    """Key of shard ``shard`` (zarr's default chunk key encoding: ``c/<i>`` per dimension)."""
    suffix = f"c/{shard}/0" if tensor.width is not None else f"c/{shard}"
    return f"{array_node(part, tensor)}/{suffix}"


def group_document(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def array_document(spec: StoreSpec, tensor: TensorSpec, num_tokens: int) -> dict[str, Any]:
    """The zarr.json of one part's array holding ``num_tokens`` tokens (its shape grows as the writer commits)."""
    row = [tensor.width] if tensor.width is not None else []
    bytes_codec = {"name": "bytes", "configuration": {"endian": "little"}}
    compressed = [tensor.compression.codec_document(tensor.itemsize)] if tensor.compression is not None else []
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [num_tokens, *row],
        "data_type": tensor.data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [spec.shard_tokens, *row]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,  # a JSON number: valid for the int, uint and float data types alike
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [tensor.chunk_tokens, *row],
                    "codecs": [bytes_codec, *compressed, {"name": "crc32c"}],
                    "index_codecs": [bytes_codec, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ],
        "attributes": {SPEC_ATTRIBUTE: {"tensor": tensor.name, "logical_dtype": tensor.logical_dtype}},
        "dimension_names": ["token", "feature"][: 1 + len(row)],
    }


def encode_json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, indent=2, allow_nan=False).encode()


def read_document(storage, key: str) -> dict[str, Any]:
    """Read and parse one ``zarr.json``: at most ``MAX_METADATA_BYTES``, nested at most ``MAX_JSON_DEPTH`` deep, a
    JSON object whose ``attributes`` (if present) is an object; else :class:`CorruptDataError` naming it."""
    return parse_document(storage.read_bytes(key, max_bytes=MAX_METADATA_BYTES), storage.describe(key))


def parse_document(raw: bytes, where: str) -> dict[str, Any]:
    """The checks of :func:`read_document` on bytes already read (at most ``MAX_METADATA_BYTES``) from ``where``."""
    try:
        document = json.loads(raw)
    except RecursionError:
        raise CorruptDataError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise CorruptDataError(f"{where} is not valid JSON: {e}") from None
    if _depth(document) > MAX_JSON_DEPTH:
        raise CorruptDataError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(document, dict):
        raise CorruptDataError(f"{where} is not a JSON object (got {type(document).__name__})")
    if not isinstance(document.get("attributes", {}), dict):
        raise CorruptDataError(f"{where}: attributes must be a JSON object, got "
                               f"{type(document['attributes']).__name__}")
    return document


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _why_no_root(storage) -> str:
    """Why ``zarr.json`` could not be read: no such path, a file instead of a directory, or no ``zarr.json``."""
    try:
        kind = storage.fs.info(storage.root).get("type")
    except (FileNotFoundError, NotADirectoryError):
        return "no such path"
    except OSError:  # e.g. object stores that refuse listing: the plain fact is all we know
        kind = None
    return "it is a file, not a directory" if kind == "file" else f"it has no {ROOT_METADATA}"


def load_spec(storage) -> StoreSpec:
    """Read and check the root metadata; raise a clear error if ``storage`` holds no hsdata store."""
    return load_root(storage)[0]


def load_root(storage) -> tuple[StoreSpec, dict[str, Any]]:
    """The store's spec and provenance (empty if none is recorded), from one read of the root metadata."""
    try:
        document = read_document(storage, ROOT_METADATA)
    except (FileNotFoundError, NotADirectoryError):
        raise NotAStoreError(f"{storage.url} is not an hsdata store: {_why_no_root(storage)}") from None
    except IsADirectoryError:
        raise NotAStoreError(f"{storage.url} is not an hsdata store: {ROOT_METADATA} is a directory") from None
    attributes = document.get("attributes", {})
    if SPEC_ATTRIBUTE not in attributes:
        raise NotAStoreError(f"{storage.url} is not an hsdata store: its {ROOT_METADATA} has no "
                             f"attributes.{SPEC_ATTRIBUTE}")
    try:
        spec = StoreSpec.from_dict(attributes[SPEC_ATTRIBUTE])
    except UnsupportedFormatError as e:
        raise UnsupportedFormatError(f"{storage.describe(ROOT_METADATA)}: {e}") from None
    provenance = attributes.get(PROVENANCE_ATTRIBUTE, {})
    if not isinstance(provenance, dict):
        raise CorruptDataError(f"{storage.describe(ROOT_METADATA)}: attributes.{PROVENANCE_ATTRIBUTE} must be a "
                               f"JSON object, got {type(provenance).__name__}")
    return spec, provenance


def load_part_provenance(storage, parts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What writers that joined a store recorded in their parts (``hsdata_part.provenance``), by part; parts that
    recorded none are left out."""
    keys = [metadata_key(part_node(part)) for part in parts]
    found = {}
    for part, key, raw in zip(parts, keys, storage.read_many(keys, max_bytes=MAX_METADATA_BYTES)):
        info = parse_document(raw, storage.describe(key)).get("attributes", {}).get(PART_ATTRIBUTE, {})
        provenance = info.get("provenance") if isinstance(info, dict) else None
        if provenance is None:
            continue
        if not isinstance(provenance, dict):
            raise CorruptDataError(f"{storage.describe(key)}: attributes.{PART_ATTRIBUTE}.provenance must be a JSON "
                                   f"object, got {type(provenance).__name__}")
        found[part] = provenance
    return found


def check_provenance(provenance: Any) -> dict[str, Any]:
    """``provenance`` as it will be stored (tuples as lists): a dict with string keys at every level, JSON
    without NaN or infinities, at most ``MAX_PROVENANCE_BYTES`` as :func:`encode_json` writes it and at most
    ``MAX_PROVENANCE_DEPTH`` deep; else ``ValueError`` saying what is wrong."""
    if not isinstance(provenance, dict):
        raise ValueError(f"provenance must be a dict (a JSON object), got {type(provenance).__name__}")
    try:
        encoded = encode_json(provenance)
    except RecursionError:
        raise ValueError(f"provenance is nested deeper than {MAX_PROVENANCE_DEPTH} levels") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"provenance must be JSON-serializable: {e}") from None
    if len(encoded) > MAX_PROVENANCE_BYTES:
        raise ValueError(f"provenance is {len(encoded):,} bytes as JSON, more than the {MAX_PROVENANCE_BYTES:,} "
                         "allowed")
    stack = [provenance]  # no cycles: json.dumps refused them
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            bad = [key for key in value if not isinstance(key, str)]
            if bad:
                raise ValueError(f"provenance keys must be strings, got {bad[0]!r}")
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    stored = json.loads(encoded)
    if _depth(stored) > MAX_PROVENANCE_DEPTH:
        raise ValueError(f"provenance is nested deeper than {MAX_PROVENANCE_DEPTH} levels")
    return stored
