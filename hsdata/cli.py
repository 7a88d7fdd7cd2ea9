"""The hsdata command line: inspect, check, clean up and fill hidden-state stores."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable

import numpy as np
import pyarrow.compute as pc

from . import __version__
from .codecs.compression import PRESETS, Compression
from .dtypes import FP8_DTYPES, HIDDEN_DTYPES, STORED_HIDDEN_DTYPES, check_pair
from .errors import HsdataError
from .extract.client import extract_from_server
from .extract.conversations import read_jsonl
from .layout import check_provenance
from .progress import Progress, human_bytes, status
from .repair import remove_loss_masks, remove_samples
from .reader import Store, open as open_store
from .show import run as run_show
from .io.storage import Storage
from .validate import leftovers, validate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsdata", description=__doc__, epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"hsdata {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="spec, sample and token counts, sizes, length distribution and provenance")
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
    check.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=True,
                       help="flag samples whose hidden states hold NaN or Inf (on by default: they would poison "
                            "training; fp8 rows are always checked)")
    check.add_argument("--verbose", action="store_true", help="list the samples each problem affects")
    _add_storage_options(check)

    gc = commands.add_parser("gc", help="list (and with --yes delete) what crashed writers left uncommitted")
    gc.add_argument("store", help="path or fsspec URL of the store")
    gc.add_argument("--yes", action="store_true", help="delete the listed files")
    gc.add_argument("--older-than", type=_non_negative_float, default=3600.0, metavar="SECONDS",
                    help="only files not modified for this long, so live writers keep theirs (3600)")
    gc.add_argument("--json", action="store_true", help="print the files deleted (or to delete) and kept as JSON")
    _add_storage_options(gc)

    remove = commands.add_parser("remove", help="repair: take samples (or their added loss masks) out of a store "
                                 "without rewriting a file (docs/format.md 6b)")
    remove.add_argument("store", help="path or fsspec URL of the store")
    remove.add_argument("sample_ids", nargs="+", metavar="SAMPLE_ID", help="the samples to take out")
    remove.add_argument("--loss-masks", action="store_true",
                        help="take out only their added loss masks, so correct ones can be added")
    remove.add_argument("--reason", help="free text recorded with the removal")
    remove.add_argument("--json", action="store_true", help="print the removal file written as JSON")
    _add_storage_options(remove)

    show = commands.add_parser("show", help="one sample: tensors, per-layer norms and statistics, loss-masked text")
    show.add_argument("store", help="path or fsspec URL of the store")
    show.add_argument("sample", metavar="SAMPLE_ID_OR_INDEX", help="a sample id, else an index (negative from the end)")
    show.add_argument("--tokenizer", metavar="PATH",
                      help="decode the text with this local tokenizer (default: the store's model, if a local folder)")
    show.add_argument("--json", action="store_true", help="print one JSON document")
    show.add_argument("--plot", metavar="FILE.png", help="also plot each layer's norm per position (needs matplotlib)")
    _add_storage_options(show)

    extract = commands.add_parser("extract", help="capture hidden states of a dataset into a store")
    source = extract.add_mutually_exclusive_group()
    source.add_argument("--server", metavar="URL",
                        help="a running SGLang server launched with the hsdata hook (docs/server_hook.md)")
    source.add_argument("--engine", choices=["hf"], default="hf",
                        help="run a transformers model in this process (the default)")
    extract.add_argument("--model", metavar="PATH_OR_CONFIG", type=_model_path,
                         help="--engine hf: a local model folder, or a config.json for random weights; "
                              "default: the embedded demo model")
    extract.add_argument("--data", metavar="FILE.jsonl", type=_existing_file,
                         help="ShareGPT (conversations), OpenAI (messages) or pre-tokenized (input_ids) rows; "
                              "default with the demo model: its shipped conversations")
    extract.add_argument("--tokenizer", type=_model_path,
                         help="a local tokenizer folder (chat template); default: the model's")
    extract.add_argument("--out", required=True, help="the store to write (path or fsspec URL)")
    extract.add_argument("--aux-layers", type=int, nargs="+", metavar="K",
                         help="--engine hf: \"output of layer k\" ids (default: EAGLE-3's [1, N//2-1, N-4])")
    extract.add_argument("--device", type=_device, default="cpu",
                         help="--engine hf: torch device (cpu); under torchrun, cuda is each rank's cuda:LOCAL_RANK")
    extract.add_argument("--device-map", choices=["auto"],
                         help="--engine hf: spread one model (a local --model folder) over this node's GPUs with "
                              "accelerate, instead of --device; under torchrun each rank of the node takes its own "
                              "block of GPUs")
    extract.add_argument("--rank-timeout", type=_positive_int, default=3600, metavar="SECONDS",
                         help="--engine hf under torchrun: how long a rank waits for the others, at the start and "
                              "at the end (3600)")
    extract.add_argument("--dtype", default="bfloat16", choices=HIDDEN_DTYPES,
                         help="--engine hf: the dtype the model runs in (bfloat16)")
    extract.add_argument("--store-dtype", choices=STORED_HIDDEN_DTYPES,
                         help="--engine hf: store the states in this dtype (default: --dtype; a float32 model's may "
                              "be stored as bfloat16 or float16; any model's as float8_e4m3fn, half of bf16's bytes, "
                              "quantized where the states are made: docs/format.md section 3b)")
    extract.add_argument("--compression", choices=COMPRESSION_CHOICES,
                         help="--engine hf: compress the hidden states of a store created here: zstd (0.68-0.69 of "
                              "the size, about one core of decoding per 2-3 GB/s read) or lz4 (0.75); "
                              "docs/format.md section 5a (none)")
    extract.add_argument("--max-batch-tokens", type=_positive_int, default=8192,
                         help="--engine hf: padded tokens per forward (8192)")
    extract.add_argument("--seed", type=int, default=0, help="--engine hf: seed of random weights (0)")
    extract.add_argument("--concurrency", type=_positive_int, default=16, help="--server: requests in flight (16)")
    extract.add_argument("--retries", type=int, default=4, help="--server: retries of a failed request (4)")
    extract.add_argument("--commit-timeout", type=float, default=120.0, metavar="SECONDS",
                         help="--server: how long to wait for the last samples to be committed (120)")
    extract.add_argument("--provenance", action="append", default=[], metavar="KEY=VALUE",
                         help="--engine hf: recorded in the store's provenance over the automatic entries "
                              "(repeatable); VALUE is parsed as JSON when it can be")
    _add_storage_options(extract)

    convert = commands.add_parser("convert", help="write a store's samples again with another stored dtype (fp8: "
                                  "half the bytes of bf16) or compression, without rerunning the model; resumable")
    convert.add_argument("src", help="the store to read (path or fsspec URL)")
    convert.add_argument("dest", help="the store to write (a new one, or one an earlier convert started)")
    convert.add_argument("--dtype", required=True, choices=STORED_HIDDEN_DTYPES,
                         help="how the hidden states are stored: float8_e4m3fn keeps a float32 scale per token and "
                              "layer (docs/format.md section 3b)")
    convert.add_argument("--compression", choices=COMPRESSION_CHOICES, help="compress the new store's hidden states")
    convert.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_storage_options(convert)
    _add_migrate_commands(commands)

    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    args.command_line = shlex.join(["hsdata", *argv])
    if unknown:  # report it with the subcommand's own usage, not the top-level one
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    code = _dispatch(args)
    distributed = sys.modules.get("hsdata.extract.distributed")  # loaded by a rank of an extraction job
    return code if distributed is None else distributed.exit_if_broken(code)


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command; its exit status (errors: one line on stderr, status 2)."""
    try:
        return {"info": _info, "validate": _validate, "gc": _gc, "extract": _extract, "show": _show,
                "remove": _remove, "import": _import, "export": _export, "convert": _convert}[args.command](args)
    except BrokenPipeError:  # `hsdata info STORE | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE  # what the shell reports for a command ended by its closed pipe
    except (HsdataError, OSError, ValueError, MemoryError) as e:
        message = " ".join(str(e).split())
        print(f"hsdata {args.command}: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": {"type": type(e).__name__, "message": message}}, indent=2))
        return 2


