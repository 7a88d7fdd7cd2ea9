"""What the writer and the repair API refuse before writing anything, and repairing a store by removal."""

from __future__ import annotations

import json
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

import hsdata
from conftest import SMALL_LAYOUT, SPEC, assert_same, make_sample
from hsdata import masks, removals
from hsdata.extract.client import HOOK_FACTORY, extract_from_server
from hsdata.extract.conversations import Record
from hsdata.inputs import MAX_META_BYTES, MAX_SAMPLE_ID_BYTES
from hsdata.io.storage import Storage

T = 12
GOOD = make_sample(T, 0)


def _files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


@pytest.mark.parametrize("sample_id, message", [
    (7, r"^sample_id must be a non-empty string, got 7$"),
    (b"bytes", r"^sample_id must be a non-empty string, got b'bytes'$"),
    ("", r"^sample_id must be a non-empty string, got ''$"),
    ("bad-\ud800", r"^sample 'bad-\\ud800': the id is not valid UTF-8 text \(surrogates not allowed at position 4\)$"),
    ("x" * (MAX_SAMPLE_ID_BYTES + 1),
     rf"^sample '{'x' * 40}'\.\.\.: the id is 1,025 bytes of UTF-8, more than the 1,024 allowed$"),
    ("é" * 513, r"^sample 'é+'\.\.\.: the id is 1,026 bytes of UTF-8"),
])
def test_an_id_a_manifest_cannot_hold_is_refused_at_add_and_the_good_samples_around_it_commit(store_path, sample_id,
                                                                                               message):
    """The lone surrogate used to pass add() and fail close(), losing the six good samples around it."""
    goods = {f"good-{i}": make_sample(T + i, i) for i in range(6)}
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        for i, (good_id, sample) in enumerate(goods.items()):
            if i == 3:
                with pytest.raises(hsdata.InvalidSampleError, match=message):
                    w.add(sample_id, **GOOD)
            w.add(good_id, **sample)
    store = hsdata.open(str(store_path))
    assert store.sample_ids == list(goods)
    for good_id, sample in goods.items():
        assert_same(store.get(good_id), sample)


