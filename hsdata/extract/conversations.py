"""Input data for extraction: JSONL conversations (ShareGPT or OpenAI form) or pre-tokenized rows, and the
chat-template tokenization that gives each conversation its input ids and assistant-only loss mask."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system", "tool": "tool"}


@dataclass(frozen=True)
class Record:
    """One line of the input: a conversation, or ids (and a mask) already tokenized."""

    sample_id: str
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


def read_jsonl(path: str) -> Iterator[Record]:
    """Records of a JSONL file; ids come from ``id`` (or ``conversation_id``), else ``line-<n>`` (1-based)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield parse_record(line, number, path)


def parse_record(line: str, number: int, path: str = "<input>") -> Record:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object per line")
    sample_id = str(row.get("id", row.get("conversation_id", f"line-{number}")))
    if "input_ids" in row:
        ids, mask = row["input_ids"], row.get("loss_mask")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{where}: input_ids must be a non-empty list of token ids")
        if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids) or set(mask) - {0, 1}):
            raise ValueError(f"{where}: loss_mask must be a list of 0/1 as long as input_ids")
        return Record(sample_id, input_ids=ids, loss_mask=mask)
    if "messages" in row:
        turns = [(m.get("role"), m.get("content")) for m in row["messages"] if isinstance(m, dict)]
    elif "conversations" in row:
        turns = [(m.get("from"), m.get("value")) for m in row["conversations"] if isinstance(m, dict)]
    else:
        raise ValueError(f"{where}: expected \"messages\" (OpenAI), \"conversations\" (ShareGPT) or \"input_ids\"")
    messages = []
    for role, content in turns:
        if ROLES.get(str(role).lower()) is None or not isinstance(content, str):
            raise ValueError(f"{where}: a turn needs a known role (got {role!r}) and text content")
        messages.append({"role": ROLES[str(role).lower()], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn to train on")
    return Record(sample_id, messages=messages)


def tokenize(tokenizer: Any, record: Record) -> tuple[list[int], list[int]]:
    """Input ids and loss mask (1 on the tokens of assistant turns) of a record, with the chat template.

    Each assistant turn's text is the part of the rendered conversation between the template's rendering of
    the turns before it (with the generation prompt) and of the turns up to it; tokens whose text starts inside
    such a span are trained on. Needs a fast tokenizer (offsets).
    """
    if record.input_ids is not None:
        return record.input_ids, record.loss_mask or [1] * len(record.input_ids)
    messages = record.messages
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(f"sample {record.sample_id!r}: the chat template does not render turns as a prefix of "
                             "the conversation, so assistant spans cannot be found; pre-tokenize the data instead")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask
