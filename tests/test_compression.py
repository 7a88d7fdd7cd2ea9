"""Compressed stores (format version 3): incompressible chunks, bit-exact reads, plain zarr and tensorstore,
validate, joining, hostile chunks and indexes, remote and DataLoader-worker reads."""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor, wait

import numcodecs.blosc
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr
from crc32c import crc32c

import hsdata
from hsdata.codecs.blosc import MEMCPYED, PROBE_BYTES, blosc_streams
from hsdata.codecs.compression import PRESETS, Compression
from hsdata.layout import shard_key
from hsdata.io.storage import Storage
from hsdata.shard import CompressedShardEncoder, chunks_per_shard, decode_index, index_nbytes
from hsdata.spec import StoreSpec
from hsdata.torch import Eagle3Dataset, decoding
from hsdata.validate import validate

from conftest import SMALL_LAYOUT, SPEC, assert_same, make_sample


def write(path, samples, compression="zstd", **layout):
    with hsdata.create(str(path), **SPEC, **(layout or SMALL_LAYOUT), compression=compression) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)


def disk_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def shard_file(store: hsdata.Store, sample_id: str, tensor: str) -> tuple[str, int]:
    part, offset, _ = store.location(store.index(sample_id))
    spec = store.spec
    shard = offset // spec.shard_tokens
    return os.path.join(store.url, shard_key(part, spec.tensor(tensor), shard)), shard


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_compressed_store_reads_back_bit_exact_and_is_smaller(tmp_path, ragged_samples, preset):
    write(tmp_path / "plain", ragged_samples, compression=None)
    write(tmp_path / "packed", ragged_samples, compression=preset)
    store = hsdata.open(str(tmp_path / "packed"))
    assert store.spec.format_version == 3 and store.spec.compression == PRESETS[preset]
    assert hsdata.open(str(tmp_path / "plain")).spec.format_version == 2  # uncompressed stays readable by v2
    for sample_id, sample in ragged_samples.items():
        assert_same(store.get(sample_id), sample)
    ids = list(ragged_samples)[::3]
    for got, sample_id in zip(store.read_many([store.index(i) for i in ids], ["hidden_states"]), ids):
        assert_same(got, {"hidden_states": ragged_samples[sample_id]["hidden_states"]})
    assert disk_bytes(tmp_path / "packed") < 0.9 * disk_bytes(tmp_path / "plain")
    report = validate(str(tmp_path / "packed"))
    assert report.ok and report.samples_checked == len(ragged_samples), report.problems


def joined(parts: list) -> bytes:
    """A frame written as buffers (``Compression.encoder``), as one bytes."""
    return b"".join(memoryview(part).cast("B").tobytes() for part in parts)


def states_bytes(nbytes: int, seed: int = 0) -> bytearray:
    """bf16 states-like values: normal, with a few large channels."""
    values = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(seed)) * 0.8
    values[::97] *= 30
    return bytearray(values.to(torch.bfloat16).view(torch.int16).numpy().tobytes())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_incompressible_chunk_is_stored_as_a_copied_frame(preset):
    chunk = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    frame = joined(PRESETS[preset].encoder(2)([chunk])[0])
    assert len(frame) == 16 + chunk.nbytes and frame[2] & MEMCPYED
    assert bytes(numcodecs.blosc.decompress(frame)) == chunk.tobytes()


