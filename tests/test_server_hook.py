"""The SGLang hook against the real sglang package: its own hook registry, ForwardMode and ForwardBatch.

A small scheduler stand-in packs prompts into forwards the way SGLang does (request-major rows, chunked prefill,
padding rows, decode forwards in between) and calls ``logits_processor`` with the positional signature SGLang's
models use: ``(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)``.
"""

from __future__ import annotations

import logging
import shutil
import time

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.hook_manager import register_forward_hooks
from sglang.srt.runtime_context import get_parallel

import hsdata
from conftest import AUX, assert_same, make_sample, resize_filesystem
from hsdata.extract.client import RID_PREFIX
from hsdata.validate import validate
from hsdata.extract import capture as capture_module
from hsdata.extract.capture import Assembler, Piece
from server_hook.sglang import HookConfig, PrefillHook
from test_remote import BUCKET, s3  # noqa: F401 - s3 is a fixture (moto server on loopback)
from test_remote_faults import proxy  # noqa: F401 - a fixture: a fault-injecting proxy in front of s3


class LogitsProcessor(torch.nn.Module):
    """Stands in for SGLang's LogitsProcessor: same name in the model, same call signature."""

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        return torch.zeros(hidden_states.shape[0], 8)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Identity()
        self.logits_processor = LogitsProcessor()


def hooked_model(store, **config) -> tuple[Model, PrefillHook]:
    model = Model()
    spec = {"name": "hsdata", "target_modules": ["logits_processor"], "hook_factory": "server_hook.sglang:make_hook",
            "config": {"store": str(store), "aux_layers": AUX, "flush_interval_s": 0.2, **config}}
    register_forward_hooks(model, [spec])  # SGLang resolves the factory from its string
    (hook,) = model.logits_processor._forward_hooks.values()
    return model, hook


def forward(model, mode, pieces, prompts, *, pad_rows=0, aux_as_list=False, rid_prefix=RID_PREFIX):
    """One packed forward: ``pieces`` are (sample id, start, length) in row order; rids are ``rid_prefix`` + id."""
    ids, aux, final = [], [], []
    for rid, start, length in pieces:
        s = prompts[rid]
        ids.append(s["input_ids"][start : start + length])
        aux.append(s["aux_hidden_states"][start : start + length])
        final.append(s["hidden_states"][start : start + length])
    ids = torch.cat(ids + [torch.zeros(pad_rows, dtype=torch.int64)])
    aux = torch.cat(aux + [torch.full((pad_rows, aux[0].shape[1]), 7.0, dtype=aux[0].dtype)])
    final = torch.cat(final + [torch.full((pad_rows, final[0].shape[1]), 7.0, dtype=final[0].dtype)])
    n = len(pieces)
    batch = ForwardBatch(
        forward_mode=mode, batch_size=n, input_ids=ids, req_pool_indices=torch.arange(n),
        seq_lens=torch.tensor([start + length for _, start, length in pieces]), out_cache_loc=torch.arange(len(ids)),
        seq_lens_sum=sum(start + length for _, start, length in pieces),
        rids=[rid_prefix + rid for rid, _, _ in pieces],
        extend_seq_lens_cpu=[length for _, _, length in pieces], extend_prefix_lens_cpu=[s for _, s, _ in pieces],
        orig_seq_lens=torch.tensor([len(prompts[rid]["input_ids"]) for rid, _, _ in pieces], dtype=torch.int32),
    )
    if aux_as_list:
        aux = list(aux.split(final.shape[1], dim=-1))
    out = model.logits_processor(ids, final, model.lm_head, batch, aux)
    assert out.shape == (len(ids), 8)  # the hook never changes the output


def serve(model, prompts, *, chunk, budget, decode_every=2, pad_rows=3, rid_prefix=RID_PREFIX):
    """Chunked prefill: each forward takes up to ``chunk`` tokens per request and ``budget`` per batch."""
    done = {rid: 0 for rid in prompts}
    step = 0
    while any(done[rid] < len(prompts[rid]["input_ids"]) for rid in prompts):
        pieces, used = [], 0
        for rid, prompt in prompts.items():
            left = len(prompt["input_ids"]) - done[rid]
            if left and used < budget:
                take = min(left, chunk, budget - used)
                pieces.append((rid, done[rid], take))
                done[rid] += take
                used += take
        forward(model, ForwardMode.EXTEND, pieces, prompts, pad_rows=pad_rows, aux_as_list=step % 2 == 1,
                rid_prefix=rid_prefix)
        step += 1
        if step % decode_every == 0:
            rid = next(iter(prompts))
            n = len(prompts[rid]["input_ids"])
            decode = {rid: {k: v[:1].repeat(*([n + 1] + [1] * (v.dim() - 1))) for k, v in prompts[rid].items()}}
            forward(model, ForwardMode.DECODE, [(rid, n, 1)], decode, rid_prefix=rid_prefix)


