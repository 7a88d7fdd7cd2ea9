"""``hsdata show``: one sample's location, tensors, per-layer statistics of its hidden states and its text (or
token ids) with the loss-masked spans marked; as text, as JSON, or as a plot of the norm per position. The sample
is read as numpy arrays (``Store.read_arrays``) and a tokenizer with a ``tokenizer.json`` is loaded through the
``tokenizers`` library, so ``show`` loads neither torch nor transformers for them."""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import textwrap
from typing import Any, Callable

import numpy as np

from .codecs import quantize
from .extract import demo
from .errors import MissingExtraError
from .reader import Store, open as open_store
from .spec import TENSOR_NAMES, TensorSpec

BLOCKS = "▁▂▃▄▅▆▇█"
NOT_FINITE = "!"  # a sparkline position whose tokens hold NaN or Inf
SPARK_WIDTH = 60
NORM_ROWS = 1024  # tokens converted to float64 at once
LOSS_OPEN, LOSS_CLOSE = "[[", "]]"
ANSI_LOSS, ANSI_RESET = "\x1b[1;32m", "\x1b[0m"
DIGITS = 5  # significant digits of the numbers reported


def run(url: str, key: str, *, storage_options: dict | None = None, tokenizer: str | None = None,
        as_json: bool = False, plot: str | None = None) -> int:
    """Print sample ``key`` (an id, else an index) of the store at ``url``; with ``plot``, also write a PNG."""
    if plot is not None:
        _matplotlib_figure()  # fail before reading anything
    with open_store(url, storage_options=storage_options) as store:
        i = find_sample(store, key)
        tok, tok_name = load_tokenizer(tokenizer, store.spec.model)
        report = describe(store, i, tok, tok_name)
    if plot is not None:
        write_plot(report, plot)
        report["plot"] = plot
    print(json.dumps(report, indent=2, ensure_ascii=False) if as_json else render(report, color=sys.stdout.isatty()))
    return 0


def find_sample(store: Store, key: str) -> int:
    """Position of the sample ``key`` names: an existing sample id first, else an int index (negative from the end)."""
    if key in store:
        return store.index(key)
    try:
        i = int(key)
    except ValueError:
        i = None
    if i is not None and -len(store) <= i < len(store):
        return i % len(store)
    ids = ", ".join(store.sample_ids[:3])
    raise ValueError(f"no sample {key} in {store.url} ({len(store)} samples{'; ids like ' + ids if ids else ''})")


def load_tokenizer(path: str | None, model: str | None) -> tuple[Any, str | None]:
    """``(tokenizer, where from)``: the one at ``path``, else the store's recorded model's when that is a local folder
    holding one (or the embedded demo model), else ``(None, None)``. Never downloads."""
    if path is not None:
        return _from_pretrained(path), path
    if model == demo.MODEL_NAME:
        return demo.bpe(), model
    if model is not None and os.path.isdir(model):
        try:
            return _from_pretrained(model), model
        except ValueError:
            pass
    return None, None


def describe(store: Store, i: int, tokenizer: Any = None, tokenizer_name: str | None = None) -> dict:
    """Everything ``hsdata show`` reports about sample ``i``, as JSON-ready data (no NaN: null instead)."""
    spec, sample = store.spec, store.read_arrays(i)
    part, offset, length = store.location(i)
    aux = _values(sample["aux_hidden_states"], spec.tensor("aux_hidden_states"), spec.hidden_size)
    hidden = _values(sample["hidden_states"], spec.tensor("hidden_states"), spec.hidden_size)
    h = spec.hidden_size
    layers = [{"label": f"layer {k}", "tensor": "aux_hidden_states", "layer": k,
               **layer_stats(lambda a, b, j=j: aux(a, b)[:, j * h:(j + 1) * h], length)}
              for j, k in enumerate(spec.aux_layers)]
    layers.append({"label": "final", "tensor": "hidden_states", "layer": None, **layer_stats(hidden, length)})
    ids, mask = sample["input_ids"].tolist(), sample["loss_mask"]
    spans = [] if mask is None else loss_spans(mask)
    return {
        "store": store.url,
        "sample_id": sample["sample_id"],
        "index": i,
        "samples": len(store),
        "part": part,
        "token_offset": offset,
        "num_tokens": length,
        "dtype": spec.dtype,
        "tensors": {name: _tensor_info(spec.tensor(name), length, sample[name] is not None) for name in TENSOR_NAMES},
        "layers": layers,
        "loss_mask": None if mask is None else {"in_loss": int(mask.sum()), "spans": [list(s) for s in spans]},
        "input_ids": ids,
        "tokenizer": tokenizer_name,
        "text": None if tokenizer is None else [
            {"tokens": [a, b], "in_loss": in_loss, "text": tokenizer.decode(ids[a:b], skip_special_tokens=False)}
            for a, b, in_loss in segments(length, spans)],
    }


