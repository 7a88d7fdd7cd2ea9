"""Compressed states decoded on the device their batch goes to (issue 28): blosc frames parsed into their zstd
streams (checked against blosc itself, on every configuration blosc writes, and refused when hostile), the
chunks crossing compressed, decoded, unshuffled and cut into each sample's rows there: bit-exact against the
host's decoding in every layout, truncated, with workers, fp8; on a GPU by nvCOMP, elsewhere by the CPU's zstd
(the same code but that call)."""

from __future__ import annotations

import ctypes
import itertools
import struct
from types import SimpleNamespace

import numcodecs
import numpy as np
import pytest
import torch
from crc32c import crc32c

import hsdata
from conftest import SMALL_LAYOUT, SPEC, make_sample
from hsdata.codecs import blosc
from hsdata.codecs.blosc import blosc_streams
from hsdata.codecs.compression import Compression
from hsdata.reader import EncodedRows
from hsdata.shard import ChunkRun
from hsdata.spec import TensorSpec
from hsdata.torch import Eagle3Dataset, Loader, ShardAwareSampler, decoding
from hsdata.torch import loader as loader_module

from test_compression import _rewrite_chunk
from test_loader import LAYOUTS, assert_equal

LENGTHS = [5 + (i * 37) % 140 for i in range(40)]
NVCOMP = decoding.nvcomp_available()
CUDA_AND_NVCOMP = torch.cuda.is_available() and NVCOMP


