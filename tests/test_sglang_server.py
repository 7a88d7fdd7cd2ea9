"""The hook inside a real ``sglang.launch_server`` (0.5.23, generic CPU platform), driven by ``hsdata extract
--server`` as a user runs it. Servers start in 25-60 s here, so the reference server is shared by the tests of
this module; the chunked-prefill, restart and data-parallel tests start their own."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import resize_filesystem
from test_remote import BUCKET, s3  # noqa: F401 - s3 is a fixture (moto server on loopback)
from test_remote_faults import proxy  # noqa: F401 - a fixture: a fault-injecting proxy in front of s3
from sglang_server import AUX_LAYER_IDS, Server, make_model

import hsdata
from hsdata.extract import demo
from hsdata.extract.client import RID_PREFIX, hook_counters
from hsdata.validate import validate

REPEATS = 3  # the demo conversations, each under REPEATS ids: 72 samples of 30-110 tokens


def run_hsdata(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdata", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def extract(server: Server, data: Path, store: Path, *extra) -> subprocess.CompletedProcess:
    return run_hsdata("extract", "--server", server.url, "--data", data, "--tokenizer", server.model, "--out", store,
                      "--commit-timeout", "30", *extra)


def wait_for(condition, timeout: float = 60.0):
    """Poll ``condition()`` until it returns something true (a store not created yet counts as false)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except hsdata.NotAStoreError:
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


def state_error(got: dict, want: dict) -> float:
    """The larger relative L2 error of a sample's aux and final states against another server's."""
    return max(relative_error(got[name], want[name]) for name in ("aux_hidden_states", "hidden_states"))


def store_with(store: Path, sample_id: str) -> hsdata.Store | None:
    """The store once ``sample_id`` is committed in it, else None."""
    opened = hsdata.open(str(store))
    return opened if sample_id in opened else None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang")


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    return make_model(workdir / "tiny-llama")


@pytest.fixture(scope="module")
def data(workdir) -> Path:
    rows = [json.loads(line) for line in Path(demo.data_path()).read_text().splitlines() if line.strip()]
    path = workdir / "conversations.jsonl"
    path.write_text("".join(json.dumps({**row, "id": f"{row['id']}-{k}"}) + "\n"
                            for k in range(REPEATS) for row in rows))
    return path


@pytest.fixture(scope="module")
def reference(workdir, model, data):
    """A server with the default chunked-prefill size (4096: no prompt here is chunked) and its extraction."""
    store = workdir / "reference"
    with Server(model, store, workdir / "reference.log") as server:
        result = extract(server, data, store)
        assert result.returncode == 0, result.stdout + result.stderr + server.log_tail()
        yield server, store, result


def test_extraction_commits_every_sample_with_the_in_process_engines_ids_and_masks(reference, workdir, model, data):
    server, store, result = reference
    samples = len(data.read_text().splitlines())
    assert f"OK: {samples} samples: 0 already in the store, {samples} sent" in result.stdout
    checked = run_hsdata("validate", store)
    assert checked.returncode == 0 and checked.stdout.startswith("OK"), checked.stdout + checked.stderr

    in_process = workdir / "in-process"
    engine = run_hsdata("extract", "--engine", "hf", "--model", model, "--data", data, "--out", in_process,
                        "--aux-layers", *AUX_LAYER_IDS)
    assert engine.returncode == 0, engine.stdout + engine.stderr
    served, local = hsdata.open(str(store)), hsdata.open(str(in_process))
    assert sorted(served.sample_ids) == sorted(local.sample_ids)
    assert served.spec.aux_layers == local.spec.aux_layers == tuple(AUX_LAYER_IDS)
    assert served.spec.vocab_size == local.spec.vocab_size is not None  # the model's, recorded by both
    for sample_id in local.sample_ids:
        got, want = served.get(sample_id), local.get(sample_id)
        assert torch.equal(got["input_ids"], want["input_ids"]), sample_id
        assert torch.equal(got["loss_mask"], want["loss_mask"]), sample_id
        # SGLang's kernels are not transformers': equal up to bf16 rounding (measured <= 0.62%), not bit for bit
        assert relative_error(got["aux_hidden_states"], want["aux_hidden_states"]) < 0.01, sample_id
        assert relative_error(got["hidden_states"], want["hidden_states"]) < 0.01, sample_id


