"""`hsdata extract --server` against a local HTTP server that speaks SGLang's /server_info and /generate and
stores through the real hook path, with injected faults a real server cannot be made to produce on demand (a 500
once, a 400 always, a restart inside the client's retry window), and a resumed run. The real SGLang server is in
test_sglang_server.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import PreTrainedTokenizerFast

import hsdata
from conftest import AUX, HIDDEN
from hsdata.extract.client import HOOK_FACTORY, RID_PREFIX
from hsdata.extract.conversations import parse_record, tokenize
from hsdata.validate import validate
from test_server_hook import hooked_model

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONVERSATIONS = [
    {"id": "share-1", "conversations": [{"from": "human", "value": "What is two plus two?"},
                                        {"from": "gpt", "value": "Four."}]},
    {"id": "oai-1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Bye"},
                                 {"role": "assistant", "content": "Goodbye, see you"}]},
    {"id": "tok-1", "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
] + [{"id": f"many-{i}", "messages": [{"role": "user", "content": f"question number {i} " * (1 + i % 5)},
                                      {"role": "assistant", "content": f"answer {i} " * (1 + i % 3)}]}
     for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    corpus = [m.get("content", m.get("value", "")) for c in CONVERSATIONS for m in c.get("messages", c.get("conversations", []))]
    tok.train_from_iterator(corpus * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=specials[1:])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


def states_for(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 'model': deterministic aux and final states for a prompt."""
    g = torch.Generator().manual_seed(sum(ids) * 7919 + len(ids))
    return (torch.randn(len(ids), len(AUX) * HIDDEN, generator=g).to(torch.bfloat16),
            torch.randn(len(ids), HIDDEN, generator=g).to(torch.bfloat16))


class FakeSGLang:
    """Serves /generate like SGLang: prefill in chunks of 16 tokens through the hooked logits_processor."""

    def __init__(self, store, port=0, fail_first=(), always_fail=(), restart_after=None):
        self.store, self.fail_first, self.always_fail = store, set(fail_first), set(always_fail)
        self.restart_after, self.served, self.lock = restart_after, 0, threading.Lock()
        self._start(port)

    def _start(self, port):
        self.model, self.hook = hooked_model(self.store)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                assert self.path == "/server_info", self.path
                self.reply(200, {"forward_hooks": [hook_entry(server.store)], "enable_return_aux_hidden_states": True,
                                 "disable_prefill_cuda_graph": True})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(*server.handle(request))

            def reply(self, status, reply):
                body = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def handle(self, request):
        rid, ids = request["rid"], request["input_ids"]
        assert rid.startswith(RID_PREFIX) and request["cache_salt"]
        assert request["sampling_params"] == {"max_new_tokens": 0}
        if rid.removeprefix(RID_PREFIX) in self.always_fail:
            return 400, {"error": "bad request"}
        with self.lock:
            if rid.removeprefix(RID_PREFIX) in self.fail_first:
                self.fail_first.discard(rid.removeprefix(RID_PREFIX))
                return 500, {"error": "internal"}
            aux, final = states_for(ids)
            for start in range(0, len(ids), 16):
                n = min(16, len(ids) - start)
                batch = ForwardBatch(
                    forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.tensor(ids[start:start + n]),
                    req_pool_indices=torch.arange(1), seq_lens=torch.tensor([start + n]),
                    out_cache_loc=torch.arange(n), seq_lens_sum=start + n, rids=[rid], extend_seq_lens_cpu=[n],
                    extend_prefix_lens_cpu=[start], orig_seq_lens=torch.tensor([len(ids)]))
                self.model.logits_processor(batch.input_ids, final[start:start + n], None, batch,
                                            aux[start:start + n])
            self.served += 1
            if self.restart_after is not None and self.served == self.restart_after:
                threading.Thread(target=self.restart, daemon=True).start()
        return 200, {"text": "", "meta_info": {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 0}}

    def restart(self):
        """The server goes down (its hook commits on shutdown) and comes back on the same port."""
        self.http.shutdown()
        self.http.server_close()
        self.hook.close()
        time.sleep(0.5)
        self._start(self.port)

    def stop(self):
        self.http.shutdown()
        self.http.server_close()
        self.hook.close()


def run_extract(server, data, tokenizer_dir, store, *extra):
    return subprocess.run([sys.executable, "-m", "hsdata", "extract", "--server", f"http://127.0.0.1:{server.port}",
                           "--data", str(data), "--tokenizer", str(tokenizer_dir), "--out", str(store),
                           "--concurrency", "4", "--commit-timeout", "20", *extra],
                          capture_output=True, text=True, timeout=300)


