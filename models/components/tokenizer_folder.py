"""A Hugging Face tokenizer folder read with the `tokenizers` library alone, as transformers 5 reads it.

Serving imports no transformers (nor, through it, torch): the pipelines' tokenizers are `tokenizers.Tokenizer`s
built from the folder's files here, set up as transformers' tokenizer class would set up its backend, so the
ids are transformers' (tests/models/test_tokenizer_parity.py checks them against transformers on folders in
the layouts the real ones have). What transformers does, and so what is done here:

- tokenizer_config.json gives the special tokens (a string or an `{"__type": "AddedToken", ...}` dict) and
  `model_max_length`. Its `added_tokens_decoder`, when present, lists the added tokens; when absent (older
  folders, and the files transformers 5 writes), special_tokens_map.json overrides the config's special tokens
  (each one special) and tokenizer.json's `added_tokens` are the added tokens.
- The class's own `__init__` rebuilds the pipeline (normalizer, pre-tokenizer, post-processor, decoder) from the
  vocabulary of tokenizer.json; the families' modules (clip_tokenizer, t5_tokenizer) do that part.
- The added tokens, in id order, then every named special token not among them (as a special token), are added
  to the rebuilt tokenizer: a token already in the vocabulary keeps its id, a new one gets the next id.
- Calls with padding="max_length", truncation=True: right truncation to max_length counting the special tokens
  the post-processor adds, right padding with the pad token to max_length, attention mask 1 on tokens.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tokenizers import AddedToken, Tokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES (the named ones).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_EXTRA_KEYS = ("additional_special_tokens", "extra_special_tokens")


class TokenizerFolderError(ValueError):
    """A tokenizer folder this module cannot read (a missing file, a tokenizer of another kind)."""


class Tokens(NamedTuple):
    input_ids: np.ndarray  # [B, max_length] int32
    attention_mask: np.ndarray  # [B, max_length] int32, 1 = token (special tokens included), 0 = padding


def read_json_file(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _added_token(value: Any, special: bool | None = None) -> AddedToken:
    """A config's token (a string or a serialized AddedToken dict) as transformers makes it an AddedToken."""
    if isinstance(value, AddedToken):
        return value
    if isinstance(value, dict):
        fields = {k: v for k, v in value.items() if k not in ("__type", "id")}
        if special is not None:
            fields["special"] = special
        return AddedToken(**fields)
    return AddedToken(str(value), special=bool(special))


Special = str | AddedToken


class FolderSpecials(NamedTuple):
    """The special tokens transformers would give a tokenizer loaded from the folder. A token stays a string
    where transformers keeps a string (which decides which of two spellings of one token is added last)."""

    named: dict[str, Special]  # e.g. {"eos_token": "</s>"}, only the keys set (or defaulted)
    extra: list[Special]  # the extra (additional) special tokens
    added: list[AddedToken]  # the added tokens, in id order
    config: dict  # tokenizer_config.json (empty when absent)


def _config_token(value: Any) -> Special:
    return _added_token(value) if isinstance(value, dict) else value