def test_rows_sglang_returns_with_return_hidden_states_are_stored_bit_identical(reference):
    server, store, _ = reference
    ids = list(range(5, 60))
    reply = server.post("/generate", {"input_ids": ids, "rid": f"{RID_PREFIX}returned-1", "return_hidden_states": True,
                                      "sampling_params": {"max_new_tokens": 1}})
    (rows,) = reply["meta_info"]["hidden_states"]  # the prompt's aux rows, as SGLang computed them
    returned = torch.tensor(rows, dtype=torch.float32)
    opened = wait_for(lambda: store_with(store, "returned-1"))
    assert opened, server.log_tail()
    stored = opened.get("returned-1")
    assert stored["input_ids"].tolist() == ids
    assert returned.shape == stored["aux_hidden_states"].shape == (len(ids), len(AUX_LAYER_IDS) * 64)
    assert torch.equal(returned.to(torch.bfloat16).view(torch.int16), stored["aux_hidden_states"].view(torch.int16))


def test_the_store_holds_exactly_the_clients_samples(reference, workdir):
    """SGLang's warm-up request and health probes, and other clients' requests sent while the extraction runs,
    reach the hook as prefill forwards; none of them becomes a sample."""
    server, store, _ = reference
    more = workdir / "more.jsonl"
    more.write_text("".join(json.dumps({"id": f"alongside-{i}", "input_ids": list(range(3, 40 + i))}) + "\n"
                            for i in range(16)))
    stop, errors = threading.Event(), []

    def other_traffic():
        n = 0
        while not stop.is_set():
            try:
                server.get("/health_generate")
                server.get("/health")
                server.post("/generate", {"text": f"unrelated prompt {n}", "sampling_params": {"max_new_tokens": 2}})
                server.post("/generate", {"input_ids": [7] * (5 + n), "rid": f"other-client-{n}",
                                          "sampling_params": {"max_new_tokens": 0}})
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)
            n += 1

    traffic = threading.Thread(target=other_traffic)
    traffic.start()
    try:
        result = extract(server, more, store, "--concurrency", "2")
    finally:
        stop.set()
        traffic.join()
    assert result.returncode == 0 and not errors, result.stdout + result.stderr + repr(errors)
    time.sleep(1.5)  # three flush intervals: anything stored by then is visible
    expected = {json.loads(line)["id"] for path in (workdir / "conversations.jsonl", more)
                for line in path.read_text().splitlines()} | {"returned-1"}
    opened = hsdata.open(str(store))
    assert set(opened.sample_ids) == expected | ({"returned-1"} & set(opened.sample_ids))
    assert len(opened.manifest) == len(set(opened.sample_ids))


def test_the_client_refuses_a_server_that_writes_another_store(reference, tmp_path):
    server, store, _ = reference
    other = tmp_path / "other"
    result = extract(server, Path(demo.data_path()), other)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (f"hsdata extract: error: the server's hsdata hook writes "
                                                      f"{str(store)!r}, not {str(other)!r}: pass --out {store}")
    assert not other.exists()