EXIT_CODES = ("exit codes: 0 success; 1 problems found (validate), failed samples (extract, export) or bad source "
              "files (import, unless --skip-bad); 2 bad arguments, "
              "not a readable store, bad store contents, or gc refusing to delete anything because what is "
              "committed is unclear (one line on stderr; with --json also {\"error\": {\"type\": ..., "
              "\"message\": ...}} on stdout)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}" if not os.path.exists(text) else f"not a file: {text}")
    return text


def _model_path(text: str) -> str:
    """A local folder or file that exists. A hub id (``gpt2``, ``org/name``) is refused before anything loads:
    hsdata reads models and tokenizers offline."""
    path = os.path.expanduser(text)
    if os.path.exists(path):
        return path
    if text.startswith(("/", ".", "~")) or text.count("/") > 1 or text.endswith(".json"):
        raise argparse.ArgumentTypeError(f"no such path: {text}")
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a local folder or file (a hub id?): hsdata loads models and tokenizers from local paths "
        f"only; download it first, e.g. `huggingface-cli download {text} --local-dir ./{text.split('/')[-1]}`, and "
        "pass that folder")


def _device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine (torch "
                                         f"{torch.__version__}); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _rounded(value):
    """``value`` with floats rounded to 3 decimals, integral ones as ints (for JSON output)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
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
    return _key_values(pairs, "--storage-option")


def _key_values(pairs: list[str], option: str) -> dict:
    """``KEY=VALUE`` pairs of a repeatable ``option`` as a dict, each value parsed as JSON when it can be."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} expects KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


COMPRESSION_CHOICES = ("none", *PRESETS)


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
        "disk_bytes": store._storage.disk_usage(),
        "parts": pc.count_distinct(store.manifest.column("part")).as_py(),
        "shard_tokens": spec.shard_tokens,
        "chunk_tokens": {t.name: t.chunk_tokens for t in spec.tensors},
        "compression": None if spec.compression is None else spec.compression.to_dict(),
        "length": dict(zip(("min", "p50", "p90", "p99", "max"), quantiles),
                       mean=float(lengths.mean()) if len(lengths) else 0.0),
        "provenance": store.provenance,
        "part_provenance": store.part_provenance,
    }