def layer_stats(rows_of: Callable[[int, int], np.ndarray], length: int) -> dict:
    """Statistics of one layer's states (``rows_of(start, end)``: float64 ``[end - start, H]`` of ``length``
    tokens): the L2 norm of each token (null where it holds NaN or Inf), their mean, the min and max of the finite
    values, and the NaN and Inf counts."""
    norms, nan, inf, low, high = [], 0, 0, math.inf, -math.inf
    for start in range(0, length, NORM_ROWS):
        rows = rows_of(start, min(start + NORM_ROWS, length))
        nan += int(np.isnan(rows).sum())
        inf += int(np.isinf(rows).sum())
        finite = rows[np.isfinite(rows)]
        if len(finite):
            low, high = min(low, float(finite.min())), max(high, float(finite.max()))
        with np.errstate(over="ignore", invalid="ignore"):
            norms.append(np.sqrt(np.square(rows).sum(axis=1)))
    per_token = np.concatenate(norms) if norms else np.zeros(0)
    finite_norms = per_token[np.isfinite(per_token)]
    return {
        "mean_norm": _round(finite_norms.mean()) if len(finite_norms) else None,
        "min": _round(low),
        "max": _round(high),
        "nan": nan,
        "inf": inf,
        "sparkline": sparkline(per_token),
        "norms": [_round(v) for v in per_token],
    }


