"""The pipeline, written once: the contract the serving side reads, and the one `__call__` every family runs.

What the serving side reads (workers/runner.py relies on nothing else):

    family, task                     "sdxl", "text-to-image" ("text-to-video" adds frames)
    defaults                         {"width", "height", "num_inference_steps", "guidance_scale", ...}
    limits                           meshserve/limits.py's fields (sizes, steps, max_n, schedulers, output_formats;
                                     video: frames; a text length: max_sequence_length)
    row_fields                       the per-row numbers of __call__ (guidance_scale; Flux adds true_cfg_scale):
                                     one value, one per prompt or one per output row
    second_prompt                    whether __call__ takes prompt_2 / negative_prompt_2 (per prompt, like the
                                     prompts: the second text encoder's texts; SDXL, Flux)
    text_fields                      per-prompt integers __call__ takes for the text encoders (SDXL: clip_skip)
    image_fields                     image arguments besides image= and mask_image= (Wan FLF2V: last_image);
    condition_fields                 those of them that condition every task (FLUX.1 Control: control_image)
    pair_fields                      per-row pairs __call__ takes for the denoiser (SDXL: the micro-conditioning)
    schedule_fields                  diffusers' custom schedules and scheduler arguments __call__ takes (SDXL:
                                     timesteps, sigmas, DDIM's eta; Flux: sigmas); limits["scheduler_arguments"]
                                     says which schedulers take each
    batch_fields                     the per-batch keyword arguments (size, steps, scheduler; frames, text length)
    batch_key(request) -> tuple      what must match for two jobs to share a batch (request: a plain mapping)
    compiled_batch_size(rows, data)  images pad to powers of two (few programs); video compiles exact sizes
    warm_up(buckets, batch_sizes,    compile every program those shapes need, with and without CFG
            num_frames=)
    __call__(prompt, negative_prompt=, seed=, num_images_per_prompt=, latents=, output_type=, callback=,
             callback_on_step_end=, return_dict=, **row_fields, **batch_fields) -> PipelineOutput (`images`;
             video: also `frames`); callback_on_step_end is diffusers' (step_end.py)
    compilations                     programs compiled so far (each also logged with its shapes and seconds)
    tasks                            what inputs it takes: ("text-to-image",), with image inputs also
                                     "image-to-image", "inpaint" (video: "text-to-video", "image-to-video");
                                     also limits["tasks"], and limits["strength"] ({min (exclusive), max,
                                     defaults: {task: strength}}) when a task takes a strength

Image inputs (docs/image-inputs.md; models/engine/image_inputs.py): __call__ also takes `image=`,
`mask_image=` (PIL images or numpy [H, W, 3] / [H, W], uint8 or floats in [0, 1]; one for all, one per prompt
or one per output row), `strength=` (one number per call: a batch field, in batch_key with the task) and, for
inpaint, `padding_mask_crop=` (models/components/mask_crop.py: the mask's region only, laid back into the image,
whose size the output then has). The task follows from them: no image -> text-to-image; image ->
image-to-image (or image-to-video); image and mask -> inpaint. Images are resized to the call's height x width (default: the model's default size, as text-to-
image) by models/components/image_processor.py (diffusers' VaeImageProcessor). A fourth program,
image_encode, runs the family's `encode_image` (the VAE posterior's mode, scaled, in the loop's layout)
and builds the dict the denoise program takes (image_latents, mask, condition: image_inputs.py). The loop then
starts at step `start_step(steps, strength)` (a traced value) from the image noised to that step with the
noise of each row's seed, or with `latents=` as that noise (not as the starting latents). Strength and the
images never compile; a task does (its programs' inputs differ).

What a family declares (class attributes) and implements (its stages); everything else is here:

    denoiser_name                    the module the denoise program takes ("unet", "transformer")
    cfg_field, cfg_needs_negative    the row field that scales CFG, and whether a row needs a negative prompt
                                     for it (Flux's true CFG); a row runs CFG when that scale is > 1 (and
                                     `guided_by_cfg`: an LCM UNet takes its guidance as an input instead)
    rescale_field                    a row field that rescales the CFG combine (SDXL's guidance_rescale), or None
    row_field_fallbacks              row fields that, left out or None, take another's values (Wan 2.2's
                                     guidance_scale_2: guidance_scale's); step_guidance(rows) (traced) the
                                     loop's CFG scales, or a function of the timestep (two experts);
                                     step_rows(rows, start, calls) (host) per-row values that depend on
                                     the steps the call runs (a ControlNet's window of steps)
    generator_in_steps               diffusers' pipeline hands its `generator` to the scheduler's step (SDXL):
                                     a `generator=` call replays those draws too (torch_generator.py)
    latents_axes, latents_layout     the loop's latents -> diffusers' layout (`latents=`, output "latent")
    load(folder) -> modules          read the weights (`load_module`), by name: text encoders, denoiser, "vae"
    tokenize(texts, settings)        host: token arrays [T, L] for the text encoders
    encode_prompt(states, *tokens)   traced: the conditioning (a pytree of [T, ...]), one row per text
    noise_shape(settings)            a row's initial noise, channels-last; `pack` (traced) makes it the loop's
                                     latents (Flux: 2x2 patches), `prepare_latents` scales it
    denoiser(state, cond, rows,      traced: model(x, t, i) for the loop, closing over the conditioning, the
             extras, shape=, do_cfg=) per-row fields and the extras (`denoise_extras`: RoPE tables...)
    decode(vae_state, latents,       traced: the VAE -> [B, (F,) H, W, 3] in [0, 1]
           shape=)
    optional: make_scheduler(name), schedule_options(scheduler, shape), denoise_extras(shape, text_len)

    image inputs (optional): tasks, default_strength(task), strength_rule ("int": SDXL, "float": Flux;
    image_inputs.start_step), encode_image(vae_state, pixels, shape=, task=) (traced: [B, H, W, 3] in [-1, 1] ->
    latents in the loop's layout), latent_mask(mask, shape=) ([B, H, W, 1] -> the loop's layout; traced, and on
    the host for latents given as image=, where a denoising_split family's must take numpy too),
    inpaint_condition (True: a 9-channel UNet takes [mask, masked image latents] as a condition), image_inputs
    (traced, the whole image_encode stage; override it for another kind, e.g. image-to-video's condition),
    pure_noise_tasks (SDXL: ("inpaint",): strength 1 starts from noise x init sigma, not the noised image),
    denoising_split (SDXL: diffusers' denoising_end / denoising_start, models/engine/denoising_split.py).
    A family whose denoiser needs the image inputs (image-to-video) gets them as `denoiser(..., image=inputs)`;
    the keyword is passed only when a call has image inputs. image_encode_states (the states image_inputs
    takes: the VAE's, image-to-video adds its image encoder's), preprocess_images may return a pytree of
    pixel arrays (image-to-video: the VAE's and CLIP's), warm_up_inputs(width, height) (the image a model
    that requires one warms up with).

Three compiled programs run a call: text_encode (prompts and, with CFG, negatives; repeated per image and
CFG-interleaved; a LoRA variant when a row's adapters adapt the text encoders: docs/lora.md), denoise
(initial noise from each row's seed, then the one loop of `denoise_loop.py`), vae_decode. Everything that
varies per request (prompt tokens, seeds, per-row fields, the schedule's arrays, the step count, adapters
and their scales) is a traced input, so only a new shape, scheduler or CFG on/off compiles. Errors in a request
raise `PipelineError` (limits: meshserve/limits.py, the check the API and the pools run too); anything else
raised is an engine fault.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.limits import (
    DEFAULT_SCHEDULER,
    IMAGE_FORMATS,
    LimitError,
    check_request,
    check_scheduler_arguments,
)
from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.block_stack import stack_blocks
from meshserve.models.components.image_processor import (
    image_rows,
    image_size,
    preprocess_image,
    preprocess_mask,
)
from meshserve.models.components.layers import place_small_maps
from meshserve.models.components.mask_crop import MaskCrops
from meshserve.models.components.quantize import activation_mode, load_quantized, quantized_rules
from meshserve.models.components.quantize import check_mode as check_quantize
from meshserve.models.engine.common import (
    GenerationCancelled,
    PipelineError,
    PipelineOutput,
    UnsupportedArgument,
    lora_scale,
    per_prompt,
    per_prompt_ints,
    second_texts,
    to_list,
    to_pil,
)
from meshserve.models.engine.denoise_loop import StepReporter, denoise_loop, interleave
from meshserve.models.engine.denoising_split import check_order, end_steps, start_step
from meshserve.models.engine.image_inputs import blend_known, check_scheduler, check_strength, noise_to
from meshserve.models.engine.previews import LatentPreviews, PreviewCallback
from meshserve.models.engine.programs import CompiledPrograms, compiler_options
from meshserve.models.engine.prompt_embeds import GivenEmbeds
from meshserve.models.engine.seeds import initial_noise, key_data, per_row, per_row_pairs, row_keys, row_seeds
from meshserve.models.engine.step_cache import CacheSlot, parse_cache
from meshserve.models.engine.step_end import StepEndHook, check_step_end
from meshserve.models.engine.torch_generator import draw_noise, generator_seeds
from meshserve.models.lora.apply import adapters_from
from meshserve.models.lora.apply import bind as lora_bind
from meshserve.models.lora.pool import ZERO_SCALES, AdapterPool
from meshserve.models.parallel.placement import Placement, gathered, gathered_blocks, gathered_per_step
from meshserve.models.schedulers import SCHEDULER_NAMES, make_scheduler, pad_schedule

log = logging.getLogger(__name__)

# Every schedule is padded to this many steps, so the step count is a traced value and never compiles.
MAX_STEPS = 200
MAX_IMAGES = 8
# "uint8": the frames as uint8 [B, (F,) H, W, 3], converted on the device at the end of the decode program
# (what the worker encodes): a quarter of float32's bytes to move to the host (an 81-frame 480p video:
# 97 MB instead of 388 MB; docs/outputs.md).
OUTPUT_TYPES = ("pil", "np", "uint8", "latent")
# The keyword arguments every family's __call__ names; a family's other row and batch fields come in **options.
_COMMON_ARGUMENTS = {"height", "width", "num_inference_steps", "scheduler", "guidance_scale"}


# A model folder may carry the settings it was made to be served with (the embedded model's training writes
# them): {"defaults": {"num_inference_steps": 20, "guidance_scale": 5.0}}. diffusers ignores the file.
SERVING_DEFAULTS_FILE = "meshserve.json"
_FOLDER_DEFAULT_TYPES = {
    "num_inference_steps": int,
    "guidance_scale": float,
    "width": int,
    "height": int,
    "max_sequence_length": int,  # a text encoder trained at this length (Flux attends every pad token)
    "num_frames": int,
}


def folder_serving_defaults(folder) -> dict:
    """The `defaults` of a model folder's meshserve.json ({} without one); PipelineError on a malformed one."""
    path = Path(folder) / SERVING_DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        defaults = read_json(path).get("defaults", {})
        return {
            name: _FOLDER_DEFAULT_TYPES[name](value)
            for name, value in defaults.items()
            if name in _FOLDER_DEFAULT_TYPES and not isinstance(value, bool)
        }
    except (ValueError, TypeError, AttributeError) as e:
        raise PipelineError(f"{path}: malformed serving defaults ({e})") from e


