"""CLIP tokenizers: loaded from a diffusers folder through transformers, or built tiny and offline.

The tiny builder gives a valid CLIP byte-level BPE (every byte, every byte at a word end, a few merges,
the two special tokens): enough for the embedded default model and for tests, with no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MAX_LENGTH = 77
_TINY_MERGES = [
    ("t", "h"),
    ("th", "e</w>"),
    ("a", "n"),
    ("an", "d</w>"),
    ("o", "f</w>"),
    ("c", "a"),
    ("ca", "t</w>"),
]


def load_clip_tokenizer(folder: Path):
    from transformers import CLIPTokenizer  # tokenizers only; transformers 5 brings no model code here

    return CLIPTokenizer.from_pretrained(str(folder))


def tokenize(tokenizer, prompts: list[str], max_length: int | None = None) -> np.ndarray:
    """Prompts -> int32 token ids [B, max_length], padded and truncated as diffusers' SDXL pipeline does."""
    max_length = max_length or tokenizer.model_max_length
    ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True).input_ids
    return np.asarray(ids, dtype=np.int32)


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's reversible byte -> printable-character table, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def build_tiny_clip_tokenizer(out_dir: Path, pad_token: str = "<|endoftext|>") -> int:
    """Writes a tiny CLIP tokenizer (vocab.json, merges.txt, tokenizer_config.json) and returns its vocab size."""
    return write_clip_tokenizer(out_dir, _TINY_MERGES, pad_token)


def write_clip_tokenizer(
    out_dir: Path, merges: list[tuple[str, str]], pad_token: str = "<|endoftext|>"
) -> int:
    """Writes the CLIP tokenizer of these BPE merges (in rank order) and returns its vocabulary size: every
    byte, every byte at a word end, each merge's result, then <|startoftext|> and <|endoftext|> (the last two
    ids, as models/embedded_folder.clip_text_config expects)."""
    from transformers import CLIPTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chars = _bytes_to_unicode()
    vocab = chars + [c + "</w>" for c in chars]
    seen = set(vocab)
    for pair in merges:
        token = "".join(pair)
        if token not in seen:
            vocab.append(token)
            seen.add(token)
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    work = out_dir / "_src"
    work.mkdir(exist_ok=True)
    (work / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}))
    (work / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    tok = CLIPTokenizer(
        str(work / "vocab.json"), str(work / "merges.txt"), pad_token=pad_token, model_max_length=MAX_LENGTH
    )
    tok.save_pretrained(str(out_dir))
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return len(vocab)
