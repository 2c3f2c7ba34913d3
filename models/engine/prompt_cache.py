"""The prompt-embedding cache: an LRU of text-encoder outputs on the pool's devices, one entry per text row.

    pipe.prompt_cache = PromptCache(max_bytes=64 << 20)   # a serving pool: `prompt_cache_mb` in pools.yaml

A request's texts (its prompts and, with CFG, its negatives) are encoded one row each: a row's entry is keyed
by the model, the family's text encoders (their names: one entry holds what `encode_prompt` makes from all of
them, e.g. SDXL's two CLIPs' states and pooled vector) and the exact token ids of every encoder (so the text
length a request picks is part of the key, and two strings that tokenize alike share an entry). The common
hits are the empty negative prompt and the negatives a client sends every time.

A call looks its rows up, encodes only the misses (deduplicated, padded to a power of two by repeating the
first: a pool compiles log2(2 x max batch) + 1 small encode programs, all at warm-up, never one per request)
and assembles the conditioning from the rows in one program per (prompts, n, CFG) - the same count the
uncached text program has. Each row goes through the same encoder computation as without the cache; the
result equals the uncached one (tests/models/test_prompt_cache.py checks it bit for bit on the CPU; a backend
whose kernels change with the batch size could differ in the last bit).

Text-encoder LoRA: a call where some row's adapters adapt the text encoders bypasses the cache entirely - it
runs the pipeline's text_encode LoRA variant, reads no entry and writes none - so an adapted row is never
served a plain entry and never stores one under the plain key (the key holds no adapter identity). Its plain
rows lose their hits in that call only; keying adapted rows by (adapter, load generation, scale) was not worth
the invalidation rules. A call whose adapters touch only the denoiser uses the cache as usual.

Scopes: a call may give each prompt a scope (`pipe(..., prompt_cache_scope=...)`), part of its rows' keys, so a
row is served only an entry its own scope stored. A serving pool passes each job's tenant: a hit is faster than
a miss (and counted in the worker's metrics), so with one shared cache a tenant could learn whether another had
asked for a given prompt. The cost is one entry per tenant for a text they share (the empty negative: 315 KB for
SDXL in bf16).

Entries stay on the devices (a hit moves nothing over the host link), bounded by bytes: SDXL's row is
77 x 2048 + 1280 values (315 KB in bf16), Flux's and Wan's 512 x 4096 (4 MB in bf16). Evicted least recently
used; `hits`, `misses`, `evictions`, `bytes` and `entries` are what the worker exports.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class PromptCache:
    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._rows: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()  # pools call from their own thread; metrics read from another
        self.hits = self.misses = self.evictions = 0
        self.bytes = 0

    @property
    def entries(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self.bytes = 0

    def row_keys(self, pipe, tokens: tuple[np.ndarray, ...], scopes: list | None = None) -> list[tuple]:
        """One key per text row: (scope, model, encoders, each encoder's exact ids with their dtype and
        length); `scopes`: one per row (None: every row unscoped)."""
        encoders = tuple(sorted(pipe._text_states))
        rows = tokens[0].shape[0]
        scopes = [None] * rows if scopes is None else scopes
        return [
            (
                scopes[r],
                pipe.model_id,
                encoders,
                tuple((t.dtype.str, t.shape[1:], t[r].tobytes()) for t in tokens),
            )
            for r in range(rows)
        ]

    def encode(
        self, pipe, tokens: tuple[np.ndarray, ...], keep, *, prompts: int, n: int, do_cfg: bool, scopes=None
    ):
        """The conditioning `pipe._text_encode` would make from these host token arrays [T, ...], from the
        cached rows and the misses encoded now (`scopes`: each text row's, as `row_keys` takes them)."""
        keys = self.row_keys(pipe, tokens, scopes)
        with self._lock:
            found = {k: self._touch(k) for k in dict.fromkeys(keys)}
        missing = [k for k, row in found.items() if row is None]
        # rows: a text repeated in the call counts each time
        missed = sum(1 for k in keys if found[k] is None)
        self.hits += len(keys) - missed
        self.misses += missed
        if missing:
            first = {k: keys.index(k) for k in missing}
            index = [first[k] for k in missing]
            index += index[:1] * (pow2(len(index)) - len(index))
            encoded = encode_rows(pipe, tuple(t[index] for t in tokens))
            for k, row in zip(missing, encoded, strict=False):
                found[k] = row
                self._put(k, row)
        return assemble_rows(pipe, tuple(found[k] for k in keys), keep, prompts=prompts, n=n, do_cfg=do_cfg)

    def warm_up(self, pipe, settings: dict, max_texts: int) -> None:
        """Compile the miss programs a pool can meet: 1, 2, 4... rows up to `max_texts` (without caching)."""
        for m in sorted({pow2(k) for k in range(1, max_texts + 1)}):
            encode_rows(pipe, pipe.tokenize([""] * m, settings))

    def _touch(self, key):
        entry = self._rows.get(key)
        if entry is None:
            return None
        self._rows.move_to_end(key)
        return entry[0]

    def _put(self, key, row) -> None:
        size = _nbytes(row)
        with self._lock:
            if key in self._rows or size > self.max_bytes:
                return
            self._rows[key] = (row, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._rows.popitem(last=False)
                self.bytes -= dropped
                self.evictions += 1


def encode_rows(pipe, tokens) -> tuple:
    """Host token arrays [M, ...] per encoder -> M rows on the pool's devices, each the `encode_prompt` pytree of
    one text (kept whole on every device, so any call can assemble them)."""
    tokens = tuple(pipe.put_batch(t) for t in tokens)
    replicated = None
    if pipe.placement is not None:
        replicated = NamedSharding(pipe.placement.mesh, P())
    static = {"pipe": pipe, "replicated": replicated}
    return pipe.programs.run("text_encode_rows", _encode_rows, static, pipe._text_states, tokens)


def assemble_rows(pipe, rows: tuple, keep, *, prompts: int, n: int, do_cfg: bool):
    """T rows (`encode_rows`' kind) -> the conditioning `pipe._text_encode` makes of T texts (one program per
    (prompts, n, CFG) and row shapes)."""
    static = {"pipe": pipe, "prompts": prompts, "n": n, "do_cfg": do_cfg}
    return pipe.programs.run("text_assemble", _assemble, static, None, rows, keep)


def _encode_rows(states, tokens, *, pipe, replicated):
    """tokens [M, ...] per encoder -> M rows, each the `encode_prompt` pytree of one text without its batch
    axis (separate outputs, so caching a row slices nothing outside the program)."""
    cond = pipe.encode_prompt(states, *tokens)
    rows = []
    for r in range(tokens[0].shape[0]):
        row = jax.tree.map(lambda x, r=r: x[r], cond)
        if replicated is not None:
            row = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), row)
        rows.append(row)
    return tuple(rows)


def _assemble(_, rows, keep, *, pipe, **text):
    """T cached rows -> the pytree of [T, ...] `encode_prompt` makes -> the conditioning (repeated per image,
    CFG-interleaved: the pipeline's `assemble_text`)."""
    encoded = jax.tree.map(lambda *xs: jax.numpy.stack(xs), *rows)
    return pipe.assemble_text(encoded, keep, **text)
