"""Shared helpers: random samples of a small spec and exact comparisons."""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hsdata

HIDDEN = 32
AUX = [1, 4, 6]
SPEC = dict(hidden_size=HIDDEN, aux_layers=AUX, model="test/tiny-llama")
SMALL_LAYOUT = dict(shard_tokens=256, chunk_tokens=16)  # many shards and chunks from few tokens


def make_sample(num_tokens: int, seed: int, hidden: int = HIDDEN, layers: int = len(AUX),
                dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 150_000, (num_tokens,), generator=g),
        "loss_mask": torch.randint(0, 2, (num_tokens,), generator=g),
        "aux_hidden_states": torch.randn(num_tokens, layers * hidden, generator=g).to(dtype),
        "hidden_states": torch.randn(num_tokens, hidden, generator=g).to(dtype),
    }


def assert_same(got: dict, want: dict) -> None:
    """Bit-exact equality of every tensor in ``want`` (floats compared by bit pattern, so NaN == NaN)."""
    for name, expected in want.items():
        actual = got[name]
        assert actual.shape == expected.shape, name
        if expected.is_floating_point():
            assert actual.dtype == expected.dtype, name
            bits = {2: torch.int16, 4: torch.int32}[expected.element_size()]
            assert torch.equal(actual.view(bits), expected.view(bits)), name
        else:
            assert torch.equal(actual.to(torch.int64), expected.to(torch.int64)), name
    assert got["input_ids"].dtype == torch.int64 if "input_ids" in got else True


def write_store(path, samples: dict[str, dict], **layout) -> None:
    with hsdata.create(str(path), **SPEC, **(layout or SMALL_LAYOUT)) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)


class RangeFilesHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a directory: listings as the standard handler does (fsspec's HTTP ``ls`` parses them), files
    through ``serve_file``, which subclasses write (usually with :func:`range_answer`)."""

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self):  # noqa: N802
        self._serve(head=True)

    def do_GET(self):  # noqa: N802
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            return super().do_HEAD() if head else super().do_GET()
        self.serve_file(path, head)

    def serve_file(self, path: str, head: bool) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def range_answer(path: str, range_header: str | None) -> tuple[int, dict[str, str], bytes]:
    """What a static file server answers to a GET of ``path`` with that Range header: status, headers, body."""
    data = open(path, "rb").read()
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header or "")
    if not match:
        return 200, {"Content-Length": str(len(data)), "Accept-Ranges": "bytes"}, data
    start = int(match.group(1))
    body = data[start : int(match.group(2)) + 1 if match.group(2) else len(data)]
    return 206, {"Content-Length": str(len(body)), "Accept-Ranges": "bytes",
                 "Content-Range": f"bytes {start}-{start + len(body) - 1}/{len(data)}"}, body


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def ragged_samples():
    rng = np.random.default_rng(0)
    lengths = [1, 2, 15, 16, 17, 255, 256, 257, 700] + rng.integers(1, 300, 40).tolist()
    return {f"sample-{i:06d}": make_sample(int(n), seed=i) for i, n in enumerate(lengths)}


@pytest.fixture
def small_filesystem(tmp_path):
    """A 3 MiB tmpfs (root only: skipped elsewhere); ``resize_filesystem`` changes its size."""
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip() or result.returncode}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def resize_filesystem(mount_point: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True)


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory) -> Path:
    """The README's first command: ``hsdata extract --out demo-store``."""
    path = tmp_path_factory.mktemp("docs") / "demo-store"
    subprocess.run([sys.executable, "-m", "hsdata", "extract", "--out", str(path)], check=True,
                   capture_output=True, timeout=300)
    return path
