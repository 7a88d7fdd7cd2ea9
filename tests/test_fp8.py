"""fp8 stores (format version 4): rows of fp8 values and a float32 scale per token and layer, checked against an
independent numpy/ml_dtypes implementation of docs/format.md section 3b; read back as bfloat16 everywhere."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import hsdata
from hsdata.codecs import quantize
from hsdata.cli import main
from hsdata.spec import StoreSpec
from hsdata.torch import Eagle3Dataset, Loader, collate_eagle3
from hsdata.validate import validate

from conftest import AUX, HIDDEN, SMALL_LAYOUT, SPEC, assert_same, make_sample
from test_hostile_audit import set_values

K, H = len(AUX), HIDDEN
FP8 = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0), "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def reference_rows(states: torch.Tensor, layers: int, dtype: str) -> np.ndarray:
    """Section 3b's rows, in numpy: scale = max|x| / M (1 where 0), x / scale clamped, rounded to nearest even."""
    fp8, top = FP8[dtype]
    x = states.float().numpy().reshape(len(states), layers, H)
    scale = (np.abs(x).max(axis=2, keepdims=True) / np.float32(top)).astype(np.float32)
    scale[scale == 0] = 1
    values = np.clip(x / scale, -top, top).astype(fp8)
    rows = np.concatenate([values.view(np.uint8), scale.view(np.uint8)], axis=2)
    return rows.reshape(len(states), layers * (H + 4))


def reference_states(rows: np.ndarray, layers: int, dtype: str) -> torch.Tensor:
    """Section 3b's two lines, then bfloat16."""
    r = rows.reshape(len(rows), layers, H + 4)
    x = r[..., :H].view(FP8[dtype][0]).astype(np.float32) * r[..., H:].copy().view("<f4")
    bits = x.reshape(len(rows), layers * H).astype(ml_dtypes.bfloat16).view(np.uint16)
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


def write_fp8(path, samples, dtype="float8_e4m3fn", **options):
    with hsdata.create(str(path), **SPEC, dtype=dtype, **{**SMALL_LAYOUT, **options}) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    return str(path)


@pytest.fixture
def samples():
    made = {f"s{i}": make_sample(20 + 9 * i, seed=i) for i in range(6)}
    made["s2"]["aux_hidden_states"][5] = 0  # an all-zero token in every aux layer
    made["s3"]["hidden_states"][:, :] *= 1e4  # a layer far from the others' magnitude
    return made