def test_the_longest_ids_and_ids_with_control_characters_commit(store_path):
    ids = ["é" * (MAX_SAMPLE_ID_BYTES // 2), "a\x00b\nc", "🦀" * (MAX_SAMPLE_ID_BYTES // 4)]
    with hsdata.create(str(store_path), **SPEC) as w:
        for sample_id in ids:
            w.add(sample_id, **GOOD)
    store = hsdata.open(str(store_path))
    assert store.sample_ids == ids
    assert_same(store.get(ids[1]), GOOD)


def test_bool_input_ids_are_refused_and_a_bool_loss_mask_is_taken(store_path):
    with hsdata.create(str(store_path), **SPEC) as w:
        for ids in (torch.ones(T, dtype=torch.bool), np.ones(T, bool)):
            with pytest.raises(hsdata.InvalidSampleError,
                               match=r"^sample 'b': input_ids must hold integers, got dtype bool$"):
                w.add("b", **{**GOOD, "input_ids": ids})
        w.add("m", **{**GOOD, "loss_mask": GOOD["loss_mask"].bool()})
    assert_same(hsdata.open(str(store_path)).get("m"), GOOD)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def _coo(t: torch.Tensor) -> torch.Tensor:
    return t.to_sparse()


def _nested(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        return torch.nested.nested_tensor([t[: len(t) // 2], t[len(t) // 2 :]])


@pytest.mark.parametrize("field", ["input_ids", "loss_mask", "aux_hidden_states", "hidden_states"])
@pytest.mark.parametrize("convert, message", [
    (_meta, "is on the meta device: it has no data"),
    (_coo, r"is a sparse_coo tensor: hsdata takes dense \(strided\) tensors \(use \.to_dense\(\)\)"),
    (_nested, r"is a nested tensor: hsdata takes dense"),
])
def test_tensors_without_dense_host_data_are_refused_naming_sample_and_field(store_path, field, convert, message):
    with hsdata.create(str(store_path), **SPEC) as w:
        with pytest.raises(hsdata.InvalidSampleError, match=rf"^sample 'odd': {field} {message}"):
            w.add("odd", **{**GOOD, field: convert(GOOD[field])})
        w.add("good", **GOOD)
    assert hsdata.open(str(store_path)).sample_ids == ["good"]


def test_a_sparse_csr_hidden_state_is_refused(store_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        csr = GOOD["hidden_states"].float().to_sparse_csr().to(torch.bfloat16)
    with hsdata.create(str(store_path), **SPEC) as w:
        with pytest.raises(hsdata.InvalidSampleError, match=r"^sample 'csr': hidden_states is a sparse_csr tensor"):
            w.add("csr", **{**GOOD, "hidden_states": csr})


def test_quantized_ids_are_refused_and_negative_views_are_stored_by_value(store_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(T), 1.0, 0, torch.qint8)
    with hsdata.create(str(store_path), **SPEC) as w:
        with pytest.raises(hsdata.InvalidSampleError,
                           match=r"^sample 'q': input_ids \(torch.qint8\) cannot be read as a host array"):
            w.add("q", **{**GOOD, "input_ids": quantized})
        w.add("neg", **{**GOOD, "hidden_states": torch._neg_view(-GOOD["hidden_states"])})
    assert_same(hsdata.open(str(store_path)).get("neg"), GOOD)


def test_meta_beyond_the_limit_is_refused(store_path):
    with hsdata.create(str(store_path), **SPEC) as w:
        with pytest.raises(hsdata.InvalidSampleError, match=rf"^sample 'big': meta is {MAX_META_BYTES + 9:,} bytes as "
                                                             rf"JSON, more than the {MAX_META_BYTES:,}"):
            w.add("big", **GOOD, meta={"x": "a" * MAX_META_BYTES})
        w.add("fits", **GOOD, meta={"x": "a" * (MAX_META_BYTES - 9)})  # {"x": "..."}
    assert hsdata.open(str(store_path)).sample_ids == ["fits"]


def _server_samples(store_path, lengths: dict[str, int]) -> dict[str, dict]:
    """Samples committed without loss masks, as the server hook commits them."""
    samples = {sid: make_sample(n, seed) for seed, (sid, n) in enumerate(lengths.items())}
    with hsdata.create(str(store_path), **SPEC) as w:
        for sid, sample in samples.items():
            w.add(sid, **{**sample, "loss_mask": None})
    return samples


def test_add_loss_masks_refuses_unknown_ids_wrong_lengths_and_second_masks_writing_nothing(store_path):
    samples = _server_samples(store_path, {"a": 8, "b": 5, "c": 3})
    with hsdata.create(str(store_path), **SPEC) as w:
        w.add("own", **GOOD)
    hsdata.add_loss_masks(str(store_path), {"c": samples["c"]["loss_mask"]})
    written = _files(store_path / "masks")
    cases = {
        "a": (samples["a"]["loss_mask"], None),  # the one good mask: not written either
        "b": ([1, 0, 1], "sample 'b': the mask has 3 tokens, the sample 5"),
        "c": ([1, 1, 1], "sample 'c': already has an added loss mask (masks/"),
        "own": (GOOD["loss_mask"], "sample 'own': has its own loss mask, stored with the sample"),
        "nope": ([1], "sample 'nope': not a committed sample of the store"),
        "bad": ([0, 2], "sample 'bad': a loss mask must be a non-empty [T] array of 0 and 1"),
        "gone": (torch.ones(8, dtype=torch.uint8, device="meta"), "sample 'gone': loss mask is on the meta device"),
    }
    with pytest.raises(hsdata.InvalidSampleError) as refused:
        hsdata.add_loss_masks(str(store_path), {sid: mask for sid, (mask, _) in cases.items()})
    message = str(refused.value)
    assert message.startswith(f"{store_path}: 6 of 7 loss masks refused, nothing written: sample 'b'")
    for sid, (_, problem) in cases.items():
        assert sid in ("a", "gone") or problem in message
    assert message.endswith("; and 1 more")  # the sixth, 'gone', is counted, not named
    assert _files(store_path / "masks") == written
    store = hsdata.open(str(store_path))
    assert store.get("a")["loss_mask"] is None
    assert_same(store.get("c"), samples["c"])


def test_add_loss_masks_names_a_few_refused_ids_and_counts_the_rest(store_path):
    _server_samples(store_path, {"a": 4})
    with pytest.raises(hsdata.InvalidSampleError, match=r": 12 of 12 loss masks refused, nothing written: sample "
                                                        r"'x0': not a committed sample of the store; .* sample 'x4': "
                                                        r"not a committed sample of the store; and 7 more$"):
        hsdata.add_loss_masks(str(store_path), {f"x{i}": [1] for i in range(12)})
    assert not (store_path / "masks").exists()


def test_add_loss_masks_needs_a_store(tmp_path):
    with pytest.raises(hsdata.NotAStoreError):
        hsdata.add_loss_masks(str(tmp_path / "nothing"), {"a": [1]})
    assert not (tmp_path / "nothing").exists()
    assert hsdata.add_loss_masks(str(tmp_path / "nothing"), {}) is None


def test_a_wrong_mask_from_an_older_writer_is_repaired_by_removal(store_path):
    samples = _server_samples(store_path, {"s": 6, "t": 4})
    storage = Storage(str(store_path))
    masks.write(storage, {"s": b"\x01"})  # what add_loss_masks accepted before it checked lengths
    with pytest.raises(hsdata.CorruptDataError, match="sample 's': its added loss mask has 1 tokens, the sample 6"):
        hsdata.open(str(store_path)).get("s")
    with pytest.raises(hsdata.InvalidSampleError, match=r"1 of 2 loss mask removals refused, nothing written: "
                                                        r"sample 't': has no added loss mask$"):
        hsdata.remove_loss_masks(str(store_path), ["s", "t"])
    assert not (store_path / "removals").exists()
    key = hsdata.remove_loss_masks(str(store_path), ["s"], reason="wrong length")
    assert key.startswith("removals/") and _files(store_path / "removals") == [key.removeprefix("removals/")]
    assert masks.load(storage) == {}
    assert hsdata.open(str(store_path)).get("s")["loss_mask"] is None
    hsdata.add_loss_masks(str(store_path), {"s": samples["s"]["loss_mask"]})
    assert_same(hsdata.open(str(store_path)).get("s"), samples["s"])
    assert len(_files(store_path / "masks")) == 2  # write-once: the wrong mask's file stays


def test_masks_load_skips_removed_masks_and_the_first_live_one_wins(store_path):
    _server_samples(store_path, {"s": 2})
    storage = Storage(str(store_path))
    first = masks.write(storage, {"s": b"\x01\x01"})
    masks.write(storage, {"s": b"\x00\x01"})
    files = sorted(_files(store_path / "masks"))
    assert masks.load(storage) == {"s": b"\x01\x01" if first.endswith(files[0]) else b"\x00\x01"}
    removals.write(storage, masks=[("s", files[0])])
    later = masks.load(storage)["s"]
    assert later == (b"\x00\x01" if first.endswith(files[0]) else b"\x01\x01")
    removals.write(storage, masks=[("other", files[1])])  # names another id: removes nothing
    assert masks.load(storage) == {"s": later}


def test_remove_samples_hides_them_and_their_masks_and_the_ids_can_be_committed_again(store_path):
    samples = _server_samples(store_path, {"a": 5, "b": 7, "c": 3})
    hsdata.add_loss_masks(str(store_path), {"a": samples["a"]["loss_mask"]})
    with pytest.raises(hsdata.InvalidSampleError, match=r"1 of 2 sample removals refused, nothing written: "
                                                        r"sample 'zz': not a committed sample of the store$"):
        hsdata.remove_samples(str(store_path), ["a", "zz"])
    assert not (store_path / "removals").exists()
    with pytest.raises(TypeError, match="a list of ids, not the string 'a'"):
        hsdata.remove_samples(str(store_path), "a")
    hsdata.remove_samples(str(store_path), ["a", "b", "a"], reason="leaked test data")
    assert hsdata.open(str(store_path)).sample_ids == ["c"]
    assert masks.load(Storage(str(store_path))) == {}
    table = removals.load(Storage(str(store_path)))
    assert {i for i, _, _ in table.rows} == {"a", "b"} and {i for i, _ in table.masks} == {"a"}
    with pytest.raises(hsdata.InvalidSampleError, match="sample 'a': not a committed sample"):
        hsdata.remove_samples(str(store_path), ["a"])  # already removed

    again = make_sample(9, 99)
    with hsdata.create(str(store_path), **SPEC) as w:
        assert "a" not in w and "c" in w
        w.add("a", **again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the removed row is no duplicate
        store = hsdata.open(str(store_path))
    assert sorted(store.sample_ids) == ["a", "c"]
    assert_same(store.get("a"), again)
    assert_same(store.get("c"), {k: v for k, v in samples["c"].items() if k != "loss_mask"})


def test_nothing_to_remove_writes_nothing(store_path):
    _server_samples(store_path, {"a": 2})
    assert hsdata.remove_samples(str(store_path), []) is None
    assert hsdata.remove_loss_masks(str(store_path), []) is None
    assert not (store_path / "removals").exists()


class _HookServer:
    """Answers /server_info as an SGLang server with the hsdata hook writing ``store``; counts /generate calls."""

    def __init__(self, store):
        server, self.generated = self, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._reply({"forward_hooks": [{"hook_factory": HOOK_FACTORY, "config": {"store": str(store)}}],
                             "enable_return_aux_hidden_states": True, "disable_prefill_cuda_graph": True})

            def do_POST(self):
                server.generated += 1
                self._reply({})

            def _reply(self, answer):
                body = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


def test_a_resumed_server_extraction_adds_the_masks_a_stopped_run_did_not(store_path):
    """The client adds masks once the server committed the samples; a run that stopped in between left samples
    without masks, which the next run adds without sending them again."""
    samples = _server_samples(store_path, {"r1": 4, "r2": 3})
    hsdata.add_loss_masks(str(store_path), {"r2": samples["r2"]["loss_mask"]})
    records = [Record(sid, input_ids=s["input_ids"].tolist(), loss_mask=s["loss_mask"].tolist())
               for sid, s in samples.items()]
    server = _HookServer(store_path)
    try:
        summary = extract_from_server(server.url, records, None, str(store_path))
    finally:
        server.http.shutdown()
    assert summary.ok and summary.skipped == 2 and server.generated == 0
    store = hsdata.open(str(store_path))
    for sid, sample in samples.items():
        assert_same(store.get(sid), sample)


def test_a_vocab_size_recorded_on_one_side_only_does_not_block_joining(tmp_path):
    """Stores made before extraction recorded the model's vocabulary size still take resumed runs that do;
    two different recorded sizes do not join."""
    url = str(tmp_path / "store")
    hsdata.create(url, **SPEC).close()
    with hsdata.create(url, **SPEC, vocab_size=1000) as writer:
        assert writer.spec.vocab_size is None  # the store's root is write-once
    sized = str(tmp_path / "sized")
    hsdata.create(sized, **SPEC, vocab_size=1000).close()
    hsdata.create(sized, **SPEC).close()
    with pytest.raises(hsdata.SpecMismatchError, match="vocab_size: store has 1000, requested 999"):
        hsdata.create(sized, **SPEC, vocab_size=999)