def _info(args: argparse.Namespace) -> int:
    with open_store(args.store, storage_options=_storage_options(args.storage_option)) as store:
        summary = summarize(store)
    if args.json:
        print(json.dumps({**_rounded(summary), "provenance": summary["provenance"],  # as recorded
                          "part_provenance": summary["part_provenance"]}, indent=2))
        return 0
    length = summary["length"]
    print(f"store       {summary['url']}  (format v{summary['format_version']})")
    print(f"model       {summary['model']}  hidden size {summary['hidden_size']}")
    print(f"aux layers  {summary['aux_layers']}  (output of layer k = HF hidden_states[k+1]); "
          f"final state {summary['final_hidden_state']}")
    computed = summary["compute_dtype"]
    computed = "compute dtype not recorded" if computed is None else f"computed in {computed}"
    scaled = ", a float32 scale per token and layer" if summary["dtype"] in FP8_DTYPES else ""
    print(f"dtype       {summary['dtype']}  ({computed}{scaled})")
    compression = summary["compression"]
    print(f"compressed  {'no' if compression is None else f'{Compression.from_dict(compression)} (hidden states)'}")
    print(f"samples     {summary['samples']:,} in {summary['parts']} part(s)")
    print(f"tokens      {summary['tokens']:,}")
    print(f"bytes       {human_bytes(summary['payload_bytes'])} of hidden states and ids, "
          f"{human_bytes(summary['disk_bytes'])} on disk (with chunk padding at commits, indexes, manifests)")
    print(f"length      min {length['min']:.0f}  p50 {length['p50']:.0f}  p90 {length['p90']:.0f}  "
          f"p99 {length['p99']:.0f}  max {length['max']:.0f}  mean {length['mean']:.1f}")
    provenance = summary["provenance"]
    print("provenance" if provenance else "provenance  none recorded")
    for key, value in provenance.items():
        print(f"  {_one_line(key)}: {_one_line(value)}")
    for part, recorded in summary["part_provenance"].items():  # writers that joined the store
        print(f"part {_one_line(part)} provenance")
        for key, value in recorded.items():
            print(f"  {_one_line(key)}: {_one_line(value)}")
    return 0


