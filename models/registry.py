"""`load_pipeline`: a diffusers-format folder (or the embedded default model) -> a ready JAX pipeline.

The family comes from `model_index.json`'s `_class_name`; adding a family is one more entry in `_FAMILIES` and
one more folder (docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.engine.common import GenerationCancelled, PipelineError, PipelineOutput
from meshserve.models.engine.pipeline import DiffusionPipeline

# diffusers pipeline class -> (family, module, class)
_FAMILIES = {
    "StableDiffusionXLPipeline": ("sdxl", "meshserve.models.sdxl.pipeline", "StableDiffusionXLPipeline"),
    # An inpainting checkpoint's folder (a 9-channel UNet) names its diffusers pipeline; the one pipeline class
    # serves it (tasks: inpaint only), as it serves the img2img and inpaint tasks of a text-to-image folder.
    "StableDiffusionXLInpaintPipeline": (
        "sdxl",
        "meshserve.models.sdxl.pipeline",
        "StableDiffusionXLPipeline",
    ),
    "StableDiffusionXLImg2ImgPipeline": (
        "sdxl",
        "meshserve.models.sdxl.pipeline",
        "StableDiffusionXLPipeline",
    ),
    "StableDiffusionXLControlNetPipeline": (
        "sdxl",
        "meshserve.models.sdxl.pipeline_controlnet",
        "StableDiffusionXLControlNetPipeline",
    ),
    # diffusers' ControlNet img2img and inpaint pipelines: the same folder, the tasks of one class.
    "StableDiffusionXLControlNetImg2ImgPipeline": (
        "sdxl",
        "meshserve.models.sdxl.pipeline_controlnet",
        "StableDiffusionXLControlNetPipeline",
    ),
    "StableDiffusionXLControlNetInpaintPipeline": (
        "sdxl",
        "meshserve.models.sdxl.pipeline_controlnet",
        "StableDiffusionXLControlNetPipeline",
    ),
    "FluxPipeline": ("flux", "meshserve.models.flux.pipeline", "FluxPipeline"),
    "FluxImg2ImgPipeline": ("flux", "meshserve.models.flux.pipeline", "FluxPipeline"),
    "FluxInpaintPipeline": ("flux", "meshserve.models.flux.pipeline", "FluxPipeline"),
    "FluxKontextPipeline": ("flux", "meshserve.models.flux.pipeline_kontext", "FluxKontextPipeline"),
    "FluxFillPipeline": ("flux", "meshserve.models.flux.pipeline_fill", "FluxFillPipeline"),
    "FluxControlPipeline": ("flux", "meshserve.models.flux.pipeline_control", "FluxControlPipeline"),
    "FluxControlImg2ImgPipeline": ("flux", "meshserve.models.flux.pipeline_control", "FluxControlPipeline"),
    "FluxControlInpaintPipeline": ("flux", "meshserve.models.flux.pipeline_control", "FluxControlPipeline"),
    "WanPipeline": ("wan", "meshserve.models.wan.pipeline", "WanPipeline"),
    "WanImageToVideoPipeline": ("wan", "meshserve.models.wan.pipeline_i2v", "WanImageToVideoPipeline"),
}
# Wan 2.2's TI2V-5B folders (model_index.json's expand_timesteps) are diffusers' WanPipeline and
# WanImageToVideoPipeline at once: one pipeline takes both tasks.
_TI2V = ("wan", "meshserve.models.wan.pipeline_ti2v", "WanTI2VPipeline")
# The VAE decodes in either (fp16 overflows SDXL's VAE: diffusers upcasts it).
_VAE_DTYPES = ("float32", "fp32", "bfloat16", "bf16")
_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
}
EMBEDDED = "embedded:tiny-sdxl"
# The embedded tiny models (made deterministically on first use, no download), by the model id each serves
# as: `load_pipeline` takes the id itself or "embedded:<id>" (a folder of that name wins over the bare id).
EMBEDDED_MODELS = {
    "tiny-sdxl": ("meshserve.models.sdxl.embedded", "embedded_model_path"),
    "tiny-flux": ("meshserve.models.flux.embedded", "embedded_model_path"),
    "tiny-wan": ("meshserve.models.wan.embedded", "embedded_model_path"),
}


def embedded_model_id(path: str | Path | None) -> str | None:
    """The embedded model `path` names (None is the default tiny SDXL), or None when it names a folder."""
    if path is None:
        return "tiny-sdxl"
    name = str(path)
    if name.startswith("embedded:") and name.removeprefix("embedded:") in EMBEDDED_MODELS:
        return name.removeprefix("embedded:")
    if name in EMBEDDED_MODELS and not Path(name).expanduser().exists():
        return name
    return None


class ModelFolderError(PipelineError):
    """The path is missing, is not a diffusers folder, or holds a family we do not serve."""


def detect_family(path: Path) -> str:
    path = Path(path)
    if not path.exists():
        raise ModelFolderError(f"model folder {path} does not exist")
    if not (path / "model_index.json").is_file():
        raise ModelFolderError(f"{path} is not a diffusers model folder (no model_index.json)")
    class_name = read_json(path / "model_index.json").get("_class_name")
    if class_name not in _FAMILIES:
        raise ModelFolderError(
            f"{path}: unsupported pipeline {class_name!r}; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[class_name][0]


def load_pipeline(
    path: str | Path | None = None,
    *,
    dtype="float32",
    vae_dtype: str | None = None,
    mesh: dict | None = None,
    devices=None,
    attention=None,
    weights: dict | None = None,
    max_programs: int | None = None,
    revision: str | None = None,
    variant: str | None = None,
    max_loras: int = 4,
    max_lora_rank: int = 64,
    lora_budget_mb: float = 512.0,
    lora_targets: str | None = None,
    lora_convs: bool = False,
    quantize: str | None = None,
    fp8_activations: bool | None = None,
    scan_blocks: bool = True,
    xla_options: dict | None = None,
):
    """Loads a pipeline from a diffusers folder or a Hugging Face Hub id (`owner/name[@revision]`, fetched
    into the Hub cache by models/checkpoints/hub.py; `revision` and `variant`, e.g. "fp16", pick what is fetched); None
    (or "embedded:tiny-sdxl") is the embedded default model, "tiny-flux" (or "embedded:tiny-flux") the
    embedded tiny Flux, "tiny-wan" the embedded tiny Wan.

    `mesh` (sizes for data/cfg/context/tensor) and `devices` place the pipeline on a device slice;
    `attention` (AttentionSettings or a dict of its fields) picks the kernel and context strategy;
    `weights` (e.g. {"shard_over": ["data", "context"]}) says which mesh axes shard the weights besides tensor;
    `max_programs` bounds the compiled programs kept (least recently used dropped; None: keep all).
    `vae_dtype` ("float32" | "bfloat16"; None: the family's default, docs/outputs.md) is the VAE's dtype.
    `max_loras` (adapters per row), `max_lora_rank` and `lora_budget_mb` (the adapter table's bytes on the
    devices) size the pool's LoRA table, `lora_targets` (a regex over diffusers' module names) narrows the layers
    it holds, `lora_convs` adds the denoiser's 2-D convolutions to them (LoCon files, LCM-LoRA; docs/lora.md).
    `quantize`: "int8" or "fp8" stores the denoiser's Linear kernels as int8 or e4m3 with per-channel scales
    (models/components/quantize.py), "none" or None keeps them in `dtype`; fp8 quantizes the activations too
    where the devices have fp8 dots (GPUs of compute capability 8.9+) and is weight-only elsewhere;
    `fp8_activations` True quantizes them on any backend (the dot then runs upcast where there are no fp8
    dots), False never.
    `scan_blocks`: the DiTs' and T5's repeated blocks run under one lax.scan (compiled once; False: unrolled,
    models/components/block_stack.py).
    `xla_options` (XLA's option names and values, e.g. {"xla_gpu_enable_latency_hiding_scheduler": True}) go to
    every program the pipeline compiles; checked here, so a wrong name or value fails the load with XLA's reason.
    """
    import importlib

    if isinstance(attention, dict):  # from a pool config: kernel, context_strategy, block sizes...
        from meshserve.models.attention import AttentionSettings

        attention = AttentionSettings(**attention)
    model_id = embedded_model_id(path)
    if model_id is not None:
        module_name, func_name = EMBEDDED_MODELS[model_id]
        path = getattr(importlib.import_module(module_name), func_name)()
    else:
        from meshserve.models.checkpoints.hub import resolve_model_path

        path = resolve_model_path(path, revision=revision, variant=variant)
    path = Path(path).expanduser()
    detect_family(path)
    index = read_json(path / "model_index.json")
    family = _FAMILIES[index["_class_name"]]
    if family[0] == "wan" and index.get("expand_timesteps"):
        family = _TI2V
    _, module_name, cls_name = family
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise PipelineError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    from meshserve.models.components.quantize import QuantizeError, activation_mode, check_mode

    try:  # before anything is read: an unknown mode fails at once, with the reason
        activation_mode(check_mode(quantize), fp8_activations, devices=[])
    except QuantizeError as e:
        raise PipelineError(str(e)) from None
    from meshserve.models.engine.programs import check_compiler_options

    try:
        check_compiler_options(xla_options)
    except ValueError as e:
        raise PipelineError(str(e)) from None
    cls = getattr(importlib.import_module(module_name), cls_name)
    kwargs = {
        "max_programs": max_programs,
        "max_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        "lora_budget_mb": lora_budget_mb,
        "lora_targets": lora_targets,
        "lora_convs": lora_convs,
        "quantize": quantize,
        "fp8_activations": fp8_activations,
        "scan_blocks": scan_blocks,
        "xla_options": xla_options,
    }
    if vae_dtype is not None:
        if vae_dtype not in _VAE_DTYPES:
            raise PipelineError(f"vae_dtype must be one of {', '.join(_VAE_DTYPES)}, got {vae_dtype!r}")
        kwargs["vae_dtype"] = _DTYPES[vae_dtype]
    if mesh is not None or devices is not None or weights is not None:
        from meshserve.models.parallel.placement import pipeline_placement

        kwargs.update(pipeline_placement(mesh or {}, devices, attention=attention, weights=weights))
    elif attention is not None:
        kwargs["attention"] = attention
    try:
        return cls(path, dtype=dtype, model_id=model_id, **kwargs)
    except CheckpointError as e:
        raise ModelFolderError(str(e)) from None


__all__ = [
    "load_pipeline",
    "detect_family",
    "PipelineError",
    "ModelFolderError",
    "GenerationCancelled",
    "PipelineOutput",
    "DiffusionPipeline",
    "EMBEDDED",
    "EMBEDDED_MODELS",
    "embedded_model_id",
]