def test_chunked_prefill_then_a_killed_server_and_a_resume(workdir, model, data, reference):
    """Two chunk sizes small enough that every request spans several forwards and batches hold several requests;
    the first server is killed mid-run, a second one (other chunk size) serves the resumed run."""
    _, reference_store, _ = reference
    store = workdir / "chunked"
    samples = len(data.read_text().splitlines())
    first = Server(model, store, workdir / "chunk-16.log", extra=["--chunked-prefill-size", "16"]).start()
    try:
        client = subprocess.Popen([sys.executable, "-m", "hsdata", "extract", "--server", first.url, "--data",
                                   str(data), "--tokenizer", str(model), "--out", str(store), "--concurrency", "4",
                                   "--retries", "1", "--commit-timeout", "3"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: len(hsdata.open(str(store))) >= samples // 4)
        first.kill()
        committed_before_kill = len(hsdata.open(str(store)))
        out, err = client.communicate(timeout=120)
    finally:
        first.kill()
    assert samples // 4 <= committed_before_kill < samples
    assert client.returncode == 1 and "FAILED" in out, out + err
    batches = [int(n) for n in re.findall(r"Prefill batch, #new-seq: (\d+)", first.log_path.read_text())]
    assert max(batches) >= 2, "no prefill batch held several requests"

    with Server(model, store, workdir / "chunk-48.log", extra=["--chunked-prefill-size", "48"]) as second:
        resumed = extract(second, data, store, "--concurrency", "4")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    already = int(re.search(r"(\d+) already in the store", resumed.stdout).group(1))
    assert already == committed_before_kill  # what the killed server committed is kept, not sent again

    opened, want = hsdata.open(str(store)), hsdata.open(str(reference_store))
    assert sorted(opened.sample_ids) == sorted(json.loads(line)["id"] for line in data.read_text().splitlines())
    assert len(opened.manifest) == samples  # each sample committed once
    assert len(set(opened.manifest.column("part").to_pylist())) == 2
    report = validate(str(store))
    assert report.ok, report.problems
    worst = 0.0
    for sample_id in opened.sample_ids:
        got, ref = opened.get(sample_id), want.get(sample_id)
        assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["loss_mask"], ref["loss_mask"])
        worst = max(worst, state_error(got, ref))
    assert worst < 0.01, f"chunked prefill changed the states by {worst:.4f} (relative L2; measured <= 0.0044)"


def test_two_data_parallel_schedulers_of_a_float32_server_write_one_part_each(workdir, model, data, reference):
    """``--dp-size 2`` on the CPU needs each rank's cores named (SGLang binds a rank per NUMA node otherwise)."""
    _, reference_store, _ = reference
    store = workdir / "dp2-float32"
    with Server(model, store, workdir / "dp2.log", dtype="float32", extra=["--dp-size", "2"],
                env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}) as server:
        result = extract(server, data, store, "--concurrency", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    opened, want = hsdata.open(str(store)), hsdata.open(str(reference_store))
    parts = Counter(opened.manifest.column("part").to_pylist())
    assert len(parts) == 2 and min(parts.values()) > 0, parts
    assert sum(parts.values()) == len(data.read_text().splitlines())
    assert (opened.spec.dtype, opened.spec.compute_dtype) == ("float32", "float32")
    report = validate(str(store))
    assert report.ok, report.problems
    worst = 0.0
    for sample_id in opened.sample_ids:
        got = opened.get(sample_id)
        assert got["hidden_states"].dtype == torch.float32
        worst = max(worst, state_error(got, want.get(sample_id)))
    assert worst < 0.01, (f"float32 states differ from the bfloat16 server's by {worst:.4f} "
                          "(relative L2; measured <= 0.0054)")


def test_an_fp8_server_stores_the_rows_of_what_it_computed_quantized(workdir, model, data, reference):
    """The hook's ``store_dtype``: SGLang's own rows (``return_hidden_states``) quantized as the writer does are the
    stored bytes, bit for bit; the extraction's states are the bf16 server's within fp8's error. (Sizes are
    measured in benchmarks/RESULTS.md: these tiny samples, committed every 0.5 s, are mostly chunk padding.)"""
    _, reference_store, _ = reference
    store = workdir / "fp8"
    ids = list(range(5, 60))
    with Server(model, store, workdir / "fp8.log", hook_config={"store_dtype": "float8_e4m3fn"}) as server:
        result = extract(server, data, store)
        assert result.returncode == 0, result.stdout + result.stderr + server.log_tail()
        reply = server.post("/generate", {"input_ids": ids, "rid": f"{RID_PREFIX}returned-fp8",
                                          "return_hidden_states": True, "sampling_params": {"max_new_tokens": 1}})
        assert wait_for(lambda: store_with(store, "returned-fp8")), server.log_tail()
    (rows,) = reply["meta_info"]["hidden_states"]
    returned = torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16)
    opened = hsdata.open(str(store))
    assert opened.spec.dtype == "float8_e4m3fn"
    stored = opened.read_arrays(opened.index("returned-fp8"))["aux_hidden_states"]
    expected = hsdata.codecs.quantize.quantize(returned, len(AUX_LAYER_IDS), "float8_e4m3fn").numpy()
    assert stored.shape == expected.shape and (stored == expected).all()
    report = validate(str(store))
    assert report.ok, report.problems
    want = hsdata.open(str(reference_store))
    extracted = [json.loads(line)["id"] for line in data.read_text().splitlines()]  # other tests add to the reference
    worst = max(state_error(opened.get(sample_id), want.get(sample_id)) for sample_id in extracted)
    assert worst < 0.05, f"fp8 states differ from the bf16 server's by {worst:.4f} (relative L2)"


