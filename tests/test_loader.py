"""The training read path: batches read straight into their place in every layout (hsdata.torch.Loader, and a plain
DataLoader with collate_eagle3), in the training process and in DataLoader workers (fork, spawn, forkserver);
memory reused only once nothing refers to it, flat across epochs; exact resume; batches moved to a GPU ahead."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

import pytest
import torch
from torch.utils.data import DataLoader

import hsdata
from conftest import AUX, HIDDEN, make_sample, write_store
from hsdata.io import segments
from hsdata.layout import shard_key
from hsdata.shard import token_ranges
from hsdata.torch import (Eagle3Dataset, Loader, Mixture, ShardAwareSampler, TokenBudgetBatchSampler,
                          collate_eagle3, pack_eagle3, to_device)
from hsdata.torch.batches import Layout, on_device
from hsdata.torch.device import _TakenAhead

LENGTHS = [3 + (i * 53) % 120 for i in range(96)]
MAX_LENGTH = 100
LAYOUTS = {  # name: (Loader options, batch size)
    "one": ({}, 1),
    "padded": ({}, 4),
    "pad8": ({"pad_to_multiple_of": 8}, 4),
    "specforge": ({"convention": "specforge"}, 3),
    "modelopt": ({"convention": "modelopt"}, 16),
    "packed": ({"pack": True}, 5),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    samples = {f"s{i:03d}": make_sample(n, seed=i) for i, n in enumerate(LENGTHS)}
    path = tmp_path_factory.mktemp("loader") / "store"
    write_store(path, samples, shard_tokens=512, chunk_tokens=16)
    return str(path), samples


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    """About 45 MiB of states per epoch (H = 512): the epochs wrap a 16 MiB ring, so memory is reused."""
    samples = {f"w{i:03d}": make_sample(10 + (i * 89) % 240, seed=i, hidden=512) for i in range(96)}
    path = tmp_path_factory.mktemp("loader-wide") / "store"
    with hsdata.create(str(path), hidden_size=512, aux_layers=[1, 4, 6], shard_tokens=4096) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    return str(path), samples


def item_of(sample_id: str, sample: dict, max_length: int | None = MAX_LENGTH) -> dict:
    n = len(sample["input_ids"]) if max_length is None else min(max_length, len(sample["input_ids"]))
    return {"sample_id": sample_id, "input_ids": sample["input_ids"][:n].long(),
            "loss_mask": sample["loss_mask"][:n].long(), "aux_hidden_states": sample["aux_hidden_states"][:n],
            "hidden_states": sample["hidden_states"][:n], "attention_mask": torch.ones(n, dtype=torch.int64),
            "position_ids": torch.arange(n)}


def reference(ids: list[str], samples: dict, options: dict, max_length: int | None = MAX_LENGTH) -> dict:
    """What collating the source samples gives (the copy path, from tensors in memory)."""
    items = [item_of(i, samples[i], max_length) for i in ids]
    if options.get("pack"):
        return pack_eagle3(items)
    return collate_eagle3(items, **options)


def flip(url: str, sample_id: str, tensor_name: str, token: int) -> None:
    """Flip a bit of one token's row of a tensor of a sample, on disk."""
    store = hsdata.open(url)
    part, offset, _ = store.location(store.index(sample_id))
    tensor = store.spec.tensor(tensor_name)
    r = token_ranges(store.spec, tensor, offset + token, 1)[0]
    with open(os.path.join(url, shard_key(part, tensor, r.shard)), "r+b") as f:
        f.seek(r.file_start)
        byte = f.read(1)
        f.seek(r.file_start)
        f.write(bytes([byte[0] ^ 0x01]))


