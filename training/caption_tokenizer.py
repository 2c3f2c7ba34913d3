"""The trained model's CLIP tokenizers: byte-level BPE whose merges make every caption word one token.

The tiny tokenizer of the random test models (models/clip_tokenizer.py) spells most words letter by letter;
a 2-layer text encoder trained for minutes learns far faster from one token per word. So the merges are
learned, by the `tokenizers` library's BPE trainer, from the caption vocabulary; the result is written as an
ordinary CLIP tokenizer (vocab.json, merges.txt) that transformers' CLIPTokenizer and diffusers read. Words
outside the captions still tokenize, byte by byte, as CLIP's do.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshserve.models.clip_tokenizer import MAX_LENGTH, _bytes_to_unicode
from meshserve.training.shapes import COLOURS, POSITIONS, SHAPES, SIZES

WORDS = sorted(
    {"a", "an", "on", "background", *COLOURS, *SHAPES, *SIZES, *(w for p in POSITIONS for w in p.split())}
)


def caption_merges() -> list[tuple[str, str]]:
    """BPE merges, in rank order, under which every word of WORDS is a single token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=10_000,  # more than the merges it can find: it stops when every word is whole
        min_frequency=1,
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    tokenizer.train_from_iterator(WORDS, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def build_caption_tokenizer(out_dir: Path, pad_token: str = "<|endoftext|>") -> int:
    """Writes the tokenizer (vocab.json, merges.txt, configs) and returns its vocabulary size."""
    from transformers import CLIPTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    merges = caption_merges()
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
