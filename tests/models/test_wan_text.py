"""Wan prompt encoding: ours (prompt_clean, the tiny T5 tokenizer, UMT5 in JAX, trim + zero-pad) against
diffusers' WanPipeline.encode_prompt on a tiny random UMT5 written by transformers (tests/fixtures/tiny_wan.py).

The measured errors are logged: `pytest tests/models/test_wan_text.py --log-cli-level=INFO` shows them.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshserve.models.components.t5 import load_t5_encoder
from meshserve.models.components.t5_tokenizer import build_tiny_t5_tokenizer, load_t5_tokenizer
from meshserve.models.wan.text import (
    WAN_MAX_SEQUENCE_LENGTH,
    encode_wan_prompts,
    prompt_clean,
    tokenize_wan_prompts,
)
from tests.fixtures.tiny_wan import UMT5, build_tiny_umt5

log = logging.getLogger(__name__)

PROMPTS = [
    "a cat &amp;amp; the dog",  # unescaped twice: "a cat & the dog"
    "  the\u3000cat\n\n  and\tthe dog  ",  # ideographic space, newlines, tabs: one space each run
    "the cat " * 40,  # longer than the tiny max length: truncated, EOS kept
    "",  # EOS alone
]
NEGATIVE = ["dog", "", "the  dog", "a &lt;cat&gt;"]


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def wan_text(tmp_path_factory):
    """(our encoder, our tokenizer, diffusers' WanPipeline holding the same tokenizer and UMT5)."""
    import torch
    from diffusers import WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    root = tmp_path_factory.mktemp("wan_text")
    vocab = build_tiny_t5_tokenizer(root / "tokenizer")
    assert vocab <= UMT5["vocab_size"]
    build_tiny_umt5(root / "text_encoder")
    pipe = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(str(root / "tokenizer")),
        text_encoder=UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), dtype=torch.float32).eval(),
        vae=None,
        scheduler=None,
    )
    return load_t5_encoder(root / "text_encoder"), load_t5_tokenizer(root / "tokenizer"), pipe


def encode(encoder, tokenizer, prompts, max_sequence_length):
    """As a pipeline's text program: tokenize on the host, one jitted encoder + trim/pad."""
    graphdef, state = nnx.split(encoder)
    tokens = tokenize_wan_prompts(tokenizer, prompts, max_sequence_length)

    @jax.jit
    def run(state, ids, mask):
        return encode_wan_prompts(nnx.merge(graphdef, state), ids, mask)

    return np.asarray(run(state, jnp.asarray(tokens.input_ids), jnp.asarray(tokens.attention_mask))), tokens


def diffusers_encode(pipe, prompts, negative, max_sequence_length):
    import torch

    with torch.no_grad():
        pos, neg = pipe.encode_prompt(
            prompts,
            negative,
            do_classifier_free_guidance=True,
            max_sequence_length=max_sequence_length,
            device="cpu",
        )
    return pos.float().numpy(), neg.float().numpy()


def test_prompt_clean_equals_diffusers():
    """Every code point that Python or the `regex` package calls whitespace (the only place our cleaner could
    differ), in leading, inner, doubled and trailing positions, plus HTML entities (unescaped twice)."""
    import regex
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as diffusers_prompt_clean

    candidates = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    spaces = [c for c in candidates if c.isspace() or regex.fullmatch(r"\s", c)]
    assert "\x1c" in spaces and "\u3000" in spaces  # Python-only and shared whitespace are both covered
    texts = [f"{c}a{c}b{c}{c}c {c}" for c in spaces]
    texts += [
        "&amp;lt;b&amp;gt; &quot;x&quot; &#39;y&#39; &nbsp;z",
        "A &amp;amp; B",
        "\x1c\x1d lone\x1f",
        "é 猫 🐈",
    ]
    for text in texts:
        assert prompt_clean(text) == diffusers_prompt_clean(text), repr(text)
    assert prompt_clean("  a\u3000\u3000b\x1cc  ") == "a b\x1cc"  # regex's \s does not cover U+001C


def test_encode_equals_diffusers_encode_prompt(wan_text):
    """Positive and negative batches at max_sequence_length 16 (the tiny test length) against diffusers'
    encode_prompt (fp32): equal within 1e-4, rows past each prompt's length exactly zero, and the trimming
    matters (UMT5's raw outputs at padding positions are far from zero)."""
    encoder, tokenizer, pipe = wan_text
    want_pos, want_neg = diffusers_encode(pipe, PROMPTS, NEGATIVE, 16)
    for prompts, want in ((PROMPTS, want_pos), (NEGATIVE, want_neg)):
        got, tokens = encode(encoder, tokenizer, prompts, 16)
        assert got.shape == (len(prompts), 16, UMT5["d_model"])
        err = rel_err(got, want)
        log.info("Wan prompt embeds (len 16) vs diffusers encode_prompt: rel err %.2e", err)
        assert err <= 1e-4
        lengths = tokens.attention_mask.sum(1)
        for row, n in enumerate(lengths):
            assert not got[row, n:].any() and np.abs(got[row, :n]).min(axis=-1).all()
    assert tokens.attention_mask.sum(1).tolist()[1] == 1  # "" is EOS alone
    raw = np.asarray(
        encoder(jnp.asarray(tokens.input_ids), jnp.asarray(tokens.attention_mask)).last_hidden_state
    )
    assert rel_err(raw, want_neg) > 1e-2


def test_encode_at_wan_length_512_equals_diffusers(wan_text):
    """The pipeline's real length: 512 tokens, mostly padding."""
    encoder, tokenizer, pipe = wan_text
    assert WAN_MAX_SEQUENCE_LENGTH == 512
    want, _ = diffusers_encode(pipe, PROMPTS[:2], None, WAN_MAX_SEQUENCE_LENGTH)
    got, _ = encode(encoder, tokenizer, PROMPTS[:2], WAN_MAX_SEQUENCE_LENGTH)
    err = rel_err(got, want)
    log.info("Wan prompt embeds (len 512) vs diffusers encode_prompt: rel err %.2e", err)
    assert got.shape == (2, 512, UMT5["d_model"]) and err <= 1e-4


def test_output_dtype_is_the_requested_one(wan_text):
    encoder, tokenizer, _ = wan_text
    tokens = tokenize_wan_prompts(tokenizer, "a cat", 8)
    out = encode_wan_prompts(
        encoder, jnp.asarray(tokens.input_ids), jnp.asarray(tokens.attention_mask), dtype=jnp.bfloat16
    )
    assert out.dtype == jnp.bfloat16 and out.shape == (1, 8, UMT5["d_model"])
