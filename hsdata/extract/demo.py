"""The embedded default for ``hsdata extract``: a small Llama-architecture model built from a config with a fixed
seed, a byte-level BPE tokenizer trained in-process on the shipped conversations, and those conversations.
Everything is made locally: no downloads."""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

from .conversations import read_jsonl

if TYPE_CHECKING:
    import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIAL_TOKENS = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
MODEL_NAME = "hsdata/demo-llama"


def data_path() -> str:
    return str(resources.files("hsdata") / "data" / "demo.jsonl")


def tokenizer():
    """A byte-level BPE tokenizer (vocabulary 512) trained on the demo conversations, with a chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=bpe(), unk_token="<unk>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def bpe():
    """The demo tokenizer as the ``tokenizers`` library holds it (what decoding needs, without transformers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for r in read_jsonl(data_path()) for m in r.messages]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    return trained


def model(vocab_size: int, *, seed: int = 0, dtype: torch.dtype | None = None):
    """A small Llama (8 layers, hidden size 256) with random weights from ``seed``, in ``dtype`` (bfloat16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=4096)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype or torch.bfloat16).eval()
