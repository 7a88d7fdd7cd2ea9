"""Every error hsdata raises is an :class:`HsdataError`; each also inherits the built-in it refines."""

from __future__ import annotations


class HsdataError(Exception):
    """Base class of all hsdata errors."""


class NotAStoreError(HsdataError, FileNotFoundError):
    """The path holds no hsdata store."""


class MissingExtraError(HsdataError, ImportError):
    """A URL needs an optional dependency that is not installed; the message names the ``pip install``."""


class UnsupportedFormatError(HsdataError, ValueError):
    """The store was written in a format version this hsdata cannot read."""


class SpecMismatchError(HsdataError, ValueError):
    """``hsdata.create`` was asked to join a store whose spec differs from the one given."""


class InvalidSampleError(HsdataError, ValueError):
    """A sample passed to ``Writer.add`` does not fit the store's spec."""


class DuplicateSampleError(InvalidSampleError):
    """A sample id was added twice (or is already committed in the store)."""


class CorruptDataError(HsdataError, OSError):
    """Bytes read from the store do not match their checksum, or a file is truncated or missing."""


class UnsafePathError(CorruptDataError):
    """A path in the store leads out of it (a symlink, ``..``) or is not a regular file (a FIFO, a device, a
    folder where a file belongs); hsdata refuses it before reading, writing or deleting anything there."""


class RemoteReadError(HsdataError, OSError):
    """A remote read kept failing transiently (5xx, timeouts, dropped connections) through every retry; the
    last failure is its ``__cause__``."""


class WriterError(HsdataError, RuntimeError):
    """The writer's background I/O failed or the writer is closed; nothing after the last commit is visible."""


class ServerCheckError(HsdataError, ValueError):
    """``hsdata extract --server``: the server cannot serve this extraction (unreachable, no hsdata hook,
    writing another store, aux hidden states off); raised before anything is written."""
