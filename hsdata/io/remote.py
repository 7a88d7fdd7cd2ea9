"""Ranged GETs streamed straight into the caller's buffers: the remote counterpart of ``preadv``.

HTTP(S) and S3 responses are copied chunk by chunk as they arrive, so a range costs one copy into its
destination instead of a whole response object first. Other async filesystems go through fsspec's ``_cat_file``.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import CorruptDataError

S3_READ_BYTES = 1 << 20


async def read_range_into(fs, path: str, start: int, end: int, buffers: Sequence[memoryview], where: str) -> None:
    """Fill ``buffers`` (their sizes add up to ``end - start``) with bytes ``[start, end)`` of ``path``."""
    sink = _Sink(buffers, where)
    if type(fs).__module__ == "fsspec.implementations.http":  # its import needs aiohttp: test by name
        await _http(fs, path, start, end, sink)
    elif type(fs).__module__.split(".")[0] == "s3fs":
        await _s3(fs, path, start, end, sink)
    else:
        sink.write(await fs._cat_file(path, start=start, end=end))
    sink.finish()


async def _http(fs, url: str, start: int, end: int, sink: _Sink) -> None:
    options = fs.kwargs.copy()
    headers = {**options.pop("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **options) as response:
        fs._raise_not_found_for_status(response, url)
        if response.status != 206 and start > 0:
            raise CorruptDataError(f"{sink.where}: the server ignored the Range header (status {response.status})")
        async for data in response.content.iter_any():
            sink.write(data)


async def _s3(fs, path: str, start: int, end: int, sink: _Sink) -> None:
    bucket, key, version = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                 **({"VersionId": version} if version else {}))
    body = response["Body"]
    try:
        while data := await body.read(S3_READ_BYTES):
            sink.write(data)
    finally:
        body.close()


def fill(buffers: Sequence[memoryview], chunks, where: str) -> None:
    """Write ``chunks`` across ``buffers``, which they must fill exactly."""
    sink = _Sink(buffers, where)
    for data in chunks:
        sink.write(data)
    sink.finish()


class _Sink:
    """Writes a stream of chunks across a list of buffers, in order."""

    def __init__(self, buffers: Sequence[memoryview], where: str):
        self._buffers = [memoryview(b).cast("B") for b in buffers if len(b)]
        self.where = where
        self._wanted = sum(len(b) for b in self._buffers)
        self._filled = 0
        self._k, self._at = 0, 0  # current buffer, position in it

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        if self._filled + len(data) > self._wanted:
            raise CorruptDataError(f"{self.where}: the response is longer than the {self._wanted} bytes asked for")
        self._filled += len(data)
        while len(data):
            buffer = self._buffers[self._k]
            n = min(len(buffer) - self._at, len(data))
            buffer[self._at : self._at + n] = data[:n]
            data, self._at = data[n:], self._at + n
            if self._at == len(buffer):
                self._k, self._at = self._k + 1, 0

    def finish(self) -> None:
        if self._filled != self._wanted:
            raise CorruptDataError(f"{self.where}: got {self._filled} bytes, expected {self._wanted} (truncated?)")