def _one_line(value) -> str:
    """A provenance key or value on one line: printable text as it is, anything else as compact JSON (escaping
    newlines and control characters, so a store's text cannot drive the terminal)."""
    if isinstance(value, str) and value.isprintable():
        return value
    return json.dumps(value, separators=(",", ":"))


def _validate(args: argparse.Namespace) -> int:
    options = _storage_options(args.storage_option)
    started = time.perf_counter()
    with Progress("validate", unit="B", total=0) as bar:
        report = validate(args.store, storage_options=options, workers=args.workers, sample=args.sample,
                          check_finite=args.check_finite, seed=args.seed, progress=bar.update,
                          on_total=bar.set_total)
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps(_rounded({**report.to_dict(), "seconds": seconds}), indent=2))
        return 0 if report.ok else 1
    for problem in report.problems:
        print(problem.line())
        if args.verbose and len(problem.samples) > 1:
            for sample_id in problem.samples:
                print(f"    sample {sample_id!r}")
    for note in report.notes:
        print(f"note: {note}")
    if report.leftovers:
        print(f"note: {len(report.leftovers)} uncommitted file(s) left by writers that stopped or are still "
              f"running (not an error; `hsdata gc {args.store}` lists them)")
    verdict = "OK" if report.ok else f"{len(report.problems)} PROBLEM(S)"
    print(f"{verdict}: {report.samples_checked:,} of {report.samples:,} samples, "
          f"{human_bytes(report.bytes_checked)} checked in {seconds:.1f} s "
          f"({human_bytes(report.bytes_checked / max(seconds, 1e-9))}/s)")
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    options = _storage_options(args.storage_option)
    storage = Storage(args.store, options)
    keys = leftovers(args.store, storage_options=options)
    now = time.time()
    old, young = [], []
    for key in keys:
        (old if now - storage.modified(key) >= args.older_than else young).append(key)
    for key in old:
        if not args.json:
            print(("deleting " if args.yes else "") + key)
        if args.yes:
            storage.delete(key)
    if args.json:
        print(json.dumps({"deleted" if args.yes else "to_delete": old, "kept": young,
                          "older_than": _rounded(args.older_than)}, indent=2))
        return 0
    for key in young:
        print(f"kept {key} (younger than {args.older_than:g} s: a writer may be running)")
    if old and not args.yes:
        print(f"{len(old)} uncommitted file(s); run again with --yes to delete them")
    elif not old:
        print("nothing to delete")
    return 0


def _remove(args: argparse.Namespace) -> int:
    remove = remove_loss_masks if args.loss_masks else remove_samples
    key = remove(args.store, args.sample_ids, reason=args.reason,
                 storage_options=_storage_options(args.storage_option))
    what = "the added loss masks of" if args.loss_masks else "the rows of"
    if args.json:
        print(json.dumps({"removal": key, "sample_ids": args.sample_ids, "loss_masks_only": args.loss_masks}, indent=2))
    else:
        print(f"removed {what} {len(args.sample_ids)} sample(s): {key}")
    return 0


def _show(args: argparse.Namespace) -> int:
    return run_show(args.store, args.sample, storage_options=_storage_options(args.storage_option),
                    tokenizer=args.tokenizer, as_json=args.json, plot=args.plot)


def _extract(args: argparse.Namespace) -> int:
    return _extract_from_server(args) if args.server else _extract_in_process(args)