def folder_specials(
    folder: Path,
    defaults: dict[str, str],
    default_extra: list[str] | None = None,
    tokenizer_json: dict | None = None,
) -> FolderSpecials:
    """tokenizer_config.json + special_tokens_map.json + tokenizer.json's added tokens, as transformers 5's
    `_from_pretrained` merges them; `defaults` are the tokenizer class's defaults for unset named tokens and
    `default_extra` its extra special tokens where the config lists none. `tokenizer_json`: the folder's
    tokenizer.json already read (it is read here otherwise, when needed)."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config = read_json_file(config_file) if config_file.is_file() else {}
    raw: dict[str, Any] = {
        k: _config_token(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None
    }
    # transformers 5 renames `additional_special_tokens` to `extra_special_tokens` unless that one is non-empty;
    # a key present with an empty list means none (the class's own default is not used then).
    if config.get("extra_special_tokens"):
        extra_raw = config["extra_special_tokens"]
    elif "additional_special_tokens" in config:
        extra_raw = config["additional_special_tokens"] or []
    elif "extra_special_tokens" in config:
        extra_raw = []
    else:
        extra_raw = list(default_extra or [])
    extra: list[Special] = [_config_token(t) for t in extra_raw if isinstance(t, (str, dict))]

    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in config:
        for idx, token in config["added_tokens_decoder"].items():
            decoder[int(idx)] = _added_token(token)
    else:
        specials_file = folder / "special_tokens_map.json"
        if specials_file.is_file():
            for key, value in read_json_file(specials_file).items():
                if key in SPECIAL_TOKEN_KEYS and value is not None:
                    raw[key] = _added_token(value, special=True) if isinstance(value, dict) else value
        tokenizer_file = folder / "tokenizer.json"
        if tokenizer_json is None and tokenizer_file.is_file():
            tokenizer_json = read_json_file(tokenizer_file)
        if tokenizer_json is not None:
            for token in tokenizer_json.get("added_tokens", []):
                decoder[int(token["id"])] = _added_token(token)
    by_content = {str(t.content): t for t in decoder.values()}

    named: dict[str, Special] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = raw.get(key, defaults.get(key))
        if value is not None:
            named[key] = by_content.get(content(value), value)
    return FolderSpecials(named, extra, [decoder[i] for i in sorted(decoder)], config)


def content(token: Special) -> str:
    return str(token.content) if isinstance(token, AddedToken) else str(token)


def add_folder_tokens(tokenizer: Tokenizer, specials: FolderSpecials) -> None:
    """transformers 5's TokenizersBackend.__init__: the added tokens, then each named and extra special token
    unless its text is an added token's or it equals one queued before (a string equals only the same
    string, an AddedToken only one with the same flags), all added at once: of two with the same text, the
    later one's flags win."""
    queue: list[Special] = list(specials.added)
    added_text = {content(t) for t in queue}
    for token in [*specials.named.values(), *specials.extra]:
        if content(token) not in added_text and token not in queue:
            queue.append(token)
    named = {content(t) for t in specials.named.values()}
    tokens = []
    for token in queue:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and content(token) in named:
            # In place, as transformers does: a normalized flag never given then follows `special` (False).
            token.special = True
        tokens.append(token)
    if tokens:
        tokenizer.add_tokens(tokens)


def token_id(tokenizer: Tokenizer, token: str) -> int:
    idx = tokenizer.token_to_id(token)
    if idx is None:
        raise TokenizerFolderError(f"token {token!r} is not in the vocabulary")
    return idx


class FolderTokenizer:
    """A `tokenizers.Tokenizer` with the folder's pad token and length: `encode(prompts, max_length)` pads
    and truncates as transformers' `tokenizer(prompts, padding="max_length", max_length=..., truncation=True)`.
    Thread-safe (padding and truncation are set per call, under a lock)."""

    def __init__(self, tokenizer: Tokenizer, pad_token: str, model_max_length: int | None, name: str = ""):
        self.backend = tokenizer
        self.pad_token = pad_token
        self.pad_token_id = token_id(tokenizer, pad_token)
        self.model_max_length = model_max_length
        self.name = name
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab={len(self)}, pad={self.pad_token!r})"

    def token_id(self, token: str) -> int:
        """The id of one token (a vocabulary piece or an added token); TokenizerFolderError if it has none."""
        return token_id(self.backend, token)

    def tokenize(self, text: str) -> list[str]:
        """The tokens of `text` without special tokens (transformers' `tokenizer.tokenize`)."""
        with self._lock:
            self.backend.no_padding()
            self.backend.no_truncation()
            return self.backend.encode(text, add_special_tokens=False).tokens

    def encode(self, prompts: list[str], max_length: int | None = None) -> Tokens:
        max_length = max_length or self.model_max_length
        if not max_length:
            raise TokenizerFolderError(f"{self.name or 'tokenizer'}: no max_length and no model_max_length")
        if isinstance(prompts, str):
            prompts = [prompts]
        with self._lock:
            self.backend.enable_truncation(max_length, stride=0, strategy="longest_first", direction="right")
            self.backend.enable_padding(
                direction="right",
                pad_id=self.pad_token_id,
                pad_type_id=0,
                pad_token=self.pad_token,
                length=max_length,
            )
            encodings = self.backend.encode_batch(list(prompts), add_special_tokens=True)
        ids = np.asarray([e.ids for e in encodings], np.int32).reshape(len(encodings), max_length)
        mask = np.asarray([e.attention_mask for e in encodings], np.int32).reshape(len(encodings), max_length)
        return Tokens(ids, mask)


def write_tokenizer_config(out_dir: Path, config: dict) -> None:
    """tokenizer_config.json as transformers' save_pretrained writes it (sorted keys, 2-space indent)."""
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (Path(out_dir) / "tokenizer_config.json").write_text(text, encoding="utf-8")


def config_max_length(config: dict, default: int | None) -> int | None:
    """`model_max_length` from tokenizer_config.json; transformers' "unset" (1e30) counts as unset."""
    value = config.get("model_max_length")
    if isinstance(value, (int, float)) and 0 < value < 1e29:
        return int(value)
    return default
