"""Our tokenizers (the `tokenizers` library alone: models/components/tokenizer_folder.py) give transformers' ids
and masks, on folders laid out as the real ones are, and our tiny-tokenizer writers write transformers' files.

Layouts (the vocabularies are tiny; the files' shapes are the real ones'):
- CLIP, as transformers 5 writes it (tokenizer.json + tokenizer_config.json): the tiny fixtures, pad
  <|endoftext|> or "!" (SDXL's tokenizer_2).
- CLIP, SDXL's: vocab.json + merges.txt + special_tokens_map.json + a tokenizer_config.json whose special
  tokens are `{"__type": "AddedToken", ..., "normalized": true}`; no tokenizer.json.
- CLIP, FLUX.1's: vocab.json + merges.txt + a tokenizer_config.json with `added_tokens_decoder`.
- CLIP, a transformers 4 tokenizer.json (normalized special tokens) + special_tokens_map.json.
- T5, as transformers 5 writes it (the tiny fixture).
- T5, FLUX.1's tokenizer_2: an older converter's tokenizer.json (SentencePiece charsmap + whitespace Replace,
  Metaspace alone) with <extra_id_N> in the vocabulary, `added_tokens_decoder`, special_tokens_map.json.
- T5, umT5-like: byte fallback in the file, sentinels not in the vocabulary (new ids), no added_tokens_decoder.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer, CLIPTokenizer, T5Tokenizer

from meshserve.models.components.clip_tokenizer import (
    build_tiny_clip_tokenizer,
    load_clip_tokenizer,
    tokenize,
    write_clip_tokenizer,
)
from meshserve.models.components.t5_tokenizer import (
    _TINY_PIECES,
    build_tiny_t5_tokenizer,
    load_t5_tokenizer,
    tokenize_t5,
)
from meshserve.models.components.tokenizer_folder import TokenizerFolderError
from meshserve.models.wan.text import prompt_clean, tokenize_wan_prompts
from meshserve.training.caption_tokenizer import caption_merges

PROMPTS = [
    "",
    "a cat",
    "A photo of THE Cat and the Dog",
    "the cat and the dog " * 40,  # over every limit
    "  leading and trailing  ",
    "whitespace\t\truns\n\nand   spaces \u3000 ideographic",
    "punctuation!?.,;:'\"()[]{}-_/\\@#$%^&*+=~`|<>",
    "it's they're we've I'm you'll he'd IT'S",
    "numbers 12345 3.14 1,000 ²³ ½",
    "café naïve résumé Ångström",
    "cafe\u0301 composed by NFC",
    "日本語のテキスト 中文 한국어 Ελληνικά кириллица",
    "emoji 🐱🐶 👩‍🚀 ❤️",
    "Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ",
    "zero\u200bwidth\u00a0nbsp\u200d",
    "<|startoftext|>inline<|endoftext|> tokens",
    "<|ENDOFTEXT|> upper <|EndOfText|>",
    "</s> <pad> <unk> <extra_id_0> <extra_id_2> eos</s>end",
    "!!! bang! !",
    "xylophone x-ray xx",  # the crafted charsmap maps "x" to "y"
    "&amp; &lt;html&gt; &#39;",
    "mIxEd CaSe WoRdS",
    "\n",
    "tab\tseparated\tvalues",
    "control\x00nul \x07bell \x1b[31mansi\x1b[0m del\x7f \ufffdreplacement\x85next\u2028line",
]
CLIP_LENGTHS = [None, 12]  # None: model_max_length (77)
T5_LENGTHS = [8, 32, 512]


# --------------------------------------------------------------------------------------------------
# Folders


def _clip_vocab_merges(folder):
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def _write_vocab_merges(src, dst):
    vocab, merges = _clip_vocab_merges(src)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")


def _added(content, normalized, typed=False, special=None):
    token = {
        "content": content,
        "lstrip": False,
        "normalized": normalized,
        "rstrip": False,
        "single_word": False,
    }
    if special is not None:
        token["special"] = special
    return {"__type": "AddedToken", **token} if typed else token


def _clip_folders(root):
    folders = {}
    for pad in ("<|endoftext|>", "!"):
        name = "fixture-pad-" + ("eot" if pad != "!" else "bang")
        folders[name] = root / name
        write_clip_tokenizer(folders[name], caption_merges(), pad_token=pad)
    base = folders["fixture-pad-eot"]

    for pad in ("<|endoftext|>", "!"):  # SDXL's tokenizer and tokenizer_2
        dst = folders["sdxl-" + ("eot" if pad != "!" else "bang")] = root / ("sdxl-" + str(len(folders)))
        _write_vocab_merges(base, dst)
        (dst / "special_tokens_map.json").write_text(
            json.dumps(
                {
                    "bos_token": _added("<|startoftext|>", True),
                    "eos_token": _added("<|endoftext|>", True),
                    "pad_token": pad,
                    "unk_token": _added("<|endoftext|>", True),
                }
            )
        )
        (dst / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "add_prefix_space": False,
                    "bos_token": _added("<|startoftext|>", True, typed=True),
                    "do_lower_case": True,
                    "eos_token": _added("<|endoftext|>", True, typed=True),
                    "errors": "replace",
                    "model_max_length": 77,
                    "name_or_path": "openai/clip-vit-large-patch14",
                    "pad_token": pad,
                    "special_tokens_map_file": "./special_tokens_map.json",
                    "tokenizer_class": "CLIPTokenizer",
                    "unk_token": _added("<|endoftext|>", True, typed=True),
                }
            )
        )

    vocab, _ = _clip_vocab_merges(base)
    dst = folders["flux"] = root / "flux"
    _write_vocab_merges(base, dst)
    (dst / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": _added("<|startoftext|>", True),
                "eos_token": _added("<|endoftext|>", False),
                "pad_token": _added("<|endoftext|>", False),
                "unk_token": _added("<|endoftext|>", False),
            }
        )
    )
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_prefix_space": False,
                "added_tokens_decoder": {
                    str(vocab["<|startoftext|>"]): _added("<|startoftext|>", True, special=True),
                    str(vocab["<|endoftext|>"]): _added("<|endoftext|>", False, special=True),
                },
                "bos_token": "<|startoftext|>",
                "clean_up_tokenization_spaces": True,
                "do_lower_case": True,
                "eos_token": "<|endoftext|>",
                "errors": "replace",
                "model_max_length": 77,
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "CLIPTokenizer",
                "unk_token": "<|endoftext|>",
            }
        )
    )

    dst = folders["tokenizer-json-v4"] = root / "v4"
    dst.mkdir()
    data = json.loads((base / "tokenizer.json").read_text())
    data["added_tokens"] = [
        {"id": vocab[t], "special": True, **_added(t, True)} for t in ("<|startoftext|>", "<|endoftext|>")
    ]
    (dst / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    shutil.copy(folders["sdxl-eot"] / "special_tokens_map.json", dst)
    shutil.copy(folders["sdxl-eot"] / "tokenizer_config.json", dst)
    return folders


def _charsmap() -> str:
    """A SentencePiece precompiled charsmap (a double-array trie and its strings) that maps "x" to "y"."""
    units = [0] * 512
    units[0x78] = (256 << 10) | (1 << 8) | 0x78  # "x": a leaf, its value at 0x78 ^ 256
    units[0x78 ^ 256] = 0  # offset 0 in the strings
    blob = struct.pack("<I", 4 * len(units)) + struct.pack(f"<{len(units)}I", *units) + b"y\0"
    return base64.b64encode(blob).decode()


def _t5_folders(root):
    folders = {"fixture": root / "t5-fixture"}
    build_tiny_t5_tokenizer(folders["fixture"])
    base = json.loads((folders["fixture"] / "tokenizer.json").read_text())
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}

    # FLUX.1's tokenizer_2: sentinels at the vocabulary's end (highest first, as T5's), an older converter's
    # pipeline, added_tokens_decoder in the config.
    data = json.loads(json.dumps(base))
    extra = [f"<extra_id_{i}>" for i in range(4)]
    data["model"]["vocab"] += [[t, 0.0] for t in reversed(extra)]
    ids = {piece: i for i, (piece, _) in enumerate(data["model"]["vocab"])}
    data["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": _charsmap()},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
        ],
    }
    data["pre_tokenizer"] = metaspace
    data["added_tokens"] += [
        {"id": ids[t], "special": True, **_added(t, False)} for t in sorted(extra, key=ids.get)
    ]
    dst = folders["flux"] = root / "t5-flux"
    dst.mkdir()
    (dst / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in data["added_tokens"]}
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_prefix_space": True,
                "added_tokens_decoder": decoder,
                "additional_special_tokens": extra,
                "clean_up_tokenization_spaces": True,
                "eos_token": "</s>",
                "extra_ids": 4,
                "legacy": True,
                "model_max_length": 512,
                "pad_token": "<pad>",
                "sp_model_kwargs": {},
                "tokenizer_class": "T5Tokenizer",
                "unk_token": "<unk>",
            }
        )
    )
    (dst / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "additional_special_tokens": [_added(t, False) for t in extra],
                "eos_token": _added("</s>", False),
                "pad_token": _added("<pad>", False),
                "unk_token": _added("<unk>", False),
            }
        )
    )

    # umT5-like: byte-fallback pieces and the flag in the file, sentinels outside the vocabulary, no
    # added_tokens_decoder (special_tokens_map.json and tokenizer.json's added tokens are read instead).
    data = json.loads(json.dumps(base))
    data["model"]["vocab"] += [[f"<0x{b:02X}>", 0.0] for b in range(256)]
    data["model"]["byte_fallback"] = True
    data["pre_tokenizer"] = metaspace
    dst = folders["umt5"] = root / "t5-umt5"
    dst.mkdir()
    (dst / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    extra = [f"<extra_id_{i}>" for i in range(3)]
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "additional_special_tokens": extra,
                "eos_token": "</s>",
                "extra_ids": 3,
                "model_max_length": 1000000000000000019884624838656,
                "pad_token": "<pad>",
                "tokenizer_class": "T5Tokenizer",
                "unk_token": "<unk>",
            }
        )
    )
    (dst / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "additional_special_tokens": extra,
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
            }
        )
    )
    return folders


@pytest.fixture(scope="module")
def clip_folders(tmp_path_factory):
    return _clip_folders(tmp_path_factory.mktemp("clip-layouts"))


@pytest.fixture(scope="module")
def t5_folders(tmp_path_factory):
    return _t5_folders(tmp_path_factory.mktemp("t5-layouts"))


CLIP_LAYOUTS = ["fixture-pad-eot", "fixture-pad-bang", "sdxl-eot", "sdxl-bang", "flux", "tokenizer-json-v4"]
T5_LAYOUTS = ["fixture", "flux", "umt5"]


# --------------------------------------------------------------------------------------------------
# Parity


def assert_same_backend(ours, ref):
    """The whole tokenizers pipeline (model, normalizer, pre-tokenizer, post-processor, decoder, added tokens
    with their flags) is the one transformers builds; padding and truncation are per call."""
    a, b = json.loads(ours.backend.to_str()), json.loads(ref.backend_tokenizer.to_str())
    for data in (a, b):
        data.pop("padding"), data.pop("truncation")
    assert a == b


@pytest.mark.parametrize("layout", CLIP_LAYOUTS)
def test_clip_ids_and_masks_match_transformers(clip_folders, layout):
    folder = clip_folders[layout]
    ref = CLIPTokenizer.from_pretrained(str(folder))
    ours = load_clip_tokenizer(folder)
    assert ours.model_max_length == ref.model_max_length == 77
    assert (ours.pad_token, ours.pad_token_id) == (ref.pad_token, ref.pad_token_id)
    assert len(ours) == len(ref)
    assert_same_backend(ours, ref)
    for max_length in CLIP_LENGTHS:
        expected = ref(
            PROMPTS, padding="max_length", max_length=max_length or ref.model_max_length, truncation=True
        )
        got = ours.encode(PROMPTS, max_length)
        np.testing.assert_array_equal(got.input_ids, np.asarray(expected.input_ids), err_msg=f"{max_length}")
        np.testing.assert_array_equal(got.attention_mask, np.asarray(expected.attention_mask))
        np.testing.assert_array_equal(tokenize(ours, PROMPTS, max_length), got.input_ids)
    for prompt in PROMPTS:
        assert ours.tokenize(prompt) == ref.tokenize(prompt), prompt


@pytest.mark.parametrize("layout", T5_LAYOUTS)
def test_t5_ids_and_masks_match_transformers(t5_folders, layout):
    folder = t5_folders[layout]
    ours = load_t5_tokenizer(folder)
    refs = [AutoTokenizer.from_pretrained(str(folder)), T5Tokenizer.from_pretrained(str(folder))]
    for ref in refs:
        assert (ours.pad_token, ours.pad_token_id) == (ref.pad_token, ref.pad_token_id)
        assert len(ours) == len(ref)
        assert_same_backend(ours, ref)
        for max_length in T5_LENGTHS:
            expected = ref(
                PROMPTS,
                padding="max_length",
                max_length=max_length,
                truncation=True,
                add_special_tokens=True,
                return_attention_mask=True,
            )
            got = tokenize_t5(ours, PROMPTS, max_length)
            np.testing.assert_array_equal(
                got.input_ids, np.asarray(expected.input_ids), err_msg=f"{max_length}"
            )
            np.testing.assert_array_equal(got.attention_mask, np.asarray(expected.attention_mask))
        for prompt in PROMPTS:
            assert ours.tokenize(prompt) == ref.tokenize(prompt), prompt


@pytest.mark.parametrize("layout", T5_LAYOUTS)
def test_wan_prompts_match_transformers(t5_folders, layout):
    """Wan: prompt_clean, then the tokenizer with its mask (512)."""
    folder = t5_folders[layout]
    ref = AutoTokenizer.from_pretrained(str(folder))
    expected = ref(
        [prompt_clean(p) for p in PROMPTS],
        padding="max_length",
        max_length=512,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
    )
    got = tokenize_wan_prompts(load_t5_tokenizer(folder), PROMPTS, 512)
    np.testing.assert_array_equal(got.input_ids, np.asarray(expected.input_ids))
    np.testing.assert_array_equal(got.attention_mask, np.asarray(expected.attention_mask))


def test_the_layouts_exercise_what_they_claim(t5_folders, clip_folders):
    """The crafted charsmap and the new sentinel ids are live: a parity test over them is not vacuous."""
    flux = load_t5_tokenizer(t5_folders["flux"])
    assert flux.tokenize("x") == flux.tokenize("y")
    umt5 = load_t5_tokenizer(t5_folders["umt5"])
    vocab = len(json.loads((t5_folders["umt5"] / "tokenizer.json").read_text())["model"]["vocab"])
    assert umt5.backend.token_to_id("<extra_id_2>") >= vocab
    assert "<extra_id_2>" in umt5.tokenize("a <extra_id_2> b")
    bang = load_clip_tokenizer(clip_folders["sdxl-bang"])
    assert bang.pad_token_id == 0 and bang.encode(["a"]).input_ids[0, -1] == 0


# --------------------------------------------------------------------------------------------------
# Writers and errors


def test_tiny_writers_write_what_transformers_writes(tmp_path):
    for pad in ("<|endoftext|>", "!"):
        ours = tmp_path / f"ours-clip-{len(pad)}"
        build_tiny_clip_tokenizer(ours, pad_token=pad)
        vocab, merges = _clip_vocab_merges(ours)
        src = tmp_path / f"src-{len(pad)}"
        src.mkdir()
        (src / "vocab.json").write_text(json.dumps(vocab))
        (src / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        theirs = tmp_path / f"theirs-clip-{len(pad)}"
        CLIPTokenizer(
            str(src / "vocab.json"), str(src / "merges.txt"), pad_token=pad, model_max_length=77
        ).save_pretrained(str(theirs))
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        for f in ours.iterdir():
            assert f.read_bytes() == (theirs / f.name).read_bytes(), f.name

    ours = tmp_path / "ours-t5"
    build_tiny_t5_tokenizer(ours)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(piece, -1.0 if len(piece) > 1 else -5.0) for piece in _TINY_PIECES]
    theirs = tmp_path / "theirs-t5"
    T5Tokenizer(vocab=vocab, extra_ids=0).save_pretrained(str(theirs))
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for f in ours.iterdir():
        assert f.read_bytes() == (theirs / f.name).read_bytes(), f.name


def test_t5_folder_without_tokenizer_json_is_refused_clearly(tmp_path):
    folder = tmp_path / "tokenizer_2"
    folder.mkdir()
    (folder / "spiece.model").write_bytes(b"\0")
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerFolderError, match="needs tokenizer.json.*spiece.model"):
        load_t5_tokenizer(folder)


def test_clip_folder_without_vocabulary_is_refused(tmp_path):
    with pytest.raises(TokenizerFolderError, match="no CLIP tokenizer"):
        load_clip_tokenizer(tmp_path)


def test_loading_imports_no_transformers(clip_folders, t5_folders):
    code = (
        "import sys\n"
        "from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize\n"
        "from meshserve.models.components.t5_tokenizer import load_t5_tokenizer, tokenize_t5\n"
        f"tokenize(load_clip_tokenizer({str(clip_folders['sdxl-bang'])!r}), ['a cat'])\n"
        f"tokenize_t5(load_t5_tokenizer({str(t5_folders['flux'])!r}), ['a cat'], 16)\n"
        "assert not {'transformers', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