def _extract_from_server(args: argparse.Namespace) -> int:
    if not args.data:
        raise ValueError("--server needs --data")
    if args.provenance:
        raise ValueError("--provenance is for --engine hf: the server's hook creates the store and records its "
                         "own (set \"provenance\" in its hook config, docs/server_hook.md)")
    status(f"reading data {args.data} ...")
    records = list(read_jsonl(args.data))
    tokenizer = _load_tokenizer(args.tokenizer) if any(r.messages is not None for r in records) else None
    status(f"sending {len(records):,} samples to {args.server} ...")
    with Progress("extract", unit="sample", total=len(records)) as bar:
        summary = extract_from_server(args.server, records, tokenizer, args.out,
                                      storage_options=_storage_options(args.storage_option),
                                      concurrency=args.concurrency, retries=args.retries,
                                      commit_timeout_s=args.commit_timeout, on_sent=bar.update)
    for sample_id, why in summary.failed.items():
        print(f"failed: sample {sample_id!r}: {why}")
    print(f"{'OK' if summary.ok else 'FAILED'}: {summary.total:,} samples: {summary.skipped:,} already in the store, "
          f"{summary.sent:,} sent ({summary.tokens_sent:,} tokens), {summary.committed:,} committed, "
          f"{len(summary.failed):,} failed, in {summary.seconds:.1f} s")
    if summary.not_stored:
        print(f"{summary.not_stored:,} generated by the server but not stored: {summary.hook_report}")
    return 0 if summary.ok else 1


def _extract_in_process(args: argparse.Namespace) -> int:
    from .extract import distributed

    job = distributed.from_environment()
    if job is not None:
        return _extract_rank(args, job)
    summary, _, _ = _run_engine(args)
    for sample_id, why in summary.failed.items():
        print(f"failed: sample {sample_id!r}: {why}")
    rate = summary.tokens / max(summary.seconds, 1e-9)
    print(f"{'OK' if summary.ok else 'FAILED'}: {summary.total:,} samples: {summary.skipped:,} already in the store, "
          f"{summary.written:,} written ({summary.tokens:,} tokens, {rate:,.0f} tokens/s), "
          f"{len(summary.failed):,} failed, in {summary.seconds:.1f} s")
    return 0 if summary.ok else 1


def _extract_rank(args: argparse.Namespace, job) -> int:
    """One rank of a torchrun job: rank 0 reads what is committed and tells the others, each rank runs its share
    into its own part, and rank 0 prints every rank's report and the job's totals. Each rank exits with its own
    status: a rank that raises reports its error to rank 0 and to torchrun (which names it), then raises it."""
    import socket

    from .extract import distributed, engine_hf

    options = _storage_options(args.storage_option)
    distributed.start(job, args.rank_timeout)
    try:
        committed = distributed.from_rank0(lambda: engine_hf.committed_ids(args.out, options))
        error, summary = None, None
        try:
            summary, token_bytes, where = _run_engine(args, job, committed)
            report = (summary, token_bytes, f"{socket.gethostname()} {where}", None)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, then raised
            error = e
            report = (None, 0, socket.gethostname(), f"{type(e).__name__}: {' '.join(str(e).split())}")
            distributed.record_error(e)
        reports = distributed.gather(report)
        if reports is not None:
            _print_job(reports, lambda: len(engine_hf.committed_ids(args.out, options)))
        sys.stdout.flush()
        distributed.barrier()  # torchrun stops every rank once one exits non-zero: not before rank 0 has printed
    finally:
        distributed.stop()
    if error is not None:
        raise error
    return 0 if summary.ok else 1


