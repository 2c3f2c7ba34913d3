"""meshserve's models: pure JAX/Flax NNX diffusion pipelines, checked against diffusers."""

from meshserve.models.pipelines import (
    EMBEDDED,
    GenerationCancelled,
    ModelFolderError,
    PipelineError,
    load_pipeline,
)

__all__ = ["load_pipeline", "GenerationCancelled", "PipelineError", "ModelFolderError", "EMBEDDED"]
