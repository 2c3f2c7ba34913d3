"""The trained models' tokenizers: CLIP byte-level BPE and T5 Unigram, each making every caption word one token.

The tiny tokenizer of the random test models (models/components/clip_tokenizer.py) spells most words letter by letter;
a 2-layer text encoder trained for minutes learns far faster from one token per word. So the merges are
learned from the caption vocabulary (deterministically, `caption_merges`) and written as an ordinary CLIP
tokenizer that transformers' CLIPTokenizer and diffusers read. Words outside the captions still tokenize,
byte by byte, as CLIP's do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from meshserve.models.components.clip_tokenizer import write_clip_tokenizer
from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer
from meshserve.training.shapes import COLOURS, POSITIONS, SHAPES, SIZES

WORDS = sorted(
    {"a", "an", "on", "background", *COLOURS, *SHAPES, *SIZES, *(w for p in POSITIONS for w in p.split())}
)


def caption_merges(words: Sequence[str] = WORDS) -> list[tuple[str, str]]:
    """BPE merges, in rank order, under which every word of WORDS is a single token.

    Learned as BPE learns them, by hand: each word spelt as symbols (its last one marked "</w>", as CLIP
    marks a word's end), then again and again the commonest adjacent pair merged everywhere, until every word
    is one symbol. Ties go to the alphabetically first pair, so the merges, hence the token ids, are the same
    on every run (the `tokenizers` library's trainer breaks ties by hash order: two builds numbered "ed</w>"
    and "er</w>" the other way round).
    """
    words = [(*w[:-1], w[-1] + "</w>") for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts = Counter(pair for w in words for pair in zip(w, w[1:], strict=False))
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        words = [_merge(w, best) for w in words]


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def build_caption_tokenizer(
    out_dir: Path, pad_token: str = "<|endoftext|>", words: Sequence[str] = WORDS
) -> int:
    """Writes the CLIP tokenizer (vocab.json, merges.txt, configs) and returns its vocabulary size."""
    return write_clip_tokenizer(out_dir, caption_merges(words), pad_token)


def build_caption_t5_tokenizer(out_dir: Path, words: Sequence[str] = WORDS) -> int:
    """Writes a T5 Unigram tokenizer (Flux's tokenizer_2, Wan's UMT5 tokenizer) whose pieces are the caption
    words, each one token, then "▁" and the letters a-z, so any other lower-case word still tokenizes (letter
    by letter, as the tiny test tokenizer does); returns its vocabulary size."""
    pieces = [f"▁{w}" for w in sorted(set(words))] + ["▁", *"abcdefghijklmnopqrstuvwxyz"]
    return build_tiny_t5_tokenizer(out_dir, pieces)