def assert_stored(store, prompts):
    opened = hsdata.open(str(store))
    assert sorted(opened.sample_ids) == sorted(prompts)
    for rid, prompt in prompts.items():
        got = opened.get(rid)
        assert got["loss_mask"] is None  # the server cannot know it
        assert_same(got, {k: v for k, v in prompt.items() if k != "loss_mask"})
    assert validate(str(store)).ok


PROMPTS = {f"req-{i}": make_sample(n, seed=i) for i, n in enumerate([1, 5, 64, 200, 33, 512, 7])}


@pytest.mark.parametrize("chunk", [1, 16, 100, 4096])
def test_chunked_prefill_is_reassembled_bit_exact(tmp_path, chunk):
    model, hook = hooked_model(tmp_path / "store")
    serve(model, PROMPTS, chunk=chunk, budget=max(chunk, 300))
    hook.close()
    assert_stored(tmp_path / "store", PROMPTS)


def test_several_requests_per_forward_with_padding_rows(tmp_path):
    model, hook = hooked_model(tmp_path / "store")
    forward(model, ForwardMode.EXTEND, [(rid, 0, len(p["input_ids"])) for rid, p in PROMPTS.items()], PROMPTS,
            pad_rows=13)
    hook.close()
    assert_stored(tmp_path / "store", PROMPTS)


def test_mixed_forward_with_a_decode_row(tmp_path):
    prompts = {"a": make_sample(40, 1), "b": make_sample(20, 2)}
    model, hook = hooked_model(tmp_path / "store")
    forward(model, ForwardMode.EXTEND, [("a", 0, 40)], prompts)
    decode_a = {"a": make_sample(41, 1), "b": prompts["b"]}  # a's generated token sits at position 40
    forward(model, ForwardMode.MIXED, [("b", 0, 20), ("a", 40, 1)], decode_a)
    hook.close()
    assert_stored(tmp_path / "store", prompts)


def test_tensor_parallel_rank_other_than_zero_writes_nothing(tmp_path):
    model, hook = hooked_model(tmp_path / "store")
    with get_parallel().override(attn_tp_rank=1, attn_tp_size=2):
        serve(model, PROMPTS, chunk=64, budget=256)
    hook.close()
    assert not (tmp_path / "store").exists()


def test_a_retracted_request_prefilled_again_is_stored_once(tmp_path):
    prompts = {"r": make_sample(100, 5), "other": make_sample(10, 6)}
    model, hook = hooked_model(tmp_path / "store")
    forward(model, ForwardMode.EXTEND, [("r", 0, 30)], prompts)
    forward(model, ForwardMode.EXTEND, [("r", 30, 30)], prompts)
    # retracted (KV freed), then prefilled again from the start, in other chunk sizes
    forward(model, ForwardMode.EXTEND, [("r", 0, 50), ("other", 0, 10)], prompts)
    forward(model, ForwardMode.EXTEND, [("r", 50, 50)], prompts)
    forward(model, ForwardMode.EXTEND, [("r", 0, 100)], prompts)  # and once more after it completed
    hook.close()
    assert_stored(tmp_path / "store", prompts)


def test_a_prefix_cache_hit_is_refused_with_one_warning(tmp_path, caplog):
    prompts = {"cached-1": make_sample(50, 7), "cached-2": make_sample(50, 8), "fine": make_sample(20, 9)}
    model, hook = hooked_model(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="hsdata.extract.capture"):
        forward(model, ForwardMode.EXTEND, [("cached-1", 16, 34), ("fine", 0, 20), ("cached-2", 32, 18)], prompts)
    hook.close()
    warnings = [r.getMessage() for r in caplog.records if "radix-cache" in r.getMessage()]
    assert len(warnings) == 1 and "cached-1" in warnings[0] and "cache_salt" in warnings[0]
    assert_stored(tmp_path / "store", {"fine": prompts["fine"]})