@pytest.mark.parametrize("typesize, clevel, shuffle, blocksize, nbytes", [
    (2, 1, "shuffle", 1 << 20, 1 << 20),  # the preset: one block, cut into two byte planes
    (2, 1, "shuffle", 1 << 20, 3 * 1000),  # a chunk smaller than a block
    (2, 1, "shuffle", 4096, 4096 * 7 + 2 * 100),  # whole blocks cut into planes, a last one that is not
    (2, 5, "shuffle", 1001, 30_000),  # a block size that is not a multiple of the item size
    (2, 1, "shuffle", 3, 10),  # blocks of 4 bytes (two items), the last one shorter
    (2, 1, "shuffle", 1 << 20, (1 << 21) + (1 << 18)),  # 2.25 MiB (aux at H = 384): three blocks of 768 KiB
    (4, 9, "shuffle", 0, 4 * 5000),  # the whole chunk one block, four planes
    (8, 1, "shuffle", 0, 8 * 3000 + 5),  # eight planes, then the bytes past the last item: a last, shorter block
    (2, 1, "shuffle", 0, 2 * 5000 + 1),
    (2, 1, "shuffle", 128, 4096),  # blocks too small to cut (64 items < 128)
    (1, 1, "shuffle", 0, 50_000),  # one byte an item: nothing to shuffle (fp8)
    (2, 3, "noshuffle", 8192, 40_000),
    (20, 1, "shuffle", 0, 20 * 1000),  # more bytes an item than blosc cuts a block into
])
def test_hsdata_zstd_frames_decode_with_blosc_and_parse_as_zstd_streams(typesize, clevel, shuffle, blocksize, nbytes):
    """Frames of hsdata's own encoder are blosc1 frames: blosc decodes them, and so does the device path's decoder
    from their streams (``blosc_streams``; zstd streams, raw copies and unshuffling as on a GPU, here on the CPU)."""
    chunk = states_bytes(nbytes + nbytes % 2)[:nbytes]
    frame = joined(Compression("zstd", clevel, shuffle, blocksize).encoder(typesize)([chunk])[0])
    assert bytes(numcodecs.blosc.decompress(frame)) == bytes(chunk)
    streams = blosc_streams(frame, nbytes)
    states = decoding.EncodedStates(nbytes, typesize, streams.offsets, streams.sizes, streams.targets, streams.lengths,
                                    np.where(streams.shuffled, streams.blocksizes, 0), np.array([[0, nbytes]]))
    decoded = decoding.decode(states, torch.frombuffer(bytearray(frame), dtype=torch.uint8))
    assert decoded.numpy().tobytes() == bytes(chunk)


def test_states_frames_hold_byte_planes_and_are_smaller_than_blosc_own():
    """The preset cuts bf16 states into their two byte planes: the low one (mantissa bits) does not compress and
    is stored raw, the high one (sign and exponent) is one zstd frame; the frame is smaller than c-blosc's own at
    the same level."""
    chunk = states_bytes(1 << 20)
    frame = joined(PRESETS["zstd"].encoder(2)([chunk])[0])
    streams = blosc_streams(frame, len(chunk))
    assert list(streams.lengths) == [1 << 19, 1 << 19]
    assert streams.sizes[0] == 1 << 19 and streams.sizes[1] < 0.5 * (1 << 19)
    assert len(frame) < len(PRESETS["zstd"].codec(2).encode(chunk))
    # 2.25 MiB (aux at H = 384): three blocks of 768 KiB rather than 1 + 1 + 0.25 MiB, the last one not cut
    streams = blosc_streams(joined(PRESETS["zstd"].encoder(2)([states_bytes(9 << 18)])[0]), 9 << 18)
    assert streams.blocksizes[0] == 3 << 18 and list(streams.lengths) == [3 << 17] * 6


def test_a_stream_whose_head_does_not_compress_is_stored_raw():
    """The encoder tries a stream's first ``PROBE_BYTES`` before the rest: one that starts incompressible is
    stored raw even when its rest would compress; one that starts compressible is compressed."""
    noise = np.random.default_rng(1).integers(0, 256, 2 * PROBE_BYTES, dtype=np.uint8).tobytes()
    chunk = noise + bytes(6 * PROBE_BYTES) + bytes(6 * PROBE_BYTES) + noise  # two blocks
    frame = joined(Compression("zstd", 1, "noshuffle", 8 * PROBE_BYTES).encoder(1)([bytearray(chunk)])[0])
    streams = blosc_streams(frame, len(chunk))
    assert list(streams.lengths) == [8 * PROBE_BYTES] * 2
    assert streams.sizes[0] == 8 * PROBE_BYTES and streams.sizes[1] < 3 * PROBE_BYTES
    assert bytes(numcodecs.blosc.decompress(frame)) == chunk


