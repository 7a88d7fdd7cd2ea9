"""The SGLang forward hook: ``--forward-hooks '[{"name": "hsdata", "target_modules": ["logits_processor"],
"hook_factory": "server_hook.sglang:make_hook", "config": {"store": "/data/kimi-hs"}}]'``.

Only requests whose rid starts with the config's ``rid_prefix`` (``hsdata:``, what ``hsdata extract --server``
sends) are stored, under the sample id that follows it: SGLang's own warm-up request and health probes, and any
other traffic the server serves, never become samples.

SGLang's models call ``logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)``
with the final post-norm states and (with ``--enable-return-aux-hidden-states``) the aux layers' states. The hook
keeps prefill (EXTEND / MIXED) forwards on the attention-TP rank 0 of each scheduler, cuts the packed rows into
requests and hands them to :class:`hsdata.extract.capture.Capture`, which stores them off the forward's path. Each
scheduler (each DP rank, each server) writes its own part of the store.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import hsdata
from hsdata.extract import capture as capture_module
from hsdata.codecs import compression
from hsdata.extract.capture import Capture, Piece, vocab_size, writer_queue_bytes
from hsdata.extract.client import RID_PREFIX
from hsdata.dtypes import hidden_dtype
from hsdata.layout import check_provenance

from . import metrics

log = logging.getLogger("hsdata.server_hook")
SGLANG_HEALTH_CHECK = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX: rids of its health probes


@dataclass(frozen=True)
class HookConfig:
    """The ``config`` object of the hook spec. Unknown keys are an error."""

    store: str
    rid_prefix: str = RID_PREFIX  # store only requests whose rid starts with it; "" stores every request
    store_dtype: str | None = None  # default: the dtype the server computes in; "bfloat16"/"float16" for float32;
    # "float8_e4m3fn": quantized on the GPU before the copy to the host (docs/format.md section 3b)
    aux_layers: list[int] | None = None  # "output of layer k" ids; default: the server's, else EAGLE-3's
    model: str | None = None  # default: the server's --model-path
    storage_options: dict = field(default_factory=dict)
    flush_interval_s: float = 5.0
    max_staged_bytes: int = 4 << 30  # host memory for rows copied off the GPU and not yet written
    on_backpressure: str = "block"  # max_staged_bytes waiting: "block" (the forward waits) or "drop" (never waits)
    max_wait_s: float | None = None  # under "block": a forward waits at most this long, then its requests drop
    provenance: dict | None = None  # recorded in the store's provenance over what the hook records itself
    compression: str | None = None  # "zstd" or "lz4": compress the hidden states of a store the hook creates

    @classmethod
    def parse(cls, config: Any) -> HookConfig:
        if not isinstance(config, dict):
            raise ValueError(f"hsdata hook: config must be a JSON object, got {config!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"hsdata hook: unknown config key(s) {unknown}; known: {sorted(known)}")
        if not isinstance(config.get("store"), str) or not config["store"]:
            raise ValueError("hsdata hook: config needs \"store\": a path or fsspec URL")
        if not isinstance(config.get("rid_prefix", RID_PREFIX), str):
            raise ValueError("hsdata hook: \"rid_prefix\" must be a string")
        if config.get("store_dtype") is not None:
            hidden_dtype("hsdata hook: store_dtype", config["store_dtype"], stored=True)
        if config.get("compression") is not None:
            try:
                compression.parse(config["compression"])
            except ValueError as e:
                raise ValueError(f"hsdata hook: {e}") from None
        if config.get("provenance") is not None:
            try:
                check_provenance(config["provenance"])
            except ValueError as e:
                raise ValueError(f"hsdata hook: {e}") from None
        parsed = cls(**config)
        if parsed.flush_interval_s <= 0 or parsed.max_staged_bytes <= 0:
            raise ValueError("hsdata hook: flush_interval_s and max_staged_bytes must be positive")
        if parsed.on_backpressure not in capture_module.BACKPRESSURE:
            raise ValueError(f"hsdata hook: on_backpressure must be one of {capture_module.BACKPRESSURE}, "
                             f"got {parsed.on_backpressure!r}")
        if parsed.max_wait_s is not None and not (isinstance(parsed.max_wait_s, (int, float))
                                                  and not isinstance(parsed.max_wait_s, bool)
                                                  and 0 <= parsed.max_wait_s < float("inf")):
            raise ValueError(f"hsdata hook: max_wait_s must be a number of seconds >= 0, got {parsed.max_wait_s!r}")
        return parsed


def make_hook(config: dict) -> Callable:
    """The hook factory SGLang's ``--forward-hooks`` calls in each scheduler process."""
    return PrefillHook(HookConfig.parse(config))