@pytest.mark.parametrize("dtype", list(FP8))
def test_numpy_dequantization_is_torch_s_bit_for_bit(dtype):
    """What ``hsdata show`` uses (no torch) against the readers' dequantization: every fp8 byte, scales of every
    magnitude (subnormal results included), zero tokens."""
    rng = np.random.default_rng(3)
    layers, hidden, tokens = 2, 256, 64
    rows = np.empty((tokens, layers, hidden + 4), np.uint8)
    rows[:, :, :hidden] = np.arange(tokens * layers * hidden).reshape(tokens, layers, hidden) % 256
    if dtype == "float8_e4m3fn":  # its NaN patterns, which validate refuses
        rows[:, :, :hidden][(rows[:, :, :hidden] & 0x7F) == 0x7F] = 0
    scales = (2.0 ** rng.uniform(-140, 100, (tokens, layers, 1))).astype(np.float32)
    scales[0] = 1.0
    rows[:, :, hidden:] = scales.view(np.uint8)
    rows = rows.reshape(tokens, -1)
    expected = quantize.dequantize(torch.from_numpy(rows), layers, hidden, dtype).view(torch.int16).numpy()
    assert np.array_equal(quantize.dequantize_bits(rows, layers, hidden, dtype), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", list(FP8))
def test_rows_are_the_specs_bit_for_bit_and_read_back_as_bfloat16(tmp_path, samples, dtype):
    path = write_fp8(tmp_path / "s", samples, dtype)
    store, raw = hsdata.open(path), hsdata.open(path, dequantize=False)
    assert store.spec.format_version == 4 and store.spec.dtype == dtype
    for i in range(len(store)):
        sample_id = store.sample_ids[i]
        want = samples[sample_id]
        for name, layers in (("aux_hidden_states", K), ("hidden_states", 1)):
            rows = reference_rows(want[name], layers, dtype)
            got = raw[i]
            stored = np.concatenate([got[name].view(torch.uint8).reshape(-1, layers, H).numpy(),
                                     got[f"{name}_scale"].reshape(-1, layers, 1).numpy().view(np.uint8)], axis=2)
            assert np.array_equal(stored.reshape(rows.shape), rows), (sample_id, name)
            assert_same({name: store[i][name]}, {name: reference_states(rows, layers, dtype)})
        assert_same(store[i], {k: want[k] for k in ("input_ids", "loss_mask")})
    zeros = store.get("s2")["aux_hidden_states"][5]
    assert not zeros.any() and torch.equal(raw.get("s2")["aux_hidden_states_scale"][5], torch.ones(K))


def test_the_error_is_what_fp8_costs_and_the_size_about_half(tmp_path, samples):
    bf16 = tmp_path / "bf16"
    with hsdata.create(str(bf16), **SPEC, **SMALL_LAYOUT) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    fp8 = hsdata.open(write_fp8(tmp_path / "fp8", samples))
    assert fp8.spec.token_nbytes == (K + 1) * (H + 4) + 5  # ids 4 + mask 1 bytes
    assert hsdata.open(str(bf16)).spec.token_nbytes == (K + 1) * H * 2 + 5
    at_4096 = [StoreSpec.new(4096, AUX, dtype=d).token_nbytes for d in ("float8_e4m3fn", "bfloat16")]
    assert at_4096[0] / at_4096[1] <= 0.501
    for sample_id, sample in samples.items():
        got, want = fp8.get(sample_id)["aux_hidden_states"].float(), sample["aux_hidden_states"].float()
        relative = (got - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)
        assert relative.max() < 0.04  # e4m3: 3 mantissa bits, per-token scale


def test_states_in_every_compute_dtype_and_from_numpy_quantize_alike(tmp_path):
    sample = make_sample(40, seed=7, dtype=torch.float32)
    for compute in ("float32", "float16", "bfloat16"):
        given = {**sample, "aux_hidden_states": sample["aux_hidden_states"].to(getattr(torch, compute)),
                 "hidden_states": sample["hidden_states"].to(getattr(torch, compute))}
        path = str(tmp_path / compute)
        with hsdata.create(path, **SPEC, dtype="float8_e4m3fn", compute_dtype=compute) as w:
            w.add("t", **given)
            as_numpy = {**given, "aux_hidden_states": given["aux_hidden_states"].float().numpy().astype(
                ml_dtypes.bfloat16 if compute == "bfloat16" else compute)}
            w.add("n", **as_numpy)
        store = hsdata.open(path, dequantize=False)
        rows = reference_rows(given["aux_hidden_states"], K, "float8_e4m3fn")
        assert torch.equal(store.get("t")["aux_hidden_states"].view(torch.uint8),
                           torch.from_numpy(rows.reshape(40, K, H + 4)[..., :H].reshape(40, K * H).copy()))
        assert torch.equal(store.get("n")["aux_hidden_states_scale"], store.get("t")["aux_hidden_states_scale"])
        assert hsdata.open(path).spec.compute_dtype == compute


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_sample_holding_nan_or_inf_is_refused_naming_it_the_tensor_and_the_token(tmp_path, bad):
    sample = make_sample(30, seed=1)
    sample["hidden_states"][17, 3] = bad
    with hsdata.create(str(tmp_path / "s"), **SPEC, dtype="float8_e4m3fn") as w:
        with pytest.raises(hsdata.InvalidSampleError, match=r"sample 'bad': hidden_states holds NaN or Inf "
                                                             r"\(first at token 17\)"):
            w.add("bad", **sample)
        w.add("good", **make_sample(5, seed=2))
    assert hsdata.open(str(tmp_path / "s")).sample_ids[:] == ["good"]


def test_wrong_dtypes_and_versions_are_refused(tmp_path):
    with hsdata.create(str(tmp_path / "s"), **SPEC, dtype="float8_e4m3fn") as w:
        with pytest.raises(hsdata.InvalidSampleError, match="aux_hidden_states is float32, this store takes bfloat16"):
            w.add("x", **make_sample(4, seed=0, dtype=torch.float32))
    with pytest.raises(ValueError, match="dtype must be one of"):
        hsdata.create(str(tmp_path / "t"), **SPEC, dtype="float8_e4m3fnuz")
    root = json.load(open(tmp_path / "s" / "zarr.json"))
    root["attributes"]["hsdata"]["dtype"] = "bfloat16"  # a version 4 root with another dtype
    json.dump(root, open(tmp_path / "s" / "zarr.json", "w"))
    with pytest.raises(hsdata.UnsupportedFormatError, match="dtype bfloat16 in a version 4 store"):
        hsdata.open(str(tmp_path / "s"))


def test_plain_zarr_and_tensorstore_read_the_rows_and_formats_two_lines_dequantize_them(tmp_path, samples):
    path = write_fp8(tmp_path / "s", samples)
    store = hsdata.open(path)
    part, offset, n = store.location(store.index("s4"))
    aux = zarr.open_group(path, mode="r")[f"parts/{part}/aux_hidden_states"][offset:offset + n]
    final = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/parts/{part}/hidden_states"}}
                    ).result()[offset:offset + n].read().result()
    assert aux.dtype == np.uint8 and aux.shape == (n, K * (H + 4))
    assert_same(store.get("s4"), {"aux_hidden_states": reference_states(aux, K, "float8_e4m3fn"),
                                  "hidden_states": reference_states(final, 1, "float8_e4m3fn")})