def test_samples_commit_within_the_flush_interval(tmp_path):
    model, hook = hooked_model(tmp_path / "store", flush_interval_s=0.2)
    forward(model, ForwardMode.EXTEND, [("early", 0, 5)], {"early": make_sample(5, 1)})
    deadline = time.monotonic() + 30  # generous: a loaded CI machine; a commit takes 0.2 s plus the fsyncs
    while time.monotonic() < deadline and not (tmp_path / "store" / "zarr.json").exists():
        time.sleep(0.05)
    while time.monotonic() < deadline and not len(hsdata.open(str(tmp_path / "store"))):
        time.sleep(0.05)
    assert list(hsdata.open(str(tmp_path / "store")).sample_ids) == ["early"]  # visible before shutdown
    hook.close()


def test_config_is_checked():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['stor'\]"):
        HookConfig.parse({"stor": "/x"})
    with pytest.raises(ValueError, match="config needs \"store\""):
        HookConfig.parse({})
    with pytest.raises(ValueError, match="flush_interval_s and max_staged_bytes must be positive"):
        HookConfig.parse({"store": "/x", "flush_interval_s": 0})
    with pytest.raises(ValueError, match="hsdata hook: compression must be None, 'none', 'zstd', 'lz4'"):
        HookConfig.parse({"store": "/x", "compression": "gzip"})
    with pytest.raises(ValueError, match="on_backpressure must be one of \\('block', 'drop'\\), got 'wait'"):
        HookConfig.parse({"store": "/x", "on_backpressure": "wait"})
    for bad in (-1, True, "5", float("nan"), float("inf")):  # JSON true is not a number of seconds
        with pytest.raises(ValueError, match=f"max_wait_s must be a number of seconds >= 0, got {bad!r}"):
            HookConfig.parse({"store": "/x", "max_wait_s": bad})
    assert HookConfig.parse({"store": "/x", "max_wait_s": 0}).max_wait_s == 0


def test_the_hook_writes_a_compressed_store_when_asked(tmp_path):
    prompts = {f"req-{i}": make_sample(n, seed=i) for i, n in enumerate([3, 70, 20])}
    model, hook = hooked_model(tmp_path / "store", compression="zstd")
    serve(model, prompts, chunk=16, budget=40)  # chunked prefill
    hook.close()
    assert_stored(tmp_path / "store", prompts)
    assert hsdata.open(str(tmp_path / "store")).spec.format_version == 3


def test_wrong_aux_layer_count_is_logged_and_the_server_keeps_serving(tmp_path, caplog):
    model, hook = hooked_model(tmp_path / "store", aux_layers=[1, 2])
    with caplog.at_level(logging.ERROR, logger="hsdata.server_hook"):
        for sample_id in ("x", "y"):
            forward(model, ForwardMode.EXTEND, [(sample_id, 0, 4)], {sample_id: make_sample(4, 1)})
    (error,) = [r.getMessage() for r in caplog.records]  # once, not once per forward
    assert "stores nothing: hsdata hook: aux_layers [1, 2] give 2 x 32 columns, but the model passes 96" in error
    assert not (tmp_path / "store").exists()


def test_aux_layer_ids_follow_each_model_familys_convention():
    from types import SimpleNamespace
    from unittest import mock

    from server_hook import sglang as hook_module

    deepseek = SimpleNamespace(config=SimpleNamespace(model_type="deepseek_v3", num_hidden_layers=61))
    llama = SimpleNamespace(config=SimpleNamespace(model_type="llama", num_hidden_layers=32))
    for ids, module, expected in [([1, 29, 57], deepseek, [1, 29, 57]), ([2, 30, 58], deepseek, [1, 29, 57]),
                                  ([2, 30, 58], llama, [2, 30, 58]), (None, llama, None)]:
        args = SimpleNamespace(return_aux_hidden_state_layer_ids=ids)
        with mock.patch.object(hook_module, "_server_args", return_value=args):
            assert hook_module._server_aux_layers(module) == expected
    assert hook_module._eagle3_default(llama) == [1, 15, 28]
    assert hook_module._eagle3_default(deepseek) == [1, 29, 57]


