"""What every pipeline shares: its output, its errors, argument normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class PipelineError(ValueError):
    """A request the pipeline cannot run (bad size, steps, scheduler...), with the reason."""


class UnsupportedArgument(PipelineError, TypeError):
    """A keyword argument the pipeline does not take (a TypeError too, as Python's own for a bad keyword)."""


class GenerationCancelled(RuntimeError):
    """The step callback asked the denoising loop to stop."""


@dataclass
class PipelineOutput:
    """images: a list of PIL images, or np.float32 [B, H, W, 3] in [0, 1]; a video family's rows are videos
    ([B, F, H, W, 3], or a list of lists of PIL frames), also under diffusers' name `frames`."""

    images: list | np.ndarray
    seeds: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    compiled: bool = False
    # With a step cache (models/engine/step_cache.py): the steps it skipped for each image; None without one.
    cached_steps: list[int] | None = None

    @property
    def frames(self):
        return self.images


def to_pil(rows: np.ndarray) -> list:
    """[B, H, W, 3] -> B PIL images; [B, F, H, W, 3] -> B lists of F PIL frames (diffusers' layouts)."""
    from PIL import Image

    def convert(x):
        if x.ndim == 3:
            return Image.fromarray(np.round(x * 255).astype(np.uint8))
        return [convert(frame) for frame in x]

    return [convert(row) for row in rows]


def to_list(value: str | Sequence[str], name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    values = list(value)
    if not values or not all(isinstance(v, str) for v in values):
        raise PipelineError(f"{name} must be a string or a non-empty list of strings")
    return values


def per_prompt_ints(value, prompts: int, name: str) -> list[int | None]:
    """One integer for all prompts, or one per prompt (None: the family's default for that prompt)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
        if len(values) != prompts:
            raise PipelineError(
                f"{name}: expected one value or {prompts} (one per prompt), got {len(values)}"
            )
    else:
        values = [value] * prompts
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer)):
            raise PipelineError(f"{name} must be an integer, or a list of integers / None (one per prompt)")
    return [None if v is None else int(v) for v in values]


def second_texts(value, firsts: list[str], name: str) -> list[str]:
    """diffusers' `prompt_2 = prompt_2 or prompt` (and negative_prompt_2's fallback to the negative prompt),
    per prompt: one text for all, one per prompt (None: that prompt's first text), or None / "" (the first
    texts)."""
    if not value:
        return list(firsts)
    values = [value] * len(firsts) if isinstance(value, str) else per_prompt(value, len(firsts), name)
    return [first if v is None else v for v, first in zip(values, firsts, strict=True)]


def per_prompt(value, prompts: int, name: str = "negative_prompt") -> list:
    """One negative prompt for all prompts, or one per prompt (None: that prompt has none)."""
    if value is None or isinstance(value, str):
        return [value] * prompts
    if not isinstance(value, Sequence):
        raise PipelineError(f"{name} must be a string, None, or a list of strings / None")
    values = list(value)
    if len(values) != prompts:
        raise PipelineError(f"{name}: expected {prompts} entries (one per prompt), got {len(values)}")
    if not all(v is None or isinstance(v, str) for v in values):
        raise PipelineError(f"{name} must be a string, None, or a list of strings / None")
    return values


def lora_scale(attention_kwargs, name: str) -> float:
    """diffusers' per-call attention kwargs (SDXL's `cross_attention_kwargs`, Flux's `joint_attention_kwargs`,
    Wan's `attention_kwargs`: `name`) -> the LoRA scale they carry: "scale" multiplies every adapter's weight,
    in the denoiser and the text encoders (diffusers' scale_lora_layers), 1 when absent. Their other keys feed
    attention processors this package does not have (IP-Adapter masks...): refused by name."""
    if attention_kwargs is None:
        return 1.0
    if not isinstance(attention_kwargs, dict):
        raise PipelineError(f"{name} must be a dict, e.g. {{'scale': 0.5}}")
    other = sorted(k for k in attention_kwargs if k != "scale")
    if other:
        raise PipelineError(f"{name}: only 'scale' (the LoRA scale) is taken, not {other}")
    scale = attention_kwargs.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.number) or not np.isfinite(scale):
        raise PipelineError(f"{name}['scale'] must be a finite number, got {scale!r}")
    return float(scale)
