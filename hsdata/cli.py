"""The ``hsdata`` command line. Exit codes: 0 success, 1 problems found, 2 bad usage or not a readable store."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import datetime

import numpy as np
from tqdm import tqdm

from .client import extract_from_server
from .conversations import read_jsonl
from .dtypes import HIDDEN_DTYPES, check_pair
from .errors import HsdataError
from .reader import Store, open as open_store
from .storage import Storage
from .validate import leftovers, validate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsdata", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="spec, sample and token counts, sizes and length distribution")
    info.add_argument("store", help="path or fsspec URL of the store")
    info.add_argument("--json", action="store_true", help="print one JSON document")
    _add_storage_options(info)

    check = commands.add_parser("validate", help="audit metadata, manifests and every checksum; exit 1 on problems")
    check.add_argument("store", help="path or fsspec URL of the store")
    check.add_argument("--json", action="store_true", help="print the report as one JSON document")
    check.add_argument("--workers", type=_positive_int, default=4, help="tensor streams checked at once (4)")
    check.add_argument("--sample", type=_sample_size, metavar="N|FRACTION",
                       help="check N random samples, or this fraction of them, instead of all")
    check.add_argument("--seed", type=int, default=0, help="seed of --sample (0)")
    check.add_argument("--check-finite", action="store_true", help="also flag samples holding NaN or Inf")
    _add_storage_options(check)

    gc = commands.add_parser("gc", help="list (and with --yes delete) what crashed writers left uncommitted")
    gc.add_argument("store", help="path or fsspec URL of the store")
    gc.add_argument("--yes", action="store_true", help="delete the listed files")
    gc.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                    help="only files not modified for this long, so live writers keep theirs (3600)")
    _add_storage_options(gc)

    extract = commands.add_parser("extract", help="capture hidden states of a dataset into a store")
    source = extract.add_mutually_exclusive_group()
    source.add_argument("--server", metavar="URL",
                        help="a running SGLang server launched with the hsdata hook (docs/server_hook.md)")
    source.add_argument("--engine", choices=["hf"], default="hf",
                        help="run a transformers model in this process (the default)")
    extract.add_argument("--model", metavar="PATH_OR_CONFIG",
                         help="--engine hf: a local model folder, or a config.json for random weights; "
                              "default: the embedded demo model")
    extract.add_argument("--data", metavar="FILE.jsonl",
                         help="ShareGPT (conversations), OpenAI (messages) or pre-tokenized (input_ids) rows; "
                              "default with the demo model: its shipped conversations")
    extract.add_argument("--tokenizer", help="tokenizer path (chat template); default: the model's")
    extract.add_argument("--out", required=True, help="the store to write (path or fsspec URL)")
    extract.add_argument("--aux-layers", type=int, nargs="+", metavar="K",
                         help="--engine hf: \"output of layer k\" ids (default: EAGLE-3's [1, N//2-1, N-4])")
    extract.add_argument("--device", default="cpu", help="--engine hf: torch device (cpu)")
    extract.add_argument("--dtype", default="bfloat16", choices=HIDDEN_DTYPES,
                         help="--engine hf: the dtype the model runs in (bfloat16)")
    extract.add_argument("--store-dtype", choices=HIDDEN_DTYPES,
                         help="--engine hf: store the states in this dtype (default: --dtype; a float32 model's may "
                              "be stored as bfloat16 or float16)")
    extract.add_argument("--max-batch-tokens", type=_positive_int, default=8192,
                         help="--engine hf: padded tokens per forward (8192)")
    extract.add_argument("--seed", type=int, default=0, help="--engine hf: seed of random weights (0)")
    extract.add_argument("--concurrency", type=_positive_int, default=16, help="--server: requests in flight (16)")
    extract.add_argument("--retries", type=int, default=4, help="--server: retries of a failed request (4)")
    extract.add_argument("--commit-timeout", type=float, default=120.0, metavar="SECONDS",
                         help="--server: how long to wait for the last samples to be committed (120)")
    _add_storage_options(extract)

    args = parser.parse_args(argv)
    try:
        return {"info": _info, "validate": _validate, "gc": _gc, "extract": _extract}[args.command](args)
    except (HsdataError, OSError, ValueError) as e:
        print(f"hsdata {args.command}: error: {e}", file=sys.stderr)
        return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _sample_size(text: str) -> float:
    value = float(text)
    if value <= 0 or (value > 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(f"expects a count >= 1 or a fraction in (0, 1), got {text}")
    return value


def _add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be")


def _storage_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def summarize(store: Store) -> dict:
    """What ``hsdata info`` reports, as plain data."""
    spec, lengths = store.spec, store.lengths
    quantiles = np.percentile(lengths, [0, 50, 90, 99, 100]).tolist() if len(lengths) else [0] * 5
    return {
        "url": store.url,
        "format_version": spec.format_version,
        "model": spec.model,
        "hidden_size": spec.hidden_size,
        "aux_layers": list(spec.aux_layers),
        "layer_convention": spec.layer_convention,
        "final_hidden_state": spec.final_hidden_state,
        "dtype": spec.dtype,
        "compute_dtype": spec.compute_dtype,
        "samples": len(store),
        "tokens": store.num_tokens,
        "payload_bytes": store.num_tokens * spec.token_nbytes,
        "parts": len(set(store.manifest.column("part").to_pylist())),
        "shard_tokens": spec.shard_tokens,
        "chunk_tokens": {t.name: t.chunk_tokens for t in spec.tensors},
        "length": dict(zip(("min", "p50", "p90", "p99", "max"), quantiles),
                       mean=float(lengths.mean()) if len(lengths) else 0.0),
    }


def _info(args: argparse.Namespace) -> int:
    with open_store(args.store, storage_options=_storage_options(args.storage_option)) as store:
        summary = summarize(store)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    length = summary["length"]
    print(f"store       {summary['url']}  (format v{summary['format_version']})")
    print(f"model       {summary['model']}  hidden size {summary['hidden_size']}")
    print(f"aux layers  {summary['aux_layers']}  (output of layer k = HF hidden_states[k+1]); "
          f"final state {summary['final_hidden_state']}")
    computed = summary["compute_dtype"]
    computed = "compute dtype not recorded" if computed is None else f"computed in {computed}"
    print(f"dtype       {summary['dtype']}  ({computed})")
    print(f"samples     {summary['samples']:,} in {summary['parts']} part(s)")
    print(f"tokens      {summary['tokens']:,}  ({_human_bytes(summary['payload_bytes'])} of hidden states and ids)")
    print(f"length      min {length['min']:.0f}  p50 {length['p50']:.0f}  p90 {length['p90']:.0f}  "
          f"p99 {length['p99']:.0f}  max {length['max']:.0f}  mean {length['mean']:.1f}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    options = _storage_options(args.storage_option)
    bar = tqdm(total=0, unit="B", unit_scale=True, desc="validate", disable=None, file=sys.stderr)
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            bar.update(n)

    def on_total(n: int) -> None:
        bar.total = n
        bar.refresh()

    started = time.perf_counter()
    report = validate(args.store, storage_options=options, workers=args.workers, sample=args.sample,
                      check_finite=args.check_finite, seed=args.seed, progress=progress, on_total=on_total)
    bar.close()
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**report.to_dict(), "seconds": seconds}, indent=2))
        return 0 if report.ok else 1
    for problem in report.problems:
        print(problem.line())
    if report.leftovers:
        print(f"note: {len(report.leftovers)} uncommitted file(s) left by writers that stopped or are still "
              f"running (not an error; `hsdata gc {args.store}` lists them)")
    verdict = "OK" if report.ok else f"{len(report.problems)} PROBLEM(S)"
    print(f"{verdict}: {report.samples_checked:,} of {report.samples:,} samples, "
          f"{_human_bytes(report.bytes_checked)} checked in {seconds:.1f} s "
          f"({_human_bytes(report.bytes_checked / max(seconds, 1e-9))}/s)")
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    options = _storage_options(args.storage_option)
    storage = Storage(args.store, options)
    keys = leftovers(args.store, storage_options=options)
    now = time.time()
    old, young = [], []
    for key in keys:
        (old if now - _mtime(storage.fs.info(storage.path(key))) >= args.older_than else young).append(key)
    for key in old:
        print(("deleting " if args.yes else "") + key)
    if args.yes:
        for key in old:
            storage.fs.rm_file(storage.path(key))
    if young:
        print(f"kept {len(young)} uncommitted file(s) younger than {args.older_than:g} s (a writer may be running)")
    if old and not args.yes:
        print(f"{len(old)} uncommitted file(s); run again with --yes to delete them")
    elif not old:
        print("nothing to delete")
    return 0


def _extract(args: argparse.Namespace) -> int:
    return _extract_from_server(args) if args.server else _extract_in_process(args)


def _extract_from_server(args: argparse.Namespace) -> int:
    if not args.data:
        raise ValueError("--server needs --data")
    records = list(read_jsonl(args.data))
    tokenizer = _load_tokenizer(args.tokenizer) if any(r.messages is not None for r in records) else None
    bar = tqdm(total=len(records), unit="sample", desc="extract", disable=None, file=sys.stderr)
    summary = extract_from_server(args.server, records, tokenizer, args.out,
                                  storage_options=_storage_options(args.storage_option),
                                  concurrency=args.concurrency, retries=args.retries,
                                  commit_timeout_s=args.commit_timeout, on_sent=bar.update)
    bar.close()
    for sample_id, why in summary.failed.items():
        print(f"failed: sample {sample_id!r}: {why}")
    print(f"{'OK' if summary.ok else 'FAILED'}: {summary.total:,} samples: {summary.skipped:,} already in the store, "
          f"{summary.sent:,} sent ({summary.tokens_sent:,} tokens), {summary.committed:,} committed, "
          f"{len(summary.failed):,} failed, in {summary.seconds:.1f} s")
    return 0 if summary.ok else 1


def _extract_in_process(args: argparse.Namespace) -> int:
    import torch

    from . import demo, engine_hf

    store_dtype = args.store_dtype or args.dtype
    check_pair(store_dtype, args.dtype)
    dtype = getattr(torch, args.dtype)
    if args.model is None:
        tokenizer = demo.tokenizer()
        model, name = demo.model(len(tokenizer), seed=args.seed, dtype=dtype), demo.MODEL_NAME
        data = args.data or demo.data_path()
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not args.data:
            raise ValueError("--model needs --data")
        data, name = args.data, args.model
        if args.model.endswith(".json"):
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        tokenizer = None
    model = model.to(device=args.device, dtype=dtype).eval()
    records = list(read_jsonl(data))
    if tokenizer is None and any(r.messages is not None for r in records):
        tokenizer = _load_tokenizer(args.tokenizer or (None if args.model.endswith(".json") else args.model))
    bar = tqdm(unit="tok", unit_scale=True, desc="extract", disable=None, file=sys.stderr)
    summary = engine_hf.extract(model, tokenizer, records, args.out, model_name=name, aux_layers=args.aux_layers,
                                max_batch_tokens=args.max_batch_tokens, store_dtype=store_dtype,
                                storage_options=_storage_options(args.storage_option), on_tokens=bar.update)
    bar.close()
    for sample_id, why in summary.failed.items():
        print(f"failed: sample {sample_id!r}: {why}")
    rate = summary.tokens / max(summary.seconds, 1e-9)
    print(f"{'OK' if summary.ok else 'FAILED'}: {summary.total:,} samples: {summary.skipped:,} already in the store, "
          f"{summary.written:,} written ({summary.tokens:,} tokens, {rate:,.0f} tokens/s), "
          f"{len(summary.failed):,} failed, in {summary.seconds:.1f} s")
    return 0 if summary.ok else 1


def _load_tokenizer(name: str | None):
    if not name:
        raise ValueError("--tokenizer is needed to apply the chat template to conversations")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _mtime(info: dict) -> float:
    """Modification time of an fsspec ``info`` entry, across filesystems' spellings."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    return 0.0


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError


if __name__ == "__main__":
    sys.exit(main())
