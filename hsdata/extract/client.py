"""``hsdata extract --server``: drive a running SGLang server (with the hsdata hook) over a dataset.

Before anything is written, :func:`check_server` asks the server's ``/server_info`` whether it runs the hsdata
hook, into this store, with aux hidden states on. Each sample then goes to ``/generate`` as ``input_ids`` with
``max_new_tokens`` 0, ``rid`` = the hook's ``rid_prefix`` + its sample id (the hook stores only such requests)
and a unique ``cache_salt`` (so no prefix is served from the radix cache); the hook stores its hidden states.
The loss masks, which only the client can know, are added to the store once their samples are committed (a
resumed run adds those a stopped run did not). The run ends when every sample it sent is committed, or reports
the ones that are not.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from .. import manifest, masks
from ..errors import NotAStoreError, ServerCheckError
from ..reader import open as open_store
from ..repair import add_loss_masks
from ..io.storage import Storage
from .conversations import Record, tokenize

BATCH = 256  # records tokenized, masked and sent together
RID_PREFIX = "hsdata:"  # the hook stores a request only if its rid starts with the hook config's rid_prefix
HOOK_FACTORY = "server_hook.sglang:make_hook"


@dataclass
class Summary:
    total: int = 0
    skipped: int = 0  # committed by an earlier run
    sent: int = 0
    committed: int = 0
    tokens_sent: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # sample id -> why
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


class _PermanentError(Exception):
    """The server refused the request (4xx): retrying will not help."""


def extract_from_server(server: str, records: Iterable[Record], tokenizer: Any, out: str, *,
                        storage_options: dict | None = None, concurrency: int = 16, retries: int = 4,
                        request_timeout_s: float = 600.0, commit_timeout_s: float = 120.0,
                        on_sent: Callable[[int], None] | None = None) -> Summary:
    """Send every record not yet committed in ``out``; wait for the commits; return what happened."""
    started = time.monotonic()
    rid_prefix = check_server(server, out)
    summary = Summary()
    done, maskless = _committed(out, storage_options), _without_loss_mask(out, storage_options)
    sent: list[str] = []
    payloads_sent: dict[str, np.ndarray] = {}  # kept compact, to send again what a restarting server lost
    loss_masks: dict[str, np.ndarray] = {}  # added once their samples are committed
    batch: list[Record] = []

    def send_batch(pool: ThreadPoolExecutor) -> None:
        payloads = []
        for record in batch:
            try:
                ids, mask = tokenize(tokenizer, record)
            except ValueError as e:
                summary.failed[record.sample_id] = str(e)
                continue
            loss_masks[record.sample_id] = np.asarray(mask, dtype=np.uint8)
            payloads.append((record.sample_id, ids))
        futures = [(sid, ids, pool.submit(_generate, server, rid_prefix + sid, ids, retries, request_timeout_s))
                   for sid, ids in payloads]
        for sid, ids, future in futures:
            try:
                future.result()
                sent.append(sid)
                summary.tokens_sent += len(ids)
                payloads_sent[sid] = np.asarray(ids, dtype=np.int32)
            except Exception as e:  # noqa: BLE001 - reported per sample in the summary
                summary.failed[sid] = f"request failed: {e}"
            if on_sent is not None:
                on_sent(1)
        batch.clear()

    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="hsdata-client") as pool:
        for record in records:
            summary.total += 1
            if record.sample_id in done:
                summary.skipped += 1
                if record.sample_id in maskless:  # committed by a run that stopped before adding its mask
                    try:
                        loss_masks[record.sample_id] = np.asarray(tokenize(tokenizer, record)[1], dtype=np.uint8)
                    except ValueError as e:
                        summary.failed[record.sample_id] = str(e)
                if on_sent is not None:
                    on_sent(1)
                continue
            batch.append(record)
            if len(batch) >= BATCH:
                send_batch(pool)
        send_batch(pool)
    summary.sent = len(sent)
    missing = _wait_for_commits(out, storage_options, set(sent), commit_timeout_s)
    if missing:  # answered, then lost: a server that stopped before its next commit. Send those once more.
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="hsdata-client") as pool:
            futures = [pool.submit(_generate, server, rid_prefix + sid, payloads_sent[sid].tolist(), retries,
                                   request_timeout_s)
                       for sid in sorted(missing)]
            for future in futures:
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - it stays missing and is reported below
                    pass
        missing = _wait_for_commits(out, storage_options, missing, commit_timeout_s)
    summary.committed = len(sent) - len(missing)
    add_loss_masks(out, {sid: mask for sid, mask in loss_masks.items() if sid not in missing and
                         sid not in summary.failed}, storage_options=storage_options)
    for sid in sorted(missing):
        summary.failed[sid] = (f"sent twice, but not committed within {commit_timeout_s:g} s (is the hook's "
                               f"store {out}? see the server's log)")
    summary.seconds = time.monotonic() - started
    return summary


def check_server(server: str, out: str, timeout_s: float = 30.0) -> str:
    """Check that ``server`` answers and runs the hsdata hook writing ``out``; return the hook's rid prefix.

    Raises :class:`ServerCheckError` naming what is wrong, before the client writes anything.
    """
    url = f"{server.rstrip('/')}/server_info"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            info = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise ServerCheckError(f"{url} answered HTTP {e.code}: is {server} an SGLang (>= 0.5.23) server?") from None
    except (urllib.error.URLError, OSError) as e:
        raise ServerCheckError(f"cannot reach the SGLang server at {server}: {getattr(e, 'reason', e)}") from None
    except ValueError:
        raise ServerCheckError(f"{url} did not answer JSON: is {server} an SGLang server?") from None
    hooks = [h for h in info.get("forward_hooks") or []
             if isinstance(h, dict) and h.get("hook_factory") == HOOK_FACTORY]
    if not hooks:
        raise ServerCheckError(f"the server at {server} runs no hsdata hook: launch it with --forward-hooks naming "
                               f"\"hook_factory\": \"{HOOK_FACTORY}\" (docs/server_hook.md)")
    if not info.get("enable_return_aux_hidden_states"):
        raise ServerCheckError(f"the server at {server} passes no aux hidden states to the hook: launch it with "
                               "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3")
    if not (info.get("disable_prefill_cuda_graph") or info.get("disable_cuda_graph")):
        raise ServerCheckError(f"the server at {server} replays prefills in CUDA graphs, which forward hooks never "
                               "see: launch it with --disable-prefill-cuda-graph")
    config = hooks[0].get("config") or {}
    store = config.get("store")
    if not isinstance(store, str) or _normalized(store) != _normalized(out):
        raise ServerCheckError(f"the server's hsdata hook writes {store!r}, not {out!r}: pass --out {store}")
    prefix = config.get("rid_prefix", RID_PREFIX)
    if not isinstance(prefix, str):
        raise ServerCheckError(f"the server's hsdata hook has rid_prefix {prefix!r}: expected a string")
    return prefix


def _normalized(url: str) -> str:
    """A local path made absolute (the server and the client may name one folder differently); URLs as given."""
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    return os.path.realpath(url.removeprefix("file://"))


def _committed(out: str, storage_options: dict | None) -> set[str]:
    try:
        return set(open_store(out, storage_options=storage_options).sample_ids)
    except NotAStoreError:
        return set()


def _without_loss_mask(out: str, storage_options: dict | None) -> set[str]:
    """Committed samples with neither a stored nor an added loss mask."""
    try:
        store = open_store(out, storage_options=storage_options)
    except NotAStoreError:
        return set()
    added = masks.load(Storage(out, storage_options))
    return {sid for sid, own in zip(store.sample_ids, manifest.has_loss_mask(store.manifest))
            if not own and sid not in added}


def _wait_for_commits(out: str, storage_options: dict | None, sent: set[str], timeout_s: float) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        missing = sent - _committed(out, storage_options)
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.5)


def _generate(server: str, rid: str, input_ids: list[int], retries: int, timeout_s: float) -> dict:
    """POST one prefill-only request; retries connection errors and 5xx with exponential backoff."""
    body = json.dumps({"input_ids": input_ids, "rid": rid, "cache_salt": uuid.uuid4().hex,
                       "sampling_params": {"max_new_tokens": 0}}).encode()
    request = urllib.request.Request(f"{server.rstrip('/')}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code < 500:
                raise _PermanentError(f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from None
            error: Exception = e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            error = e
        if attempt < retries:
            time.sleep(min(30.0, 0.5 * 2**attempt))
    raise error
