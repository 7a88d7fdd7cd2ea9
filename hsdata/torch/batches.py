"""Batch layouts: where each tensor of a batch lies in one block of memory, and each sample's rows in them.

A batch is planned from its samples' lengths before anything is read (:func:`plan`), its tensors are views of
one block (:func:`views`), and each sample is written straight into its rows (:func:`fill_row`, with the hidden
states read there by the store), so building a batch makes no second pass over its bytes. ``collate_eagle3`` and
``pack_eagle3`` build the same layouts from items in memory.

Padded layouts right-pad every sample with zeros to the batch's width (the longest sample rounded up to
``pad_to_multiple_of``); the packed layout puts samples end to end in one row. Row ``b`` of a padded batch and
sample ``b`` of a packed one are both a run of consecutive tokens in every per-token tensor, which is all that
writing a sample needs to know.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import torch

from ..codecs import quantize
from ..spec import StoreSpec
from .decoding import decode_many

CONVENTIONS = ("hsdata", "specforge", "modelopt")
IGNORE_INDEX = -100  # labels of positions that predict nothing (ModelOpt's IGNORE_TOKEN_ID)
TOKEN_INTS = ("input_ids", "loss_mask", "attention_mask", "position_ids")  # int64 per token
HIDDEN = ("aux_hidden_states", "hidden_states")
PER_TOKEN = (*TOKEN_INTS, *HIDDEN)
ALIGN = 64  # bytes between the start of the block and each tensor, a multiple of this


@dataclass(frozen=True)
class Layout:
    """How a batch is laid out: ``convention`` (``collate_eagle3``'s), padded to a multiple of
    ``pad_to_multiple_of``, or ``pack``ed into one row (``pack_eagle3``'s layout; hsdata's keys only)."""

    convention: str = "hsdata"
    pad_to_multiple_of: int = 1
    pack: bool = False

    def __post_init__(self):
        if self.convention not in CONVENTIONS:
            raise ValueError(f"unknown convention {self.convention!r}; expected one of {list(CONVENTIONS)}")
        if not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be an int >= 1, got {self.pad_to_multiple_of!r}")
        if self.pack and (self.convention != "hsdata" or self.pad_to_multiple_of != 1):
            raise ValueError("a packed batch has hsdata's keys and no padding: pack=True takes neither "
                             "convention nor pad_to_multiple_of")


@dataclass(frozen=True)
class Hidden:
    """What a batch's hidden states are: their dtype and the widths of ``aux_hidden_states`` and
    ``hidden_states``."""

    dtype: torch.dtype
    aux_width: int
    width: int

    @classmethod
    def of_spec(cls, spec: StoreSpec, *, stored: bool = False) -> Hidden:
        """As read (an fp8 store's dequantized), or with ``stored`` as the store holds them (its fp8 rows)."""
        aux, final = spec.tensor("aux_hidden_states"), spec.tensor("hidden_states")
        if stored and final.quantized:
            return cls(torch.uint8, aux.width, final.width)
        return cls(final.read_dtype.torch, aux.values_width, final.values_width)

    @classmethod
    def of_item(cls, item: dict[str, Any]) -> Hidden:
        aux, final = item["aux_hidden_states"], item["hidden_states"]
        return cls(final.dtype, aux.shape[-1], final.shape[-1])


@dataclass(frozen=True)
class Entry:
    offset: int  # bytes from the start of the block
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Plan:
    """One batch: its samples' lengths, where each sample's tokens start in the flattened token axis (of the token
    tensors, and of the hidden states: the same unless ``dense``), and every tensor's place in the block (the
    hidden states' compressed bytes instead, under :func:`encoded_name`, when they are decoded on the device)."""

    layout: Layout
    lengths: tuple[int, ...]
    width: int  # tokens per row: the padded width, or every sample's tokens when packed
    starts: tuple[int, ...]
    dense: bool  # the hidden states end to end in one row, without padding (:func:`on_device` pads them)
    entries: dict[str, Entry]
    nbytes: int

    @cached_property
    def hidden_starts(self) -> tuple[int, ...]:
        """Where each sample's hidden states start in their flattened token axis."""
        return tuple(itertools.accumulate(self.lengths[:-1], initial=0)) if self.dense else self.starts

    @property
    def tokens(self) -> int:
        """Token positions of the batch, padding included."""
        return self.width * (1 if self.layout.pack else len(self.lengths))

    def row_end(self, b: int) -> int:
        """Where sample ``b``'s padding ends (its start, when packed, plus its length)."""
        return self.starts[b] + (self.lengths[b] if self.layout.pack else self.width)


def plan(layout: Layout, hidden: Hidden, lengths: Sequence[int], *, dense: bool = False,
         encoded: dict[str, int] | None = None) -> Plan:
    """The block layout of a batch of samples of ``lengths`` tokens (each >= 1) with ``hidden`` states;
    ``dense``: the hidden states end to end in one row (a batch crossing to a GPU, padded there), the token
    tensors laid out as always; ``encoded``: the hidden states by name that cross compressed, as this many bytes
    (decoded on the device: :mod:`hsdata.torch.decoding`), in place of their rows."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a batch needs samples of at least one token, got lengths {list(lengths)}")
    if layout.pack:
        width, rows, starts = sum(lengths), 1, tuple(itertools.accumulate(lengths[:-1], initial=0))
    else:
        multiple = layout.pad_to_multiple_of
        width, rows = -(-max(lengths) // multiple) * multiple, len(lengths)
        starts = tuple(b * width for b in range(rows))
    dense = dense and not layout.pack and (rows, width) != (1, lengths[0])  # (else padded is dense already)
    hidden_rows, hidden_width = (1, sum(lengths)) if dense else (rows, width)
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "aux_hidden_states": (hidden.dtype, (hidden_rows, hidden_width, hidden.aux_width)),
        "hidden_states": (hidden.dtype, (hidden_rows, hidden_width, hidden.width)),
        **{name: (torch.int64, (rows, width)) for name in TOKEN_INTS},
    }
    for name, nbytes in (encoded or {}).items():
        del shapes[name]
        shapes[encoded_name(name)] = (torch.uint8, (nbytes,))
    if layout.convention == "modelopt":
        shapes["labels"] = (torch.int64, (rows, width))
    if layout.pack:
        shapes["document_ids"] = (torch.int64, (1, width))
        shapes["cu_seqlens"] = (torch.int32, (len(lengths) + 1,))
    entries, offset = {}, 0
    for name, (dtype, shape) in shapes.items():
        entries[name] = Entry(offset, dtype, shape)
        offset += -(-entries[name].nbytes // ALIGN) * ALIGN
    return Plan(layout, lengths, width, starts, dense, entries, offset)


def encoded_name(name: str) -> str:
    """The key of a hidden-state tensor's compressed bytes in a batch's tensors."""
    return f"{name}:encoded"


def views(plan: Plan, block: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch's tensors over ``block`` (uint8, at least ``plan.nbytes``), by hsdata's names."""
    out = {}
    for name, e in plan.entries.items():
        out[name] = block[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
    return out


def flat(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-token tensors with their batch and token axes merged: sample ``b``'s tokens are
    ``[starts[b], starts[b] + lengths[b])``."""
    return {name: tensors[name].flatten(0, 1) for name in (*PER_TOKEN, "labels") if name in tensors}


def hidden_rows(plan: Plan, tensors: dict[str, torch.Tensor], b: int) -> dict[str, torch.Tensor]:
    """Where sample ``b``'s hidden states go: its rows of ``aux_hidden_states`` and ``hidden_states``."""
    start, n = plan.hidden_starts[b], plan.lengths[b]
    return {name: tensors[name].flatten(0, 1)[start : start + n] for name in HIDDEN}


def fill_row(plan: Plan, rows: dict[str, torch.Tensor], b: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             hidden: dict[str, torch.Tensor] | None = None) -> None:
    """Write sample ``b``'s token tensors (its first ``lengths[b]`` of ``input_ids`` and ``loss_mask``) and its
    padding into ``rows`` (:func:`flat`); ``hidden``: its hidden states to copy in, None when they were read in
    place."""
    start, n, end = plan.starts[b], plan.lengths[b], plan.row_end(b)
    rows["input_ids"][start : start + n] = input_ids[:n]
    rows["loss_mask"][start : start + n] = loss_mask[:n]
    rows["attention_mask"][start : start + n] = 1
    torch.arange(n, out=rows["position_ids"][start : start + n])
    for name, value in (hidden or {}).items():
        rows[name][plan.hidden_starts[b] : plan.hidden_starts[b] + n] = value[:n]
    if plan.layout.convention == "specforge":
        rows["loss_mask"][start + n - 1] = 0  # its target lies past the sample's end
    if "labels" in rows:
        rows["labels"][start : start + n - 1] = rows["input_ids"][start + 1 : start + n]
        rows["labels"][start + n - 1 : end] = IGNORE_INDEX
    if end > start + n:
        for name in TOKEN_INTS if plan.dense else PER_TOKEN:
            rows[name][start + n : end] = 0


def finish_pack(plan: Plan, tensors: dict[str, torch.Tensor]) -> None:
    """A packed batch's ``document_ids`` and ``cu_seqlens``, from the plan alone."""
    lengths = torch.tensor(plan.lengths)
    tensors["document_ids"][0] = torch.repeat_interleave(torch.arange(len(plan.lengths)), lengths)
    tensors["cu_seqlens"][0] = 0
    tensors["cu_seqlens"][1:] = lengths.cumsum(0)


@dataclass
class Built:
    """A batch whose tensors are filled: its plan, its tensors by hsdata's names, its samples' ids and metas."""

    plan: Plan
    tensors: dict[str, torch.Tensor]
    sample_ids: list[str]
    metas: list[Any] | None = None
    encoded: dict[str, Any] | None = None  # hidden states decoded on the device: name -> EncodedStates

    def batch(self) -> dict[str, Any]:
        """The batch as its convention lays it out (``collate_eagle3``'s docstring)."""
        return assemble(self.plan.layout.convention, self.tensors, self.sample_ids, self.metas)

    def stored(self) -> dict[str, Any]:
        """The batch as it crosses to a GPU, before its states are dequantized, padded and laid out there
        (:func:`on_device` does all three)."""
        return {"convention": self.plan.layout.convention, "tensors": self.tensors, "lengths": list(self.plan.lengths),
                "sample_ids": self.sample_ids, "metas": self.metas, "encoded": self.encoded}


def on_device(built: dict[str, Any], spec: StoreSpec) -> dict[str, Any]:
    """A batch read as it crosses to a GPU (:meth:`Built.stored`: its hidden states as the store holds them, fp8
    rows for an fp8 store, compressed where ``encoded``, and end to end when the plan was ``dense``), on any
    device, with its states decoded, dequantized and padded into their rows there and laid out in its
    convention."""
    return on_device_many([built], spec)[0]


def on_device_many(builts: Sequence[dict[str, Any]], spec: StoreSpec) -> list[dict[str, Any]]:
    """Several batches, each as :func:`on_device` makes it, the compressed states of all of them decoded at once
    (:func:`decode_many`)."""
    tensors = [dict(built["tensors"]) for built in builts]
    encoded = [(t, name, states) for built, t in zip(builts, tensors) for name, states in
               (built.get("encoded") or {}).items()]
    if encoded:
        hidden = Hidden.of_spec(spec, stored=True)
        decoded = decode_many([(states, t.pop(encoded_name(name))) for t, name, states in encoded])
        for (t, name, _), rows in zip(encoded, decoded):
            t[name] = rows.view(hidden.dtype).view(1, -1, hidden.aux_width if name == "aux_hidden_states"
                                                   else hidden.width)
    return [_finished(built, t, spec) for built, t in zip(builts, tensors)]


def _finished(built: dict[str, Any], tensors: dict[str, torch.Tensor], spec: StoreSpec) -> dict[str, Any]:
    """A batch's states on the device, decoded, dequantized and padded, laid out in its convention."""
    rows, width = tensors["input_ids"].shape
    for name in HIDDEN:
        states = tensors[name]
        if states.dtype == torch.uint8:  # (a batch made again from items after a corrupt sample is read already)
            tensor = spec.tensor(name)
            states = quantize.dequantize(states.reshape(-1, tensor.width), tensor.layers, spec.hidden_size,
                                         tensor.logical_dtype).view(*states.shape[:-1], tensor.values_width)
        if states.shape[:2] != (rows, width):
            states = _padded(states[0], built["lengths"], width)
        tensors[name] = states
    return assemble(built["convention"], tensors, built["sample_ids"], built["metas"])


def _padded(states: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """``states`` of samples of ``lengths`` end to end, each in its row of ``width`` tokens, zero-padded."""
    out = states.new_empty((len(lengths), width, states.shape[-1]))
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = states[start : start + n]
        out[b, n:] = 0
        start += n
    return out


def assemble(convention: str, tensors: dict[str, torch.Tensor], sample_ids: list[str],
             metas: list[Any] | None) -> dict[str, Any]:
    """The batch in ``convention``'s keys, over ``tensors`` (hsdata's names)."""
    if convention == "specforge":
        return {"input_ids": tensors["input_ids"], "attention_mask": tensors["attention_mask"],
                "loss_mask": tensors["loss_mask"], "hidden_state": tensors["aux_hidden_states"],
                "target": tensors["hidden_states"]}
    if convention == "modelopt":
        return {"input_ids": tensors["input_ids"], "attention_mask": tensors["attention_mask"],
                "loss_mask": tensors["loss_mask"], "labels": tensors["labels"],
                "base_model_outputs": {"base_model_hidden_states": tensors["hidden_states"],
                                       "aux_hidden_states": tensors["aux_hidden_states"],
                                       "base_hidden_prenorm": False}}
    batch: dict[str, Any] = {"sample_id": sample_ids}
    if metas is not None:
        batch["meta"] = metas
    batch.update((name, tensors[name]) for name in (*PER_TOKEN, "document_ids", "cu_seqlens") if name in tensors)
    return batch


def collate(layout: Layout, items: list[dict[str, Any]], take: Callable[[int], torch.Tensor]) -> Built:
    """A batch of ``items`` (in memory) in ``layout``, copied into a block from ``take(nbytes)``."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    p = plan(layout, Hidden.of_item(items[0]), [len(item["input_ids"]) for item in items])
    tensors = views(p, take(p.nbytes))
    rows = flat(tensors)
    for b, item in enumerate(items):
        fill_row(p, rows, b, item["input_ids"], item["loss_mask"], {name: item[name] for name in HIDDEN})
    if layout.pack:
        finish_pack(p, tensors)
    metas = [item["meta"] for item in items] if "meta" in items[0] else None
    return Built(p, tensors, [item["sample_id"] for item in items], metas)


class BatchItems(list):
    """The items of a batch that was read in place (hsdata's layout, no extra padding), each a view of its row.

    ``collate_eagle3`` given these items, unchanged, returns that batch in the layout it asks for without copying
    the hidden states when the padded width is the same (``pad_to_multiple_of`` divides the longest length);
    otherwise, or for packing, it copies them as it copies any items."""

    def __init__(self, built: Built, *, pin: bool | None = None):
        p, tensors = built.plan, built.tensors
        self.pin = pin  # whether the training process page-locks a batch sent from a worker (None: with CUDA)
        if p.layout != Layout():
            raise ValueError(f"items are views of hsdata's padded layout, not {p.layout}")
        items = []
        for b, (start, n) in enumerate(zip(p.starts, p.lengths)):
            item: dict[str, Any] = {"sample_id": built.sample_ids[b]}
            item.update((name, tensors[name][b, :n]) for name in PER_TOKEN)
            if built.metas is not None:
                item["meta"] = built.metas[b]
            items.append(item)
        super().__init__(items)
        self._built = built
        self._views = [[(name, item[name]) for name in PER_TOKEN] for item in items]

    def batch(self, layout: Layout) -> dict[str, Any] | None:
        """The batch in ``layout`` over the block these items are views of; None where that would differ from
        collating them (the items were changed, or another width or packing is asked for)."""
        p, built = self._built.plan, self._built
        intact = len(self) == len(self._views) and all(
            all(item.get(name) is view for name, view in views_) for item, views_ in zip(self, self._views))
        multiple = layout.pad_to_multiple_of
        if not intact or layout.pack or -(-max(p.lengths) // multiple) * multiple != p.width:
            return None
        tensors = dict(built.tensors)
        ends = torch.tensor(p.lengths) - 1
        if layout.convention == "specforge":
            tensors["loss_mask"] = tensors["loss_mask"].clone()
            tensors["loss_mask"][torch.arange(len(p.lengths)), ends] = 0
        if layout.convention == "modelopt":
            labels = torch.full_like(tensors["input_ids"], IGNORE_INDEX)
            labels[:, :-1] = tensors["input_ids"][:, 1:]
            labels[torch.arange(p.width) >= ends[:, None]] = IGNORE_INDEX
            tensors["labels"] = labels
        return assemble(layout.convention, tensors, built.sample_ids, built.metas)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