def test_only_requests_with_the_rid_prefix_are_stored(tmp_path):
    """SGLang's warm-up (a bare uuid rid), its health probes and other clients' requests share forwards with the
    extraction's; only the ``hsdata:`` ones become samples, under the id after the prefix."""
    prompts = {"0f8e2a9c4b1d4e6f8a7b6c5d4e3f2a1b": make_sample(9, 1), "HEALTH_CHECK_7c1d": make_sample(1, 2),
               "chat-from-someone-else": make_sample(30, 3), f"{RID_PREFIX}wanted-1": make_sample(40, 4),
               f"{RID_PREFIX}wanted-2": make_sample(12, 5), RID_PREFIX: make_sample(3, 6)}
    model, hook = hooked_model(tmp_path / "store")
    forward(model, ForwardMode.EXTEND, [(rid, 0, len(p["input_ids"])) for rid, p in prompts.items()], prompts,
            rid_prefix="", pad_rows=5)
    hook.close()
    assert_stored(tmp_path / "store", {sid: prompts[RID_PREFIX + sid] for sid in ("wanted-1", "wanted-2")})


def test_an_empty_rid_prefix_stores_every_request_but_health_probes(tmp_path):
    prompts = {"HEALTH_CHECK_7c1d": make_sample(1, 2), "chat-1": make_sample(30, 3), "job-2": make_sample(7, 4)}
    model, hook = hooked_model(tmp_path / "store", rid_prefix="")
    serve(model, prompts, chunk=8, budget=20, rid_prefix="")
    hook.close()
    assert_stored(tmp_path / "store", {rid: prompts[rid] for rid in ("chat-1", "job-2")})


def test_a_forward_with_no_stored_request_creates_no_store(tmp_path):
    model, hook = hooked_model(tmp_path / "store")
    forward(model, ForwardMode.EXTEND, [("HEALTH_CHECK_1", 0, 1)], {"HEALTH_CHECK_1": make_sample(1, 1)}, rid_prefix="")
    hook.close()
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("server_dtype, store_dtype", [(torch.float16, None), (torch.float32, None),
                                                       (torch.float32, "bfloat16"), (torch.float32, "float16")])
def test_a_server_in_any_dtype_is_stored_in_it_or_converted_on_request(tmp_path, server_dtype, store_dtype):
    prompts = {f"req-{i}": make_sample(n, seed=i, dtype=server_dtype) for i, n in enumerate([3, 70, 20])}
    model, hook = hooked_model(tmp_path / "store", store_dtype=store_dtype)
    serve(model, prompts, chunk=16, budget=40)
    hook.close()
    stored = getattr(torch, store_dtype) if store_dtype else server_dtype
    assert_stored(tmp_path / "store", {rid: {k: v.to(stored) if v.is_floating_point() else v for k, v in p.items()}
                                       for rid, p in prompts.items()})
    spec = hsdata.open(str(tmp_path / "store")).spec
    assert (spec.dtype, spec.compute_dtype) == (str(stored).removeprefix("torch."),
                                                str(server_dtype).removeprefix("torch."))


def test_a_server_whose_dtype_differs_from_the_stores_stores_nothing_and_says_why(tmp_path, caplog):
    first = {"bf16": make_sample(10, 1)}
    model, hook = hooked_model(tmp_path / "store")
    forward(model, ForwardMode.EXTEND, [("bf16", 0, 10)], first)
    hook.close()
    model, hook = hooked_model(tmp_path / "store")
    with caplog.at_level(logging.ERROR, logger="hsdata.server_hook"):
        forward(model, ForwardMode.EXTEND, [("fp16", 0, 10)], {"fp16": make_sample(10, 2, dtype=torch.float16)})
    hook.close()
    assert isinstance(hook.failed, hsdata.SpecMismatchError)
    assert "cannot join the existing store, its spec differs: dtype: store has 'bfloat16'" in caplog.text
    assert hsdata.open(str(tmp_path / "store")).sample_ids == ["bf16"]


def test_a_bad_store_dtype_is_refused_when_the_server_starts():
    with pytest.raises(ValueError, match="store_dtype must be one of bfloat16, float16, float32"):
        HookConfig.parse({"store": "/x", "store_dtype": "fp8"})


