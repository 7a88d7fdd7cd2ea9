"""A real ``sglang.launch_server`` process on this CPU machine, for the end-to-end tests of the hook.

SGLang 0.5.23 runs here on its generic platform (``--device cpu`` without ``SGLANG_USE_CPU_ENGINE``) with the
``torch_native`` attention backend; ``sglang_stub/`` stands in for the one vllm import it makes there. The model
is a tiny random Llama saved from a config, next to the demo tokenizer: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from hsdata.extract.client import HOOK_FACTORY

STUB = Path(__file__).parent / "sglang_stub"
AUX_LAYER_IDS = [0, 1, 2]  # Llama family: SGLang captures "output of layer k" for these ids
START_TIMEOUT_S = 240.0


def make_model(path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A 4-layer Llama (hidden size 64) with random weights from seed 0, saved in ``dtype`` with the demo tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hsdata.extract import demo

    tokenizer = demo.tokenizer()
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server in its own process group, its log in ``log_path``; a context manager that kills it."""

    def __init__(self, model: Path, store: Path, log_path: Path, *, dtype: str = "bfloat16",
                 hook_config: dict | None = None, extra: list[str] = (), env: dict | None = None,
                 hooked: bool = True):
        self.model, self.store, self.log_path = model, store, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        hook = {"name": "hsdata", "target_modules": ["logits_processor"], "hook_factory": HOOK_FACTORY,
                "config": {"store": str(store), "aux_layers": AUX_LAYER_IDS, "flush_interval_s": 0.5,
                           **(hook_config or {})}}
        self.command = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph", "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", dtype, "--max-total-tokens", "16384", "--sleep-on-idle",
            "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *map(str, AUX_LAYER_IDS), "--disable-radix-cache",
            "--disable-prefill-cuda-graph", *(["--forward-hooks", json.dumps([hook])] if hooked else []), *extra,
        ]
        root = str(Path(__file__).parents[1])
        # a stopped server's scheduler dies of the SIGTERM, which SGLang takes for a crash: no 5 s wait for crash
        # diagnostics of a GPU (py-spy, CUDA coredumps) on this CPU server
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUB), root]),
                    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", **(env or {})}
        self.env.pop("SGLANG_USE_CPU_ENGINE", None)
        self.process: subprocess.Popen | None = None

    def start(self) -> Server:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health_generate", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"sglang server not ready within {START_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (tokenizer manager, schedulers, detokenizer) and wait for it."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _group_alive(self.process.pid):
            time.sleep(0.1)
        self.process = None

    def stop(self) -> None:
        """SIGTERM (the hook commits at exit), then SIGKILL whatever is left after 30 s."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        self.kill()

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in text[-lines:])

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def get(self, path: str, timeout: float = 60.0) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as response:
            return response.read()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