def _chunk(kind: str, nbytes: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    if kind == "states":  # bf16 bits of gaussian values of log-normal scales: compress as activations do
        values = g.standard_normal(nbytes // 2).astype(np.float32) * np.exp(g.standard_normal(nbytes // 2))
        return torch.from_numpy(values.astype(np.float32)).bfloat16().view(torch.uint8).numpy()
    if kind == "noise":  # incompressible: blosc stores raw streams or copies the frame
        return g.integers(0, 256, nbytes, dtype=np.uint8)
    return np.zeros(nbytes, np.uint8)


@pytest.mark.parametrize("typesize, blocksize, nbytes, kind, shuffle", [
    (ts, bs, n, kind, shuffle)
    for ts, bs, n, kind, shuffle in itertools.product(
        [1, 2, 4], [0, 1 << 16, 1 << 20], [64, 4096, 3 * 65536 + 8], ["states", "noise", "zeros"],
        ["shuffle", "noshuffle"])
])
def test_blosc_frames_decode_through_their_streams_as_blosc_decodes_them(typesize, blocksize, nbytes, kind, shuffle):
    """Every configuration blosc writes for zstd: copied frames (small, incompressible), raw streams, leftover
    blocks, typesizes 1 (fp8), 2 (bf16) and 4 (fp32). A run cut from the middle of three chunks."""
    tensor = TensorSpec("x", "uint8", {1: "uint8", 2: "bfloat16", 4: "float32"}[typesize], nbytes // typesize, 1,
                        Compression("zstd", 1, shuffle, blocksize))
    codec = tensor.compression.codec(typesize)
    chunks = [_chunk(kind, nbytes, seed) for seed in range(3)]
    frames = [codec.encode(c) for c in chunks]
    for frame, chunk in zip(frames, chunks):
        streams = blosc_streams(memoryview(frame), nbytes)
        assert streams.typesizes.tolist() == [typesize] and streams.lengths.sum() == nbytes
    skip = nbytes // 3
    run = ChunkRun(0, 0, tuple(len(f) + 4 for f in frames), skip, 2 * nbytes + nbytes // 2 - skip)
    data = torch.frombuffer(bytearray(b"".join(f + struct.pack("<I", crc32c(f)) for f in frames)), dtype=torch.uint8)
    states = decoding.EncodedStates.of_samples(data, [(0, EncodedRows(data, (run,), tensor))])
    want = np.concatenate(chunks)[skip : skip + run.nbytes]
    assert np.array_equal(decoding.decode(states, data).numpy(), want)


def test_frames_parsed_together_give_each_frame_s_streams():
    """Frames of every kind (copied, raw streams, split and not, block sizes apart) parsed in one call, placed
    anywhere in a buffer: each stream is the frame's own, moved to where the frame lies, in the frames' order."""
    nbytes, frames = 3 * 65536 + 8, []
    for typesize, blocksize, kind in itertools.product([1, 2, 4], [0, 1 << 16], ["states", "noise", "zeros"]):
        codec = Compression("zstd", 1, "shuffle", blocksize).codec(typesize)
        frames.append(codec.encode(_chunk(kind, nbytes, len(frames))))
    gaps = [7 * k for k in range(len(frames))]  # bytes before each frame
    data = b"".join(bytes(gap) + frame for gap, frame in zip(gaps, frames))
    sizes = np.array([len(f) for f in frames], np.int64)
    starts = np.cumsum(sizes + gaps) - sizes
    together = blosc_streams(data, nbytes, (starts, sizes))
    for k, (frame, start) in enumerate(zip(frames, starts.tolist())):
        alone, mine = blosc_streams(memoryview(frame), nbytes), together.frames == k
        for field in ("typesizes", "blocksizes", "shuffled"):
            assert getattr(together, field)[k] == getattr(alone, field)[0], (k, field)
        for field, shift in (("offsets", start), ("sizes", 0), ("targets", 0), ("lengths", 0)):
            assert np.array_equal(getattr(together, field)[mine], getattr(alone, field) + shift), (k, field)
    assert np.array_equal(together.frames, np.sort(together.frames))


@pytest.mark.parametrize("starts, sizes, frame, message", [
    ([0, 10**6], [100, 100], 1, "a frame of 100 bytes at 1000000 lies outside the"),
    ([-4, 0], [100, 100], 0, "a frame of 100 bytes at -4 lies outside the"),
    ([0, 0], [100, 8], 1, "8 bytes are too short for a blosc header"),
])
def test_frames_given_outside_the_buffer_or_too_short_are_refused_by_index(starts, sizes, frame, message):
    data = _frame()
    with pytest.raises(blosc.FrameError, match=message) as refused:
        blosc_streams(data, 1 << 18, (np.array(starts), np.array(sizes)))
    assert refused.value.frame == frame


def test_a_hostile_frame_among_many_is_named_by_its_sample_s_run_and_chunk():
    tensor = TensorSpec("aux_hidden_states", "uint16", "bfloat16", 1 << 16, 1, Compression("zstd", 1, "shuffle", 0))
    codec = tensor.compression.codec(2)
    chunks = [codec.encode(_chunk("states", 1 << 17, seed)) for seed in range(5)]
    chunks[3] = chunks[3][:3] + bytes([4]) + chunks[3][4:]  # shuffled in items of 4 bytes
    stored = [c + struct.pack("<I", crc32c(c)) for c in chunks]
    data = torch.frombuffer(bytearray(b"".join(stored)), dtype=torch.uint8)
    first = EncodedRows(data[: sum(map(len, stored[:2]))], (ChunkRun(0, 0, tuple(map(len, stored[:2])), 0, 9),), tensor)
    second = EncodedRows(data[len(first.data) :], (ChunkRun(1, 0, (len(stored[2]),), 0, 9),
                                                   ChunkRun(2, 500, tuple(map(len, stored[3:])), 0, 9)), tensor)
    with pytest.raises(hsdata.CorruptDataError, match="aux_hidden_states: chunk 0 of a run at byte 500 of shard 2: "
                                                     "shuffled in items of 4 bytes, the tensor's are 2"):
        decoding.EncodedStates.of_samples(data, [(0, first), (len(first.data), second)])


def _encoded_tensor(name: str, chunk_values: int, itemsize: int, seeds: range, prefix: int = 0):
    """A tensor's stored chunks (frames and their crc32c) after ``prefix`` bytes of padding, and its spec."""
    tensor = TensorSpec(name, f"uint{8 * itemsize}", {1: "uint8", 2: "bfloat16"}[itemsize], chunk_values, 1,
                        Compression("zstd", 1, "shuffle", 0))
    codec = tensor.compression.codec(itemsize)
    frames = [codec.encode(_chunk("states", chunk_values * itemsize, seed)) for seed in seeds]
    stored = bytes(prefix) + b"".join(f + struct.pack("<I", crc32c(f)) for f in frames)
    return tensor, stored, [len(f) + 4 for f in frames]


def test_tensors_parsed_together_are_parsed_as_each_alone():
    """One header parse for a batch's tensors (of other chunk and item sizes, at their own places in one block)
    gives each tensor's streams and runs as parsing it alone does, its offsets counted from its own bytes."""
    aux, aux_bytes, aux_sizes = _encoded_tensor("aux_hidden_states", 1 << 15, 2, range(4))
    last, last_bytes, last_sizes = _encoded_tensor("hidden_states", 1 << 16, 1, range(4, 7), prefix=24)
    block = torch.frombuffer(bytearray(aux_bytes + last_bytes), dtype=torch.uint8)
    aux_data, last_data = block[: len(aux_bytes)], block[len(aux_bytes) :]
    aux_samples = [(0, EncodedRows(aux_data, (ChunkRun(0, 0, tuple(aux_sizes[:3]), 100, 150_000),), aux)),
                   (sum(aux_sizes[:3]), EncodedRows(aux_data, (ChunkRun(1, 0, (aux_sizes[3],), 0, 9),), aux))]
    last_samples = [(24, EncodedRows(last_data, (ChunkRun(2, 0, tuple(last_sizes[:2]), 7, 70_000),
                                                 ChunkRun(3, 64, (last_sizes[2],), 0, 1000)), last))]
    together = decoding.EncodedStates.of_tensors(block, [(0, aux_samples), (len(aux_bytes), last_samples)])
    alone = [decoding.EncodedStates.of_samples(aux_data, aux_samples),
             decoding.EncodedStates.of_samples(last_data, last_samples)]
    for got, want in zip(together, alone):
        assert (got.chunk_nbytes, got.typesize) == (want.chunk_nbytes, want.typesize)
        for field in ("stream_offsets", "stream_sizes", "stream_targets", "stream_lengths", "blocksizes", "runs"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
    for states, data, (tensor, *_, chunks) in zip(together, (aux_data, last_data), (
            (aux, range(4)), (last, range(4, 7)))):
        decoded = decoding.decode(states, data).numpy()
        want = np.concatenate([_chunk("states", tensor.chunk_nbytes, seed) for seed in chunks])
        runs = [want[first : first + n] for first, n in states.runs.tolist()]
        assert np.array_equal(decoded, np.concatenate(runs))


def test_a_hostile_frame_parsed_with_other_tensors_is_named_by_its_own_tensor_and_chunk():
    aux, aux_bytes, aux_sizes = _encoded_tensor("aux_hidden_states", 1 << 15, 2, range(2))
    last, last_bytes, last_sizes = _encoded_tensor("hidden_states", 1 << 15, 2, range(2, 4))
    at = len(aux_bytes) + last_sizes[0]  # the second chunk of the second tensor: shuffled in items of 4 bytes
    block = torch.frombuffer(bytearray(aux_bytes + last_bytes), dtype=torch.uint8)
    block[at + 3] = 4
    aux_data, last_data = block[: len(aux_bytes)], block[len(aux_bytes) :]
    parts = [(0, [(0, EncodedRows(aux_data, (ChunkRun(0, 0, tuple(aux_sizes), 0, 9),), aux))]),
             (len(aux_bytes), [(0, EncodedRows(last_data, (ChunkRun(5, 800, tuple(last_sizes), 0, 9),), last))])]
    with pytest.raises(hsdata.CorruptDataError, match="^hidden_states: chunk 1 of a run at byte 800 of shard 5: "
                                                     "shuffled in items of 4 bytes, the tensor's are 2"):
        decoding.EncodedStates.of_tensors(block, parts)


def _frame() -> bytes:
    return numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE, 1 << 16).encode(_chunk("states", 1 << 18, 0)
                                                                             .view(np.uint16))


@pytest.mark.parametrize("change, message", [
    (lambda f: f[:10], "too short for a blosc header"),
    (lambda f: f[:-1], "the frame holds"),
    (lambda f: f[:2] + bytes([f[2] | 0x4]) + f[3:], "not a blosc1 frame with byte shuffle"),
    (lambda f: bytes([3]) + f[1:], "blosc frame version 3"),
    (lambda f: f[:2] + bytes([(f[2] & 0x1f) | 0x20]) + f[3:], "codec format 1, not zstd"),
    (lambda f: f[:16] + struct.pack("<i", len(f) + 5) + f[20:], "starts outside it"),
    (lambda f: f[:struct.unpack_from("<i", f, 16)[0]] + struct.pack("<i", 1 << 30)
     + f[struct.unpack_from("<i", f, 16)[0] + 4:], "runs past its end"),
])
def test_a_hostile_blosc_frame_is_refused_naming_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        blosc_streams(memoryview(change(_frame())), 1 << 18)


@pytest.fixture(scope="module")
def zstd_store(tmp_path_factory):
    samples = {f"s{i:03d}": make_sample(n, seed=i) for i, n in enumerate(LENGTHS)}
    samples["s007"]["aux_hidden_states"][:] = 0  # a chunk blosc copies or stores raw
    path = str(tmp_path_factory.mktemp("zstd") / "store")
    with hsdata.create(path, **SPEC, **SMALL_LAYOUT, compression=Compression("zstd", 1, "shuffle", 512)) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    return path


def _batches(path: str, options: dict, batch_size: int, **loader) -> list:
    dataset = Eagle3Dataset(path, max_length=100)
    return list(Loader(dataset, batch_size=batch_size, sampler=ShardAwareSampler(dataset, seed=2), **options, **loader))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bundle_bytes", [1, 60_000, None])
def test_batches_decoded_on_the_device_equal_the_host_s(zstd_store, layout, workers, bundle_bytes, monkeypatch):
    """The CPU stands in for the GPU (the CPU's zstd in place of nvCOMP's): the chunks cross compressed, into
    workers' shared memory too, and come out bit-exact in every layout, samples truncated by max_length,
    decoded a batch at a time, a few at a time, or all together."""
    if bundle_bytes is not None:
        monkeypatch.setattr(loader_module, "DEVICE_DECODE_BYTES", bundle_bytes)
    options, batch_size = LAYOUTS[layout]
    want = _batches(zstd_store, options, batch_size)
    got = _batches(zstd_store, options, batch_size, device="cpu", decode="device", num_workers=workers,
                   multiprocessing_context="fork" if workers else None)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_equal(g, w, f"batch {k}")


def test_an_fp8_store_compressed_is_decoded_then_dequantized_on_the_device(tmp_path):
    samples = {f"s{i}": make_sample(n, seed=i) for i, n in enumerate([40, 300, 7, 129])}
    path = str(tmp_path / "fp8")
    with hsdata.create(path, **SPEC, **SMALL_LAYOUT, dtype="float8_e4m3fn", compression="zstd") as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    want = _batches(path, {}, 3)
    got = _batches(path, {}, 3, device="cpu", decode="device")
    for g, w in zip(got, want):
        assert_equal(g, w)
    assert got[0]["hidden_states"].dtype == torch.bfloat16


def test_the_chunks_cross_compressed_and_their_crc32c_is_checked_on_the_host(zstd_store, tmp_path):
    dataset = Eagle3Dataset(zstd_store)
    loader = Loader(dataset, batch_size=4, device="cpu", decode="device")
    built = dataset.start_batch([0, 1, 2, 3], loader.layout, lambda n: torch.empty(n, dtype=torch.uint8), stored=True,
                                encoded=True).result()
    crossing = built.stored()
    assert set(crossing["encoded"]) == {"aux_hidden_states", "hidden_states"}
    encoded = crossing["tensors"]["aux_hidden_states:encoded"]
    runs = [r for j in range(4) for r in dataset.store.encoded_runs(j, "aux_hidden_states")]
    assert encoded.numel() == sum(r.file_end - r.file_start for r in runs)  # the chunks' bytes as stored
    assert "aux_hidden_states" not in crossing["tensors"] and "hidden_states" not in crossing["tensors"]
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(zstd_store, copy)
    _rewrite_chunk(hsdata.open(copy), "s003", "hidden_states", lambda b: b.__setitem__(slice(30, 34), bytes(4)),
                   fix_crc=False)
    with pytest.raises(hsdata.CorruptDataError, match=r"sample 's00[23]': .*hidden_states.*fails its crc32c"):
        list(Loader(Eagle3Dataset(copy), batch_size=4, device="cpu", decode="device"))


def test_decode_is_checked_and_says_why_a_store_cannot_be_decoded_on_a_device(zstd_store, tmp_path):
    dataset = Eagle3Dataset(zstd_store)
    with pytest.raises(ValueError, match="decode must be 'host' or 'device', got 'gpu'"):
        Loader(dataset, decode="gpu")
    with pytest.raises(ValueError, match="decode='device' needs a device"):
        Loader(dataset, decode="device")
    plain = str(tmp_path / "plain")
    with hsdata.create(plain, **SPEC, **SMALL_LAYOUT) as w:
        w.add("a", **make_sample(10, seed=0))
    with pytest.raises(ValueError, match="cannot be decoded on cpu: its hidden states are not compressed"):
        Loader(Eagle3Dataset(plain), device="cpu", decode="device")
    lz4 = str(tmp_path / "lz4")
    with hsdata.create(lz4, **SPEC, **SMALL_LAYOUT, compression="lz4") as w:
        w.add("a", **make_sample(10, seed=0))
    with pytest.raises(ValueError, match="only blosc zstd with byte shuffle or none decodes on a device"):
        Loader(Eagle3Dataset(lz4), device="cpu", decode="device")


@pytest.mark.skipif(not CUDA_AND_NVCOMP, reason="needs a CUDA GPU and nvCOMP")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("layout", ["one", "padded", "packed"])
@pytest.mark.parametrize("bundle_bytes", [60_000, None])
def test_nvcomp_decodes_on_the_gpu_what_the_host_decodes(zstd_store, layout, workers, bundle_bytes, monkeypatch):
    if bundle_bytes is not None:
        monkeypatch.setattr(loader_module, "DEVICE_DECODE_BYTES", bundle_bytes)
    options, batch_size = LAYOUTS[layout]
    want = _batches(zstd_store, options, batch_size)
    dataset = Eagle3Dataset(zstd_store, max_length=100)
    loader = Loader(dataset, batch_size=batch_size, sampler=ShardAwareSampler(dataset, seed=2), **options,
                    device="cuda", decode="device", num_workers=workers,
                    multiprocessing_context="fork" if workers else None)
    got = list(loader)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g["hidden_states"].is_cuda
        assert_equal(g, w, f"batch {k}")


@pytest.mark.skipif(not NVCOMP, reason="needs nvCOMP's library (hsdata[nvcomp-cu12] or [nvcomp-cu13])")
def test_nvcomp_s_c_api_answers_as_its_header_declares():
    """The ctypes declarations against the real library: its queries answer (no GPU needed), and a call with
    null buffers is refused with nvcompErrorInvalidValue (10) rather than crashing."""
    nvcomp = decoding.NvcompZstd()
    assert nvcomp.alignment >= 1
    temp = ctypes.c_size_t()
    assert nvcomp._temp_size(8, 1 << 20, decoding._Options(), ctypes.byref(temp), 8 << 20, None) == 0
    assert temp.value > 0
    assert nvcomp._decompress(None, None, None, None, 1, None, 0, None, decoding._Options(), None, None) == 10


def test_batches_are_bundled_until_they_hold_enough_decoded_bytes():
    def batch(*nbytes):
        return {"encoded": {f"t{k}": SimpleNamespace(nbytes=n) for k, n in enumerate(nbytes)}}

    batches = [batch(60, 10), batch(20), {"encoded": None}, batch(50, 50), batch(5)]
    bundles = list(loader_module._bundles(iter(batches), 80))
    assert [len(b) for b in bundles] == [2, 2, 1]
    assert [x for b in bundles for x in b] == batches
    assert list(loader_module._bundles(iter([]), 80)) == []


@pytest.mark.parametrize("copy, device", [
    (decoding._copy_each, "cpu"), (decoding._copy_by_length, "cpu"),  # the CPU's and the GPU's way, on the CPU
    pytest.param(decoding.copy_pieces, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU"))])
def test_pieces_are_copied_each_to_its_place(copy, device):
    """Many pieces of one length (a bundle's raw planes), lone lengths and empty pieces, in no order: each lands
    where it goes and nothing else of the output is written."""
    rng = np.random.default_rng(0)
    lengths = rng.permutation(np.array([512] * 40 + [300] * 3 + [77, 1, 0, 0, 4096], np.int64))
    targets = np.cumsum(lengths + 5) - lengths  # 5 bytes apart
    offsets = rng.integers(0, 20_000 - lengths)  # anywhere in the source, overlapping each other
    source = torch.from_numpy(rng.integers(0, 256, 20_000, dtype=np.uint8)).to(device)
    out = torch.full((int(targets[-1] + lengths[-1] + 5),), 7, dtype=torch.uint8, device=device)
    copy(source, offsets, out, targets, lengths)
    want, got = np.full(len(out), 7, np.uint8), source.cpu().numpy()
    for offset, target, length in zip(offsets, targets, lengths):
        want[target : target + length] = got[offset : offset + length]
    assert np.array_equal(out.cpu().numpy(), want)


@pytest.mark.parametrize("align", [1, 8, 16])
def test_frames_off_the_decoder_s_alignment_are_staged_on_it_and_their_output_copied_back(align):
    """nvCOMP asks that every buffer it reads and writes start on its alignment; a blosc frame's streams start
    anywhere. The staging runs here with the CPU's zstd in nvCOMP's place, which checks what it is given."""
    frames = [numcodecs.Zstd(1).encode(_chunk("states", n, seed)) for seed, n in enumerate([1000, 38, 4096, 10])]
    data = torch.frombuffer(bytearray(b"x" + b"".join(frames)), dtype=torch.uint8)
    sizes = np.array([len(f) for f in frames], np.int64)
    offsets = 1 + np.cumsum(sizes) - sizes
    lengths = np.array([1000, 38, 4096, 10], np.int64)
    targets = np.array([3, 1003, 1041, 5137], np.int64)
    out = torch.zeros(5147, dtype=torch.uint8)
    seen = []

    def batched(source, frames_at, decoded, spots):
        for buffer, (places, _) in ((source, frames_at), (decoded, spots)):
            assert buffer.data_ptr() % align == 0 and not (places % align).any()
        seen.append(source is data)
        decoding.cpu_zstd(source, frames_at, decoded, spots)

    decoding.on_alignment(data, (offsets, sizes), out, (targets, lengths), align, batched)
    want = np.zeros(5147, np.uint8)
    for seed, (target, length) in enumerate(zip(targets, lengths)):
        want[target : target + length] = _chunk("states", int(length), seed)
    assert np.array_equal(out.numpy(), want)
    assert seen == [align == 1]  # staged only when off the alignment


def test_reading_encoded_rows_checks_its_arguments(zstd_store, tmp_path):
    store = hsdata.open(zstd_store)
    n = int(store.lengths[3])
    with pytest.raises(ValueError, match=r"sample 's003': rows must be in \[1, \d+\], got 0"):
        store.encoded_runs(3, "hidden_states", 0)
    with pytest.raises(ValueError, match="encoded has 1 entries for 2 samples"):
        store.read_many([3, 4], encoded=[n])
    with pytest.raises(ValueError, match=r"out\['hidden_states'\] must be \d+ contiguous bytes"):
        store.read_many([3], out=[{"hidden_states": torch.empty(7, dtype=torch.uint8)}], encoded=[n])
    with pytest.raises(ValueError, match=r"encoded rows must be in \[1, \d+\], got " + str(n + 1)):
        store.read_many([3], encoded=[n + 1])
    plain = str(tmp_path / "plain")
    with hsdata.create(plain, **SPEC, **SMALL_LAYOUT) as w:
        w.add("a", **make_sample(10, seed=0))
    with pytest.raises(ValueError, match="hidden_states is not compressed"):
        hsdata.open(plain).encoded_runs(0, "hidden_states")
    runs = store.encoded_runs(3, "hidden_states")
    got = store.read_many([3], encoded=[n])[0]["hidden_states"]
    assert got.runs == runs and got.data.numel() == sum(r.file_end - r.file_start for r in runs)
