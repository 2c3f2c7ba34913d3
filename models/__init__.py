"""meshserve's models: pure JAX/Flax NNX diffusion pipelines, checked against diffusers.

The names below load on first use (PEP 562): importing a JAX-free submodule such as
`meshserve.models.parallel.layout_spec` (the worker reads its pools.yaml with it before JAX starts) must not
import the pipelines and JAX with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EMBEDDED": "meshserve.models.registry",
    "GenerationCancelled": "meshserve.models.registry",
    "ModelFolderError": "meshserve.models.registry",
    "PipelineError": "meshserve.models.registry",
    "load_pipeline": "meshserve.models.registry",
}
__all__ = ["load_pipeline", "GenerationCancelled", "PipelineError", "ModelFolderError", "EMBEDDED"]

if TYPE_CHECKING:
    from meshserve.models.registry import (
        EMBEDDED,
        GenerationCancelled,
        ModelFolderError,
        PipelineError,
        load_pipeline,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
