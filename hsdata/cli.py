"""The ``hsdata`` command line. Exit codes: 0 success, 1 problems found, 2 bad usage or not a readable store."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .errors import HsdataError
from .reader import Store, open as open_store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsdata", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="spec, sample and token counts, sizes and length distribution")
    info.add_argument("store", help="path or fsspec URL of the store")
    info.add_argument("--json", action="store_true", help="print one JSON document")
    _add_storage_options(info)
    args = parser.parse_args(argv)
    try:
        return {"info": _info}[args.command](args)
    except (HsdataError, OSError, ValueError) as e:
        print(f"hsdata {args.command}: error: {e}", file=sys.stderr)
        return 2


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
    print(f"samples     {summary['samples']:,} in {summary['parts']} part(s)")
    print(f"tokens      {summary['tokens']:,}  ({_human_bytes(summary['payload_bytes'])} of hidden states and ids)")
    print(f"length      min {length['min']:.0f}  p50 {length['p50']:.0f}  p90 {length['p90']:.0f}  "
          f"p99 {length['p99']:.0f}  max {length['max']:.0f}  mean {length['mean']:.1f}")
    return 0


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError


if __name__ == "__main__":
    sys.exit(main())