class PrefillHook:
    """A ``register_forward_hook`` callback for SGLang's ``logits_processor``; never changes its output."""

    def __init__(self, config: HookConfig):
        self.config = config
        self.capture: Capture | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.failed: Exception | None = None  # why the store could not be opened; then nothing more is stored

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.failed is not None:
            return None
        forward_batch = args[3] if len(args) > 3 else None
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is None or mode.name not in ("EXTEND", "MIXED"):
            return None  # decode, idle, target-verify, draft passes: nothing to store
        if _attention_tp_rank() != 0:
            return None  # TP ranks hold the same all-reduced states; rank 0 writes
        aux = args[4] if len(args) > 4 else None
        if aux is None or (isinstance(aux, (list, tuple)) and not aux):
            self._warn_once("no-aux", "logits_processor got no aux hidden states: launch the server with "
                            "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3")
            return None
        if forward_batch.rids is None or forward_batch.orig_seq_lens is None:
            self._warn_once("no-rids", "this prefill batch carries no request ids or prompt lengths (prefill CUDA "
                            "graph?): launch with --disable-prefill-cuda-graph")
            return None
        pieces = self._pieces(forward_batch)
        if not pieces:
            return None  # none of this forward's requests is the client's
        final = args[1]
        try:
            capture = self._capture(module, aux, final)
        except Exception as e:  # noqa: BLE001 - a misconfigured hook must not break the server's forwards
            self.failed = e
            log.error("hsdata: cannot store into %s, so this server stores nothing: %s", self.config.store, e)
            return None
        capture.add_forward([piece for _, piece in pieces], forward_batch.orig_seq_lens, args[0], aux, final,
                            requests=[i for i, _ in pieces])
        return None

    def _pieces(self, forward_batch) -> list[tuple[int, Piece]]:
        """``(batch index, piece)`` of each stored request: its rid carries the prefix and a sample id after it."""
        pieces, row, prefix = [], 0, self.config.rid_prefix
        for i, (rid, length, start) in enumerate(zip(forward_batch.rids, forward_batch.extend_seq_lens_cpu,
                                                     forward_batch.extend_prefix_lens_cpu)):
            rid = str(rid)
            if rid.startswith(prefix) and len(rid) > len(prefix) and not rid.startswith(SGLANG_HEALTH_CHECK):
                pieces.append((i, Piece(rid[len(prefix):], int(start), row, int(length))))
            row += int(length)
        return pieces

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()
            self.capture = None

    def _capture(self, module: torch.nn.Module, aux, final: torch.Tensor) -> Capture:
        if self.capture is None:
            with self._lock:
                if self.capture is None:
                    self.capture = self._open(module, aux, final)
        return self.capture

    def _open(self, module: torch.nn.Module, aux, final: torch.Tensor) -> Capture:
        hidden = final.shape[-1]
        width = aux.shape[-1] if isinstance(aux, torch.Tensor) else sum(a.shape[-1] for a in aux)
        layers = self.config.aux_layers or _server_aux_layers(module) or _eagle3_default(module)
        if len(layers) * hidden != width:
            raise ValueError(f"hsdata hook: aux_layers {layers} give {len(layers)} x {hidden} columns, but the "
                             f"model passes {width}: set \"aux_layers\" in the hook config")
        model = self.config.model or _server_model()
        provenance = {**self._provenance(model, list(layers), final), **(self.config.provenance or {})}
        vocab = vocab_size(module)

        def new_writer() -> hsdata.Writer:  # the first part, and a fresh one after a write fault
            return hsdata.create(self.config.store, hidden_size=hidden, aux_layers=list(layers), model=model,
                                 dtype=self.config.store_dtype or final.dtype, compute_dtype=final.dtype,
                                 vocab_size=vocab, storage_options=self.config.storage_options,
                                 provenance=provenance, compression=self.config.compression,
                                 max_pending_bytes=writer_queue_bytes(self.config.max_staged_bytes))

        writer = new_writer()
        capture = Capture(writer, flush_interval_s=self.config.flush_interval_s,
                          max_staged_bytes=self.config.max_staged_bytes, reopen=new_writer,
                          on_backpressure=self.config.on_backpressure, max_wait_s=self.config.max_wait_s,
                          events=metrics.capture_events())
        # At exit, before the interpreter's teardown: concurrent.futures refuses new work from its own exit
        # callback on, and the writer's final commit runs on its pools. Threading's exit callbacks run in reverse
        # order of registration, so this one runs before that one (atexit callbacks would run after it).
        threading._register_atexit(self.close)
        log.info("hsdata: storing prefill hidden states in %s (part %s, computed in %s, stored as %s)",
                 self.config.store, writer.part, writer.spec.compute_dtype, writer.spec.dtype)
        return capture

    def _provenance(self, model: str | None, aux_layers: list[int], final: torch.Tensor) -> dict[str, Any]:
        """What the hook knows about the extraction: engine, versions, host and time, the model, the dtype and
        device it computes in, the store dtype and aux layers it stores (the client's data and tokenizer never
        reach the server)."""
        import sglang

        return {**capture_module.provenance("sglang", sglang.__version__), "model": model,
                "dtype": str(final.dtype).removeprefix("torch."), "device": str(final.device),
                "store_dtype": self.config.store_dtype, "aux_layers": aux_layers}

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("hsdata: %s", message)