def test_every_collate_convention_and_the_loader_get_bfloat16_states(tmp_path, samples):
    path = write_fp8(tmp_path / "s", samples)
    store = hsdata.open(path)
    dataset = Eagle3Dataset(path)
    for convention in ("hsdata", "specforge", "modelopt"):
        items = [dataset[i] for i in range(3)]
        batch = collate_eagle3(items, convention=convention)
        values = [*batch.values(), *batch.get("base_model_outputs", {}).values()]
        states = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
        assert states and all(v.dtype == torch.bfloat16 for v in states), convention
    for batch in Loader(dataset, batch_size=4, num_workers=0):
        for b, sample_id in enumerate(batch["sample_id"]):
            n = int(store.lengths[store.index(sample_id)])
            assert torch.equal(batch["aux_hidden_states"][b, :n].view(torch.int16),
                               store.get(sample_id)["aux_hidden_states"].view(torch.int16))
            assert not batch["aux_hidden_states"][b, n:].any()
    with pytest.raises(ValueError, match="Eagle3Dataset reads fp8 states as bfloat16"):
        Eagle3Dataset(path, dequantize=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_samples_get_their_first_rows_dequantized_and_still_verified(tmp_path, samples, workers):
    """``max_length`` on an fp8 store: an item and a padded batch hold the first rows of the full sample's
    bfloat16 states; the rows beyond still feed the checksum, so damage there is caught."""
    path = write_fp8(tmp_path / "s", samples)
    store, cut = hsdata.open(path), 24
    dataset = Eagle3Dataset(path, max_length=cut)
    for i in range(len(dataset)):
        item, full = dataset[i], store.get(dataset[i]["sample_id"])
        for name in ("aux_hidden_states", "hidden_states"):
            assert torch.equal(item[name].view(torch.int16), full[name][:cut].view(torch.int16)), name
    loader = Loader(dataset, batch_size=3, num_workers=workers, multiprocessing_context="fork" if workers else None)
    seen = []
    for batch in loader:
        for b, sample_id in enumerate(batch["sample_id"]):
            n = min(cut, int(store.lengths[store.index(sample_id)]))
            assert torch.equal(batch["hidden_states"][b, :n].view(torch.int16),
                               store.get(sample_id)["hidden_states"][:n].view(torch.int16))
            assert not batch["hidden_states"][b, n:].any()
            seen.append(sample_id)
    assert sorted(seen) == sorted(samples)
    part, offset, n = store.location(store.index("s5"))  # 65 tokens: flip a byte of its last row
    array = zarr.open_group(path, mode="r+")[f"parts/{part}/hidden_states"]
    row = array[offset + n - 1]
    row[0] ^= 1
    array[offset + n - 1] = row
    with pytest.raises(hsdata.CorruptDataError, match="s5"):
        Eagle3Dataset(path, max_length=cut)[store.index("s5")]


def test_validate_reports_an_fp8_nan_and_a_bad_scale_whose_checksums_agree(tmp_path, capsys):
    samples = {"a": make_sample(6, seed=1), "b": make_sample(6, seed=2)}
    path = write_fp8(tmp_path / "s", samples, chunk_tokens=16, shard_tokens=256)
    assert validate(path).ok
    rows = reference_rows(samples["a"]["hidden_states"], 1, "float8_e4m3fn")
    rows[2, 7] = 0x7F  # e4m3fn NaN, checksums made to agree
    set_values(tmp_path / "s", "a", "hidden_states", rows)
    rows = reference_rows(samples["b"]["aux_hidden_states"], K, "float8_e4m3fn")
    rows[4, H : H + 4] = np.frombuffer(np.float32(0).tobytes(), np.uint8)  # layer 0's scale 0
    set_values(tmp_path / "s", "b", "aux_hidden_states", rows)
    report = validate(path)
    found = {(p.kind, p.tensor, tuple(p.samples)): p.message for p in report.problems}
    assert set(found) == {("non_finite", "hidden_states", ("a",)), ("non_finite", "aux_hidden_states", ("b",))}
    assert "fp8 value is NaN" in found["non_finite", "hidden_states", ("a",)]
    assert "scale is 0.0, not finite and positive (token 4" in found["non_finite", "aux_hidden_states", ("b",)]
    assert main(["validate", path]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_convert_makes_an_fp8_store_of_a_bf16_one_resumes_and_info_says_so(tmp_path, samples, capsys):
    src = tmp_path / "bf16"
    with hsdata.create(str(src), **SPEC, **SMALL_LAYOUT) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample, meta={"id": sample_id})
    dest = str(tmp_path / "fp8")
    assert main(["convert", str(src), dest, "--dtype", "float8_e4m3fn"]) == 0
    assert "6 converted to float8_e4m3fn" in capsys.readouterr().out
    assert main(["convert", str(src), dest, "--dtype", "float8_e4m3fn", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 6
    converted, direct = hsdata.open(dest), hsdata.open(write_fp8(tmp_path / "direct", samples))
    for sample_id in samples:
        assert_same(converted.get(sample_id), {k: v for k, v in direct.get(sample_id).items() if k != "sample_id"})
        assert converted.meta(converted.index(sample_id)) == {"id": sample_id}
    assert converted.provenance["converted_from"] == str(src)
    assert main(["info", dest]) == 0
    assert "float8_e4m3fn  (computed in bfloat16, a float32 scale per token and layer)" in capsys.readouterr().out
    assert validate(dest).ok and os.path.exists(os.path.join(dest, "manifests"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantizing_on_the_gpu_is_bit_identical_to_the_cpu():
    g = torch.Generator().manual_seed(3)
    states = (torch.randn(4096, K * 4096, generator=g) * torch.logspace(-3, 3, 4096)[:, None]).bfloat16()
    states[7] = 0
    for dtype in FP8:
        cpu = quantize.quantize(states, K, dtype)
        gpu = quantize.quantize(states.cuda(), K, dtype)
        assert torch.equal(gpu.cpu(), cpu), dtype
        back = quantize.dequantize(gpu, K, 4096, dtype)
        assert torch.equal(back.cpu().view(torch.int16), quantize.dequantize(cpu, K, 4096, dtype).view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_capture_path_quantizes_on_the_gpu_as_the_writer_does_on_the_cpu(tmp_path):
    from hsdata.extract.capture import Capture, Piece

    g = torch.Generator().manual_seed(4)
    aux = [torch.randn(300, H, generator=g).bfloat16() for _ in range(K)]
    final = torch.randn(300, H, generator=g).bfloat16()
    ids = torch.randint(0, 1000, (300,), generator=g)
    capture = Capture(hsdata.create(str(tmp_path / "gpu"), **SPEC, dtype="float8_e4m3fn"))
    for start in (0, 120):  # one request in two chunks of prefill, and a second request in the second forward
        pieces = [Piece("r0", start, 0, 120)] + ([Piece("r1", 0, 120, 60)] if start else [])
        rows = slice(start, start + 180)
        capture.add_forward(pieces, [240, 60], ids[rows].cuda(), [a[rows].cuda() for a in aux], final[rows].cuda())
    capture.close()
    with hsdata.create(str(tmp_path / "cpu"), **SPEC, dtype="float8_e4m3fn") as w:
        w.add("r0", input_ids=ids[:240], loss_mask=None, aux_hidden_states=torch.cat(aux, 1)[:240],
              hidden_states=final[:240])
    gpu, cpu = hsdata.open(str(tmp_path / "gpu"), dequantize=False), hsdata.open(str(tmp_path / "cpu"),
                                                                                 dequantize=False)
    for name in ("aux_hidden_states", "aux_hidden_states_scale", "hidden_states", "hidden_states_scale"):
        assert torch.equal(gpu.get("r0")[name].view(torch.uint8), cpu.get("r0")[name].view(torch.uint8)), name


def test_extract_stores_fp8_as_converting_its_bf16_store_does(tmp_path):
    """``hsdata extract --store-dtype float8_e4m3fn`` (the demo model, bf16) against ``convert`` of the same run
    stored bf16: the same rows, bit for bit."""
    for args in (["--out", str(tmp_path / "bf16")], ["--out", str(tmp_path / "fp8"), "--store-dtype", "float8_e4m3fn"]):
        assert main(["extract", *args]) == 0
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "converted"), "--dtype", "float8_e4m3fn"]) == 0
    extracted, converted = (hsdata.open(str(tmp_path / n), dequantize=False) for n in ("fp8", "converted"))
    assert len(extracted) == len(converted) == 24 and extracted.spec.dtype == "float8_e4m3fn"
    for sample_id in converted.sample_ids:
        got, want = extracted.get(sample_id), converted.get(sample_id)
        for name in ("aux_hidden_states", "aux_hidden_states_scale", "hidden_states", "hidden_states_scale"):
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (sample_id, name)


@pytest.mark.parametrize("convention, pack", [("hsdata", False), ("specforge", False), ("modelopt", False),
                                              ("hsdata", True)])
def test_a_batch_read_as_stored_and_dequantized_after_is_the_batch_read_dequantized(tmp_path, samples, convention,
                                                                                    pack):
    from hsdata.torch.batches import Layout, on_device

    dataset = Eagle3Dataset(write_fp8(tmp_path / "s", samples))
    layout = Layout(convention, pack=pack)
    positions = [4, 0, 5]
    direct = dataset.start_batch(positions, layout, lambda n: torch.zeros(n, dtype=torch.uint8)).result().batch()
    stored = dataset.start_batch(positions, layout, lambda n: torch.full((n,), 7, dtype=torch.uint8),
                                 stored=True).result().stored()
    assert stored["tensors"]["aux_hidden_states"].dtype == torch.uint8  # half the bytes cross to the device
    later = on_device(stored, dataset.spec)
    flat_direct = {**direct, **direct.get("base_model_outputs", {})}
    flat_later = {**later, **later.get("base_model_outputs", {})}
    for key, value in flat_direct.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(flat_later[key], value), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_dequantizes_an_fp8_store_on_the_gpu(tmp_path, samples, workers):
    path = write_fp8(tmp_path / "s", samples)
    on_host = {b["sample_id"][0]: b for b in Loader(Eagle3Dataset(path), batch_size=1)}
    loader = Loader(Eagle3Dataset(path), batch_size=1, num_workers=workers, multiprocessing_context="fork",
                    device="cuda")
    seen = 0
    for batch in loader:
        assert batch["aux_hidden_states"].is_cuda and batch["aux_hidden_states"].dtype == torch.bfloat16
        want = on_host[batch["sample_id"][0]]
        for key in ("aux_hidden_states", "hidden_states", "input_ids", "loss_mask"):
            assert torch.equal(batch[key].cpu(), want[key]), key
        seen += 1
    assert seen == len(samples)