def _print_job(reports: list, stored: Callable[[], int]) -> None:
    """Print a job's summary from every rank's ``(summary, token_bytes, where, error)``; ``stored()`` counts
    the samples in the store (asked only when a rank failed)."""
    summaries = [summary for summary, _, _, _ in reports if summary is not None]
    failed = {sid: why for summary in summaries for sid, why in summary.failed.items()}  # tokenizing: every rank
    for sample_id, why in failed.items():
        print(f"failed: sample {sample_id!r}: {why}")
    for rank, (summary, _, where, error) in enumerate(reports):
        if error is not None:
            print(f"rank {rank} ({where}): FAILED: {error}")
        else:
            rate = summary.tokens / max(summary.seconds, 1e-9)
            print(f"rank {rank} ({where}): {summary.written:,} written ({summary.tokens:,} tokens, "
                  f"{rate:,.0f} tokens/s) in {summary.seconds:.1f} s")
    errors = sum(error is not None for *_, error in reports)
    total, skipped = (summaries[0].total, summaries[0].skipped) if summaries else (0, 0)
    written, tokens = sum(s.written for s in summaries), sum(s.tokens for s in summaries)
    seconds = max([s.seconds for s in summaries], default=0.0)
    nbytes = sum(s.tokens * token_bytes for s, token_bytes, _, _ in reports if s is not None)
    ok = not failed and not errors
    print(f"{'OK' if ok else 'FAILED'}: {total:,} samples: {skipped:,} already in the store, {written:,} written "
          f"({tokens:,} tokens, {tokens / max(seconds, 1e-9):,.0f} tokens/s, "
          f"{human_bytes(nbytes / max(seconds, 1e-9))}/s), {len(failed):,} failed, in {seconds:.1f} s, "
          f"by {len(reports)} ranks ({errors} failed)")
    if errors:
        print(f"the store holds {stored():,} samples; the same command, with any number of ranks, does the rest")


def _run_engine(args: argparse.Namespace, job=None, committed=None):
    """Load the model and data and run :func:`engine_hf.extract` (this rank's share in a job): the summary,
    the bytes stored per token, and where the model runs."""
    import torch

    from .extract import demo, distributed, engine_hf

    store_dtype = args.store_dtype or args.dtype
    check_pair(store_dtype, args.dtype)
    given = check_provenance(_key_values(args.provenance, "--provenance"))  # before the model is loaded
    dtype = getattr(torch, args.dtype)
    if args.device_map and (args.model is None or args.model.endswith(".json")):
        raise ValueError("--device-map needs --model, a local model folder")
    placement = distributed.device_map(job) if args.device_map else None
    device = distributed.device(args.device, job)
    if args.model is None:
        status("training the demo tokenizer ...")
        tokenizer = demo.tokenizer()
        status(f"building the demo model ({demo.MODEL_NAME}, random weights) ...")
        model, name = demo.model(len(tokenizer), seed=args.seed, dtype=dtype), demo.MODEL_NAME
        tokenizer_name = demo.MODEL_NAME
        data = args.data or demo.data_path()
    else:
        if not args.data:
            raise ValueError("--model needs --data")
        status(f"loading model {args.model} ...")
        from transformers import AutoConfig, AutoModelForCausalLM

        data, name, tokenizer_name = args.data, args.model, None
        if args.model.endswith(".json"):
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        elif placement:
            model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype, **placement)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        tokenizer = None
    if not placement:
        model = model.to(device=device, dtype=dtype)
    model = model.eval()
    where = ",".join(sorted({str(p.device) for p in model.parameters()}))
    status(f"reading data {data} ...")
    records = list(read_jsonl(data))
    if tokenizer is None and any(r.messages is not None for r in records):
        tokenizer_name = args.tokenizer or (None if args.model.endswith(".json") else args.model)
        tokenizer = _load_tokenizer(tokenizer_name)
    layers, norm = engine_hf.decoder_parts(model)
    aux = args.aux_layers or engine_hf.eagle3_layers(len(layers))
    token_bytes = 4 + 1 + (len(aux) + 1) * norm.weight.shape[-1] * getattr(torch, store_dtype).itemsize
    provenance = {**engine_hf.extract_provenance(model, tokenizer, model_name=name, tokenizer_name=tokenizer_name,
                                                 data=data, records=len(records)),
                  "command": args.command_line, **given}
    bars: list[Progress] = []

    def on_plan(samples: int, tokens: int) -> None:
        if job is None or job.rank == 0:  # one bar on the terminal: rank 0's share
            bars.append(Progress("extract", unit="tok", total=tokens, samples=samples, unit_bytes=token_bytes))

    def on_batch(samples: int, tokens: int) -> None:
        for bar in bars:
            bar.update(tokens, samples)

    status(f"tokenizing {len(records):,} records ...")
    try:
        summary = engine_hf.extract(model, tokenizer, records, args.out, model_name=name, aux_layers=args.aux_layers,
                                    max_batch_tokens=args.max_batch_tokens, store_dtype=store_dtype,
                                    storage_options=_storage_options(args.storage_option), on_plan=on_plan,
                                    on_batch=on_batch, provenance=provenance, committed=committed,
                                    share=None if job is None else (job.rank, job.world_size),
                                    compression=args.compression)
    finally:
        for bar in bars:
            bar.close()
    return summary, token_bytes, where