def batch_bucket(rows: int, data: int = 1) -> int:
    """The next power of two >= rows, and a multiple of the mesh's data axis."""
    size = 1 << max(rows - 1, 0).bit_length()
    return -(-size // data) * data


def repeat_rows(x, n: int, prompts: int):
    """Repeats each prompt's rows n times (prompt-major, as diffusers does); negatives follow the prompts."""
    if n == 1:
        return x
    return jnp.repeat(x.reshape(-1, prompts, *x.shape[1:]), n, axis=1).reshape(-1, *x.shape[1:])


def positive_without_cfg(model: Callable, cfg_rows) -> Callable:
    """The model with each CFG-off row's negative prediction replaced by its positive one: the combine
    neg + s * (pos - neg) then returns the positive prediction exactly, what that row alone (no CFG) computes."""

    def guided(x, t, i):
        out = model(x, t, i)
        pairs = out.reshape(-1, 2, *out.shape[1:])
        keep = cfg_rows.reshape(-1, *([1] * (out.ndim - 1)))
        return interleave(jnp.where(keep, pairs[:, 0], pairs[:, 1]), pairs[:, 1])

    return guided


def with_condition(model: Callable, condition, do_cfg: bool) -> Callable:
    """The model with `condition` [B, ...] concatenated after x on the last (channel) axis of every input
    (a 9-channel inpainting UNet's mask and masked image; image-to-video's image), CFG-interleaved like x."""
    if do_cfg:
        condition = interleave(condition, condition)

    def conditioned(x, t, i):
        return model(jnp.concatenate([x, condition.astype(x.dtype)], axis=-1), t, i)

    return conditioned


class DiffusionPipeline:
    """Base of every family's pipeline (module docstring: what a family declares and implements)."""

    family: str = ""
    task: str = "text-to-image"
    row_fields: tuple[str, ...] = ("guidance_scale",)
    batch_fields: tuple[str, ...] = ("width", "height", "num_inference_steps", "scheduler")
    cfg_field: str = "guidance_scale"
    cfg_needs_negative: bool = False
    # A row field applied to the CFG combine of the rows that run CFG (denoise_loop.guide): diffusers'
    # guidance_rescale on SDXL. Per-row data, so any value runs the program every other value runs.
    rescale_field: str | None = None
    # Row fields that, left out, take another row field's values (Wan 2.2's guidance_scale_2: guidance_scale's, as
    # diffusers' WanPipeline does).
    row_field_fallbacks: Mapping[str, str] = {}
    # Step cache methods (models/engine/step_cache.py) -> their default thresholds; a family whose denoiser
    # routes its blocks through step_cache.after_first_block declares "first_block", through before_blocks
    # "teacache".
    cache_methods: Mapping[str, float] = {}
    # The family's second text encoder takes texts of its own: diffusers' prompt_2 / negative_prompt_2 (SDXL's
    # OpenCLIP-G, Flux's T5), each defaulting to the first encoder's text. `tokenize` then gets `texts_2`.
    second_prompt: bool = False
    # What `encode_prompt` makes, in diffusers' argument names (its pytree's leaves, in order): a call may give
    # them instead of texts, with `negative_` ones for the negatives (models/engine/prompt_embeds.py).
    embeds_names: tuple[str, ...] = ()
    # Tasks whose diffusers pipeline takes the image's own size when a call names none (SDXL's img2img has no
    # height/width arguments); the others default to the model's size, as text-to-image.
    image_sized_tasks: tuple[str, ...] = ()
    # diffusers' custom schedules the family's pipeline takes as call arguments (SDXL: timesteps and sigmas;
    # Flux: sigmas), each with the schedulers that take it (limits["scheduler_arguments"]); they give the step
    # count. Host arrays padded as any schedule: no program is compiled for them. Also a scheduler's traced
    # step argument, DDIM's eta (SDXL), carried in the schedule the same way.
    schedule_fields: tuple[str, ...] = ()
    # Per-prompt integers the family's text encoding reads (SDXL: diffusers' clip_skip): `tokenize` gets each as
    # a keyword argument, one value per text (None for the negatives' and where a prompt gave none), and returns
    # it as a token array, so it is a traced input and part of the prompt cache's keys.
    text_fields: tuple[str, ...] = ()
    # Per-row pairs of numbers (SDXL's micro-conditioning: original_size, crops_coords_top_left, target_size and
    # their negatives): one pair, one per prompt or one per row, None where a row gives none. `pair_rows` turns
    # them into the denoiser's per-row inputs (rows [B, k]), traced like the row fields.
    pair_fields: tuple[str, ...] = ()
    # Image arguments besides `image` and `mask_image` (Wan first-last-frame-to-video: last_image), one for all,
    # one per prompt or one per row like `image`; handed to `preprocess_images` as keywords (None: not given).
    image_fields: tuple[str, ...] = ()
    # Image arguments that condition every task, so that a call with one and no `image=` still runs the
    # image_encode program (FLUX.1 Canny/Depth: control_image); a subset of image_fields.
    condition_fields: tuple[str, ...] = ()
    # The condition images go through the VAE (diffusers samples their posterior with a call's generator, which
    # `generator=` cannot replay); False where a control image is read as pixels (an SDXL ControlNet).
    conditions_encoded: bool = True
    # diffusers' `denoising_end` and `denoising_start` (SDXL; models/engine/denoising_split.py): a call stops
    # before the schedule's end, leaving the last steps to another model (the refiner), whose image-to-image
    # call then takes those latents as `image=` and starts where the first stopped, without adding noise. The
    # start and stop are traced inputs of the loop, so no value compiles; a call's values are its batch's.
    denoising_split: bool = False
    # Negative rows of a prompt given none are zeros, not the empty text's embedding (SDXL's
    # force_zeros_for_empty_prompt).
    zeros_for_empty_negative: bool = False
    denoiser_name: str = "transformer"
    # The scheduler classes a folder's scheduler_config.json may name (None: any this package implements).
    scheduler_classes: tuple[str, ...] | None = None
    latents_axes: tuple[int, ...] | None = None  # None: the loop's layout is diffusers'
    # Whether diffusers' pipeline passes its generator to the scheduler's step (SDXL's does; Flux's and Wan's
    # stochastic steps draw from torch's global generator): a `generator=` call then replays those draws too.
    generator_in_steps: bool = False
    latents_layout: str = ""
    default_output_type: str = "pil"
    # Images: pad a batch to a power of two, which bounds a pool to log2(max_batch) + 1 programs per bucket.
    # A padded row is not free: on the tiny SDXL (CPU, 64x48, CFG, 4 steps, median of 5) batch 1 -> 2 took
    # denoise 133 -> 265 ms and decode 14 -> 27 ms, so a padded row costs ~a real row. Cheap for images;
    # for video that would be a whole extra video, so video families set False and compile the exact
    # batch sizes their pool warms up.
    pads_batches: bool = True
    # Image inputs (module docstring): how a strength picks the start step, and inpainting's two kinds.
    strength_rule: str = "int"
    inpaint_condition: bool = False
    pure_noise_tasks: tuple[str, ...] = ()
    scheduler_config: Mapping
    placement: Placement | None = None
    model_id: str = ""
    # An LRU of text-encoder outputs (models/engine/prompt_cache.py) when set; a serving pool sets one.
    prompt_cache = None
    # diffusers' interrupt flag: a callback_on_step_end sets it to end the loop (models/engine/step_end.py).
    _interrupt: bool = False
    # The name of the family's diffusers pipelines' per-call attention kwargs, whose "scale" scales the LoRA
    # adapters (common.lora_scale); None: the family takes none.
    attention_kwargs_name: str | None = None
    # The text encoders a LoRA file may adapt (their Linears join the adapter table; docs/lora.md): the
    # family's CLIP encoders. Others' keys (T5, umT5) are refused at registration.
    lora_text_encoders: tuple[str, ...] = ()
    # XLA options this family's programs compile with on GPUs, under the pool's own `xla_options` (which win).
    gpu_xla_options: Mapping[str, bool | int | float | str] = {}

    def __init__(
        self,
        folder: Path | None = None,
        *,
        dtype=jnp.float32,
        vae_dtype=None,
        model_id: str | None = None,
        attention=None,
        placement: Placement | None = None,
        max_programs: int | None = None,
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
        # The DiTs' and T5's repeated blocks stacked and run under a lax.scan (models/components/block_stack.py):
        # a program compiles one block instead of each. False keeps them unrolled (to compare).
        self.scan_blocks = bool(scan_blocks)
        # int8 or fp8 kernels for the denoiser's Linear layers (models/components/quantize.py), or None; with
        # fp8, the activations too where the devices have fp8 dots (or when asked: the same numbers upcast).
        self.quantize = check_quantize(quantize)
        devices = list(placement.mesh.devices.flat) if placement is not None else jax.devices()[:1]
        # XLA options for every program this pipeline compiles: the family's on GPUs, then the pool's
        # `xla_options` (load_pipeline checks them).
        options = compiler_options(self.gpu_xla_options, devices[0].platform, xla_options)
        self.programs = CompiledPrograms(type(self).__name__, max_programs, options)
        self.activation_quantization = activation_mode(self.quantize, fp8_activations, devices)
        if self.quantize == "fp8":
            rows = self.activation_quantization
            log.info("quantize fp8: %s", f"activations too ({rows})" if rows else "weight-only (no fp8 dots)")
        # LoRA adapters per request (docs/lora.md): a fixed-shape table on the pool's devices, made on first load.
        self.lora = AdapterPool(
            self,
            max_per_request=max_loras,
            max_rank=max_lora_rank,
            budget_mb=lora_budget_mb,
            targets=lora_targets,
            convs=lora_convs,
        )
        self.step_reporter = StepReporter()
        self.step_end = StepEndHook(self.latents_axes)  # diffusers' callback_on_step_end: step_end.py
        # The VAE's dtype when the pool sets one (float32 | bfloat16), else the family's default (vae_dtype_for).
        self.vae_dtype_override = None if vae_dtype is None else jnp.dtype(vae_dtype)
        self.previews = LatentPreviews(self)  # live previews: models/engine/previews.py
        self._schedulers: dict[str | None, object] = {}
        self._schedules = lru_cache(maxsize=256)(self._make_schedule)
        self._extras = lru_cache(maxsize=64)(self.denoise_extras)
        if folder is None:  # a stand-in with no weights (the serving side's tests)
            return
        from meshserve.models.attention import AttentionSettings

        folder = Path(folder)
        self.folder, self.model_id, self.dtype = folder, model_id or folder.name, jnp.dtype(dtype)
        # Only the denoiser (nearly all the FLOPs) runs attention on the mesh; the text encoders and the VAE
        # run plain kernels, their batch split by whatever sharding it carries, their weights placed by
        # their own rules tables.
        self.attention = attention or AttentionSettings()
        self.plain_attention = dataclasses.replace(self.attention, mesh=None)
        self.placement = placement
        self.scheduler_config = read_json(folder / "scheduler" / "scheduler_config.json")
        indexed = scheduler_class_in_index(folder)
        if indexed is not None:
            # diffusers' from_pretrained builds the class model_index.json names and reads the config for its
            # settings alone: a folder whose two files disagree runs model_index's scheduler.
            self.scheduler_config = {**self.scheduler_config, "_class_name": indexed}
        name = self.scheduler_config.get("_class_name")
        if self.scheduler_classes is not None and name not in self.scheduler_classes:
            raise CheckpointError(
                f"{folder / 'scheduler'}: a {type(self).__name__} needs one of {list(self.scheduler_classes)}, "
                f"got {name!r}"
            )
        self._rules: dict[str, object] = {}
        self.split_modules(self.load(folder))
        self.scheduler(None)  # fail at load time on an unsupported default scheduler

    # ---------------------------------------------------------------------------------------------
    # Loading

    def load(self, folder: Path) -> dict:
        """The family's modules by name (text encoders, `denoiser_name`, "vae"), each from `load_module`."""
        raise NotImplementedError

    def load_module(self, loader: Callable, path: Path, rules, *, dtype=None, attention=None):
        """One module of the folder onto the pool's devices, split by its sharding rules (kept for `merged`
        under the folder's name), in the pipeline's dtype unless given; `attention`: the settings of a
        loader that takes them."""
        quantized = self.quantize is not None and Path(path).name == self.denoiser_name
        rules = quantized_rules(rules) if quantized else rules
        self._rules[Path(path).name] = rules
        place = self.placement.placer(rules) if self.placement else None
        kwargs = {} if attention is None else {"settings": attention}
        if quantized:
            loader = partial(
                load_quantized, loader, mode=self.quantize, activations=self.activation_quantization
            )
        return loader(path, dtype=self.dtype if dtype is None else dtype, place=place, **kwargs)

    def validate_heads(self, heads: set[int]) -> None:
        if self.placement:
            self.placement.validate_heads(heads, self.attention.context_strategy)

    def split_modules(self, modules: Mapping[str, object]) -> None:
        """Split each loaded module into graph + state once (`self._graphs`, `self._states`, by name): the
        compiled programs take the state as an argument and merge inside, so no Python walks a module tree per
        call (nnx.jit would, every call)."""
        from flax import nnx

        self._graphs, self._states = {}, {}
        for name, module in modules.items():
            if self.scan_blocks:
                stack_blocks(module)
            if self.placement:  # convs of maps too small to split over context keep them whole
                place_small_maps(module, self.placement.mesh)
            self._graphs[name], self._states[name] = nnx.split(module)
        self._text_states = {k: v for k, v in self._states.items() if k not in (self.denoiser_name, "vae")}

    def merged(self, name: str, state):
        """The module `name` from its state, inside a program; weights split over shard_over are gathered
        where used (placement.gather_weights says why)."""
        from flax import nnx

        rules = self._rules.get(name)
        module = gathered_blocks(
            self.placement, nnx.merge(self._graphs[name], gathered(self.placement, state, rules)), rules
        )
        # In the text_encode program with text-encoder adapters, the encoder's Linears find theirs by
        # "<name>.<module>" (models/lora/apply.py); elsewhere this does nothing.
        return lora_bind(module, prefix=f"{name}.")

    def merged_per_step(self, state, x):
        """The denoiser inside the loop body, and x: FSDP-split weights are gathered per step, tied to this
        step's x so XLA cannot hoist the gathers out of the loop (which keeps the whole denoiser gathered:
        docs/weights.md)."""
        from flax import nnx

        name = self.denoiser_name
        rules = self._rules.get(name)
        state, x = gathered_per_step(self.placement, state, x, rules)
        return lora_bind(gathered_blocks(self.placement, nnx.merge(self._graphs[name], state), rules)), x

    # ---------------------------------------------------------------------------------------------
    # LoRA adapters (docs/lora.md; models/lora/): registered once, then picked per row by name

    def load_lora(self, name: str, source) -> dict:
        """Registers an adapter (a .safetensors file or folder, or a Hub id) under `name` onto the pool's
        devices, evicting the least recently used one when the table is full -> {name, rank, targets, bytes}."""
        return self.lora.load(name, source)

    def unload_lora(self, name: str) -> None:
        self.lora.unload(name)

    @property
    def loras(self) -> list[str]:
        """The registered adapters, least recently used first."""
        return self.lora.names

    # ---------------------------------------------------------------------------------------------
    # The stages a family implements (module docstring)

    @property
    def defaults(self) -> dict:
        raise NotImplementedError

    @property
    def limits(self) -> dict:
        raise NotImplementedError

    def tokenize(
        self, texts: list[str], settings: dict, texts_2: list[str] | None = None
    ) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def pair_rows(
        self, pairs: dict[str, list], settings: dict, task: str, rows: dict
    ) -> dict[str, np.ndarray]:
        """Host: the `pair_fields`' per-row pairs (None: not given) -> the denoiser's per-row inputs [B, k];
        `rows`: the row fields' per-row values, should the inputs take some."""
        raise NotImplementedError

    def encode_prompt(self, states, *tokens):
        raise NotImplementedError

    def noise_shape(self, settings: dict) -> tuple[int, ...]:
        raise NotImplementedError

    def pack(self, noise):
        return noise

    def denoiser(self, state, cond, rows, extras, *, shape, do_cfg: bool) -> Callable:
        raise NotImplementedError

    def decode(self, vae_state, latents, *, shape):
        raise NotImplementedError

    def denoise_extras(self, shape: tuple[int, ...], text_len: int | None):
        """Inputs of the denoise program fixed by the shape (RoPE tables), on the devices; cached."""
        return None

    @property
    def tasks(self) -> tuple[str, ...]:
        """The inputs this model takes (module docstring); a family with image inputs adds its tasks."""
        return (self.task,)

    @property
    def guided_by_cfg(self) -> bool:
        """Whether rows with a CFG scale > 1 run classifier-free guidance; False where the denoiser takes the
        scale as an input instead (an LCM-distilled SDXL UNet), as diffusers' pipelines then run no CFG."""
        return True

    def default_strength(self, task: str) -> float | None:
        """A task's strength when a call gives none (diffusers' pipeline default); None: takes no strength."""
        return None

    def scheduler_argument_limits(self, schedulers, max_steps: int = MAX_STEPS) -> dict:
        """limits["scheduler_arguments"]: {scheduler name, DEFAULT_SCHEDULER for the folder's own: the rules of
        the custom schedules it takes of the family's `schedule_fields`} (meshserve/limits.py). A scheduler that
        calls the model more than once a step (Heun, DPM2, DPM2 a, DPM++ SDE: twice; PNDM: once more, 9 more
        with its Runge-Kutta start) gets a "max_steps" whose calls fit the compiled loop's `max_steps` trips."""
        out = {}
        for name in (None, *schedulers):
            try:
                sched = self.scheduler(name)
            except PipelineError:  # a folder scheduler the engine lacks: requests must name one
                continue
            rules = dict(sched.scheduler_arguments())
            if sched.model_calls(max_steps) > max_steps:
                fit = sched.max_steps_within(max_steps)
                rules = {**rules, "max_steps": min(rules.get("max_steps") or fit, fit)}
            fields = ("sigmas", "timesteps", "eta")
            for field in fields:
                rules[field] = bool(rules.get(field)) and field in self.schedule_fields
            if any(rules[field] for field in fields) or any(
                rules.get(bound) is not None for bound in ("max_steps", "min_steps")
            ):
                out[name or DEFAULT_SCHEDULER] = rules
        return out

    def cache_limits(self) -> dict | None:
        """limits["cache"]: {method: {"default_threshold"}}, or None for a model without a step cache."""
        if not self.cache_methods:
            return None
        return {method: {"default_threshold": t} for method, t in self.cache_methods.items()}

    def strength_limits(self) -> dict | None:
        """limits["strength"]: {min (exclusive), max, defaults per task}, or None without such a task."""
        defaults = {t: self.default_strength(t) for t in self.tasks if self.default_strength(t) is not None}
        return {"min": 0.0, "max": 1.0, "defaults": defaults} if defaults else None

    def task_of(self, image, mask_image) -> str:
        """The task a call's inputs ask for; PipelineError when the model does not take it."""
        if image is None:
            if mask_image is not None:
                raise PipelineError("mask_image needs an image to inpaint")
            if self.task not in self.tasks:
                raise PipelineError(
                    f"{self.model_id or self.family} needs an image: it takes {list(self.tasks)}"
                )
            return self.task
        if mask_image is not None:
            task = "inpaint"
        else:
            task = "image-to-video" if "image-to-video" in self.tasks else "image-to-image"
        if task not in self.tasks:
            given = "image and mask_image" if mask_image is not None else "image"
            raise PipelineError(
                f"{self.model_id or self.family} does not take {given} ({task}); it takes {list(self.tasks)}"
            )
        return task

    @property
    def image_encode_states(self):
        """The module states the image_encode program takes (its `image_inputs`' first argument): the VAE's;
        image-to-video also takes its image encoder's (models/wan/pipeline_i2v.py)."""
        return self._states["vae"]

    def warm_up_inputs(self, width: int, height: int) -> dict:
        """Extra arguments of the warm-up calls: none, or the image a model that needs one warms up with."""
        return {}

    def encode_image(self, vae_state, pixels, *, shape, task):
        raise NotImplementedError

    def latent_mask(self, mask, *, shape):
        raise NotImplementedError

    def image_inputs(self, vae_state, pixels, mask, *, shape, task):
        """Traced (the image_encode program): pixels [B, H, W, 3] in [-1, 1], mask [B, H, W, 1] of {0, 1} or
        None -> the denoise program's image inputs (models/engine/image_inputs.py)."""
        inputs = {"image_latents": self.encode_image(vae_state, pixels, shape=shape, task=task)}
        if mask is None:
            return inputs
        latent_mask = self.latent_mask(mask, shape=shape)
        if self.inpaint_condition:  # a 9-channel UNet: [mask, masked image latents] after the latents
            masked = self.encode_image(vae_state, pixels * (mask < 0.5), shape=shape, task=task)
            inputs["condition"] = jnp.concatenate([latent_mask, masked], axis=-1)
        else:  # the base model: the known region is put back after every step
            inputs["mask"] = latent_mask
        return inputs

    def after_step(self, image, scheduler, schedule, noise, stop):
        """Traced: what runs after each scheduler step of a call with image inputs, (latents, i) -> latents, or
        None. 4-channel inpainting puts the known region back (image_inputs.blend_known)."""
        if "mask" not in image:
            return None
        return lambda x, i: blend_known(scheduler, schedule, x, image, noise, i, stop)

    def preprocess_images(self, image, mask_image, prompts: int, n: int, settings: dict):
        """Host: the call's images (and masks) -> [B, H, W, 3] (and [B, H, W, 1]) at the call's size."""
        height, width = settings["height"], settings["width"]
        pixels = image_rows(image, prompts, n, "image", preprocess_image, height, width)
        return pixels, self.preprocess_masks(mask_image, prompts, n, settings)

    def preprocess_masks(self, mask_image, prompts: int, n: int, settings: dict):
        """Host: the call's masks -> [B, H, W, 1] at the call's size, or None without one."""
        if mask_image is None:
            return None
        height, width = settings["height"], settings["width"]
        return image_rows(mask_image, prompts, n, "mask_image", preprocess_mask, height, width)

    def vae_dtype_for(self, default) -> jnp.dtype:
        """The dtype a family loads its VAE in: the pool's `vae_dtype` when set, else `default` (the family's:
        docs/outputs.md has the measured errors behind each)."""
        return self.vae_dtype_override if self.vae_dtype_override is not None else jnp.dtype(default)

    @property
    def latent_dtype(self):
        """The loop's latents: the pipeline dtype (Wan keeps them fp32)."""
        return self.dtype

    def prepare_latents(self, keys, latents, *, shape, sigma):
        """Traced: the loop's starting latents, the given ones or each row's noise drawn from its own key (so
        a seed gives the same output at any batch position and layout), packed, scaled by the schedule's
        initial sigma, in the latent dtype."""
        if latents is None:
            latents = self.pack(initial_noise(keys, shape))
        return (latents * sigma).astype(self.latent_dtype)

    # ---------------------------------------------------------------------------------------------
    # The contract's generic parts

    def batch_key(self, request: Mapping) -> tuple:
        """With image tasks, (task, strength) lead the key: two jobs share a batch (one program, one start
        step) only with equal task and strength. The task is the request's `task`, else it follows from
        whether `image` / `mask_image` are set."""
        d, limits = self.defaults, self.limits
        key = tuple(
            request[name] if request.get(name) is not None else _batch_default(name, d, limits)
            for name in self.batch_fields
        )
        # A custom schedule (and eta) is the batch's: only jobs with the same one share a call.
        for name in self.schedule_fields:
            value = request.get(name)
            if name == "eta" and value == 0:  # diffusers' default: the same as none
                continue
            if value is not None:
                key += ((name, tuple(value) if isinstance(value, Sequence) else value),)
        for name in ("denoising_end", "denoising_start") if self.denoising_split else ():
            if request.get(name) is not None:  # where the batch stops, or starts
                key += ((name, request[name]),)
        # padding_mask_crop: one per call (the outputs take their images' sizes; the worker keys by the image too)
        if request.get("padding_mask_crop") is not None:
            key += (("padding_mask_crop", request["padding_mask_crop"]),)
        if request.get("cache") is not None:  # rows of a batch share the cache's decisions (step_cache.py)
            try:
                cache = parse_cache(request["cache"], self.cache_methods)
                key = (*key, cache.method, cache.threshold)
            except PipelineError:  # the call refuses it: a batch of its own, never a key error in a pool
                key = (*key, "bad cache", repr(request["cache"]))
        if len(self.tasks) == 1:
            return key
        task = request.get("task")
        if task is None:
            has_image, has_mask = request.get("image") is not None, request.get("mask_image") is not None
            task = "inpaint" if has_mask else ("image-to-image" if has_image else self.task)
            if task == "image-to-image" and "image-to-video" in self.tasks:
                task = "image-to-video"
        strength = request.get("strength")
        if strength is None:
            strength = self.default_strength(task)
        return (task, strength, *key)

    @property
    def interrupt(self) -> bool:
        """diffusers' `interrupt`: set (as `_interrupt`) by a callback_on_step_end to end the call's loop."""
        return self._interrupt

    def compiled_batch_size(self, rows: int, data: int = 1) -> int:
        return batch_bucket(rows, data) if self.pads_batches else rows

    @property
    def compilations(self) -> int:
        return self.programs.count

    def warm_up(
        self,
        buckets: Sequence[tuple[int, int]] | None = None,
        batch_sizes: Sequence[int] = (1,),
        num_frames: Sequence[int] | None = None,
        tasks: Sequence[str] | None = None,
        output_type: str = "np",
        loras: bool | None = None,
        cache: Sequence[str] = (),
        schedulers: Sequence[str | None] = (None,),
    ) -> float:
        """Compiles every stage for each (width, height) bucket and batch size, with and without CFG, and for a
        video family each of `num_frames` (None: its default frame count; a frame count is a shape), for each
        of `tasks` (None: the text task, or every task of a model without one; an image task compiles its own
        image_encode and denoise programs). One step is enough: the step count is traced (an image task warms
        up at strength 1; the strength is traced too). `output_type` picks the decode program: "np" (also what
        "pil" runs) or "uint8" (the worker's: it runs no other). `loras` (None: when adapters are registered)
        also compiles each denoise program's LoRA variant (docs/lora.md), and the text_encode program's when the
        table has text-encoder targets, every adapter slot at scale 0: the first call with adapters then
        compiles nothing. `cache`: step cache methods (limits["cache"]) whose denoise programs to compile too
        (a threshold never compiles: any one warms a method up). `schedulers`: the scheduler names to compile
        the denoise programs for (None: the folder's own; one equal to it compiles nothing more)."""
        t0 = time.perf_counter()
        d = self.defaults
        if tasks is None:
            tasks = [self.task] if self.task in self.tasks else list(self.tasks)
        for task in tasks:
            if task not in self.tasks:
                raise PipelineError(
                    f"{self.model_id or self.family} does not take {task}: {list(self.tasks)}"
                )
        if "frames" in self.limits:
            frame_counts = [{"num_frames": int(n)} for n in num_frames or [self.limits["frames"]["default"]]]
        elif num_frames:
            raise PipelineError(f"{self.family} makes images: it takes no num_frames to warm up")
        else:
            frame_counts = [{}]
        if loras is None:
            loras = bool(self.lora.names)
        # The LoRA programs: the denoise program's variant and, when the table holds text-encoder targets, the
        # text_encode program's (ZERO_SCALES runs both; decode is shared).
        adapter_calls = [None, ZERO_SCALES] if loras else [None]
        cache_calls = [None, *({"method": method, "threshold": 0.0} for method in cache)]
        for width, height in buckets or [(d["width"], d["height"])]:
            for extra in frame_counts:
                for task in tasks:
                    inputs = self._warm_up_task_inputs(task, width, height)
                    calls = itertools.product(
                        batch_sizes,
                        (False, True) if self.guided_by_cfg else (False,),
                        adapter_calls,
                        cache_calls,
                        schedulers,
                    )
                    for b, cfg, adapters, cached, scheduler in calls:
                        self(
                            [""] * b,
                            negative_prompt="" if cfg else None,
                            height=height,
                            width=width,
                            num_inference_steps=1,
                            seed=0,
                            output_type="np" if output_type == "pil" else output_type,
                            **{self.cfg_field: 2.0 if cfg else 1.0},
                            **extra,
                            **inputs,
                            loras=adapters,
                            cache=cached,
                            scheduler=scheduler,
                        )
        if self.prompt_cache is not None:  # the programs encoding a call's misses: 1, 2, 4... texts
            settings = {name: _batch_default(name, d, self.limits) for name in self.batch_fields}
            self.prompt_cache.warm_up(self, settings, 2 * max(batch_sizes))
        return time.perf_counter() - t0

    def _warm_up_task_inputs(self, task: str, width: int, height: int) -> dict:
        """A task's image arguments for warm_up: the family's `warm_up_inputs`, else for an image task a gray
        image (and a mask that repaints all) at strength 1."""
        inputs = self.warm_up_inputs(width, height)
        if task in ("text-to-image", "text-to-video") or "image" in inputs:
            return inputs
        inputs = {**inputs, "image": np.full((height, width, 3), 128, np.uint8)}
        if task == "inpaint":
            inputs["mask_image"] = np.full((height, width), 255, np.uint8)
        if self.default_strength(task) is not None:
            inputs["strength"] = 1.0
        return inputs

    # ---------------------------------------------------------------------------------------------
    # The call

    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        negative_prompt: str | Sequence[str | None] | None = None,
        prompt_2: str | Sequence[str | None] | None = None,
        negative_prompt_2: str | Sequence[str | None] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | Sequence[float] | None = None,
        seed: int | Sequence[int] | None = None,
        generator=None,
        latents=None,
        image=None,
        mask_image=None,
        strength: float | None = None,
        padding_mask_crop: int | None = None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        output_type: str | None = None,
        callback: Callable[[int, int], bool | None] | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] | None = None,
        return_dict: bool = True,
        preview_every: int | Sequence[int] | None = None,
        preview_callback: PreviewCallback | None = None,
        loras=None,
        cache=None,
        prompt_cache_scope: str | Sequence[str | None] | None = None,
        **options,
    ):
        """Generates images (or videos). Per row (one value, one per prompt or one per output row): seed (one
        int, or one per prompt: that prompt's images take it, it + 1, ...) and the family's row fields
        (guidance_scale; Flux: true_cfg_scale); negative_prompt: one for all or one per prompt (None: that
        prompt has none). `generator`: instead of seed, diffusers' torch.Generator on the CPU (or one per output
        row), which draws the starting noise as diffusers' `randn_tensor` does and advances as it would
        (models/engine/torch_generator.py; not for image-to-image and inpaint from a picture, where diffusers
        also samples the VAE posterior with it); where the family's diffusers pipeline passes it to the
        scheduler's step (`generator_in_steps`: SDXL) the step's draws are replayed from it too (the
        scheduler's `generator_draws`), else a stochastic step's noise is the engine's, seeded from the
        generator's next word. `prompt_2` / `negative_prompt_2` (families with `second_prompt`): the second text encoder's texts, one for all or one per prompt, each defaulting to
        the first encoder's (None: that prompt's). `latents` and output_type "latent" use diffusers' layout
        (`latents_layout`); "np" gives [B, H, W, 3] (video [B, F, H, W, 3]) floats in [0, 1], "uint8" the same
        converted to uint8 on the device (workers/encoding.to_uint8's rounding), "pil" PIL
        images (video: a list of frames per row). `callback(step, total)` after every step; False cancels.
        diffusers' `callback_on_step_end(pipe, i, t, callback_kwargs)` after every step, with the latents in
        diffusers' layout; it may return new latents, and `pipe._interrupt = True` ends the loop there
        (models/engine/step_end.py; a variant of the denoise program, compiled once).
        `cache`: {"method", "threshold" (optional)}, a step cache (models/engine/step_cache.py; the methods and
        default thresholds are limits["cache"]); the output's `cached_steps` says how many steps it skipped.
        `prompt_cache_scope`: one for all prompts or one per prompt, part of the prompt cache's keys (a
        prompt is served only what its own scope cached: models/engine/prompt_cache.py).
        The family's batch fields (num_frames, max_sequence_length) are keyword arguments too, and so are
        diffusers' `prompt_embeds` and its kin (`embeds_names`, with `negative_` ones) in place of the texts
        (models/engine/prompt_embeds.py); video families take `num_videos_per_prompt` as diffusers' name for
        num_images_per_prompt, and the family's diffusers attention kwargs (`attention_kwargs_name`: SDXL's
        cross_attention_kwargs...) with a "scale" that multiplies every LoRA scale of the call, as diffusers'
        does. Any other name is an UnsupportedArgument."""
        own = set(self.row_fields) | set(self.batch_fields) | set(self.text_fields) | set(self.pair_fields)
        own |= set(self.image_fields) | set(self.schedule_fields)
        own |= {"denoising_end", "denoising_start"} if self.denoising_split else set()
        # diffusers' video pipelines name n `num_videos_per_prompt`
        own |= {"num_videos_per_prompt"} if "frames" in self.limits else set()
        own |= GivenEmbeds.names(self)  # prompt_embeds and its kin (models/engine/prompt_embeds.py)
        own |= {self.attention_kwargs_name} - {None}  # cross_attention_kwargs={"scale": ...} (LoRA)
        own -= _COMMON_ARGUMENTS
        if not self.second_prompt:
            options |= {
                k: v for k, v in (("prompt_2", prompt_2), ("negative_prompt_2", negative_prompt_2)) if v
            }
        for name in options:
            if name not in own:
                raise UnsupportedArgument(
                    f"unsupported argument {name!r}; {type(self).__name__} takes, besides the common ones, "
                    f"{sorted(own) or 'none'}"
                )
        text_options = {name: options.pop(name, None) for name in self.text_fields}
        pairs = {name: options.pop(name, None) for name in self.pair_fields}
        images = {name: options.pop(name, None) for name in self.image_fields}
        conditioned = any(images[name] is not None for name in self.condition_fields)
        custom = {name: options.pop(name) for name in self.schedule_fields if options.get(name) is not None}
        denoising_end = options.pop("denoising_end", None)
        denoising_start = options.pop("denoising_start", None)
        videos = options.pop("num_videos_per_prompt", None)
        adapter_scale = lora_scale(options.pop(self.attention_kwargs_name, None), self.attention_kwargs_name)
        if videos is not None:
            if num_images_per_prompt not in (1, videos):
                raise PipelineError(
                    f"num_videos_per_prompt ({videos}) and num_images_per_prompt ({num_images_per_prompt}) are "
                    "one setting: give one of them"
                )
            num_images_per_prompt = videos
        embeds = GivenEmbeds.take(self, options, prompt, negative_prompt, prompt_2, negative_prompt_2)
        if embeds is not None:  # empty texts stand in for the rows given as embeddings
            prompt, negative_prompt = embeds.texts(prompt, negative_prompt)
            if "max_sequence_length" in self.batch_fields and options.get("max_sequence_length") is None:
                options["max_sequence_length"] = embeds.sequence_length()
        if prompt is None:
            raise PipelineError("a prompt is needed" + (" (or prompt_embeds)" if self.embeds_names else ""))
        given = {
            "height": height,
            "width": width,
            "num_inference_steps": num_inference_steps,
            "scheduler": scheduler,
            "guidance_scale": guidance_scale,
            **options,
        }
        d, limits = self.defaults, self.limits
        settings = {
            name: given[name] if given.get(name) is not None else _batch_default(name, d, limits)
            for name in self.batch_fields
        }
        task = self.task_of(image, mask_image)
        latent_image = self._latent_image(image, task)  # the first model's latents, given as image= (refiner)
        if latent_image is not None and height is None and width is None:
            settings["height"], settings["width"] = self._latent_size(latent_image.shape[2:])
        elif task in self.image_sized_tasks and height is None and width is None:
            settings["height"], settings["width"] = image_size(image, "image", limits["size_multiple"])
        if strength is not None and self.default_strength(task) is None:
            raise PipelineError(f"strength applies to image-to-image and inpaint, not to {task}")
        strength = self.default_strength(task) if strength is None else strength
        try:
            # A custom schedule's length is the step count; without one, the scheduler's own cap applies.
            settings["num_inference_steps"] = (
                check_scheduler_arguments(
                    limits,
                    {
                        **custom,
                        "scheduler": settings["scheduler"],
                        "num_inference_steps": num_inference_steps,
                    },
                    model=self.model_id or self.family,
                    default_steps=settings["num_inference_steps"],
                )
                or settings["num_inference_steps"]
            )
            if custom.get("eta") == 0:  # diffusers' default, taken by any scheduler: the same as none
                del custom["eta"]
            check_request(
                limits,
                {**settings, "n": num_images_per_prompt, "task": task, "strength": strength},
                model=self.model_id or self.family,
                names={"n": "num_images_per_prompt"},
            )
        except LimitError as e:
            raise PipelineError(str(e)) from None
        cache = parse_cache(cache, self.cache_methods)
        step_end_names = check_step_end(callback_on_step_end, callback_on_step_end_tensor_inputs)
        output_type = output_type or self.default_output_type
        check_padding_mask_crop(padding_mask_crop, task, latent_image is not None, output_type)
        if output_type not in OUTPUT_TYPES:
            raise PipelineError(f"output_type must be 'pil', 'np', 'uint8' or 'latent', got {output_type!r}")
        prompts, n = to_list(prompt, "prompt"), int(num_images_per_prompt)
        rows = {}
        for name in self.row_fields:
            if name in self.row_field_fallbacks:  # left out (or None in a row): that row's other field
                fallback = rows[self.row_field_fallbacks[name]]
                value = [None] * len(fallback) if given.get(name) is None else given[name]
                value = per_row(value, len(prompts), n, name, lambda v: v)
                rows[name] = [f if v is None else float(v) for v, f in zip(value, fallback, strict=True)]
            else:
                value = d[name] if given.get(name) is None else given[name]
                rows[name] = per_row(value, len(prompts), n, name, float)
            if not np.all(np.isfinite(rows[name])):
                raise PipelineError(f"{name} must be a finite number")
        negatives = per_prompt(negative_prompt, len(prompts))
        text_options = {k: per_prompt_ints(v, len(prompts), k) for k, v in text_options.items()}
        texts_2 = None  # the second encoder's texts: the prompts', then the negatives'
        if prompt_2 or negative_prompt_2:
            texts_2 = second_texts(prompt_2, prompts, "prompt_2") + second_texts(
                negative_prompt_2, [neg or "" for neg in negatives], "negative_prompt_2"
            )
        scopes = per_prompt(prompt_cache_scope, len(prompts), "prompt_cache_scope")
        # Per row: CFG runs when its scale is > 1 (and, for true CFG, it has a negative prompt). Whether any row
        # runs it is static (it doubles the denoiser's batch); the others select their positive prediction.
        cfg_rows = (np.asarray(rows[self.cfg_field]) > 1.0) & self.guided_by_cfg
        if self.cfg_needs_negative:
            cfg_rows &= np.repeat([neg is not None for neg in negatives], n)
        do_cfg = bool(cfg_rows.any())
        if self.rescale_field is not None:  # diffusers rescales only when CFG runs
            rows[self.rescale_field] = np.where(cfg_rows, rows[self.rescale_field], 0.0)
        if pairs:
            pairs = {k: per_row_pairs(v, len(prompts), n, k) for k, v in pairs.items()}
            rows |= self.pair_rows(pairs, settings, task, rows)
        shape = self.noise_shape(settings)
        sched, schedule, steps = self.schedule(
            settings["scheduler"], settings["num_inference_steps"], shape, **custom
        )
        calls = steps  # the schedule's model calls (a split or a strength runs some of them)
        start, full_strength, pixels, mask_pixels, crops = 0, False, None, None, None
        check_order(denoising_start, denoising_end)
        # A split's cut-offs read the schedule's timesteps (one copy to the host, only for such a call).
        split = denoising_start is not None or denoising_end is not None
        timesteps = np.asarray(schedule.timesteps)[:steps] if split else None
        if denoising_start is not None and task not in ("image-to-image", "inpaint"):
            raise PipelineError(
                f"denoising_start applies to image-to-image and inpaint (an image= to start from), not {task}"
            )
        if image is not None:
            if denoising_start is not None:  # diffusers then ignores the strength and adds no noise
                start = start_step(denoising_start, timesteps, self.scheduler_config, sched.order)
                check_scheduler(sched)
            elif strength is not None:  # a strength runs the last steps of the schedule (image_inputs.py)
                # ... counted in steps, then in model calls: step k's first call is k x order (get_timesteps).
                start = sched.order * check_strength(
                    strength,
                    settings["num_inference_steps"],
                    self.strength_rule,
                    length=-(-steps // sched.order),
                    steps_from=next(
                        (k for k in ("sigmas", "timesteps") if k in custom), "num_inference_steps"
                    ),
                )
                full_strength = float(strength) == 1.0 and task in self.pure_noise_tasks
                check_scheduler(sched)
            if padding_mask_crop is not None:  # each row's masked region, cut out (components/mask_crop.py)
                size = settings["width"], settings["height"]
                crops = MaskCrops.of(image, mask_image, len(prompts), n, *size, padding_mask_crop)
                pixels, mask_pixels = crops.inputs(*size)
            elif latent_image is None:
                pixels, mask_pixels = self.preprocess_images(
                    image, mask_image, len(prompts), n, settings, **images
                )
            else:  # latents (a refiner's inpaint: its mask at their size)
                mask_pixels = self.preprocess_masks(mask_image, len(prompts), n, settings)
        elif conditioned:  # a condition image alone: the loop starts from noise
            pixels, mask_pixels = self.preprocess_images(None, None, len(prompts), n, settings, **images)
        stop = steps  # the schedule's end, or where denoising_end cuts it
        if denoising_end is not None:
            stop = start + end_steps(denoising_end, timesteps[start:], self.scheduler_config)
        steps = stop - start  # the steps this call runs (and reports)
        rows |= self.step_rows(rows, start, calls)
        # LoRA: each row's adapter slots and scales, or None (no row has one: the program without adapters).
        lora_rows = self.lora.rows(loras, len(prompts), n, adapter_scale)
        # Text-encoder adapters per prompt [P, K], or None (no row's adapters touch the text encoders: the
        # plain text program, and the prompt cache when set).
        text_lora = self.lora.text_rows(loras, lora_rows, len(prompts), n)
        # With a generator: the draws diffusers' stochastic step makes from it, replayed [B, calls, ...].
        step_noise = None
        if generator is None:
            seeds = row_seeds(seed, len(prompts), n)
        else:  # diffusers' torch.Generator: it draws the starting noise (torch_generator.py)
            # (a task with a strength starts from the picture; one without, from noise: Kontext, image-to-video;
            # diffusers encodes a condition image with the generator's draws before the noise's)
            from_picture = latent_image is None and (
                strength is not None or (conditioned and self.conditions_encoded)
            )
            adds_noise = denoising_start is None  # (diffusers adds none to a denoising_start call's image)
            latents = self._generator_noise(
                generator, seed, latents, shape, len(prompts) * n, task, from_picture, adds_noise
            )
            if self.generator_in_steps:
                eta = float(custom.get("eta", getattr(sched, "eta", 0.0)))
                draws = sched.generator_draws(schedule, start, stop, calls, eta)
                step_noise = self._generator_step_noise(generator, draws, schedule, shape, len(prompts) * n)
            seeds = generator_seeds(generator, len(prompts) * n)
        if latents is not None:
            latents = self.put_batch(self._loop_latents(latents, len(seeds), shape))
        timings = {}
        compiled_before = self.compilations

        # 1. Text: one call per encoder over the prompts and (with CFG) the negatives.
        t0 = time.perf_counter()
        texts = prompts + ([neg or "" for neg in negatives] if do_cfg else [])
        negative_texts = len(texts) - len(prompts)
        text_options = {k: v + [None] * negative_texts for k, v in text_options.items()}
        if texts_2 is not None:
            text_options["texts_2"] = texts_2 if do_cfg else texts_2[: len(prompts)]
        tokens = self.tokenize(texts, settings, **text_options)
        keep = None
        if self.zeros_for_empty_negative:
            keep = self.put_batch(np.repeat([neg is not None for neg in negatives], n))
        text = {"prompts": len(prompts), "n": n, "do_cfg": do_cfg}
        if embeds is not None:  # the given rows, the others encoded (the prompt cache neither read nor kept)
            cond = embeds.conditioning(self, tokens, keep, text_adapters=text_lora is not None, **text)
        elif text_lora is not None:
            # The text_encode program's LoRA variant: the table's text-encoder part rides with the weights
            # (fixed shapes: adapters and scales compile nothing); each text row, negatives too, takes its
            # prompt's adapters. It bypasses the prompt cache (neither read nor written: a cached row is the
            # plain encoders' output; prompt_cache.py).
            index, scale = (np.concatenate([x, x]) if do_cfg else x for x in text_lora)
            adapters = {"index": self.put_batch(index), "scale": self.put_batch(scale)}
            tokens = tuple(self.put_batch(t) for t in tokens)
            states = (self._text_states, self.lora.text_tables())
            cond = self.programs.run("text_encode", self._text_encode, text, states, tokens, keep, adapters)
        elif self.prompt_cache is not None:  # cached rows reused, only the misses encoded
            # Each text's row in the cache (`texts`: the prompts, then their negatives) is its prompt's scope's.
            cond = self.prompt_cache.encode(self, tokens, keep, scopes=scopes * (2 if do_cfg else 1), **text)
        else:
            tokens = tuple(self.put_batch(t) for t in tokens)
            cond = self.programs.run("text_encode", self._text_encode, text, self._text_states, tokens, keep)
        jax.block_until_ready(cond)
        timings["text_encode"] = time.perf_counter() - t0

        # 1b. Images: the image_encode program (VAE encode, mask, condition), once per call.
        image_inputs = None
        if latent_image is not None:  # as diffusers takes them: neither encoded nor scaled
            rows_of = latent_image.shape[0]
            if rows_of != len(seeds) and rows_of in (1, len(prompts)):  # one for all, or one per prompt
                latent_image = np.repeat(latent_image, len(seeds) // rows_of, axis=0)
            given = self._loop_latents(latent_image, len(seeds), shape, "image").astype(self.latent_dtype)
            image_inputs = {"image_latents": self.put_batch(given)}
            if mask_pixels is not None:  # the known region is the given latents' (diffusers' image_latents)
                image_inputs["mask"] = self.put_batch(np.asarray(self.latent_mask(mask_pixels, shape=shape)))
        elif pixels is not None:
            t0 = time.perf_counter()
            put_mask = None if mask_pixels is None else self.put_batch(mask_pixels)
            image_inputs = self.programs.run(
                "image_encode",
                self.image_inputs,
                {"shape": shape, "task": task},
                self.image_encode_states,
                jax.tree.map(self.put_batch, pixels),
                put_mask,
            )
            jax.block_until_ready(image_inputs)
            timings["image_encode"] = time.perf_counter() - t0
        init = {"latents": latents, "start": self.put_replicated(np.int32(start))}
        if step_noise is not None:
            init["step_noise"] = self.put_batch(step_noise)
        init["stop"] = self.put_replicated(np.int32(stop))
        if cache is not None:  # the threshold is an input: a new one compiles nothing
            init["cache_threshold"] = self.put_replicated(np.float32(cache.threshold))
        if lora_rows is not None:
            init["lora"] = {"index": self.put_batch(lora_rows[0]), "scale": self.put_batch(lora_rows[1])}
        if image_inputs is not None:
            init["image"] = image_inputs
            init["full_strength"] = self.put_replicated(np.bool_(full_strength))
            init["image_as_is"] = self.put_replicated(np.bool_(denoising_start is not None))

        # 2. The denoising loop, initial noise included: one program.
        t0 = time.perf_counter()
        static = {"scheduler": sched, "do_cfg": do_cfg, "shape": shape}
        if cache is not None:
            static["cache"] = cache.method
        if callback_on_step_end is not None:
            static["step_end"] = True
        inputs = (
            schedule,
            init,
            self.put_keys(seeds),
            cond,
            {name: self.put_batch(np.float32(values)) for name, values in rows.items()},
            self.put_batch(cfg_rows),
            self._extras(shape, settings.get("max_sequence_length")),
            self.previews.inputs(preview_every, len(seeds), shape[-1]),
        )
        state = self._states[self.denoiser_name]
        if lora_rows is not None:  # the adapter table rides with the weights: fixed shapes, not in the key
            state = (state, self.lora.tables())
        step_end = self.step_end.listening(self, callback_on_step_end, step_end_names, start)
        with self.previews.listening(preview_callback, steps), step_end:
            latents, *skipped = self.run_denoise(
                steps, callback, lambda: self.programs.run("denoise", self._denoise, static, state, *inputs)
            )
        timings["denoise"] = time.perf_counter() - t0

        # 3. Decode (or the latents, in diffusers' layout, before the VAE's scaling).
        if output_type == "latent":
            images = to_host(latents).astype(np.float32, copy=False)
            if self.latents_axes is not None:
                images = np.transpose(images, self.latents_axes)
        else:
            t0 = time.perf_counter()
            images = self.run_decode(latents, shape, uint8=output_type == "uint8")
            timings["vae_decode"] = time.perf_counter() - t0
            if crops is not None:  # laid back into the images they were cut from (their sizes)
                images = crops.paste(images, output_type)
            elif output_type == "pil":
                images = to_pil(images)
        out = PipelineOutput(
            images=images,
            seeds=seeds,
            timings=timings,
            compiled=self.compilations > compiled_before,
            cached_steps=[int(n) for n in np.asarray(skipped[0])[: len(seeds)]] if skipped else None,
        )
        return out if return_dict else (out.images,)

    def run_decode(self, latents, shape: tuple[int, ...], *, uint8: bool) -> np.ndarray:
        """The vae_decode program on the loop's latents -> the host's [B, (F,) H, W, 3]: float32 in [0, 1], or
        with `uint8` the program that ends in the conversion (a separate program: parity tests read floats, the
        worker only ever runs and warms up this one)."""
        if uint8:
            images = self.programs.run(
                "vae_decode",
                self._decode_uint8,
                {"shape": shape, "uint8": True},
                self._states["vae"],
                latents,
            )
            return to_host(images)
        images = self.programs.run("vae_decode", self.decode, {"shape": shape}, self._states["vae"], latents)
        return to_host(images).astype(np.float32, copy=False)

    def _decode_uint8(self, vae_state, latents, *, shape, uint8: bool = True):
        """Traced: the family's decode, then [0, 1] -> uint8 on the device (device_uint8)."""
        return device_uint8(self.decode(vae_state, latents, shape=shape))

    def _generator_noise(
        self, generator, seed, latents, shape, rows: int, task: str, from_picture, adds_noise
    ):
        """diffusers' `generator=`: the starting noise it draws, in diffusers' layout (as `latents=`), unless
        the call gives latents or adds no noise (denoising_start)."""
        if seed is not None:
            raise PipelineError("give seed or generator, not both (the generator draws the starting noise)")
        if from_picture:
            raise PipelineError(
                f"generator reproduces diffusers' noise for text-to-image, text-to-video and image-to-video, not "
                f"for {task} from a picture (diffusers first samples the image's VAE posterior with it, this "
                "engine takes the posterior's mode): give seed=, or the noise as latents="
            )
        if latents is not None or not adds_noise:
            return latents
        loop = self._drawn_in_loop_layout(generator, shape, rows)
        return loop if self.latents_axes is None else np.transpose(loop, self.latents_axes)

    def _generator_step_noise(self, generator, draws, schedule, shape, rows: int) -> np.ndarray | None:
        """The noise diffusers' stochastic step draws from the generator at the calls `draws`, in order, each
        in the loop's layout at its call -> [B, calls (padded), ...] (zeros where nothing is drawn), or None."""
        if not draws:
            return None
        noise = None
        for i in draws:
            loop = self._drawn_in_loop_layout(generator, shape, rows)
            if noise is None:
                noise = np.zeros((rows, np.shape(schedule.timesteps)[0], *loop.shape[1:]), np.float32)
            noise[:, i] = loop
        return noise

    def _drawn_in_loop_layout(self, generator, shape, rows: int) -> np.ndarray:
        """One `randn_tensor` of diffusers' latents shape [B, C, ...] from the generator (bf16 pipelines: bf16
        values, as diffusers draws them there), in the loop's layout."""
        bf16 = np.dtype(self.latent_dtype) == np.dtype(jnp.bfloat16)
        drawn = draw_noise(generator, (rows, shape[-1], *shape[:-1]), bfloat16=bf16)
        return np.asarray(self.pack(np.moveaxis(drawn, 1, -1)), np.float32)

    def _loop_latents(self, latents, batch: int, shape: tuple[int, ...], name: str = "latents") -> np.ndarray:
        """Given latents in diffusers' layout (the argument `name`) -> the loop's layout, checked against the
        request's shape."""
        latents = np.asarray(latents, np.float32)
        loop = jax.eval_shape(self.pack, jax.ShapeDtypeStruct((batch, *shape), jnp.float32)).shape
        axes = self.latents_axes or tuple(range(len(loop)))
        expected = tuple(loop[a] for a in axes)
        if latents.shape != expected:
            raise PipelineError(
                f"{name}: expected shape {expected} {self.latents_layout}, got {latents.shape}"
            )
        return np.ascontiguousarray(np.transpose(latents, np.argsort(axes)))

    def _latent_image(self, image, task: str) -> np.ndarray | None:
        """`image` as latents (diffusers' rule: an array [B, C, h, w] with the VAE's latent channels), for a
        family that splits schedules (`denoising_split`: the refiner's input); None for pictures."""
        if not self.denoising_split or not hasattr(image, "shape") or len(image.shape) != 4:
            return None
        latent_channels = self.noise_shape(dict(self.defaults))[-1]
        if image.shape[1] != latent_channels or image.shape[-1] == 3:
            return None
        if task == "inpaint" and self.inpaint_condition:
            # diffusers fails there too: the UNet's masked image latents cannot be made from latents
            raise PipelineError(
                "latents given as image= inpaint with a 4-channel UNet only: this 9-channel inpainting UNet "
                "takes the masked image's latents every step; give it the picture"
            )
        return np.asarray(image, np.float32)

    def _latent_size(self, latent_hw) -> tuple[int, int]:
        """(height, width) in pixels of latents [h, w] (the VAE's factor, read off the default size)."""
        d = dict(self.defaults)
        factor = d["height"] // self.noise_shape(d)[0]
        return int(latent_hw[0]) * factor, int(latent_hw[1]) * factor

    # ---------------------------------------------------------------------------------------------
    # The programs (pure functions of state + traced inputs)

    def _text_encode(self, states, tokens, keep, lora=None, *, prompts: int, n: int, do_cfg: bool):
        """tokens [T, ...] (prompts, then negatives with CFG) -> the denoiser's conditioning, each row
        repeated per image and, with CFG, interleaved [neg0, pos0, neg1, pos1, ...] (keep [B]: whether a
        row's negative is kept, else zeros). With `lora` ({"index", "scale"} [T, K]) the states are
        (encoders' weights, the table's text-encoder part) and the encoders add each text row's adapters."""
        with adapters_from(states, lora) as states:
            encoded = self.encode_prompt(states, *tokens)
        return self.assemble_text(encoded, keep, prompts=prompts, n=n, do_cfg=do_cfg)

    def assemble_text(self, encoded, keep, *, prompts: int, n: int, do_cfg: bool):
        """Traced: the encoders' rows (a pytree of [T, ...]) -> the conditioning (the prompt cache's too)."""
        cond = jax.tree.map(lambda x: repeat_rows(x, n, prompts), encoded)
        if not do_cfg:
            return cond
        batch = prompts * n

        def pair(x):
            neg = x[batch:]
            if keep is not None:
                neg = jnp.where(keep.reshape(-1, *([1] * (x.ndim - 1))), neg, 0.0)
            return interleave(neg, x[:batch])  # each sample's uncond row, then its cond row

        return jax.tree.map(pair, cond)

    def _denoise(
        self,
        state,
        schedule,
        init,
        key_data,
        cond,
        rows,
        cfg_rows,
        extras,
        preview,
        *,
        scheduler,
        do_cfg,
        shape,
        cache: str | None = None,
        step_end: bool = False,
    ):
        """init: {"latents": given latents in the loop's layout or None (drawn from each row's key), "start":
        [] int32 first step, "stop": [] int32 the step it stops before (denoising_end), with image inputs
        also "image" (image_inputs.py), "full_strength" and "image_as_is" (denoising_start) [] bool};
        key_data [B, 2]; cond [2B or B, ...]; rows {field: [B] float32}; cfg_rows [B] bool. `cache`: a step
        cache's method, its threshold init["cache_threshold"]. Returns (latents, steps_done), with a cache
        also the steps it skipped."""
        # With LoRA inputs the state is (weights, adapter table) and the denoiser's adapted layers add each
        # row's adapters while this body is traced (models/lora/apply.py); without, the context does nothing.
        with adapters_from(state, init.get("lora")) as state:
            keys = row_keys(key_data)
            latents, start, image = init["latents"], init["start"], init.get("image")
            sigma = scheduler.init_noise_sigma(schedule)
            after_step = None
            if image is None:
                latents = self.constrain(self.prepare_latents(keys, latents, shape=shape, sigma=sigma))
                model = self.denoiser(state, cond, rows, extras, shape=shape, do_cfg=do_cfg)
            else:
                noise = self.pack(initial_noise(keys, shape)) if latents is None else latents
                noise = noise.astype(jnp.float32)
                if "image_latents" in image:
                    noised = noise_to(scheduler, schedule, image["image_latents"], noise, start)
                    noised = jnp.where(init["full_strength"], noise * sigma, noised)
                    # denoising_start: the image is the first model's latents at the start step, noise and all
                    noised = jnp.where(init["image_as_is"], image["image_latents"], noised)
                    latents = self.constrain(noised.astype(self.latent_dtype))
                else:  # the image conditions the model only (image-to-video): the loop starts from noise
                    latents = self.constrain((noise * sigma).astype(self.latent_dtype))
                after_step = self.after_step(image, scheduler, schedule, noise, init["stop"])
                model = self.denoiser(state, cond, rows, extras, shape=shape, do_cfg=do_cfg, image=image)
                if "condition" in image:
                    model = with_condition(model, image["condition"], do_cfg)
            if do_cfg:
                model = positive_without_cfg(model, cfg_rows)
            return denoise_loop(
                model,
                scheduler,
                schedule,
                latents,
                keys,
                self.step_guidance(rows),
                do_cfg=do_cfg,
                rescale=None if self.rescale_field is None else rows[self.rescale_field],
                on_step=self.step_reporter,
                constrain=self.constrain,
                start=start,
                stop=init["stop"],
                after_step=after_step,
                preview=self.previews.in_loop(preview, shape),
                step_cache=None
                if cache is None
                else CacheSlot(cache, init["cache_threshold"], cfg_rows if do_cfg else None),
                step_end=self.step_end.in_loop() if step_end else None,
                step_noise=init.get("step_noise"),
            )

    # ---------------------------------------------------------------------------------------------
    # Shared host machinery

    def step_rows(self, rows: dict, start: int, calls: int) -> dict:
        """Host: per-row values that depend on the model calls the call runs (start..calls: a strength starts
        later, a denoising_end's cut is not counted, as diffusers), added to the rows (a ControlNet's window of
        steps); none here."""
        return {}

    def step_guidance(self, rows):
        """Traced: the CFG scales of the loop, [B], or a function of the step's timestep -> [B] (Wan 2.2's
        two experts: guidance_scale_2 below the boundary)."""
        return rows[self.cfg_field]

    def make_scheduler(self, name: str | None):
        return make_scheduler(name, self.scheduler_config)

    def scheduler(self, name: str | None):
        """The scheduler object for a name (None: the folder's own), made once: it is a static argument of
        the denoise program, so reusing the instance keeps the program cache hit."""
        if name not in self._schedulers:
            try:
                self._schedulers[name] = self.make_scheduler(name)
            except ValueError as e:
                raise PipelineError(str(e)) from None
        return self._schedulers[name]

    def schedule_options(self, scheduler, shape: tuple[int, ...] | None) -> dict:
        """Keyword arguments of `scheduler.schedule` for this request (Flux: the shift for its size)."""
        return {}

    def schedule(self, name: str | None, steps: int, shape: tuple[int, ...] | None = None, **custom):
        """(scheduler, padded schedule on the pool's devices, the steps it really runs), cached per
        (name, steps, options): a request computes nothing on the host for its schedule. `custom`: a call's
        own sigmas, timesteps or eta (checked against limits["scheduler_arguments"]), made for it alone."""
        options = self.schedule_options(self.scheduler(name), shape)
        if custom:
            return self._make_schedule(name, int(steps), tuple({**options, **custom}.items()))
        return self._schedules(name, int(steps), tuple(sorted(options.items())))

    def _make_schedule(self, name, steps, options):
        sched, max_steps = self.scheduler(name), self.limits["max_steps"]
        if sched.model_calls(steps) > max_steps:  # (the API refuses them: scheduler_arguments)
            raise PipelineError(
                f"{steps} steps of {type(sched).__name__} call the model {sched.model_calls(steps)} times, more "
                f"than the {max_steps} a call runs"
            )
        schedule = sched.schedule(steps, **dict(options))
        # The model calls: DPM-Solver's clipped schedules can be shorter than the steps, Heun's and DPM2's longer.
        real = int(schedule.timesteps.shape[0])
        return sched, self.put_replicated(pad_schedule(schedule, max_steps)), real

    def put_replicated(self, tree):
        if self.placement is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(self.placement.mesh, P()))

    def put_batch(self, x: np.ndarray) -> jax.Array:
        """A host array [B, ...] straight into its batch sharding on the pool's devices (no device-0 copy)."""
        x = np.asarray(x)
        if self.placement is None:
            return jax.device_put(x)
        return jax.device_put(x, self.placement.batch_spec(x.shape[0], x.ndim))

    def put_keys(self, seeds: list[int]) -> jax.Array:
        return self.put_batch(key_data(seeds))

    def constrain(self, x):
        return self.placement.constrain_batch(x) if self.placement else x

    def run_denoise(self, total: int, callback: Callable | None, program: Callable, *args):
        """Runs a denoise program with `callback(step, total)` wired to its step callback: (latents, *what
        else the program returns after the steps done). Raises GenerationCancelled when the callback stopped
        it."""
        self.step_reporter.listener, self.step_reporter.total = callback, total
        try:
            latents, done, *extra = program(*args)
            done = int(done)
        finally:
            self.step_reporter.listener = None
        if self.step_end.error is not None:  # callback_on_step_end raised: its error, not a cancel
            error, self.step_end.error = self.step_end.error, None
            raise error
        if done < total and not self.step_end.interrupted:  # diffusers' interrupt decodes what it has
            raise GenerationCancelled(f"stopped after {done} of {total} steps")
        return latents, *extra


def check_padding_mask_crop(pad, task: str, latent_image: bool, output_type: str) -> None:
    """diffusers' `padding_mask_crop`: a number of pixels >= 0, for an inpaint of pictures whose result is a
    picture (it is laid back into the given image)."""
    if pad is None:
        return
    if isinstance(pad, bool) or not isinstance(pad, int | np.integer) or pad < 0:
        raise PipelineError(f"padding_mask_crop must be an int >= 0 (pixels), got {pad!r}")
    if task != "inpaint":
        raise PipelineError(f"padding_mask_crop applies to inpaint (image and mask_image), not to {task}")
    if latent_image:
        raise PipelineError("padding_mask_crop needs the image as a picture to crop, not as latents")
    if output_type == "latent":
        raise PipelineError("padding_mask_crop lays its result into the image: output_type 'latent' has none")


def _batch_default(name: str, defaults: Mapping, limits: Mapping):
    """A batch field's value when a call leaves it out: the model's default, its default frame count, or its
    longest text."""
    if name in defaults:
        return defaults[name]
    if name == "num_frames":
        return (limits.get("frames") or {}).get("default")
    return limits.get(name)


def device_uint8(images):
    """Traced: [..., 3] in [0, 1] -> uint8, the same operations in the same order as the worker's host
    conversion (workers/encoding.to_uint8: clip, x 255, + 0.5, floor; diffusers' numpy_to_pil rounds to
    nearest too), so both give the same bytes (tests/models/test_uint8_outputs.py checks they are equal)."""
    x = jnp.clip(images.astype(jnp.float32), 0.0, 1.0) * 255.0
    return jnp.floor(x + 0.5).astype(jnp.uint8)


def to_host(x) -> np.ndarray:
    """A device array as a numpy array on this host. An array that spans the devices of several processes (a
    multi-host pool: workers/multihost.py) cannot be read by np.asarray; it is all-gathered instead, a
    collective that every process of the group calls (they all run the same pipeline call) and that gives each
    of them the whole array."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def scheduler_class_in_index(folder: Path) -> str | None:
    """The scheduler class model_index.json names (`"scheduler": ["diffusers", "EulerDiscreteScheduler"]`), if
    it names one."""
    path = folder / "model_index.json"
    entry = read_json(path).get("scheduler") if path.is_file() else None
    if isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[1], str):
        return entry[1]
    return None


def image_limits(size_multiple: int, default_size: int) -> dict:
    """The limits of a text-to-image family (sizes in pixels)."""
    return {
        "size_multiple": size_multiple,
        "min_size": size_multiple,
        "max_size": max(2048, default_size * 2),
        "min_steps": 1,
        "max_steps": MAX_STEPS,
        "max_n": MAX_IMAGES,
        "schedulers": list(SCHEDULER_NAMES),
        "output_formats": list(IMAGE_FORMATS),
    }
