"""``hsdata extract --engine hf``: run a transformers causal LM in-process and store its prefill hidden states.

Forward hooks on the decoder layers (aux: "output of layer k") and on the final norm (post-norm final state)
feed the same :class:`hsdata.extract.capture.Capture` path as the SGLang hook: one implementation, two front ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable

import torch

from .. import writer as writer_module
from ..errors import NotAStoreError
from ..reader import open as open_store
from . import capture as capture_module, distributed
from .capture import Capture, Piece, vocab_size
from .conversations import Record, tokenize

MAX_TEMPLATE_CHARS = 4096  # a longer chat template is recorded by its hash alone


@dataclass
class EngineSummary:
    total: int = 0
    skipped: int = 0
    written: int = 0
    tokens: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    forward_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default capture points as "output of layer k" ids."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """The decoder layers and the final norm of a transformers causal LM (``model.model.layers/norm``)."""
    base = getattr(model, "model", model)
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"{type(model).__name__}: expected .model.layers and .model.norm (a Llama-style decoder)")
    return layers, norm


def extract(model: torch.nn.Module, tokenizer: Any, records: Iterable[Record], out: str, *, model_name: str,
            aux_layers: list[int] | None = None, max_batch_tokens: int = 8192, storage_options: dict | None = None,
            store_dtype: str | torch.dtype | None = None, on_plan: Callable[[int, int], None] | None = None,
            on_batch: Callable[[int, int], None] | None = None, provenance: dict | None = None,
            committed: Collection[str] | None = None, share: tuple[int, int] | None = None,
            compression: Any = None) -> EngineSummary:
    """Tokenize, batch by length, run ``model`` and store every record not yet committed in ``out``.

    The states are stored in ``store_dtype`` (None: the model's dtype, as computed; a float32 model's may be
    stored as bfloat16 or float16). ``on_plan(samples, tokens)`` is called once with what is to be run, before
    the first forward; ``on_batch(samples, tokens)`` after each forward. ``provenance`` goes to
    ``hsdata.create`` (:func:`extract_provenance` makes the automatic entries), and ``compression`` too.

    For one rank of a job: ``committed`` are the ids already in ``out`` (None: read them from it), the same on
    every rank; ``share=(rank, world_size)`` runs only that rank's share of the batches
    (:func:`hsdata.extract.distributed.share`), each sample in the batch a single process would put it in."""
    started = time.monotonic()
    summary = EngineSummary()
    layers, norm = decoder_parts(model)
    aux_layers = aux_layers or eagle3_layers(len(layers))
    if max(aux_layers) >= len(layers):
        raise ValueError(f"aux_layers {aux_layers}: the model has {len(layers)} layers (ids are 0-based)")
    done = set(committed_ids(out, storage_options) if committed is None else committed)
    todo: list[tuple[str, list[int]]] = []
    masks: dict[str, list[int]] = {}
    for record in records:
        summary.total += 1
        if record.sample_id in done:
            summary.skipped += 1
            continue
        try:
            ids, mask = tokenize(tokenizer, record)
        except ValueError as e:
            summary.failed[record.sample_id] = str(e)
            continue
        todo.append((record.sample_id, ids))
        masks[record.sample_id] = mask
    plan = list(batches_by_length(todo, max_batch_tokens))
    if share is not None:
        plan = distributed.share(plan, *share)
    mine = [item for batch in plan for item in batch]
    if on_plan is not None:
        on_plan(len(mine), sum(len(ids) for _, ids in mine))
    hidden, compute_dtype = norm.weight.shape[-1], norm.weight.dtype
    store_writer = writer_module.create(out, hidden_size=hidden, aux_layers=aux_layers, model=model_name,
                                        dtype=store_dtype or compute_dtype, compute_dtype=compute_dtype,
                                        vocab_size=vocab_size(model), storage_options=storage_options,
                                        provenance=provenance, compression=compression)
    capture = Capture(store_writer, loss_masks=masks)
    captured: dict[str, torch.Tensor] = {}
    hooks = [layers[k].register_forward_hook(_keep(captured, f"aux{k}")) for k in aux_layers]
    hooks.append(norm.register_forward_hook(_keep(captured, "final")))
    device = next(model.parameters()).device
    base = getattr(model, "model", model)  # the decoder stack: no logits are needed
    try:
        with torch.inference_mode():
            for batch in plan:
                input_ids, attention = pad_batch(batch)
                width = input_ids.shape[1]
                t0 = time.monotonic()
                base(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False)
                pieces = [Piece(sid, 0, b * width, len(ids)) for b, (sid, ids) in enumerate(batch)]
                final = captured["final"].reshape(len(batch) * width, -1)
                # with a device map the layers may sit on several GPUs: hand the capture one device's tensors
                flat = [captured[f"aux{k}"].reshape(len(batch) * width, -1).to(final.device) for k in aux_layers]
                capture.add_forward(pieces, [len(ids) for _, ids in batch], input_ids.reshape(-1).to(final.device),
                                    flat, final)
                summary.forward_seconds += time.monotonic() - t0
                tokens = sum(len(ids) for _, ids in batch)
                summary.tokens += tokens
                if on_batch is not None:
                    on_batch(len(batch), tokens)
    finally:
        for hook in hooks:
            hook.remove()
        capture.close()
    summary.written = capture.samples_written
    stored = set(committed_ids(out, storage_options))
    for sid, _ in mine:
        if sid not in stored and sid not in summary.failed:
            summary.failed[sid] = "not committed (see the log)"
    summary.seconds = time.monotonic() - started
    return summary


def committed_ids(out: str, storage_options: dict | None = None) -> list[str]:
    """The samples committed in the store ``out`` (none when there is no store yet)."""
    try:
        with open_store(out, storage_options=storage_options) as store:
            return list(store.sample_ids)
    except NotAStoreError:
        return []


def extract_provenance(model: torch.nn.Module, tokenizer: Any, *, model_name: str, tokenizer_name: str | None,
                       data: str, records: int) -> dict[str, Any]:
    """The provenance ``hsdata extract`` records: engine and versions, host and time (:func:`capture.provenance`),
    the model, its device and dtype, the tokenizer and hashes of it and its chat template, the data file, its
    sha256 and number of records."""
    import transformers

    weight = next(model.parameters())
    facts: dict[str, Any] = capture_module.provenance("transformers", transformers.__version__)
    facts.update(model=model_name, device=str(weight.device), dtype=str(weight.dtype).removeprefix("torch."),
                 tokenizer=tokenizer_name)
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: its whole tokenizer.json
        definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
        facts["tokenizer_sha256"] = _sha256(definition.encode())
        template = getattr(tokenizer, "chat_template", None)
        if template:
            text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
            facts["chat_template_sha256"] = _sha256(text.encode())
            if len(text) <= MAX_TEMPLATE_CHARS:
                facts["chat_template"] = template
    facts.update(data=os.path.abspath(data), data_sha256=_file_sha256(data), records=records)
    return facts


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def pad_batch(batch: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, longest] of a batch, right-padded with token 0."""
    width = max(len(ids) for _, ids in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.int64)
    attention = torch.zeros(len(batch), width, dtype=torch.int64)
    for b, (_, ids) in enumerate(batch):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
    return input_ids, attention


def _keep(captured: dict, name: str):
    def hook(_module, _args, output):
        captured[name] = output[0] if isinstance(output, tuple) else output
    return hook


def batches_by_length(todo: list[tuple[str, list[int]]], max_batch_tokens: int):
    """Samples sorted by length, grouped so that batch size x longest sample stays within ``max_batch_tokens``."""
    batch: list[tuple[str, list[int]]] = []
    for item in sorted(todo, key=lambda t: len(t[1])):
        if batch and (len(batch) + 1) * len(item[1]) > max_batch_tokens:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch
