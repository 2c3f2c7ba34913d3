"""Text embeddings given to a call instead of texts (diffusers' `prompt_embeds` and its kin).

    given = GivenEmbeds.take(pipe, options, prompt, negative_prompt, prompt_2, negative_prompt_2)
    prompts, negatives = given.texts(prompt, negative_prompt)       # placeholders where embeddings stand in
    cond = given.conditioning(pipe, tokens, keep, prompts=P, n=n, do_cfg=do_cfg, text_adapters=False)

A family names the arrays its `encode_prompt` makes, in diffusers' words (`embeds_names`: SDXL and Flux
("prompt_embeds", "pooled_prompt_embeds"), Wan ("prompt_embeds",)); a call may give them per prompt ([P, ...],
diffusers' layouts) with `negative_` ones for the negatives, under diffusers' rules: a prompt or its
embeddings, not both (nor `prompt_2` beside them); every array of a side, not some; a negative prompt or its
embeddings, not both. A side given as text is encoded as usual (SDXL's empty negative still zeros when the
folder forces it), so a call may give its prompts as embeddings and its negatives as text. The rows are then
assembled as the text program assembles them (repeated per image, CFG-interleaved) by the prompt cache's
programs (models/engine/prompt_cache.py), so the denoiser sees the same conditioning either way; the cache
itself is neither read nor written, and text-encoder adapters are refused (the encoders do not run).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.prompt_cache import assemble_rows, encode_rows


@dataclass(frozen=True)
class GivenEmbeds:
    """The call's embeddings: per side (prompts, negatives), the family's arrays [P, ...] or None (as text)."""

    positive: tuple[np.ndarray, ...] | None
    negative: tuple[np.ndarray, ...] | None

    @staticmethod
    def names(pipe) -> set[str]:
        """The keyword arguments a family takes for them."""
        return {*pipe.embeds_names, *(f"negative_{name}" for name in pipe.embeds_names)}

    @classmethod
    def take(
        cls, pipe, options: dict, prompt, negative_prompt, prompt_2, negative_prompt_2
    ) -> GivenEmbeds | None:
        """Pops the family's embedding arguments from `options` and checks them against diffusers' rules; None
        when the call gives none."""
        sides = []
        for prefix in ("", "negative_"):
            given = {name: options.pop(prefix + name, None) for name in pipe.embeds_names}
            if all(v is None for v in given.values()):
                sides.append(None)
                continue
            missing = [prefix + name for name, v in given.items() if v is None]
            if missing:
                raise PipelineError(f"{prefix}prompt_embeds need {missing} too (diffusers' rule)")
            sides.append(tuple(np.asarray(v, np.float32) for v in given.values()))
        positive, negative = sides
        if positive is None and negative is None:
            return None
        if positive is None and prompt is None:
            raise PipelineError("a prompt or prompt_embeds is needed")
        for side, text, texts_2, name in (
            (positive, prompt, prompt_2, "prompt"),
            (negative, negative_prompt, negative_prompt_2, "negative_prompt"),
        ):
            if side is not None and (text is not None or texts_2):
                raise PipelineError(f"give {name} or {name.removesuffix('prompt')}prompt_embeds, not both")
        rows = {a.shape[0] for side in (positive, negative) if side is not None for a in side}
        if positive is not None and len(rows) > 1:
            raise PipelineError(f"prompt_embeds: one row per prompt on every array, got {sorted(rows)} rows")
        return cls(positive, negative)

    def texts(self, prompt, negative_prompt) -> tuple:
        """The call's prompt and negative_prompt with an empty text standing in for each row given as
        embeddings (they fix the prompts' count, and a given negative counts as one, as diffusers' CFG needs)."""
        if self.positive is not None:
            prompt = [""] * self.positive[0].shape[0]
        if self.negative is not None:
            negative_prompt = [""] * self.negative[0].shape[0]
        return prompt, negative_prompt

    def sequence_length(self) -> int:
        """The text length the first array gives ([P, L, D]): the call's max_sequence_length when it sets none."""
        return int((self.positive or self.negative)[0].shape[1])

    def conditioning(self, pipe, tokens, keep, *, prompts: int, n: int, do_cfg: bool, text_adapters: bool):
        """The denoiser's conditioning: the given rows, and the texts' rows for a side given as text (its
        `tokens`, made for every text of the call), assembled as the text program assembles them."""
        if text_adapters:
            raise PipelineError("text-encoder adapters adapt the encoders, which given prompt_embeds skip")
        shapes = jax.eval_shape(pipe.encode_prompt, pipe._text_states, *(t[:1] for t in tokens))
        treedef, wants = jax.tree.structure(shapes), jax.tree.leaves(shapes)  # one text's arrays
        sides = [self.positive] + ([self.negative] if do_cfg else [])
        for side, prefix in zip(sides, ("", "negative_"), strict=False):
            if side is None:
                continue
            for name, array, want in zip(pipe.embeds_names, side, wants, strict=True):
                if array.shape != (prompts, *want.shape[1:]):
                    raise PipelineError(
                        f"{prefix}{name}: expected shape {[prompts, *want.shape[1:]]} for this call, got "
                        f"{list(array.shape)}"
                    )
        encode = [i for i, side in enumerate(sides) if side is None]  # the sides given as text
        encoded = ()
        if encode:
            index = np.concatenate([np.arange(prompts) + i * prompts for i in encode])
            encoded = encode_rows(pipe, tuple(t[index] for t in tokens))
        replicated = NamedSharding(pipe.placement.mesh, P()) if pipe.placement is not None else None
        rows, taken = [], iter(encoded)
        for side in sides:
            for r in range(prompts):
                if side is None:
                    rows.append(next(taken))
                    continue
                # in the encoders' output dtypes, so the rows stack as encoded rows do
                leaves = [
                    jax.device_put(a[r].astype(w.dtype), replicated) for a, w in zip(side, wants, strict=True)
                ]
                rows.append(jax.tree.unflatten(treedef, leaves))
        return assemble_rows(pipe, tuple(rows), keep, prompts=prompts, n=n, do_cfg=do_cfg)
