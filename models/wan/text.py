"""Wan 2.1's prompt encoding, as diffusers' WanPipeline does it (`prompt_clean`, `_get_t5_prompt_embeds`).

    tokens = tokenize_wan_prompts(tokenizer, prompts, max_sequence_length=512)       # host: clean + tokenize
    embeds = encode_wan_prompts(umt5, tokens.input_ids, tokens.attention_mask)       # JAX, jittable
    -> [B, max_sequence_length, d_model]: UMT5's states for each prompt's real tokens (EOS included), zeros after

The UMT5 encoder (models/components/t5.py, `model_type` "umt5") runs WITH the attention mask, so padding keys are not
attended; its outputs at padding positions are real numbers, which diffusers then drops: each prompt is
trimmed to its length `mask.sum()` and zero-padded back to max_sequence_length. The transformer's
cross-attention has no mask, so those zero rows (bias-only after its text_embedder) are attended: the zeros
are part of the function, not a convenience.

`prompt_clean` is diffusers' `whitespace_clean(basic_clean(text))`: html.unescape twice, strip, every run of
Unicode whitespace to one space, strip. diffusers applies `ftfy.fix_text` first only when ftfy is installed
(`is_ftfy_available()`); it is not a dependency of diffusers (nor installed with this project's test extra),
so diffusers' default behaviour is without it, and so is ours: mojibake such as "cafÃ©" stays as it is.
(The original Wan code always runs ftfy.) diffusers' `\\s` is the `regex` package's, which is Unicode's
White_Space set; Python's `re` would also match the four ASCII separators U+001C..U+001F, so the set is
spelled out here.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

import jax.numpy as jnp

from meshserve.models.components.t5_tokenizer import T5Tokens, tokenize_t5

# WanPipeline's max_sequence_length default in __call__ (encode_prompt's own default, 226, is never used by
# the pipeline).
WAN_MAX_SEQUENCE_LENGTH = 512

# Unicode's White_Space property: what the `regex` package's \s matches in diffusers' whitespace_clean.
_WHITESPACE = re.compile("[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")


def prompt_clean(text: str) -> str:
    """diffusers' wan `prompt_clean` without ftfy (module docstring)."""
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


def tokenize_wan_prompts(
    tokenizer, prompts: Sequence[str], max_sequence_length: int = WAN_MAX_SEQUENCE_LENGTH
) -> T5Tokens:
    """Cleaned prompts -> ids and attention mask [B, max_sequence_length], padded and truncated (EOS kept)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    return tokenize_t5(tokenizer, [prompt_clean(p) for p in prompts], max_sequence_length)


def encode_wan_prompts(encoder, input_ids, attention_mask, dtype=None):
    """UMT5 with the mask, then each row trimmed to its length and zero-padded: [B, S] ids/mask ->
    [B, S, d_model] in `dtype` (default: the encoder's output dtype; the pipeline casts to the transformer's).

    A row's length is its mask's count of ones and its first that many rows are kept, exactly as diffusers'
    `u[:v]` (the tokenizer pads on the right, so these are the masked-in tokens)."""
    out = encoder(input_ids, attention_mask).last_hidden_state
    seq_lens = jnp.sum(attention_mask > 0, axis=1)
    keep = jnp.arange(out.shape[1])[None, :] < seq_lens[:, None]
    out = jnp.where(keep[..., None], out, jnp.zeros((), out.dtype))
    return out if dtype is None else out.astype(dtype)
