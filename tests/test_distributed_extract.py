"""`hsdata extract --engine hf` as a job of several ranks on CPU (gloo), launched by torchrun or by hand with
RANK/WORLD_SIZE: the ranks' parts hold the dataset exactly once, bit-exact against one process; a failed rank
fails the job, named; a rerun with another world size completes the store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
import warnings

import pytest
import torch

import hsdata
from conftest import assert_same
from hsdata import cli
from hsdata.extract import distributed
from hsdata.validate import validate

# The hsdata CLI with rank $FAULTY_RANK failing at its third batch (FAULT=raise: an exception; kill: SIGKILL
# once its first two samples are committed). For these tests only.
FAULTY = """
import os, signal, sys, time
from hsdata import cli
from hsdata.extract import engine_hf

if os.environ["RANK"] == os.environ["FAULTY_RANK"]:
    captures, batches, pad_batch = [], [], engine_hf.pad_batch

    class CommittingCapture(engine_hf.Capture):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, flush_interval_s=0.01, **kwargs)
            captures.append(self)

    def failing_pad_batch(batch):
        batches.append(batch)
        if len(batches) == 3:
            if os.environ["FAULT"] == "raise":
                raise RuntimeError("injected failure")
            while captures[0].writer.num_committed < 2:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return pad_batch(batch)

    engine_hf.Capture, engine_hf.pad_batch = CommittingCapture, failing_pad_batch
sys.exit(cli.main())
"""
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def torchrun(ranks: int, *args: str, script: str = "-m hsdata", **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               *script.split(), "extract", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment(**env),
                          check=False)


def single(out: str, *args: str) -> None:
    """The single-process CLI, in this process (torch is imported already)."""
    assert cli.main(["extract", "--out", out, *args]) == 0


def assert_same_stores(got: str, want: str) -> None:
    """The same samples, each once, with bit-identical tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # hsdata.open warns about duplicate rows
        a, b = hsdata.open(got), hsdata.open(want)
    assert sorted(a.sample_ids) == sorted(b.sample_ids) and len(set(a.sample_ids)) == len(a) == 24
    for sample_id in b.sample_ids:
        assert_same(a.get(sample_id), {k: v for k, v in b.get(sample_id).items() if torch.is_tensor(v)})
    assert validate(got).ok


def test_two_ranks_store_exactly_what_one_process_stores(tmp_path):
    job, reference = str(tmp_path / "job"), str(tmp_path / "single")
    result = torchrun(2, "--out", job, "--max-batch-tokens", "200")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines[:2]] == ["rank 0", "rank 1"]
    assert lines[-1].startswith("OK: 24 samples: 0 already in the store, 24 written (1,636 tokens, ")
    assert lines[-1].endswith("by 2 ranks (0 failed)") and "tokens/s, " in lines[-1] and "iB/s)" in lines[-1]
    single(reference, "--max-batch-tokens", "200")
    assert_same_stores(job, reference)
    assert len(set(hsdata.open(job).manifest.column("part").to_pylist())) == 2


def test_failed_ranks_fail_the_job_by_name_and_reruns_with_other_world_sizes_complete(tmp_path):
    (tmp_path / "faulty.py").write_text(FAULTY)
    job, reference = str(tmp_path / "job"), str(tmp_path / "single")
    args = ("--out", job, "--max-batch-tokens", "1")  # one sample a batch: 24 batches, 8 a rank

    # 3 ranks, rank 1 raises at its third batch: the job fails, rank 0's summary and torchrun name rank 1
    result = torchrun(3, *args, script=str(tmp_path / "faulty.py"), FAULTY_RANK="1", FAULT="raise")
    assert result.returncode != 0
    assert "rank 1 (" in result.stdout and "): FAILED: RuntimeError: injected failure" in result.stdout
    assert "FAILED: 24 samples: 0 already in the store, 16 written" in result.stdout
    assert "the store holds 18 samples" in result.stdout
    root_cause = result.stderr.split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "RuntimeError: injected failure" in root_cause
    assert len(hsdata.open(job)) == 18  # ranks 0 and 2 did their 8, rank 1 its first 2

    # 2 ranks launched by hand (RANK, WORLD_SIZE, ...), rank 1 killed at its third batch: rank 0 fails, saying so
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "faulty.py"), "extract", *args, "--rank-timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=environment(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port, FAULTY_RANK="1",
                                              FAULT="kill"))
             for r in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 2 and outputs[0][0] == ""
    assert outputs[0][1].startswith("hsdata extract: error: rank 0: not every rank of the job answered")
    assert len(hsdata.open(job)) == 23  # rank 0 did its 3 of the 6 left, rank 1 2 before it was killed

    # one process: the last sample, then the store is the dataset, each sample once, as one process makes it
    single(job, "--max-batch-tokens", "1")
    single(reference, "--max-batch-tokens", "1")
    assert_same_stores(job, reference)