def test_a_full_disk_fails_the_samples_it_touches_and_capture_resumes_when_it_has_room(small_filesystem, monkeypatch,
                                                                                      caplog):
    """Issue 29: a write fault is per sample, not per server. The store's 40 MiB tmpfs fills; the samples it touches
    fail (counted, the cause logged once with counts); once it has room again a fresh part takes the next samples,
    with no restart; what was committed before stays committed and valid. (Samples of hidden size 1024, 2 MiB
    each: the store's chunks are ~4 MiB, so smaller states would fill the disk with a part's first chunks.)"""
    monkeypatch.setattr(capture_module, "REOPEN_BACKOFF_S", (0.05, 0.2))
    resize_filesystem(small_filesystem, "40m")
    store = small_filesystem / "store"
    model, hook = hooked_model(store, flush_interval_s=0.1)
    prompts = {f"full-{i}": make_sample(256, seed=i, hidden=1024) for i in range(48)}
    first, second = list(prompts)[:36], list(prompts)[36:]

    def wait_until_handled(count):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            capture = hook.capture
            if capture.samples_written + capture.samples_failed >= count:
                return
            time.sleep(0.02)
        raise AssertionError(f"{count} samples not handled in 60 s")

    with caplog.at_level(logging.WARNING, logger="hsdata.extract.capture"):
        for n, rid in enumerate(first, 1):
            forward(model, ForwardMode.EXTEND, [(rid, 0, 256)], prompts)
            if n % 4 == 0:  # a commit every 4 samples, the first ones before the disk is full
                wait_until_handled(n)
                time.sleep(0.15)
        assert hook.capture.samples_failed > 0, "the filesystem never filled"
        committed_while_full = set(hsdata.open(str(store)).sample_ids)
        assert committed_while_full and not committed_while_full - set(first)

        resize_filesystem(small_filesystem, "256m")
        time.sleep(0.3)  # past the longest backoff
        for rid in second:
            forward(model, ForwardMode.EXTEND, [(rid, 0, 256)], prompts)
        capture = hook.capture
        hook.close()

    opened = hsdata.open(str(store))
    stored = set(opened.sample_ids)
    assert committed_while_full <= stored  # committed stays committed
    assert set(second) <= stored  # capture resumed by itself
    assert len(stored) == capture.samples_written and len(stored) + capture.samples_failed == len(prompts)
    assert len(set(opened.manifest.column("part").to_pylist())) >= 2  # a fresh part after the fault
    for rid in stored:
        assert_same(opened.get(rid), {k: v for k, v in prompts[rid].items() if k != "loss_mask"})
    report = validate(str(store))
    assert report.ok, [p.line() for p in report.problems]
    said = [r.getMessage() for r in caplog.records]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all("No space left on device (ENOSPC)" in e for e in errors), said
    assert any("capture resumed in a fresh part" in line for line in said), said
    assert len(said) <= 6, said  # each cause once (a minute apart at most), then its counts at close


def test_a_store_removed_mid_run_is_created_again_and_capture_goes_on(tmp_path, monkeypatch, caplog):
    """The store's folder removed under a running server: the samples in flight fail, the next ones go to a store
    created again at the same path (what was committed went with the folder)."""
    monkeypatch.setattr(capture_module, "REOPEN_BACKOFF_S", (0.05, 0.2))
    store = tmp_path / "store"
    model, hook = hooked_model(store, flush_interval_s=0.1)
    prompts = {f"gone-{i}": make_sample(64, seed=i) for i in range(20)}
    before, after = list(prompts)[:10], list(prompts)[10:]
    with caplog.at_level(logging.WARNING, logger="hsdata.extract.capture"):
        for rid in before:
            forward(model, ForwardMode.EXTEND, [(rid, 0, 64)], prompts)
        deadline = time.monotonic() + 60
        while not ((store / "zarr.json").exists() and len(hsdata.open(str(store))) == len(before)):
            assert time.monotonic() < deadline, "the first samples were not committed in 60 s"
            time.sleep(0.05)
        shutil.rmtree(store)
        for rid in after:  # the first ones meet the removed folder
            forward(model, ForwardMode.EXTEND, [(rid, 0, 64)], prompts)
            time.sleep(0.1)
        capture = hook.capture
        hook.close()
    opened = hsdata.open(str(store))
    assert set(opened.sample_ids) <= set(after) and len(opened) >= len(after) - 3, sorted(opened.sample_ids)
    assert len(opened) + capture.samples_failed == len(after)
    for rid in opened.sample_ids:
        assert_same(opened.get(rid), {k: v for k, v in prompts[rid].items() if k != "loss_mask"})
    assert validate(str(store)).ok
    said = [r.getMessage() for r in caplog.records]
    assert any("capture resumed in a fresh part" in line for line in said) and len(said) <= 6, said