def test_each_byte_plane_is_probed_and_kept_on_its_own():
    """All of a chunk's streams are probed in one call and compressed in another: each plane of each block still
    gets its own verdict, in its place (4-byte items: planes 0 and 2 noise, 1 and 3 constant; two blocks, the second
    with its noise and constant planes swapped)."""
    items, rng = 4 * PROBE_BYTES, np.random.default_rng(2)
    blocks = []
    for noisy in ((0, 2), (1, 3)):
        planes = np.zeros((4, items), np.uint8)
        planes[list(noisy)] = rng.integers(0, 256, (2, items), dtype=np.uint8)
        blocks.append(planes.T.reshape(-1))
    chunk = np.concatenate(blocks).tobytes()
    frame = joined(Compression("zstd", 1, "shuffle", 4 * items).encoder(4)([bytearray(chunk)])[0])
    streams = blosc_streams(frame, len(chunk))
    assert list(streams.lengths) == [items] * 8
    raw = [int(size) == items for size in streams.sizes]
    assert raw == [True, False, True, False, False, True, False, True]
    assert bytes(numcodecs.blosc.decompress(frame)) == chunk


def test_rows_given_to_a_compressed_shard_are_not_read_once_their_compressions_are_done(tmp_path):
    """Whole chunks are compressed straight from the caller's rows; incompressible ones become copied frames, which
    would lie in those rows: the writer's buffers are reused as soon as the compressions ``write`` returns are
    done (rows gathered into the encoder's own buffer at once), so the shard must hold what the rows held then."""
    spec = StoreSpec.new(64, [1], compression="zstd", shard_tokens=64, chunk_tokens=8)
    tensor = spec.tensor("hidden_states")
    rows = bytearray(np.random.default_rng(2).integers(0, 256, 35 * tensor.row_nbytes, dtype=np.uint8).tobytes())
    given = bytes(rows)
    with ThreadPoolExecutor(2) as pool:
        out = Storage(str(tmp_path)).open_writer("shard")
        encoder = CompressedShardEncoder(out, spec, tensor, pool, in_flight=2)
        reading = encoder.write(memoryview(rows)[: 20 * tensor.row_nbytes])  # two whole chunks, four rows gathered
        assert len(reading) == 1  # the two whole chunks are one task
        wait(reading)
        rows[: 20 * tensor.row_nbytes] = bytes(20 * tensor.row_nbytes)
        reading = encoder.write(memoryview(rows)[20 * tensor.row_nbytes :])  # 4 rows gathered, a chunk, 3 gathered
        assert len(reading) == 1
        wait(reading)
        rows[:] = bytes(len(rows))
        encoder.finish()
        out.commit()
    data = (tmp_path / "shard").read_bytes()
    chunks = chunks_per_shard(spec, tensor)
    index = decode_index(data[-index_nbytes(chunks):], chunks, where="shard")
    decoded = b"".join(bytes(numcodecs.blosc.decompress(data[offset : offset + size - 4]))
                       for offset, size in index[:5].tolist())
    assert index[5:].tolist() == [[2**64 - 1] * 2] * 3
    assert decoded == given + bytes(5 * 8 * tensor.row_nbytes - len(given))


def test_positional_and_sequential_writes_make_the_same_shard(tmp_path):
    """Locally the compress threads write their chunks side by side at the offsets their predecessors' ends give;
    a remote file takes them one after another. Both make the same bytes, whatever order the chunks finish in
    (chunks of very different sizes: zeros compress fast and small, noise is stored raw)."""
    spec = StoreSpec.new(64, [1], compression="zstd", shard_tokens=256, chunk_tokens=8)
    tensor = spec.tensor("hidden_states")
    rng = np.random.default_rng(4)
    rows = bytearray()
    for k in range(31):  # 31 chunks of 32, the last partial one padded; the index marks one chunk missing
        kind = k % 3
        rows += (bytes(tensor.chunk_nbytes) if kind == 0 else states_bytes(tensor.chunk_nbytes, k) if kind == 1
                 else rng.integers(0, 256, tensor.chunk_nbytes, dtype=np.uint8).tobytes())
    rows = rows[: -tensor.row_nbytes * 3]
    shards = []
    for url in (str(tmp_path), "memory://positional-vs-sequential"):
        out = Storage(url).open_writer("shard")
        assert out.positional == (url == str(tmp_path))
        with ThreadPoolExecutor(4) as pool:
            encoder = CompressedShardEncoder(out, spec, tensor, pool, in_flight=8)
            for start in range(0, len(rows), 5 * tensor.row_nbytes):  # whole chunks straight from the rows, and gathered
                encoder.write(memoryview(rows)[start : start + 5 * tensor.row_nbytes])
            encoder.finish()
        out.commit()
        shards.append(Storage(url).read_bytes("shard"))
    assert shards[0] == shards[1]
    chunks = chunks_per_shard(spec, tensor)
    index = decode_index(shards[0][-index_nbytes(chunks):], chunks, where="shard")
    decoded = b"".join(bytes(numcodecs.blosc.decompress(shards[0][offset : offset + size - 4]))
                       for offset, size in index[:31].tolist())
    assert decoded == bytes(rows) + bytes(31 * tensor.chunk_nbytes - len(rows))