def assert_equal(got, want, where: str = "batch") -> None:
    """Bit-exact equality of nested batches (floats by bit pattern), keys and values alike."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for key in want:
            assert_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, torch.Tensor):
        got = got.cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape, want.shape)
        if want.is_floating_point():
            bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
            got, want = got.view(bits), want.view(bits)
        assert torch.equal(got, want), where
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_equal_collating_the_samples(store, layout, workers):
    url, samples = store
    options, batch_size = LAYOUTS[layout]
    dataset = Eagle3Dataset(url, max_length=MAX_LENGTH)
    sampler = ShardAwareSampler(dataset, seed=4)
    loader = Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                    multiprocessing_context="fork" if workers else None, **options)
    batches = list(loader)
    assert len(batches) == len(loader) == -(-len(samples) // batch_size)
    order = [dataset.sample_ids[i] for i in ShardAwareSampler(dataset, seed=4)]  # every sample once, in order
    for k, batch in enumerate(batches):
        assert_equal(batch, reference(order[k * batch_size : (k + 1) * batch_size], samples, options), f"batch {k}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_batch_crosses_to_the_gpu_without_its_padding_and_is_padded_there(store, layout):
    """What the Loader sends a CUDA device (``stored=True``) holds each sample's states once, end to end; on the
    device (here the CPU stands in) :func:`on_device` pads them into the batch collating the samples gives."""
    url, samples = store
    options, batch_size = LAYOUTS[layout]
    dataset = Eagle3Dataset(url, max_length=MAX_LENGTH)
    positions = list(range(7, 7 + batch_size))
    garbage = lambda n: torch.full((n,), 0xFF, dtype=torch.uint8)  # recycled memory: padding is written, not assumed
    crossing = dataset.start_batch(positions, Layout(**options), garbage, stored=True).result().stored()
    tokens = sum(int(dataset.lengths[i]) for i in positions)
    for name, width in (("aux_hidden_states", len(AUX) * HIDDEN), ("hidden_states", HIDDEN)):
        assert crossing["tensors"][name].numel() == tokens * width, name
    ids = [dataset.sample_ids[i] for i in positions]
    assert_equal(on_device(crossing, dataset.spec), reference(ids, samples, options))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_with_collate_eagle3_gets_the_batch_read_in_place(store, workers):
    url, samples = store
    dataset = Eagle3Dataset(url, max_length=MAX_LENGTH)
    for convention, multiple in (("hsdata", 1), ("specforge", 1), ("modelopt", 1), ("hsdata", 8)):
        loader = DataLoader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=1), num_workers=workers,
                            multiprocessing_context="fork" if workers else None,
                            collate_fn=lambda items, c=convention, m=multiple: collate_eagle3(
                                items, convention=c, pad_to_multiple_of=m))
        order = [dataset.sample_ids[i] for i in ShardAwareSampler(dataset, seed=1)]
        options = {"convention": convention, "pad_to_multiple_of": multiple}
        for k, batch in enumerate(loader):
            assert_equal(batch, reference(order[4 * k : 4 * k + 4], samples, options))
        assert k == len(samples) // 4 - 1
    items = dataset.__getitems__([5, 9, 2])
    batch = collate_eagle3(items)
    assert batch["aux_hidden_states"].data_ptr() == items[0]["aux_hidden_states"].data_ptr()  # no copy
    assert collate_eagle3(items, pad_to_multiple_of=7)["aux_hidden_states"].data_ptr() != \
        items[0]["aux_hidden_states"].data_ptr()  # another width: copied, same values
    items[1] = dict(items[1], aux_hidden_states=items[1]["aux_hidden_states"] + 1)  # changed items are copied
    changed = collate_eagle3(items)
    assert torch.equal(changed["aux_hidden_states"][1, :5], items[1]["aux_hidden_states"][:5])


def test_a_mixture_and_a_token_budget_sampler_read_in_place_too(store, tmp_path):
    url, samples = store
    other = {f"o{i:02d}": make_sample(7 + i, seed=100 + i) for i in range(20)}
    write_store(tmp_path / "other", other)
    mixture = Mixture([Eagle3Dataset(url, max_length=MAX_LENGTH), Eagle3Dataset(str(tmp_path / "other"))])
    everything = {**samples, **other}
    loader = Loader(mixture, batch_size=6, sampler=ShardAwareSampler(mixture, seed=2))
    batches = list(loader)
    assert sorted(i for batch in batches for i in batch["sample_id"]) == sorted(everything)
    for batch in batches:
        ids = batch["sample_id"]
        want = collate_eagle3([item_of(i, everything[i], MAX_LENGTH if i in samples else None) for i in ids])
        assert_equal(batch, want)
    dataset = Eagle3Dataset(url, max_length=64)
    budget = Loader(dataset, batch_sampler=TokenBudgetBatchSampler(dataset, max_tokens=300, seed=0))
    seen = []
    for batch in budget:
        assert batch["input_ids"].numel() <= 300 or len(batch["sample_id"]) == 1
        assert_equal(batch, reference(batch["sample_id"], samples, {}, max_length=64))
        seen += batch["sample_id"]
    assert sorted(seen) == sorted(samples)


def _memory_seen(loader) -> dict:
    """The arenas batches have lain in so far, by identity: the loader's ring, the dataset's, or the ones
    workers lent this process."""
    ring = getattr(loader, "_buffers", None) or getattr(loader.dataset, "_buffers", None)
    arenas = {("ring", a.number): a.size for a in ring._arenas} if ring is not None else {}
    return {**arenas, **{key: len(buffer) for key, (buffer, _) in segments.borrower()._mapped.items()}}


def _kept_and_checked(loader, sampler, samples, epochs: int) -> tuple[int, int, int]:
    """Run ``epochs`` epochs keeping every 13th batch and views of others alive to the end, then check each kept
    tensor against the source; the number checked, the bytes of all batches, and the bytes of all the memory
    they lay in."""
    kept, views, delivered, memory = [], [], 0, {}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for k, batch in enumerate(loader):
            delivered += batch["aux_hidden_states"].nbytes + batch["hidden_states"].nbytes
            memory.update(_memory_seen(loader))
            if k % 13 == 0:
                kept.append(batch)
            elif k % 11 == 0:  # a view of one sample's rows outlives its batch
                n = min(MAX_LENGTH, len(samples[batch["sample_id"][0]]["input_ids"]))
                views.append((batch["sample_id"][0], batch["aux_hidden_states"][0, :n].view(torch.int16)))
            del batch
    for batch in kept:
        assert_equal(batch, collate_eagle3([item_of(i, samples[i]) for i in batch["sample_id"]]))
    for sample_id, view in views:
        n = len(view)
        assert torch.equal(view, samples[sample_id]["aux_hidden_states"][:n].view(torch.int16)), sample_id
    return len(kept) + len(views), delivered, sum(memory.values())


@pytest.mark.parametrize("mode", ["threads", "fork", "spawn", "forkserver", "dataloader-fork", "dataloader-spawn"])
def test_batches_kept_alive_stay_intact_while_the_memory_of_others_is_reused(wide_store, mode):
    url, samples = wide_store
    dataset = Eagle3Dataset(url, max_length=MAX_LENGTH, pin_memory=False)
    sampler = ShardAwareSampler(dataset, seed=3)
    if mode.startswith("dataloader"):
        loader = DataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=collate_eagle3, num_workers=2,
                            multiprocessing_context=mode.split("-")[1], persistent_workers=True)
    else:
        workers = 0 if mode == "threads" else 2
        loader = Loader(dataset, batch_size=3, sampler=sampler, num_workers=workers,
                        multiprocessing_context=None if mode == "threads" else mode,
                        persistent_workers=True, prefetch_bytes=8 << 20)
    checked, delivered, memory = _kept_and_checked(loader, sampler, samples, epochs=5)
    assert checked > 20
    assert memory < 0.6 * delivered, (memory >> 20, delivered >> 20)  # dropped batches' memory was filled again


def _memory() -> dict[str, int]:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return {"rss": int(status["VmRSS"].split()[0]) << 10, "shared": segments.borrower().mapped_bytes}


@pytest.mark.parametrize("mode", ["threads", "workers", "dataloader"])
def test_five_epochs_keep_resident_pinned_and_shared_memory_flat(wide_store, mode):
    url, _ = wide_store
    cuda = torch.cuda.is_available()
    dataset = Eagle3Dataset(url)
    sampler = ShardAwareSampler(dataset, seed=0)
    if mode == "dataloader":
        loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=collate_eagle3, num_workers=2,
                            multiprocessing_context="fork", persistent_workers=True, pin_memory=cuda)
    else:
        loader = Loader(dataset, batch_size=2, sampler=sampler, num_workers=0 if mode == "threads" else 2,
                        multiprocessing_context="fork", device="cuda" if cuda else None,
                        persistent_workers=True)
    after = []
    for epoch in range(5):
        sampler.set_epoch(epoch)
        for batch in loader:
            pass
        del batch
        ring = getattr(loader, "_buffers", None) or getattr(dataset, "_buffers", None)
        after.append({**_memory(), "pinned": ring.held_bytes if ring is not None and ring.pinned else 0,
                      "ring": ring.held_bytes if ring is not None else 0})
    for name in ("rss", "shared", "pinned", "ring"):
        first, later = after[1][name], max(a[name] for a in after[2:])
        assert later <= first * 1.05 + (24 << 20), (name, [a[name] >> 20 for a in after])
    if mode != "threads":
        assert after[-1]["shared"] > 0  # the workers' batches came through shared memory
    if cuda and mode != "dataloader":
        assert after[-1]["pinned"] > 0 or after[-1]["shared"] > 0


def test_the_loader_resumes_where_the_loop_stopped_with_workers_and_prefetch(store):
    url, samples = store
    dataset = Eagle3Dataset(url)

    def make(workers):
        sampler = ShardAwareSampler(dataset, seed=9)
        return sampler, Loader(dataset, batch_size=5, sampler=sampler, num_workers=workers,
                               multiprocessing_context="fork")

    for workers in (0, 2):
        sampler, loader = make(workers)
        sampler.set_epoch(1)
        seen = []
        for k, batch in enumerate(loader):
            seen += batch["sample_id"]
            if k == 3:
                state = loader.state_dict()  # 20 samples, whatever the workers read ahead
                break
        assert state["consumed"] == 20 and state["epoch"] == 1
        sampler, loader = make(workers)
        loader.load_state_dict(state)
        loader.set_epoch(1)
        seen += [i for batch in loader for i in batch["sample_id"]]
        assert sorted(seen) == sorted(samples)


def test_a_corrupt_sample_is_replaced_in_place_with_on_error_skip(tmp_path):
    samples = {f"c{i:02d}": make_sample(30 + i, seed=i) for i in range(24)}
    write_store(tmp_path / "s", samples)
    flip(str(tmp_path / "s"), "c05", "hidden_states", 3)
    for workers in (0, 2):
        dataset = Eagle3Dataset(str(tmp_path / "s"), on_error="skip")
        loader = Loader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=0), num_workers=workers,
                        multiprocessing_context="fork")
        seen = [i for batch in loader for i in batch["sample_id"]]
        assert "c05" not in seen and len(seen) == 24 and len(set(seen)) == 23  # its neighbour stood in
    strict = Loader(Eagle3Dataset(str(tmp_path / "s")), batch_size=4)  # (a worker's error: torch re-raises it)
    with pytest.raises(hsdata.CorruptDataError, match="c05"):
        list(strict)


def test_reading_into_given_rows_checks_the_whole_sample_and_reads_no_more_without_verify(store):
    url, samples = store
    s = hsdata.open(url)
    i = s.index("s007")
    n = len(samples["s007"]["input_ids"])
    head = torch.empty(n // 2, s.spec.tensor("aux_hidden_states").width, dtype=torch.bfloat16)
    got = s.read_many([i], out=[{"aux_hidden_states": head}], inline=True)[0]
    assert got["aux_hidden_states"] is head
    assert torch.equal(head.view(torch.int16), samples["s007"]["aux_hidden_states"][: n // 2].view(torch.int16))
    for bad, why in ((torch.empty(n + 1, head.shape[1], dtype=torch.bfloat16), "at most"),
                     (torch.empty(3, head.shape[1], dtype=torch.float32), "bfloat16"),
                     (torch.empty(3, head.shape[1] * 2, dtype=torch.bfloat16)[:, ::2], "contiguous")):
        with pytest.raises(ValueError, match=why) as e:
            s.read_many([i], out=[{"aux_hidden_states": bad}])
        assert "s007" in str(e.value)
    with pytest.raises(ValueError, match="entries"):
        s.read_many([i, i], out=[{}])


def test_rows_past_the_given_ones_are_read_to_verify_and_skipped_without(tmp_path):
    samples = {f"t{i}": make_sample(60, seed=i) for i in range(3)}
    write_store(tmp_path / "s", samples)
    flip(str(tmp_path / "s"), "t1", "aux_hidden_states", 50)  # past the first 40 rows
    width = hsdata.open(str(tmp_path / "s")).spec.tensor("aux_hidden_states").width
    for verify in (True, False):
        s = hsdata.open(str(tmp_path / "s"), verify=verify)
        head = torch.empty(40, width, dtype=torch.bfloat16)
        if verify:
            with pytest.raises(hsdata.CorruptDataError, match="t1.*aux_hidden_states does not match"):
                s.read_many([1], out=[{"aux_hidden_states": head}])
        else:
            s.read_many([1], out=[{"aux_hidden_states": head}])
            assert torch.equal(head.view(torch.int16), samples["t1"]["aux_hidden_states"][:40].view(torch.int16))
    truncated = Eagle3Dataset(str(tmp_path / "s"), max_length=40, verify=False)
    assert_equal(next(iter(Loader(truncated, batch_size=3))),
                 collate_eagle3([item_of(f"t{i}", samples[f"t{i}"], 40) for i in range(3)]))


def test_bad_loader_arguments_say_what_is_wrong(store):
    url, _ = store
    dataset = Eagle3Dataset(url)
    with pytest.raises(TypeError, match="Eagle3Dataset or Mixture"):
        Loader(list(range(4)))
    with pytest.raises(ValueError, match="exclusive"):
        Loader(dataset, batch_size=2, batch_sampler=TokenBudgetBatchSampler(dataset, max_tokens=100))
    with pytest.raises(ValueError, match="packed"):
        Loader(dataset, pack=True, convention="specforge")
    with pytest.raises(ValueError, match="convention"):
        Loader(dataset, convention="megatron")
    with pytest.raises(ValueError, match="batch_size"):
        Loader(dataset, batch_size=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        collate_eagle3([item_of("x", make_sample(3, 0))], pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="empty"):
        collate_eagle3([])


# torch's SIGCHLD handler may raise again while the iterator shuts the dead worker's pool down (in its __del__:
# "Exception ignored"), whatever the dataset
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_killed_worker_stops_the_loop_and_its_memory_goes_at_the_next_batch(wide_store):
    """A worker killed with a batch on its way: the loop raises torch's "DataLoader worker ..." error (or hsdata's,
    naming the worker, when the batch's memory cannot be fetched from it any more), and its memory goes."""
    url, _ = wide_store
    dataset = Eagle3Dataset(url)
    loader = Loader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    pids = list(segments.borrower()._pipes)
    before = segments.borrower().mapped_bytes
    assert pids and before > 0
    with pytest.raises(RuntimeError, match="DataLoader worker"):  # torch's SIGCHLD handler: raised anywhere
        os.kill(pids[0], signal.SIGKILL)
        for _ in batches:
            pass
    batches.close()  # the DataLoader's iterator goes: torch no longer watches the dead worker
    loader.close()
    del batches
    gc.collect()
    again = Loader(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork")
    first = next(iter(again))
    assert first["sample_id"]
    assert not any(key[0] in pids for key in segments.borrower()._mapped)  # the dead worker's memory went


def test_to_device_moves_nested_batches_and_keeps_other_values():
    batches = [{"a": torch.arange(4), "n": {"b": torch.ones(2)}, "ids": ["x"], "flag": False}] * 3
    moved = list(to_device(batches, "cpu"))
    assert len(moved) == 3 and moved[0]["ids"] == ["x"] and moved[0]["flag"] is False
    assert torch.equal(moved[0]["n"]["b"], torch.ones(2))
    with pytest.raises(ValueError, match="ahead"):
        list(to_device(batches, "cpu", ahead=-1))


def test_batches_are_taken_ahead_on_a_thread_in_order_with_errors_passed_on_and_the_source_closed():
    taken, closed = [], []

    def batches(fail_at):
        try:
            for k in range(6):
                if k == fail_at:
                    raise ValueError(f"batch {k} is bad")
                taken.append(threading.current_thread().name)
                yield k
        finally:
            closed.append(fail_at)

    ahead = _TakenAhead(batches(None))
    assert list(ahead) == list(range(6)) and next(ahead, "end") == "end"
    assert set(taken) == {"hsdata-host-batches"}
    ahead.close()
    failing = _TakenAhead(batches(3))
    with pytest.raises(ValueError, match="batch 3 is bad"):
        list(failing)
    stopped = _TakenAhead(batches(None))
    assert next(stopped) == 0
    stopped.close()  # while its thread waits to hand over a batch
    assert not stopped._thread.is_alive() and closed == [None, 3, None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_reach_the_gpu_from_pinned_memory_on_a_side_stream(store, workers):
    url, samples = store
    dataset = Eagle3Dataset(url, max_length=MAX_LENGTH)
    loader = Loader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=5), num_workers=workers,
                    multiprocessing_context="fork", device="cuda", ahead=2)
    seen = []
    for batch in loader:
        assert batch["aux_hidden_states"].is_cuda
        torch.cuda._sleep(1_000_000)  # a step: the next copies overlap it
        assert_equal(batch, reference(batch["sample_id"], samples, {}))
        seen += batch["sample_id"]
    assert sorted(seen) == sorted(samples)
    host = Loader(dataset, batch_size=4, num_workers=workers, multiprocessing_context="fork", pin_memory=True)
    assert all(b["aux_hidden_states"].is_pinned() for b in host)


if sys.platform != "linux":  # memfd_create and /proc
    pytestmark = pytest.mark.skip(reason="the read path's shared memory needs Linux")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_device_passes_errors_on_and_closes_its_source_when_the_loop_stops():
    closed = []

    def batches(fail_at):
        try:
            for k in range(10):
                if k == fail_at:
                    raise ValueError(f"batch {k} is bad")
                yield {"x": torch.full((4,), k).pin_memory(), "k": k}
        finally:
            closed.append(fail_at)

    with pytest.raises(ValueError, match="batch 3 is bad"):
        for batch in to_device(batches(3), "cuda", ahead=2):
            assert batch["x"].is_cuda and int(batch["x"][0]) == batch["k"]
    for batch in to_device(batches(None), "cuda", ahead=0):
        if batch["k"] == 2:
            break
    assert closed == [3, None]  # the source is closed before the loop goes on
    assert [b["k"] for b in to_device(batches(None), "cuda", ahead=1)] == list(range(10))