def fill(folder: Path) -> Path:
    """Write a file into ``folder`` until its filesystem is full (another tenant filling the disk)."""
    ballast = folder / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == 28, e
    return ballast


def greedy(server: Server) -> list[int]:
    """A greedy generation by a request the hook does not store (another client's traffic)."""
    reply = server.post("/generate", {"input_ids": list(range(3, 40)), "rid": "not-stored-greedy",
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
    return reply["output_ids"]


def test_a_full_disk_or_a_removed_store_fails_its_samples_the_server_serves_on_and_a_rerun_completes_it(
        workdir, model, data, small_filesystem):
    """Issue 29: the store's disk fills midway (another file takes the space). The samples sent meanwhile fail,
    the client says so and exits 1; the server answers every request, /health stays 200, a greedy generation is
    the one made before, and the hook's log says each cause a few times, not once per sample; the client names
    the cause from the hook's counters on /metrics. Once the space is back, a rerun against the same server
    completes the store (24 of 24) and it validates. Then the store's folder is removed: the next run makes it
    again, 24 of 24."""
    resize_filesystem(small_filesystem, "64m")
    store = small_filesystem / "store"
    rows = data.read_text().splitlines()[:24]
    first_half, all_rows = workdir / "full-first.jsonl", workdir / "full-all.jsonl"
    first_half.write_text("\n".join(rows[:12]) + "\n")
    all_rows.write_text("\n".join(rows) + "\n")
    with Server(model, store, workdir / "full.log", extra=["--enable-metrics"]) as server:  # the hook's counters
        before = greedy(server)
        result = extract(server, first_half, store)
        assert result.returncode == 0, result.stdout + result.stderr + server.log_tail()
        ballast = fill(small_filesystem)

        full = extract(server, all_rows, store, "--commit-timeout", "5")
        assert full.returncode == 1, full.stdout + full.stderr
        assert "12 already in the store, 12 sent" in full.stdout and "12 failed" in full.stdout, full.stdout
        assert ("12 generated by the server but not stored: the server's hook counted during this run (a sample sent "
                "twice counts twice): 24 lost to write faults (writes fail: No space left on device (ENOSPC))"
                in full.stdout), full.stdout
        server.get("/health")  # raises unless 200
        assert greedy(server) == before

        ballast.unlink()
        rerun = extract(server, all_rows, store)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr + server.log_tail()
        assert "12 already in the store, 12 sent" in rerun.stdout and "12 committed, 0 failed" in rerun.stdout
        assert greedy(server) == before
        checked = run_hsdata("validate", store)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        opened = hsdata.open(str(store))
        assert sorted(opened.sample_ids) == sorted(json.loads(row)["id"] for row in rows)
        assert all(opened.get(sample_id)["loss_mask"] is not None for sample_id in opened.sample_ids)

        shutil.rmtree(store)  # the store's folder removed under the running server: it is made again
        again = extract(server, all_rows, store, "--commit-timeout", "5")  # the first ones meet the removal
        assert again.returncode == 0, again.stdout + again.stderr + server.log_tail()
        assert "0 already in the store, 24 sent" in again.stdout and "24 committed, 0 failed" in again.stdout
        assert greedy(server) == before
        said = [line for line in server.log_path.read_text().splitlines() if "hsdata:" in line]
    checked = run_hsdata("validate", store)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert sorted(hsdata.open(str(store)).sample_ids) == sorted(json.loads(row)["id"] for row in rows)
    faults = [line for line in said if "writes fail" in line or "takes no writes" in line]
    assert faults and len(faults) <= 10, "\n".join(said)


def test_sigterm_with_samples_staged_commits_them_and_nothing_half_written_shows(workdir, model):
    """SIGTERM to the server (what an orchestrator sends) while the hook holds samples it has not committed (the
    next commit is a minute away): SGLang stops its schedulers, the hook commits at exit, and the store is
    valid with every answered sample; a later kill -9 could only lose what is uncommitted (tested above)."""
    store = workdir / "sigterm"
    server = Server(model, store, workdir / "sigterm.log", hook_config={"flush_interval_s": 60}).start()
    try:
        sent = [f"term-{i}" for i in range(8)]
        for i, sample_id in enumerate(sent):
            server.post("/generate", {"input_ids": list(range(3, 40 + i)), "rid": f"{RID_PREFIX}{sample_id}",
                                      "sampling_params": {"max_new_tokens": 0}})
        assert wait_for(lambda: (store / "zarr.json").exists()), server.log_tail()
        assert len(hsdata.open(str(store))) == 0  # all of them staged or added, none committed yet
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
        exited = time.monotonic() - started
    finally:
        server.kill()
    report = validate(str(store))
    assert report.ok, report.problems
    assert sorted(hsdata.open(str(store)).sample_ids) == sorted(sent), server.log_tail()
    assert exited < 30, f"the server took {exited:.1f} s to stop"


def test_a_drop_server_never_waits_for_a_slow_store_and_the_client_says_what_was_dropped(workdir, model, data, s3,
                                                                                         proxy):
    """``on_backpressure="drop"`` in a real server whose store (S3 on loopback) takes 2 s a write, with 16 KiB
    staged (a sample or so): the server answers every request while commits take seconds, the samples it had no
    room for are dropped whole (what is stored validates), and the client exits 1 saying so from the hook's
    counters. (Measured: 47 of 216 stored, 169 not, in 23 s.)"""
    proxy["state"].delay_s = 2.0
    options = {**proxy["options"], "key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}
    store = f"s3://{BUCKET}/served-drop"
    config = {"storage_options": options, "on_backpressure": "drop", "max_staged_bytes": 16 << 10}
    flags = [f"--storage-option={key}={json.dumps(value)}" for key, value in options.items()]
    many = workdir / "drop.jsonl"  # 216 samples sent 2 at a time: forwards go on while a commit takes seconds
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    many.write_text("".join(json.dumps({**row, "id": f"{row['id']}-{k}"}) + "\n" for k in range(3) for row in rows))
    with Server(model, store, workdir / "drop.log", hook_config=config, extra=["--enable-metrics"]) as server:
        before = greedy(server)
        slow = extract(server, many, store, "--concurrency", "2", "--commit-timeout", "5", *flags)
        assert slow.returncode == 1, slow.stdout + slow.stderr + server.log_tail()
        assert f"{3 * len(rows)} sent" in slow.stdout, slow.stdout  # every request answered
        assert "dropped because the store was slower than the model" in slow.stdout, slow.stdout
        committed = int(re.search(r"(\d+) committed", slow.stdout).group(1))
        server.get("/health")  # raises unless 200
        assert greedy(server) == before
        said = [line for line in server.log_path.read_text().splitlines() if "hsdata:" in line]
    assert len(said) <= 10, "\n".join(said)  # the drops are logged once, then at most once a minute with counts
    proxy["state"].delay_s = 0.0
    checked = run_hsdata("validate", store, *flags)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    stored = hsdata.open(store, storage_options=options).sample_ids
    assert 0 < committed <= len(stored) < 3 * len(rows)  # a commit still under way when the client stopped waiting
    assert set(stored) <= {f"{row['id']}-{k}" for k in range(3) for row in rows}


def _hook_lines(server: Server) -> list[str]:
    return [line for line in server.log_path.read_text().splitlines() if "hsdata:" in line]


def _seconds(result: subprocess.CompletedProcess) -> float:
    """The run's duration as the client prints it (``..., in 12.3 s``)."""
    return float(re.search(r", in ([\d.]+) s$", result.stdout, re.MULTILINE).group(1))


def test_an_s3_store_failing_every_request_fails_its_samples_the_server_serves_on_and_a_rerun_completes_it(
        workdir, model, data, s3, proxy):
    """Issue 29: the hook's S3 store (on loopback, behind a proxy) answers every request 503 SlowDown midway, for
    longer than the retries last. The samples sent meanwhile fail, the client exits 1 naming how many and the
    cause from the hook's counters; every request is answered, /health stays 200, a greedy generation is the one
    made before, and the hook's log stays short. Once the store answers again, a rerun against the same server
    completes the store (24 of 24), which validates. The hook's botocore makes one attempt a request
    (``total_max_attempts``: 1; s3fs still tries a PutObject 5 times): with botocore's default 5, a commit took
    39 s to fail and each try to reopen the store 51 s, the test minutes. The client reads the store directly,
    not through the proxy (only the server's way to the store fails). (Measured: the hook counted 12 or 24 lost,
    each sample being sent twice, the second time meeting a reopen's 6 s of read retries or its backoff; the
    failing run 12-13 s, the rerun 2-3 s; 9 hook log lines, 5 of them one reopen's read retries.)"""
    options = {**proxy["options"], "key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"},
               "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    store = f"s3://{BUCKET}/served-outage"
    flags = [f"--storage-option={key}={json.dumps(value)}" for key, value in s3["options"].items()]
    rows = data.read_text().splitlines()[:24]
    first_half, all_rows = workdir / "outage-first.jsonl", workdir / "outage-all.jsonl"
    first_half.write_text("\n".join(rows[:12]) + "\n")
    all_rows.write_text("\n".join(rows) + "\n")
    config = {"storage_options": options}
    with Server(model, store, workdir / "outage.log", hook_config=config, extra=["--enable-metrics"]) as server:
        before = greedy(server)
        result = extract(server, first_half, store, *flags)
        assert result.returncode == 0, result.stdout + result.stderr + server.log_tail()

        proxy["state"].fail_every = 1  # every request of the hook's store: 503 SlowDown
        failing = extract(server, all_rows, store, "--commit-timeout", "5", *flags)
        assert failing.returncode == 1, failing.stdout + failing.stderr + server.log_tail()
        assert "12 already in the store, 12 sent" in failing.stdout and "12 failed" in failing.stdout, failing.stdout
        lost = re.search(r"^12 generated by the server but not stored: the server's hook counted during this run "
                         r"\(a sample sent twice counts twice\): (\d+) lost to write faults \(writes fail: the "
                         r"store answers HTTP 503 SlowDown\)$", failing.stdout, re.MULTILINE)
        assert lost and 12 <= int(lost.group(1)) <= 24, failing.stdout
        server.get("/health")  # raises unless 200
        assert greedy(server) == before
        failing_said = len(_hook_lines(server))

        proxy["state"].fail_every = 0  # the store answers again
        rerun = extract(server, all_rows, store, *flags)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr + server.log_tail()
        # The failing run's second sending may still be in the hook (a reopen retrying its reads) when the store
        # answers again: capture then resumes with it, and the rerun finds it committed.
        counts = re.search(r"24 samples: (\d+) already in the store, (\d+) sent .* (\d+) committed, 0 failed",
                           rerun.stdout)
        assert counts, rerun.stdout
        already, resent, committed = map(int, counts.groups())
        assert already >= 12 and already + resent == 24 and committed == resent, rerun.stdout
        assert greedy(server) == before
    said = _hook_lines(server)
    print(f"outage: {lost.group(1)} lost, the failing run {_seconds(failing):.1f} s, the rerun "
          f"{_seconds(rerun):.1f} s, {failing_said} hook log lines by the rerun, {len(said)} in all")
    checked = run_hsdata("validate", store, *flags)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    opened = hsdata.open(store, storage_options=s3["options"])
    assert sorted(opened.sample_ids) == sorted(json.loads(row)["id"] for row in rows)
    faults = [line for line in said if "writes fail" in line or "takes no writes" in line]
    assert faults and len(faults) <= 10, "\n".join(said)
    assert any("capture resumed in a fresh part" in line for line in said), "\n".join(said)
    assert len(said) <= 20, "\n".join(said)  # 5 of them a failed reopen's read retries (storage.RETRIES)


def _writes(proxy) -> tuple[int, int]:
    """The writes (PUT, POST, DELETE) the proxy has passed on, and the commits among them (a manifest each)."""
    writes = [path for method, path, _ in proxy["state"].log if method in ("PUT", "POST", "DELETE")]
    return len(writes), sum("/manifests/" in path for path in writes)


def test_a_block_server_waits_for_a_slow_store_and_loses_nothing(workdir, model, data, s3, proxy):
    """``on_backpressure="block"`` (the default) in a real server whose store (S3 on loopback, behind a proxy)
    takes 0.5 s a write (each PUT, POST, DELETE; a commit's chunks, then its metadata and manifest), 16 KiB staged
    (less than a sample: a forward waits until the one before is handed to the writer, and through a commit) and
    commits every 0.1 s (so that a commit is under way while the prompts are prefilled, however fast the CPU):
    every sample is committed, every request answered, the hook counts 0 failed and 0 dropped, a greedy
    generation is the one made before, and the store validates. The same 24 prompts (other ids) run first at the
    store's full speed, for comparison. The client reads the store directly, not through the proxy (only the
    hook's writes are slow). (Measured: 7.7 s, 4 commits of 9 writes, the prefills in bursts 2 s apart, one
    between commits; 2.5 s at full speed.)"""
    options = {**proxy["options"], "key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}
    store = f"s3://{BUCKET}/served-slow"
    flags = [f"--storage-option={key}={json.dumps(value)}" for key, value in s3["options"].items()]
    rows = data.read_text().splitlines()[:48]  # ids demo-*-0, then demo-*-1: the same 24 prompts
    fast_rows, slow_rows = workdir / "slow-first.jsonl", workdir / "slow-then.jsonl"
    fast_rows.write_text("\n".join(rows[:24]) + "\n")
    slow_rows.write_text("\n".join(rows[24:]) + "\n")
    config = {"storage_options": options, "max_staged_bytes": 16 << 10, "flush_interval_s": 0.1}
    with Server(model, store, workdir / "slow.log", hook_config=config, extra=["--enable-metrics"]) as server:
        before = greedy(server)
        fast = extract(server, fast_rows, store, "--concurrency", "2", *flags)
        assert fast.returncode == 0, fast.stdout + fast.stderr + server.log_tail()
        fast_writes, fast_commits = _writes(proxy)

        proxy["state"].delay_s = 0.5
        slow = extract(server, slow_rows, store, "--concurrency", "2", *flags)
        writes, commits = (n - m for n, m in zip(_writes(proxy), (fast_writes, fast_commits)))
        assert slow.returncode == 0, slow.stdout + slow.stderr + server.log_tail()
        assert "0 already in the store, 24 sent" in slow.stdout and "24 committed, 0 failed" in slow.stdout, slow.stdout
        counters = hook_counters(server.url)
        assert counters == {"committed": 48, "dropped": 0, "failed": {}}, counters
        assert greedy(server) == before
        said = _hook_lines(server)
    proxy["state"].delay_s = 0.0
    print(f"slow store: 24 samples in {_seconds(slow):.1f} s, {commits} commits, {writes} writes of 0.5 s; "
          f"{_seconds(fast):.1f} s, {fast_commits} commits at full speed; {len(said)} hook log lines")
    assert commits >= 1 and _seconds(slow) >= 1.0  # a commit: its chunks, then its manifest, 0.5 s each at least
    checked = run_hsdata("validate", store, *flags)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert sorted(hsdata.open(store, storage_options=s3["options"]).sample_ids) == sorted(
        json.loads(row)["id"] for row in rows)
    assert not [line for line in said if "dropped" in line or "writes fail" in line], "\n".join(said)