@pytest.mark.parametrize("policy", ["block", "block, max_wait_s 0.3", "drop"])
def test_a_store_slower_than_the_model_blocks_or_drops_as_configured(s3, proxy, policy, caplog):  # noqa: F811
    """Backpressure (issue 29): an S3 store whose every write takes 0.5 s (about 2 MiB/s) under chunked prefill
    at ~20 MiB/s. "block" loses nothing and the forwards wait; with ``max_wait_s`` no forward waits much longer
    than it; "drop" never makes a forward wait. Dropped requests lose all their pieces (earlier and later ones),
    what is stored is whole and exact, and staged host memory stays within ``max_staged_bytes``."""
    proxy["state"].delay_s = 0.5
    config = {"storage_options": {**proxy["options"], "default_block_size": 5 << 20},  # s3fs's smallest part
              "max_staged_bytes": 1 << 20, "flush_interval_s": 0.2,
              "on_backpressure": policy.split(",")[0], **({"max_wait_s": 0.3} if "max_wait_s" in policy else {})}
    store = f"s3://{BUCKET}/slow-{policy.replace(' ', '').replace(',', '-')}"
    model, hook = hooked_model(store, **config)
    prompts = {f"slow-{i}": make_sample(2048, seed=i) for i in range(40)}  # 528 KiB of states each
    started, waits = [], []
    model.logits_processor.register_forward_pre_hook(lambda *_: started.append(time.monotonic()))
    model.logits_processor.register_forward_hook(lambda *_: waits.append(time.monotonic() - started[-1]))
    with caplog.at_level(logging.WARNING, logger="hsdata.extract.capture"):
        serve(model, prompts, chunk=512, budget=1024, decode_every=1000)  # 2 requests a forward, 4 pieces each
        capture = hook.capture
        hook.close()
    later = max(waits[1:])  # the first forward creates the store
    stored = hsdata.open(store, storage_options=s3["options"])
    assert len(stored) == capture.samples_written and len(stored) + capture.samples_dropped == len(prompts)
    for rid in stored.sample_ids:
        assert_same(stored.get(rid), {k: v for k, v in prompts[rid].items() if k != "loss_mask"})
    assert validate(store, storage_options=s3["options"]).ok
    dropped = [r.getMessage() for r in caplog.records if "requests dropped" in r.getMessage()]
    if policy == "block":
        assert capture.samples_dropped == 0 and later > 0.5, later  # nothing lost; the forwards waited
        assert not dropped
    else:
        assert capture.samples_dropped > 0 and 0 < len(dropped) <= 2, dropped  # once, then the counts at close
        assert later < (1.0 if "max_wait_s" in policy else 0.25), later
    assert 0 < capture.peak_staged_bytes <= capture.max_staged_bytes


def test_a_dropped_or_completed_request_sent_again_is_assembled_again(caplog):
    """The assembler's bookkeeping under faults: a dropped request's later chunks are ignored without the
    radix-cache warning, and the same request sent again (the client's retry) is assembled anew; so is a
    completed one (its write may have failed): the writer refuses a duplicate of what its store holds."""
    assembler = Assembler()
    rows = make_sample(8, seed=0)

    def piece(start, length):
        args = rows["input_ids"][start:start + length], rows["aux_hidden_states"][start:start + length]
        return assembler.add(Piece("r", start, 0, length), 8, *args, rows["hidden_states"][start:start + length])

    with caplog.at_level(logging.WARNING, logger="hsdata.extract.capture"):
        assert piece(0, 4) is None
        assembler.drop("r")
        assert piece(4, 4) is None and assembler.in_progress == 0  # the rest of the dropped prefill
        assert piece(0, 4) is None and piece(4, 4) is not None  # sent again: whole
        done = piece(0, 8)
    assert done is not None and torch.equal(done.hidden_states, rows["hidden_states"])
    assert not caplog.records