def test_extract_through_failures_and_a_restart_then_resume(tmp_path, tokenizer_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    store = tmp_path / "store"
    server = FakeSGLang(store, fail_first={"share-1", "many-3"}, restart_after=20)
    try:
        result = run_extract(server, data, tokenizer_dir, store)
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK: {len(CONVERSATIONS)} samples: 0 already in the store" in result.stdout
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    opened = hsdata.open(str(store))
    assert sorted(opened.sample_ids) == sorted(c["id"] for c in CONVERSATIONS)
    assert len(set(opened.manifest.column("part").to_pylist())) == 2  # before and after the restart
    for number, row in enumerate(CONVERSATIONS, 1):
        ids, mask = tokenize(tok, parse_record(json.dumps(row), number))
        got = opened.get(row["id"])
        aux, final = states_for(ids)
        assert got["input_ids"].tolist() == ids and got["loss_mask"].tolist() == mask
        assert torch.equal(got["aux_hidden_states"].view(torch.int16), aux.view(torch.int16))
        assert torch.equal(got["hidden_states"].view(torch.int16), final.view(torch.int16))
    assert validate(str(store)).ok

    again = FakeSGLang(store)
    try:
        resumed = run_extract(again, data, tokenizer_dir, store)
    finally:
        again.stop()
    assert resumed.returncode == 0 and again.served == 0
    assert f"{len(CONVERSATIONS)} already in the store, 0 sent" in resumed.stdout


def test_assistant_tokens_only_are_masked(tokenizer_dir):
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    ids, mask = tokenize(tok, parse_record(json.dumps(CONVERSATIONS[1]), 1))
    text = tok.decode([i for i, m in zip(ids, mask) if m])
    assert text == "Hello there<|end|>Goodbye, see you<|end|>"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]).startswith("<|system|>Be brief.<|end|><|user|>Hi")


def test_failed_requests_give_a_nonzero_exit_and_name_the_sample(tmp_path, tokenizer_dir):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(CONVERSATIONS[0]) + "\n" + json.dumps(CONVERSATIONS[2]) + "\n")
    server = FakeSGLang(tmp_path / "store", always_fail={"tok-1"})
    try:
        result = run_extract(server, data, tokenizer_dir, tmp_path / "store")
    finally:
        server.stop()
    assert result.returncode == 1
    assert "failed: sample 'tok-1': request failed: HTTP 400" in result.stdout
    assert hsdata.open(str(tmp_path / "store")).sample_ids == ["share-1"]


@pytest.mark.parametrize("line, message", [
    ("not json", "data.jsonl:1: not valid JSON"),
    ('{"text": "hi"}', 'expected "messages" \\(OpenAI\\), "conversations" \\(ShareGPT\\) or "input_ids"'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', "loss_mask must be a list of 0/1 as long as input_ids"),
])
def test_bad_input_lines_are_named(tmp_path, line, message):
    data = tmp_path / "data.jsonl"
    data.write_text(line + "\n")
    result = subprocess.run([sys.executable, "-m", "hsdata", "extract", "--server", "http://127.0.0.1:9", "--data",
                             str(data), "--out", str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    import re

    assert re.search(message, result.stderr), result.stderr


class ServerInfo(BaseHTTPRequestHandler):
    """Answers /server_info with ``self.server.info`` and counts every other request."""

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        body = json.dumps(self.server.info).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.server.posts += 1
        self.send_response(500)
        self.end_headers()


def hook_entry(store):
    return {"hook_factory": HOOK_FACTORY, "config": {"store": str(store)}}


@pytest.mark.parametrize("info, message", [
    ({"forward_hooks": None, "enable_return_aux_hidden_states": True, "disable_prefill_cuda_graph": True},
     "runs no hsdata hook: launch it with --forward-hooks"),
    ({"forward_hooks": "STORE", "enable_return_aux_hidden_states": False, "disable_prefill_cuda_graph": True},
     "passes no aux hidden states to the hook: launch it with --enable-return-aux-hidden-states"),
    ({"forward_hooks": "STORE", "enable_return_aux_hidden_states": True, "disable_prefill_cuda_graph": False},
     "replays prefills in CUDA graphs, which forward hooks never see: launch it with --disable-prefill-cuda-graph"),
])
def test_a_server_that_cannot_serve_the_extraction_is_refused_before_anything_is_written(tmp_path, tokenizer_dir,
                                                                                          info, message):
    store = tmp_path / "store"
    if info["forward_hooks"] == "STORE":
        info = {**info, "forward_hooks": [hook_entry(store)]}
    http = ThreadingHTTPServer(("127.0.0.1", 0), ServerInfo)
    http.info, http.posts = info, 0
    threading.Thread(target=http.serve_forever, daemon=True).start()
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    try:
        result = subprocess.run([sys.executable, "-m", "hsdata", "extract", "--server",
                                 f"http://127.0.0.1:{http.server_address[1]}", "--data", str(data), "--tokenizer",
                                 str(tokenizer_dir), "--out", str(store)], capture_output=True, text=True, timeout=120)
    finally:
        http.shutdown()
        http.server_close()
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and http.posts == 0
    assert not store.exists()


def test_a_refused_connection_is_one_line_and_leaves_no_files(tmp_path, tokenizer_dir):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "hsdata", "extract", "--server", f"http://127.0.0.1:{port}",
                             "--data", str(data), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "store")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"hsdata extract: error: cannot reach the SGLang server at "
                                     f"http://127.0.0.1:{port}: [Errno 111] Connection refused")
    assert not (tmp_path / "store").exists()
