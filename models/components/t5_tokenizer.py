"""T5-family tokenizers (T5 v1.1 for Flux's `tokenizer_2/`, UMT5 for Wan's `tokenizer/`): read from a diffusers
folder's tokenizer.json with the `tokenizers` library, or written tiny and offline for tests.

Both pipelines pad to `max_sequence_length` and truncate, with the end-of-sequence token appended (Flux: 512 for
dev, 256 for schnell; Wan: 512). Flux ignores the attention mask; Wan passes it to UMT5 and keeps `seq_lens`.

`load_t5_tokenizer` sets the backend up as transformers 5's T5Tokenizer (what AutoTokenizer gives for these
folders) does (models/components/tokenizer_folder.py says how the folder is read): tokenizer.json's Unigram
vocabulary (unk id 2, no byte fallback), its SentencePiece charsmap (the `Precompiled` normalizer) and nothing
else of its normalizer, whitespace split then "▁" before every word (Metaspace), `$A </s>`, and the folder's
added and special tokens (<extra_id_N> included). Where a tokenizer.json's own pipeline differs from that
(files written by older converters add a whitespace-collapsing Replace and split on Metaspace alone, so a
trailing space gives a lone "▁"), transformers 5 does not follow the file, and neither does this module.
A folder with only spiece.model (the slow tokenizer's file) is refused: converting it needs sentencepiece's
protobuf; `T5TokenizerFast.from_pretrained(folder).save_pretrained(folder)` writes the tokenizer.json.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import Unigram

from meshserve.models.components.tokenizer_folder import (
    FolderSpecials,
    FolderTokenizer,
    TokenizerFolderError,
    Tokens,
    add_folder_tokens,
    config_max_length,
    content,
    folder_specials,
    read_json_file,
    token_id,
    write_tokenizer_config,
)

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


T5Tokens = Tokens  # input_ids, attention_mask: [B, max_sequence_length] int32 (mask 1 = token, EOS included)

# T5Tokenizer's defaults for special tokens a folder leaves unset.
_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def _precompiled(normalizer: dict | None) -> dict | None:
    """The `Precompiled` (SentencePiece charsmap) entry of a tokenizer.json normalizer, if it has one."""
    if not normalizer:
        return None
    entries = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    return next(
        (n for n in entries if n.get("type") == "Precompiled" and n.get("precompiled_charsmap")), None
    )


def _t5_backend(
    vocab: list[tuple[str, float]], precompiled: dict | None, specials: FolderSpecials
) -> Tokenizer:
    """transformers 5's T5Tokenizer.__init__, in the tokenizers library."""
    tokenizer = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    if precompiled is not None:
        tokenizer.normalizer = normalizers.Precompiled(base64.b64decode(precompiled["precompiled_charsmap"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    add_folder_tokens(tokenizer, specials)
    eos = content(specials.named["eos_token"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, token_id(tokenizer, eos))]
    )
    return tokenizer


def load_t5_tokenizer(folder: Path) -> FolderTokenizer:
    """The tokenizer of a `tokenizer/` or `tokenizer_2/` folder (tokenizer.json + tokenizer_config.json)."""
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) if folder.is_dir() else "no such folder"
        raise TokenizerFolderError(
            f"{folder}: a T5 tokenizer needs tokenizer.json (found: {found}). A folder with only the slow "
            "tokenizer's spiece.model can be converted once, where transformers is installed: "
            "T5TokenizerFast.from_pretrained(folder).save_pretrained(folder)"
        )
    data = read_json_file(tokenizer_file)
    model = data.get("model", {})
    if model.get("type") != "Unigram":
        raise TokenizerFolderError(f"{tokenizer_file}: a {model.get('type')} model, not T5's Unigram")
    vocab = [(str(piece), float(score)) for piece, score in model["vocab"]]
    config_file = folder / "tokenizer_config.json"
    extra_ids = int((read_json_file(config_file) if config_file.is_file() else {}).get("extra_ids", 100))
    # T5Tokenizer's sentinels, <extra_id_0> ... (100 unless the config says), where the config lists none.
    specials = folder_specials(folder, _DEFAULTS, [f"<extra_id_{i}>" for i in range(extra_ids)], data)
    backend = _t5_backend(vocab, _precompiled(data.get("normalizer")), specials)
    max_length = config_max_length(specials.config, None)
    return FolderTokenizer(backend, content(specials.named["pad_token"]), max_length, name=str(folder))


def tokenize_t5(tokenizer: FolderTokenizer, prompts: list[str], max_sequence_length: int) -> T5Tokens:
    """Prompts -> ids and mask padded and truncated to max_sequence_length, as Flux's `_get_t5_prompt_embeds`
    and Wan's (after its `prompt_clean`, which is the Wan pipeline's) call the tokenizer."""
    return tokenizer.encode(list(prompts), max_sequence_length)


def build_tiny_t5_tokenizer(out_dir: Path, pieces: Sequence[str] = _TINY_PIECES) -> int:
    """Writes a tiny T5 Unigram tokenizer (<pad> 0, </s> 1, <unk> 2, then `pieces`) and returns its vocab
    size: the files transformers' `T5Tokenizer(vocab=..., extra_ids=0).save_pretrained(out_dir)` writes."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    # Whole words score higher than their letters, so "▁cat" is one token and unknown words fall to letters.
    vocab += [(piece, -1.0 if len(piece) > 1 else -5.0) for piece in pieces]
    specials = FolderSpecials(named=dict(_DEFAULTS), extra=[], added=[], config={})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _t5_backend(vocab, None, specials).save(str(out_dir / "tokenizer.json"))
    config = {
        "backend": "tokenizers",
        "tokenizer_class": "T5Tokenizer",
        "model_max_length": int(1e30),  # transformers' VERY_LARGE_INTEGER: no limit of its own
        "extra_ids": 0,
        "extra_special_tokens": [],
        **_DEFAULTS,
    }
    write_tokenizer_config(out_dir, config)
    return len(vocab)