def sparkline(values: np.ndarray, width: int = SPARK_WIDTH) -> str:
    """``values`` as block characters, lowest to highest; more than ``width`` values are averaged in buckets.
    A bucket holding NaN or Inf is ``!``."""
    values = np.asarray(values, dtype=np.float64)
    buckets = [bucket.mean() for bucket in np.array_split(values, min(width, len(values)))]
    finite = [v for v in buckets if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
    top = len(BLOCKS) - 1
    return "".join(NOT_FINITE if not math.isfinite(v) else
                   BLOCKS[round((v - low) / (high - low) * top) if high > low else top // 2] for v in buckets)


def loss_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of tokens whose loss mask is 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def segments(length: int, spans: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``[0, length)`` cut at the spans' edges: ``(start, end, in a span)``."""
    cuts = sorted({0, length, *(edge for span in spans for edge in span)})
    starts = {a for a, _ in spans}
    return [(a, b, a in starts) for a, b in itertools.pairwise(cuts)]


def render(report: dict, *, color: bool = False) -> str:
    """The text form of a :func:`describe` report; spans in the loss between ``[[ ]]``, or in colour."""
    tensors = ", ".join(f"{name} {t['dtype']} {t['shape']}" if t else f"{name} None"
                        for name, t in report["tensors"].items())
    start, n = report["token_offset"], report["num_tokens"]
    lines = [
        f"sample      {report['sample_id']}  (index {report['index']} of {report['samples']})",
        f"location    part {report['part']}  tokens [{start}, {start + n})  ({n} tokens)",
        f"tensors     {tensors}",
        "",
        f"{'layer':<12}{'mean norm':>10}{'min':>11}{'max':>11}{'NaN':>7}{'Inf':>7}  norm per position",
    ]
    for layer in report["layers"]:
        lines.append(f"{layer['label']:<12}{_num(layer['mean_norm']):>10}{_num(layer['min']):>11}"
                     f"{_num(layer['max']):>11}{layer['nan']:>7}{layer['inf']:>7}  {layer['sparkline']}")
    lines.append("layer k = output of layer k (HF hidden_states[k+1]); final = after the final norm; "
                 f"statistics over finite values; {NOT_FINITE} = NaN or Inf")
    lines.append("")
    mask = report["loss_mask"]
    if mask is None:
        lines.append("loss mask   none (stored without one and none added: hsdata.add_loss_masks)")
    else:
        spans = " ".join(f"[{a}, {b})" for a, b in mask["spans"])
        lines.append(f"loss mask   {mask['in_loss']} of {n} tokens in the loss (mask 1), "
                     f"{len(mask['spans'])} span(s){': ' + spans if spans else ''}")
    marks = ""
    if mask is not None:
        marks = "; tokens in the loss " + ("in colour" if color else f"between {LOSS_OPEN} {LOSS_CLOSE}")
    if report["text"] is not None:
        lines.append(f"text        (tokenizer {report['tokenizer']}{marks})")
        lines.append("".join(_mark(s["text"], s["in_loss"], color) for s in report["text"]))
    else:
        ids = report["input_ids"]
        pieces = [_mark(" ".join(map(str, ids[a:b])), in_loss, color)
                  for a, b, in_loss in segments(n, mask["spans"] if mask else [])]
        lines.append(f"input ids   (no tokenizer: give --tokenizer PATH{marks})")
        lines.append(textwrap.fill(" ".join(pieces), width=120))
    if "plot" in report:
        lines.append(f"plot        {report['plot']}")
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """A PNG of each layer's norm per position (gaps where a token holds NaN or Inf)."""
    figure_class = _matplotlib_figure()
    figure = figure_class(figsize=(10, 4), layout="constrained")
    axes = figure.add_subplot()
    for layer in report["layers"]:
        axes.plot([math.nan if v is None else v for v in layer["norms"]], label=layer["label"], linewidth=1)
    axes.set(xlabel="position", ylabel="L2 norm", title=f"{report['sample_id']} ({report['num_tokens']} tokens)")
    axes.legend()
    figure.savefig(path, format="png")


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib: pip install matplotlib (or pip install 'hsdata[plot]')") \
            from None
    return Figure


def _from_pretrained(path: str) -> Any:
    """The tokenizer saved in folder ``path``, to decode with: its ``tokenizer.json`` through the ``tokenizers``
    library when transformers would decode the same text (transformers adds a space clean-up only for tokenizers
    other than BPE that ask for it), else transformers' ``AutoTokenizer``."""
    fast = _tokenizer_json(path)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        raise ValueError(f"no tokenizer can be loaded from {path} (local files only)") from None


def _values(stored: np.ndarray, tensor: TensorSpec, hidden: int) -> Callable[[int, int], np.ndarray]:
    """Rows ``[start, end)`` of a stored hidden-state array as float64 values, as ``store[i]`` reads them."""
    def rows_of(start: int, end: int) -> np.ndarray:
        rows = stored[start:end]
        if tensor.quantized:
            rows = quantize.dequantize_bits(rows, tensor.layers, hidden, tensor.logical_dtype)
        if rows.dtype == np.uint16:  # bfloat16 bit patterns: the high half of a float32
            rows = (rows.astype(np.uint32) << 16).view(np.float32)
        return rows.astype(np.float64)

    return rows_of


def _tokenizer_json(path: str) -> Any:
    """The ``tokenizers`` Tokenizer of ``path/tokenizer.json`` if it decodes as transformers would, else None."""
    file, config = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer

    try:
        fast = Tokenizer.from_file(file)
        clean_up = False
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                clean_up = json.load(f).get("clean_up_tokenization_spaces", False)
    except Exception:  # noqa: BLE001 (tokenizers raises plain Exception): transformers may still load it
        return None
    return None if clean_up and type(fast.model).__name__ != "BPE" else fast


def _tensor_info(tensor: TensorSpec, length: int, present: bool) -> dict | None:
    """Shape and dtype of the tensor ``store[i]`` returns (input_ids widened to int64)."""
    if not present:
        return None
    dtype = "int64" if tensor.name == "input_ids" else tensor.read_dtype.name
    return {"shape": [length] if tensor.width is None else [length, tensor.values_width], "dtype": dtype}


def _mark(text: str, in_loss: bool, color: bool) -> str:
    if not in_loss:
        return text
    return f"{ANSI_LOSS}{text}{ANSI_RESET}" if color else f"{LOSS_OPEN}{text}{LOSS_CLOSE}"


def _round(value: float) -> float | None:
    """``value`` to :data:`DIGITS` significant digits; None for NaN and infinities (JSON has neither)."""
    return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else None


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.{DIGITS}g}"