def batch(*lengths: int) -> list:
    return [(f"s{n}-{i}", [0] * n) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_shares_are_disjoint_complete_and_balanced_by_padded_tokens(world_size):
    batches = [batch(*[n] * max(1, 400 // n)) for n in range(3, 300, 7)]
    shares = [distributed.share(batches, rank, world_size) for rank in range(world_size)]
    assert sorted(id(b) for share in shares for b in share) == sorted(id(b) for b in batches)
    loads = [sum(len(b) * max(len(ids) for _, ids in b) for b in share) for share in shares]
    assert max(loads) - min(loads) <= max(len(b) * max(len(ids) for _, ids in b) for b in batches)
    assert all(share == sorted(share, key=batches.index) for share in shares)  # in plan order, short first


def test_the_rank_comes_from_torchruns_variables(monkeypatch):
    for name in TORCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert distributed.from_environment() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.from_environment() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 but RANK, MASTER_ADDR, MASTER_PORT not set"):
        distributed.from_environment()
    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert distributed.from_environment() == distributed.Rank(3, 4, 1, 2)


def test_each_rank_takes_cuda_local_rank(monkeypatch):
    rank = distributed.Rank(3, 4, 1, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [distributed.device(d, rank) for d in ("cpu", "cuda")] == ["cpu", "cuda:1"]
    assert distributed.device("cuda:1", None) == "cuda:1"
    with pytest.raises(ValueError, match="each rank takes cuda:LOCAL_RANK; give --device cuda"):
        distributed.device("cuda:1", rank)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a launcher that shows each rank its own GPU
    assert distributed.device("cuda", rank) == "cuda:0"


def test_device_map_gives_each_rank_of_a_node_its_own_block_of_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=100))
    monkeypatch.setitem(sys.modules, "accelerate", types.ModuleType("accelerate"))
    assert distributed.device_map(None) == {"device_map": "auto"}
    assert distributed.device_map(distributed.Rank(3, 4, 1, 2)) == {"device_map": "auto",
                                                                    "max_memory": {4: 90, 5: 90, 6: 90, 7: 90}}
    with pytest.raises(ValueError, match="9 ranks on this node but only 8 GPU"):
        distributed.device_map(distributed.Rank(0, 9, 0, 9))


def test_device_map_is_refused_without_a_model_folder_gpus_or_accelerate(capsys, tmp_path, monkeypatch):
    def run(*args):
        code = cli.main(["extract", "--out", str(tmp_path / "s"), *args])
        return code, capsys.readouterr().err.strip()

    assert run("--device-map", "auto") == (2, "hsdata extract: error: --device-map needs --model, a local model folder")
    (tmp_path / "model").mkdir()
    folder = ("--model", str(tmp_path / "model"), "--data", __import__("hsdata.extract.demo").extract.demo.data_path())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run(*folder, "--device-map", "auto")
    assert code == 2 and err.startswith("hsdata extract: error: --device-map auto spreads the model over this "
                                        "node's GPUs, and CUDA is not available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # not installed
    assert run(*folder, "--device-map", "auto") == (
        2, "hsdata extract: error: --device-map auto needs accelerate: pip install accelerate")
    assert not (tmp_path / "s").exists()
