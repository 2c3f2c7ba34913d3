"""What every pipeline shares: its output, its errors, argument normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class PipelineError(ValueError):
    """A request the pipeline cannot run (bad size, steps, scheduler...), with the reason."""


class GenerationCancelled(RuntimeError):
    """The step callback asked the denoising loop to stop."""


@dataclass
class PipelineOutput:
    images: list | np.ndarray  # list of PIL images, or np.float32 [B, H, W, 3] in [0, 1]
    seeds: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    compiled: bool = False

    @classmethod
    def make(cls, images: np.ndarray, output_type: str, **kw) -> PipelineOutput:
        if output_type == "pil":
            from PIL import Image

            images = [Image.fromarray(np.round(im * 255).astype(np.uint8)) for im in images]
        return cls(images=images, **kw)


def to_list(value: str | Sequence[str], name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    values = list(value)
    if not values or not all(isinstance(v, str) for v in values):
        raise PipelineError(f"{name} must be a string or a non-empty list of strings")
    return values