@pytest.mark.parametrize("remote", [False, True])
def test_a_chunk_that_fails_to_compress_fails_its_shard_and_no_chunk_after_it_is_placed(tmp_path, remote):
    """Chunks are placed in order by whichever thread completes the run: one that fails stops the run there (the
    chunks after it are compressed but never placed nor written), its error reaches the caller, and the shard,
    never finished, is not committed."""
    spec = StoreSpec.new(64, [1], compression="zstd", shard_tokens=256, chunk_tokens=8)
    tensor = spec.tensor("hidden_states")
    rows = b"".join(states_bytes(tensor.chunk_nbytes, seed) for seed in range(20))
    bad = rows[5 * tensor.chunk_nbytes : 6 * tensor.chunk_nbytes]
    storage = Storage(f"memory://failing-chunk-{tmp_path.name}" if remote else str(tmp_path))
    out = storage.open_writer("shard")
    with ThreadPoolExecutor(4) as pool:
        encoder = CompressedShardEncoder(out, spec, tensor, pool, in_flight=8)
        encode = encoder._frame

        def failing(chunks):
            if any(bytes(chunk) == bad for chunk in chunks):
                raise MemoryError("zstd: out of memory")
            return encode(chunks)

        encoder._frame = failing
        with pytest.raises(MemoryError, match="out of memory"):
            for start in range(0, len(rows), 3 * tensor.row_nbytes):
                wait(encoder.write(memoryview(rows)[start : start + 3 * tensor.row_nbytes]))
            encoder.finish()
    assert len(encoder._sizes) == 5  # the pool has run every chunk handed to it
    if remote:  # memory:// shows a file as it is written: the five frames placed, in order, and nothing else
        frames = [joined(frame) for frame in encode([rows[k * tensor.chunk_nbytes : (k + 1) * tensor.chunk_nbytes]
                                                     for k in range(5)])]
        assert out._file.getvalue() == b"".join(frame + struct.pack("<I", crc32c(frame)) for frame in frames)
    out.abort()
    assert remote or not storage.exists("shard")


def test_one_encoder_shared_by_threads_writes_what_it_writes_alone():
    encode = PRESETS["zstd"].encoder(2)
    chunks = [states_bytes(1 << 18, seed) for seed in range(24)]
    alone = [joined(encode([chunk])[0]) for chunk in chunks]
    with ThreadPoolExecutor(4) as pool:
        assert [joined(parts[0]) for parts in pool.map(encode, [[chunk] for chunk in chunks])] == alone
    assert [joined(parts) for parts in encode(chunks)] == alone  # chunks encoded together: the same frames


def test_ranges_cut_at_chunk_boundaries_read_back_exact(tmp_path, ragged_samples):
    """A small ``range_bytes`` splits a sample's chunks over many reads, locally on the I/O threads."""
    write(tmp_path / "s", ragged_samples)
    store = hsdata.open(str(tmp_path / "s"), range_bytes=1, concurrency=3)
    for sample_id, sample in ragged_samples.items():
        assert_same(store.get(sample_id), sample)