def _load_tokenizer(name: str | None):
    if not name:
        raise ValueError("--tokenizer is needed to apply the chat template to conversations")
    status(f"loading tokenizer {name} ...")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _add_migrate_commands(commands) -> None:
    """``hsdata import`` and ``hsdata export`` (docs/migrating.md)."""
    from .formats import FORMAT_NAMES

    imp = commands.add_parser("import", help="copy a SpecForge, ModelOpt or speculators dump into a store, verified; "
                              "exit 1 if bad source files were found (unless --skip-bad)")
    imp.add_argument("--from", dest="fmt", required=True, choices=FORMAT_NAMES, help="the dump's format")
    imp.add_argument("src", help="the dump's folder")
    imp.add_argument("dest", help="the store to write or extend (path or fsspec URL)")
    imp.add_argument("--aux-layers", type=int, nargs="+", metavar="K",
                     help="the aux layers' ids, in the order the dump concatenates them (default with --model: "
                          "EAGLE-3's [1, N//2-1, N-4] as \"output of layer k\" ids)")
    imp.add_argument("--layer-ids", choices=["output", "input"], default="output",
                     help="--aux-layers counts \"output of layer k\" (hsdata, HF hidden_states[k+1]; the default) "
                          "or \"input of layer k\" (SGLang/vLLM, HF hidden_states[k]) ids")
    imp.add_argument("--model", metavar="NAME_OR_PATH",
                     help="the target model, recorded in the store; a local folder or config.json also gives the "
                          "layer count (default --aux-layers) and vocab_size")
    imp.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                     help="import only the files whose index in the sorted listing is K modulo N (run N processes "
                          "K = 0..N-1 into one store)")
    imp.add_argument("--skip-bad", action="store_true",
                     help="bad source files are skipped and listed, and do not make the exit status 1")
    imp.add_argument("--commit-bytes", type=_positive_int, default=1 << 30, metavar="BYTES",
                     help="commit and verify after about this many source bytes (1 GiB)")
    imp.add_argument("--compression", choices=COMPRESSION_CHOICES,
                     help="compress the hidden states of a store created here (zstd, lz4; docs/format.md section 5a)")
    imp.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    _add_storage_options(imp)

    exp = commands.add_parser("export", help="write a store in a trainer's old layout (SpecForge, ModelOpt, "
                              "speculators), bit for bit; a rerun skips files already written")
    exp.add_argument("--to", dest="fmt", required=True, choices=FORMAT_NAMES, help="the layout to write")
    exp.add_argument("store", help="path or fsspec URL of the store")
    exp.add_argument("dest", help="the folder to write")
    exp.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    _add_storage_options(exp)