def _attention_tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_rank)
    except (RuntimeError, ValueError):
        return 0  # no parallel context published: a single process


def _server_aux_layers(module: torch.nn.Module) -> list[int] | None:
    """The server's ``--return-aux-hidden-state-layer-ids`` as "output of layer k" ids.

    SGLang's models capture "output of layer k" for the ids given (they add 1 to get the layer whose input
    they read), except the DeepSeek-V2/V3 family (Kimi-K2.x included): it adds 1 only when the first id is 1
    and otherwise reads the ids as "input of layer k" (models/deepseek_v2.py ``set_eagle3_layers_to_capture``).
    """
    args = _server_args()
    ids = list(args.return_aux_hidden_state_layer_ids) if args and args.return_aux_hidden_state_layer_ids else None
    if ids and ids[0] != 1 and _is_deepseek_family(module):
        return [k - 1 for k in ids]
    return ids


def _is_deepseek_family(module: torch.nn.Module) -> bool:
    config = getattr(module, "config", None)
    names = [str(getattr(config, "model_type", "")), *map(str, getattr(config, "architectures", None) or [])]
    return any("deepseek" in n.lower() or "kimi" in n.lower() for n in names)


def _server_model() -> str | None:
    args = _server_args()
    return getattr(args, "model_path", None) if args else None


def _server_args():
    from sglang.srt.runtime_context import get_server_args

    try:
        return get_server_args()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _eagle3_default(module: torch.nn.Module) -> list[int]:
    """EAGLE-3's default capture points as "output of layer k" ids: ``[1, N // 2 - 1, N - 4]``."""
    config = getattr(module, "config", None)
    layers = getattr(getattr(config, "text_config", config), "num_hidden_layers", None)
    if not layers:
        raise ValueError("hsdata hook: cannot tell the model's depth; set \"aux_layers\" in the hook config")
    return [1, layers // 2 - 1, layers - 4]