def test_plain_zarr_and_tensorstore_read_compressed_arrays(tmp_path, ragged_samples):
    write(tmp_path / "s", ragged_samples)
    store = hsdata.open(str(tmp_path / "s"))
    part = store.location(0)[0]
    path = f"{store.url}/parts/{part}/aux_hidden_states"
    document = json.load(open(f"{path}/zarr.json"))
    inner = document["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "blosc", "crc32c"]
    assert inner[1]["configuration"] == {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20,
                                         "typesize": 2}
    by_zarr = zarr.open_array(path, mode="r")[:]
    by_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result().read().result()
    np.testing.assert_array_equal(by_zarr, by_ts)
    for i in range(len(store)):
        _, offset, length = store.location(i)
        want = ragged_samples[store.sample_ids[i]]["aux_hidden_states"].view(torch.uint16).numpy()
        np.testing.assert_array_equal(by_zarr[offset : offset + length], want)


def test_a_joining_writer_takes_the_store_compression_and_a_different_one_is_refused(tmp_path):
    samples = {f"a{i}": make_sample(40 + i, seed=i) for i in range(5)}
    write(tmp_path / "s", samples)
    more = {f"b{i}": make_sample(30 + i, seed=100 + i) for i in range(3)}
    with hsdata.create(str(tmp_path / "s"), **SPEC) as w:  # compression None: the store's
        for sample_id, sample in more.items():
            w.add(sample_id, **sample)
    store = hsdata.open(str(tmp_path / "s"))
    assert len(store) == 8 and validate(str(tmp_path / "s")).ok
    for sample_id, sample in {**samples, **more}.items():
        assert_same(store.get(sample_id), sample)
    with pytest.raises(hsdata.SpecMismatchError, match="compression: store has blosc zstd level 1.*requested none"):
        hsdata.create(str(tmp_path / "s"), **SPEC, compression="none")
    write(tmp_path / "plain", samples, compression=None)
    with pytest.raises(hsdata.SpecMismatchError, match="compression: store has none, requested blosc lz4"):
        hsdata.create(str(tmp_path / "plain"), **SPEC, compression="lz4")


@pytest.mark.parametrize("value, message", [
    ("gzip", "compression must be None, 'none', 'zstd', 'lz4' or a hsdata.Compression, got 'gzip'"),
    (Compression("zstd", 1, "shuffle", 0), None),
])
def test_compression_option_is_checked(tmp_path, value, message):
    if message is None:
        hsdata.create(str(tmp_path / "s"), **SPEC, compression=value).close()
        assert hsdata.open(str(tmp_path / "s")).spec.compression == value
        return
    with pytest.raises(ValueError, match=message):
        hsdata.create(str(tmp_path / "s"), **SPEC, compression=value)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("config, message", [
    ({"cname": "evil", "clevel": 1, "shuffle": "shuffle", "blocksize": 0}, "cname must be one of"),
    ({"cname": "zstd", "clevel": 99, "shuffle": "shuffle", "blocksize": 0}, r"clevel must be an integer in \[1, 9\]"),
    ({"cname": "zstd", "clevel": 1, "shuffle": "shuffle"}, "must have exactly the keys"),
])
def test_a_hostile_compression_record_is_refused(tmp_path, config, message):
    write(tmp_path / "s", {"a": make_sample(10, seed=0)})
    root = json.loads((tmp_path / "s" / "zarr.json").read_text())
    root["attributes"]["hsdata"]["compression"]["configuration"] = config
    (tmp_path / "s" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(hsdata.UnsupportedFormatError, match=message):
        hsdata.open(str(tmp_path / "s"))


def _shard(store: hsdata.Store, sample_id: str, tensor: str) -> tuple[str, int, np.ndarray]:
    """The path of the (first) shard holding a sample's rows of ``tensor``, its chunk count and its index."""
    path, _ = shard_file(store, sample_id, tensor)
    per_shard = chunks_per_shard(store.spec, store.spec.tensor(tensor))
    index = decode_index(open(path, "rb").read()[-index_nbytes(per_shard) :], per_shard, where=path)
    return path, per_shard, index.copy()


def _rewrite_chunk(store: hsdata.Store, sample_id: str, tensor: str, change, *, fix_crc: bool) -> None:
    """Apply ``change`` to the compressed bytes of the first chunk holding the sample (its crc32c recomputed if
    ``fix_crc``)."""
    path, _, index = _shard(store, sample_id, tensor)
    _, offset, _ = store.location(store.index(sample_id))
    chunk = offset % store.spec.shard_tokens // store.spec.tensor(tensor).chunk_tokens
    data = bytearray(open(path, "rb").read())
    start, size = int(index[chunk, 0]), int(index[chunk, 1])
    payload = bytearray(data[start : start + size - 4])
    change(payload)
    trailer = struct.pack("<I", crc32c(bytes(payload))) if fix_crc else data[start + size - 4 : start + size]
    data[start : start + size] = payload + trailer
    open(path, "wb").write(bytes(data))


def test_a_corrupt_compressed_chunk_is_refused_by_reads_and_reported_by_validate(tmp_path):
    samples = {f"s{i}": make_sample(100, seed=i) for i in range(6)}
    write(tmp_path / "s", samples)
    store = hsdata.open(str(tmp_path / "s"))
    _rewrite_chunk(store, "s0", "aux_hidden_states", lambda b: b.__setitem__(slice(40, 48), bytes(8)), fix_crc=False)
    with pytest.raises(hsdata.CorruptDataError, match=r"sample 's0': .*aux_hidden_states/c/0/0.*chunk 0 of the "
                                                      r"range fails its crc32c"):
        hsdata.open(str(tmp_path / "s")).get("s0")
    assert_same(hsdata.open(str(tmp_path / "s")).get("s5"), samples["s5"])  # other shards are fine
    report = validate(str(tmp_path / "s"))
    assert not report.ok
    assert [(p.kind, p.tensor, list(p.samples)) for p in report.problems] == [("checksum", "aux_hidden_states",
                                                                                ["s0"])]
    assert "crc32c mismatch in chunk" in report.problems[0].message


def test_a_chunk_whose_blosc_header_lies_is_refused_before_it_is_decoded(tmp_path):
    """A crafted chunk (crc32c recomputed) that claims to decompress to more than a chunk holds."""
    samples = {f"s{i}": make_sample(100, seed=i) for i in range(3)}
    write(tmp_path / "s", samples)
    store = hsdata.open(str(tmp_path / "s"))
    _rewrite_chunk(store, "s0", "hidden_states", lambda b: b.__setitem__(slice(4, 8), struct.pack("<I", 1 << 30)),
                   fix_crc=True)
    with pytest.raises(hsdata.CorruptDataError, match="decompresses to 1073741824 bytes, expected"):
        hsdata.open(str(tmp_path / "s")).get("s0")
    report = validate(str(tmp_path / "s"))
    assert [(p.kind, p.tensor, list(p.samples)) for p in report.problems] == [("checksum", "hidden_states", ["s0"])]
    assert "does not decompress: its blosc header says it decompresses to 1073741824" in report.problems[0].message


def test_an_index_that_is_not_packed_or_a_truncated_shard_is_refused(tmp_path):
    samples = {f"s{i}": make_sample(100, seed=i) for i in range(3)}
    write(tmp_path / "s", samples)
    store = hsdata.open(str(tmp_path / "s"))
    path, per_shard, index = _shard(store, "s1", "hidden_states")
    data = open(path, "rb").read()
    index[0, 0] = 1  # a valid crc32c, the first chunk misplaced
    raw = index.astype("<u8").tobytes()
    open(path, "wb").write(data[: -index_nbytes(per_shard)] + raw + struct.pack("<I", crc32c(raw)))
    with pytest.raises(hsdata.CorruptDataError, match="shard index: its chunks do not lie back to back from byte 0"):
        hsdata.open(str(tmp_path / "s")).get("s1")
    report = validate(str(tmp_path / "s"))
    assert ("index", "hidden_states") in {(p.kind, p.tensor) for p in report.problems}
    open(path, "wb").write(data[:-10])  # truncated: the index's crc32c fails
    with pytest.raises(hsdata.CorruptDataError, match="shard index"):
        hsdata.open(str(tmp_path / "s")).get("s1")
    report = validate(str(tmp_path / "s"))
    kinds = {(p.kind, p.tensor) for p in report.problems}
    assert ("index", "hidden_states") in kinds and ("unreadable", "hidden_states") in kinds
    unreadable = [p for p in report.problems if p.kind == "unreadable"]
    assert unreadable[0].samples and set(unreadable[0].samples) <= set(samples)


def test_dataloader_workers_read_a_compressed_store(tmp_path, ragged_samples):
    write(tmp_path / "s", ragged_samples)
    dataset = Eagle3Dataset(str(tmp_path / "s"))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    seen = {}
    for item in loader:
        seen[item["sample_id"]] = item
    assert set(seen) == set(ragged_samples)
    for sample_id, sample in ragged_samples.items():
        assert_same(seen[sample_id], {k: v for k, v in sample.items() if k.endswith("hidden_states")})


def test_cli_extract_writes_a_compressed_store_and_info_says_so(tmp_path, capsys):
    from hsdata.cli import main

    out = tmp_path / "demo"
    assert main(["extract", "--out", str(out), "--compression", "zstd"]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "(format v3)" in shown and "compressed  blosc zstd level 1, shuffle" in shown
    assert main(["validate", str(out)]) == 0
