"""The prompt-embedding cache (models/engine/prompt_cache.py): a call with cached rows gives exactly what the
uncached call gives, counts its hits and misses, stays within its byte bound, and compiles nothing once
warmed up; for SDXL (two CLIPs), Flux (CLIP + T5) and Wan (UMT5 with its mask)."""

import jax
import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.engine.prompt_cache import PromptCache
from tests.xla_level import SERVING_EMITTERS

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


# A cached row is encoded in another batch than the call's, so bit-identity rests on the code being the same in
# both programs: the pipelines compile with serving's fusion emitters (tests/xla_level.py).
@pytest.fixture(scope="module")
def sdxl():
    return load_pipeline(None, xla_options=SERVING_EMITTERS)


def test_cached_call_equals_uncached_and_warm_calls_compile_nothing(sdxl):
    kw = dict(seed=[0, 1], num_inference_steps=2, output_type="np", guidance_scale=2.0)
    negatives = [None, "blurry"]
    sdxl.prompt_cache = None
    reference = sdxl(PROMPTS, negative_prompt=negatives, **kw).images
    cache = sdxl.prompt_cache = PromptCache(64 << 20)
    try:
        settings = {"width": 64, "height": 64, "num_inference_steps": 2, "scheduler": None}
        cache.warm_up(sdxl, settings, max_texts=4)  # what warm_up adds for a pool of batch 2
        got = sdxl(PROMPTS, negative_prompt=negatives, **kw)
        np.testing.assert_array_equal(got.images, reference)  # bit for bit
        # 4 text rows: 2 prompts, SDXL's zeroed empty negative (its "" row) and "blurry": all misses.
        assert (cache.hits, cache.misses, cache.entries) == (0, 4, 4)
        before = sdxl.compilations
        again = sdxl(PROMPTS, negative_prompt=negatives, **kw)
        np.testing.assert_array_equal(again.images, reference)
        assert (cache.hits, cache.misses) == (4, 4)
        # A new prompt: one miss, encoded by a warmed-up program; nothing compiles.
        sdxl(["a blue triangle", PROMPTS[1]], negative_prompt=negatives, **kw)
        assert (cache.hits, cache.misses) == (7, 5)
        assert sdxl.compilations == before
        assert got.timings["text_encode"] > 0 and again.timings["text_encode"] > 0
        # Scopes (a pool's tenants): the unscoped rows are not another scope's, and a scope hits its own rows.
        scoped = sdxl(PROMPTS, negative_prompt=negatives, prompt_cache_scope=["alice", "bob"], **kw)
        np.testing.assert_array_equal(scoped.images, reference)
        assert (cache.hits, cache.misses) == (7, 9)
        sdxl(PROMPTS[::-1], negative_prompt=negatives[::-1], prompt_cache_scope=["bob", "alice"], **kw)
        assert (cache.hits, cache.misses) == (11, 9)
        sdxl(PROMPTS, negative_prompt=negatives, prompt_cache_scope="carol", **kw)
        assert (cache.hits, cache.misses) == (11, 13)
        assert sdxl.compilations == before
    finally:
        sdxl.prompt_cache = None


def test_the_byte_bound_evicts_least_recently_used(sdxl):
    tokens = sdxl.tokenize(["one", "two", "three"], {})
    row_bytes = (77 * 64 + 32) * 4  # embeds [77, 32 + 32] and pooled [32], fp32
    cache = PromptCache(2 * row_bytes)
    for i in range(3):
        cache.encode(sdxl, tuple(t[i : i + 1] for t in tokens), None, prompts=1, n=1, do_cfg=False)
    assert (cache.entries, cache.bytes, cache.evictions) == (2, 2 * row_bytes, 1)
    cache.encode(sdxl, tuple(t[2:3] for t in tokens), None, prompts=1, n=1, do_cfg=False)
    assert cache.hits == 1  # "three" was kept, "one" went first
    with pytest.raises(ValueError):
        PromptCache(0)


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan"])
def test_flux_and_wan_rows_equal_the_uncached_encoding(model):
    pipe = load_pipeline(model, xla_options=SERVING_EMITTERS)
    settings = {name: pipe.defaults.get(name, pipe.limits.get(name)) for name in pipe.batch_fields}
    texts = ["a cat", "a dog", "", "a cat"]  # 2 prompts, then their negatives (CFG)
    tokens = pipe.tokenize(texts, settings)
    text = {"prompts": 2, "n": 1, "do_cfg": True}
    reference = pipe.programs.run(
        "text_encode",
        pipe._text_encode,
        text,
        pipe._text_states,
        tuple(pipe.put_batch(t) for t in tokens),
        None,
    )
    cache = PromptCache(64 << 20)
    got = cache.encode(pipe, tokens, None, **text)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (cache.hits, cache.misses, cache.entries) == (
        0,
        4,
        3,
    )  # "a cat" twice: two missed rows, one encoding