def _shard(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 0 <= int(k) < int(n):
        raise argparse.ArgumentTypeError(f"expects K/N with 0 <= K < N, got {text!r}")
    return int(k), int(n)


def _import(args: argparse.Namespace) -> int:
    from .extract.engine_hf import eagle3_layers
    from .formats.importer import run_import

    layers, vocab = _model_facts(args.model)
    if args.aux_layers:
        aux = [k - 1 for k in args.aux_layers] if args.layer_ids == "input" else list(args.aux_layers)
    elif layers is not None:
        aux = eagle3_layers(layers)
    else:
        raise ValueError("give --aux-layers (the dump does not record its layer ids), or --model with a local "
                         "config.json to take EAGLE-3's defaults")
    provenance = {"engine": f"hsdata import --from {args.fmt}", "source": os.path.abspath(args.src),
                  "command": args.command_line, "hsdata_version": __version__}
    bars: list[Progress] = []

    def on_plan(files: int, done: int) -> None:
        bars.append(Progress("import", unit="file", total=files))
        bars[0].update(done)

    try:
        summary = run_import(args.fmt, args.src, args.dest, aux_layers=aux, model=args.model, vocab_size=vocab,
                             shard=args.shard, storage_options=_storage_options(args.storage_option),
                             commit_bytes=args.commit_bytes, provenance=provenance, compression=args.compression,
                             on_plan=on_plan,
                             on_sample=lambda tokens: bars[0].update(1))
    finally:
        for bar in bars:
            bar.close()
    ok = not summary.bad or args.skip_bad
    if args.json:
        print(json.dumps({**summary.to_dict(), "ok": ok}, indent=2))
        return 0 if ok else 1
    for rel, why in summary.bad.items():
        print(f"bad: {rel}: {' '.join(why.split())}")
    verdict = "OK" if not summary.bad else ("OK, BAD FILES SKIPPED" if args.skip_bad else "BAD FILES")
    rate = summary.bytes / max(summary.seconds, 1e-9)
    print(f"{verdict}: {summary.files:,} files: {summary.skipped:,} already in the store, {summary.imported:,} "
          f"imported and verified ({summary.tokens:,} tokens, {human_bytes(summary.bytes)}, "
          f"{human_bytes(rate)}/s), {len(summary.bad):,} bad, in {summary.seconds:.1f} s")
    return 0 if ok else 1


def _model_facts(model: str | None) -> tuple[int | None, int | None]:
    """``(num_hidden_layers, vocab_size)`` from a local config.json (a folder holding one, or the file)."""
    if model is None:
        return None, None
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not (path.endswith(".json") and os.path.isfile(path)):
        return None, None
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    return config.get("num_hidden_layers"), config.get("vocab_size")


def _with_progress(name: str, run: Callable):
    """``run(on_plan, on_sample)``'s result, with a bar of samples made at its plan and stepped per sample."""
    bars: list[Progress] = []
    try:
        return run(lambda n: bars.append(Progress(name, unit="sample", total=n)), lambda tokens: bars[0].update(1))
    finally:
        for bar in bars:
            bar.close()


def _export(args: argparse.Namespace) -> int:
    from .formats.exporter import run_export

    summary = _with_progress("export", lambda on_plan, on_sample: run_export(
        args.fmt, args.store, args.dest, storage_options=_storage_options(args.storage_option), on_plan=on_plan,
        on_sample=on_sample))
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
        return 0 if not summary.failed else 1
    for sample_id, why in summary.failed.items():
        print(f"failed: sample {sample_id!r}: {why}")
    print(f"{'OK' if not summary.failed else 'FAILED'}: {summary.samples:,} samples: {summary.skipped:,} already "
          f"exported, {summary.written:,} written ({summary.tokens:,} tokens), {len(summary.failed):,} failed, in "
          f"{summary.seconds:.1f} s")
    return 0 if not summary.failed else 1


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert

    options = _storage_options(args.storage_option)
    compression = None if args.compression in (None, "none") else args.compression
    summary = _with_progress("convert", lambda on_plan, on_sample: convert(
        args.src, args.dest, dtype=args.dtype, compression=compression, storage_options=options,
        dest_storage_options=options, provenance={"command": args.command_line}, on_plan=on_plan,
        on_sample=on_sample))
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
        return 0
    ratio = f", {summary.dest_bytes / summary.source_bytes:.3f} of the size" if summary.source_bytes else ""
    print(f"OK: {summary.samples:,} samples: {summary.skipped:,} already in {args.dest}, {summary.converted:,} "
          f"converted to {args.dtype} ({summary.tokens:,} tokens, {human_bytes(summary.source_bytes)} -> "
          f"{human_bytes(summary.dest_bytes)}{ratio}) in {summary.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
