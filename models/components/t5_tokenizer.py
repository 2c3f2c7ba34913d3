"""T5-family tokenizers (T5 v1.1 for Flux's `tokenizer_2/`, UMT5 for Wan's `tokenizer/`): loaded from a diffusers
folder through transformers' fast tokenizer (transformers is a runtime dependency for tokenizers only), or built
tiny and offline for tests.

Both pipelines pad to `max_sequence_length` and truncate, with the end-of-sequence token appended (Flux: 512 for
dev, 256 for schnell; Wan: 512). Flux ignores the attention mask; Wan passes it to UMT5 and keeps `seq_lens`.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

# The pieces of the tiny tokenizer after its three special tokens, SentencePiece style ("▁" starts a word).
_TINY_PIECES = [
    "▁a",
    "▁cat",
    "▁the",
    "▁and",
    "▁of",
    "▁dog",
    "▁",
    "a",
    "c",
    "t",
    "h",
    "e",
    "o",
    "d",
    "n",
    "g",
    "s",
]


class T5Tokens(NamedTuple):
    input_ids: np.ndarray  # [B, max_sequence_length] int32
    attention_mask: np.ndarray  # [B, max_sequence_length] int32, 1 = token (EOS included), 0 = padding


def load_t5_tokenizer(folder: Path):
    """The fast tokenizer of a `tokenizer/` or `tokenizer_2/` folder (tokenizer.json + tokenizer_config.json)."""
    from transformers import AutoTokenizer  # tokenizers only; no model code is imported

    return AutoTokenizer.from_pretrained(str(folder))


def tokenize_t5(tokenizer, prompts: list[str], max_sequence_length: int) -> T5Tokens:
    """Prompts -> ids and mask padded and truncated to max_sequence_length, as Flux's `_get_t5_prompt_embeds`
    and Wan's (after its `prompt_clean`, which is the Wan pipeline's) call the tokenizer."""
    out = tokenizer(
        list(prompts),
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
    )
    return T5Tokens(np.asarray(out.input_ids, np.int32), np.asarray(out.attention_mask, np.int32))


def build_tiny_t5_tokenizer(out_dir: Path) -> int:
    """Writes a tiny T5 Unigram tokenizer (<pad> 0, </s> 1, <unk> 2, then a few pieces) and returns its vocab
    size. No download: transformers' T5Tokenizer builds the Unigram model from the (piece, score) list."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    # Whole words score higher than their letters, so "▁cat" is one token and unknown words fall to letters.
    vocab += [(piece, -1.0 if len(piece) > 1 else -5.0) for piece in _TINY_PIECES]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return len(vocab)
