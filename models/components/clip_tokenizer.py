"""CLIP tokenizers: read from a diffusers folder with the `tokenizers` library, or written tiny and offline.

`load_clip_tokenizer` builds the backend as transformers' CLIPTokenizer does (models/components/tokenizer_folder.py
says how a folder is read): byte-level BPE with "</w>" ending a word, NFC + whitespace runs to one space +
lowercase, CLIP's split regex, <|startoftext|> ... <|endoftext|> around the tokens, padding with the folder's
pad token (<|endoftext|>, or "!" for SDXL's second tokenizer) to model_max_length (77). The vocabulary comes
from tokenizer.json, or from vocab.json + merges.txt where a folder has no tokenizer.json (SDXL's and FLUX.1's
CLIP folders ship only those).

The tiny builder gives a valid CLIP byte-level BPE (every byte, every byte at a word end, a few merges,
the two special tokens): enough for the embedded default model and for tests, with no download. It writes the
files transformers' CLIPTokenizer.save_pretrained writes (tokenizer.json, tokenizer_config.json), byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

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
# CLIPTokenizer's defaults for special tokens a folder leaves unset.
_DEFAULTS = {
    "unk_token": "<|endoftext|>",
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _clip_backend(
    vocab: dict[str, int], merges: list[tuple[str, str]], specials: FolderSpecials
) -> Tokenizer:
    """transformers' CLIPTokenizer.__init__, in the tokenizers library: the BPE and its pipeline, the folder's
    added and special tokens, then <|startoftext|> $A <|endoftext|> (RobertaProcessing, by the token ids)."""
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="</w>",
            fuse_unk=False,
            unk_token=content(specials.named["unk_token"]),
        )
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    add_folder_tokens(tokenizer, specials)
    eos, bos = content(specials.named["eos_token"]), content(specials.named["bos_token"])
    tokenizer.post_processor = processors.RobertaProcessing(
        (eos, token_id(tokenizer, eos)), (bos, token_id(tokenizer, bos)), False, False
    )
    return tokenizer


def _vocab_and_merges(folder: Path) -> tuple[dict[str, int], list[tuple[str, str]], dict | None]:
    """The BPE vocabulary and merges, and the parsed tokenizer.json where the folder has one."""
    tokenizer_file = folder / "tokenizer.json"
    if tokenizer_file.is_file():
        data = read_json_file(tokenizer_file)
        model = data.get("model", {})
        if model.get("type") != "BPE":
            raise TokenizerFolderError(f"{tokenizer_file}: a {model.get('type')} model, not CLIP's BPE")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        return model["vocab"], merges, data
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        vocab, merges = BPE.read_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
        return vocab, list(merges), None
    raise TokenizerFolderError(f"{folder}: no CLIP tokenizer (tokenizer.json, or vocab.json and merges.txt)")


def load_clip_tokenizer(folder: Path) -> FolderTokenizer:
    """A diffusers `tokenizer/` (or SDXL's `tokenizer_2/`) folder -> its tokenizer (module docstring)."""
    folder = Path(folder)
    vocab, merges, data = _vocab_and_merges(folder)
    specials = folder_specials(folder, _DEFAULTS, tokenizer_json=data)
    backend = _clip_backend(vocab, merges, specials)
    max_length = config_max_length(specials.config, MAX_LENGTH)
    return FolderTokenizer(backend, content(specials.named["pad_token"]), max_length, name=str(folder))


def tokenize(tokenizer: FolderTokenizer, prompts: list[str], max_length: int | None = None) -> np.ndarray:
    """Prompts -> int32 token ids [B, max_length], padded and truncated as diffusers' SDXL pipeline does."""
    return tokenizer.encode(prompts, max_length).input_ids


def tokenize_with_mask(
    tokenizer: FolderTokenizer, prompts: list[str], max_length: int | None = None
) -> Tokens:
    """As `tokenize`, with the attention mask (1 on <|startoftext|>, the tokens and <|endoftext|>)."""
    return tokenizer.encode(prompts, max_length)


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
    """Writes a tiny CLIP tokenizer (tokenizer.json, tokenizer_config.json) and returns its vocab size."""
    return write_clip_tokenizer(out_dir, _TINY_MERGES, pad_token)


def write_clip_tokenizer(
    out_dir: Path, merges: list[tuple[str, str]], pad_token: str = "<|endoftext|>"
) -> int:
    """Writes the CLIP tokenizer of these BPE merges (in rank order) and returns its vocabulary size: every
    byte, every byte at a word end, each merge's result, then <|startoftext|> and <|endoftext|> (the last two
    ids, as models/embedded_folder.clip_text_config expects). The files are the ones transformers'
    `CLIPTokenizer(vocab, merges, pad_token=..., model_max_length=77).save_pretrained(out_dir)` writes."""
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
    names = dict(_DEFAULTS, pad_token=pad_token)
    specials = FolderSpecials(
        named={key: names[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")},
        extra=[],
        added=[],
        config={},
    )
    backend = _clip_backend({tok: i for i, tok in enumerate(vocab)}, list(merges), specials)
    backend.save(str(out_dir / "tokenizer.json"))
    config = {
        "backend": "tokenizers",
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": MAX_LENGTH,
        **{key: names[key] for key in ("bos_token", "eos_token", "pad_token", "unk_token")},
    }
    write_tokenizer_config(out_dir, config)
    return len(vocab)
