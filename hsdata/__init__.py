"""hsdata: chunked, checksummed, crash-safe hidden-state stores for speculative-decoding (EAGLE-3) training."""

from .codecs.compression import Compression
from .errors import (CorruptDataError, DuplicateSampleError, HsdataError, InvalidSampleError, MissingExtraError,
                     NotAStoreError, RemoteReadError, ServerCheckError, SpecMismatchError, UnsupportedFormatError,
                     WriterError)
from .reader import Store, open
from .repair import add_loss_masks, remove_loss_masks, remove_samples
from .spec import FORMAT_VERSION, StoreSpec, TensorSpec
from .writer import Writer, create

__version__ = "0.1.0"

__all__ = [
    "Compression", "CorruptDataError", "DuplicateSampleError", "FORMAT_VERSION", "HsdataError", "InvalidSampleError",
    "MissingExtraError", "NotAStoreError", "RemoteReadError", "ServerCheckError", "SpecMismatchError", "Store",
    "StoreSpec", "TensorSpec",
    "UnsupportedFormatError", "Writer", "WriterError", "add_loss_masks", "create", "open",
    "remove_loss_masks", "remove_samples",
]
