"""The Wan 2.1 text-to-video pipeline: UMT5 -> one compiled denoising loop over video latents -> causal 3D VAE.

Mirrors diffusers' WanPipeline (`pipelines/wan/pipeline_wan.py`, the reference it is tested against) on the
engine's pipeline (models/engine/pipeline.py) and denoising loop. What is Wan's own:

- Text: `prompt_clean`, UMT5 WITH its attention mask at `max_sequence_length` tokens (512), each prompt's
  states trimmed to its length and zero-padded back (models/wan/text.py); the transformer's cross-attention
  has no mask. The negative prompt: diffusers' `negative_prompt or ""` (None is the empty string, never zeros).
- Latents are fp32 video [B, T, h, w, C] channels-last, T = (num_frames - 1) // 4 + 1, h, w = H / 8, W / 8
  (diffusers' [B, C, T, h, w] at the call's edges); the transformer's input is cast to the model dtype each
  step and the guidance combine runs in that dtype, as diffusers does.
- Decode: `z / (1 / latents_std) + latents_mean` in fp32 (diffusers' exact arithmetic), the VAE in fp32, frames
  `clip(x / 2 + 0.5, 0, 1)` -> [B, F, H, W, 3], split over the whole mesh: the batch over (data, cfg), the
  larger spatial dimension over the other axes (`decode_sharding`).
- The frame count is a shape (a batch field); a padded row would be a whole extra video, so batches are not
  padded. The output is diffusers' too: `frames` (also `images`).
- Wan 2.2's two-expert folders (A14B: `transformer_2` switched in below `boundary_ratio`, with diffusers'
  `guidance_scale_2`) run both experts as one denoiser (models/wan/two_experts.py); TI2V-5B's folders
  (`expand_timesteps`, the Wan 2.2 VAE: 16x in space, 48 latent channels) load as WanTI2VPipeline
  (models/wan/pipeline_ti2v.py: this text-to-video, whose per-token timesteps are all the step's, and its
  image-to-video).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.limits import VIDEO_FORMATS
from meshserve.models.attention.context import batch_axes_for
from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.t5 import SHARDING_RULES as T5_RULES
from meshserve.models.components.t5 import load_t5_encoder
from meshserve.models.components.t5_tokenizer import load_t5_tokenizer
from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.pipeline import DiffusionPipeline, folder_serving_defaults, image_limits
from meshserve.models.parallel.small_maps import MIN_ROWS
from meshserve.models.schedulers import (
    FLOW_SCHEDULER_NAMES,
    FlowMatchEulerDiscreteScheduler,
    is_flow_config,
    make_scheduler,
)
from meshserve.models.wan.autoencoder_kl_wan import SHARDING_RULES as VAE_RULES
from meshserve.models.wan.autoencoder_kl_wan import load_autoencoder_kl_wan
from meshserve.models.wan.text import WAN_MAX_SEQUENCE_LENGTH, encode_wan_prompts, tokenize_wan_prompts
from meshserve.models.wan.transformer_wan import SHARDING_RULES as WAN_RULES
from meshserve.models.wan.transformer_wan import load_wan_transformer, wan_rope
from meshserve.models.wan.two_experts import load_wan_experts

__all__ = ["WanPipeline", "decode_sharding"]

# diffusers' WanPipeline.__call__ defaults (480p, 5 s at 16 fps: the Wan 2.1 model card's setting).
DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_FRAMES, DEFAULT_STEPS, DEFAULT_GUIDANCE = 480, 832, 81, 50, 5.0
FPS = 16
# Wan 2.1 was trained on videos of up to 81 frames; diffusers accepts more, which nothing here has tested.
MAX_FRAMES = 81
# Wan 2.2's TI2V-5B: 720p videos of 121 frames at 24 fps (its model card's setting).
TI2V_FPS, TI2V_MAX_FRAMES = 24, 121
# A model whose RoPE tables (rope_max_seq_len positions per axis) cannot address diffusers' default grid
# (480x832 -> 30 x 52 patches; real checkpoints have 1024 positions, the tiny test models 32) is a test model:
# it defaults to this small video (2 x 3 patches: 32 x 48 with Wan 2.1's VAE, 2 latent frames) and 4 steps, so
# warm-up stays cheap.
SMALL_PATCHES, SMALL_FRAMES, SMALL_STEPS = (2, 3), 5, 4


@dataclasses.dataclass(frozen=True)
class _Fp32Latents:
    """A scheduler whose step returns the sample's dtype. diffusers' flow-match Euler casts its result to the
    model output's dtype (bf16 latents after the first bf16 step); bf16 values are exact in fp32, so keeping
    the carry fp32 (the while_loop needs one dtype) and upcasting each result changes no number."""

    inner: object

    def __getattr__(self, name):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def step(self, schedule, state, model_output, sample, i, key=None, *, noise=None):
        prev, state = self.inner.step(schedule, state, model_output, sample, i, key, noise=noise)
        return prev.astype(sample.dtype), state


class WanPipeline(DiffusionPipeline):
    family = "wan"
    attention_kwargs_name = "attention_kwargs"  # its "scale" scales the LoRA adapters
    task = "text-to-video"
    batch_fields = (
        "width",
        "height",
        "num_frames",
        "num_inference_steps",
        "scheduler",
        "max_sequence_length",
    )
    pads_batches = False
    embeds_names = ("prompt_embeds",)  # encode_prompt's output, as diffusers names it
    # Step caches (models/engine/step_cache.py): first-block and TeaCache. The default thresholds are starting
    # values, not yet measured on trained weights (docs/step-cache.md).
    cache_methods = {"first_block": 0.08, "teacache": 0.1}
    scheduler_classes = (
        "UniPCMultistepScheduler",
        "FlowMatchEulerDiscreteScheduler",
        "DPMSolverMultistepScheduler",
        "DPMSolverSinglestepScheduler",
    )
    latents_axes = (0, 4, 1, 2, 3)
    latents_layout = "[B, C, T, h, w]"
    default_output_type = "np"  # diffusers' WanPipeline's
    # Wan 2.2's two experts (two_experts.py): the timestep at and above which `transformer` runs, else None.
    boundary_timestep: float | None = None
    # Wan 2.2's TI2V-5B (text-to-video here): diffusers gives the transformer one timestep per token, all equal
    # for text-to-video, which is the per-video timestep's arithmetic, so the loop is Wan 2.1's.
    expand_timesteps: bool = False

    def load(self, folder: Path) -> dict:
        index = read_json(folder / "model_index.json")
        experts = two_experts(index)
        self.expand_timesteps = bool(index.get("expand_timesteps"))
        if self.expand_timesteps and (self.task != "text-to-video" or experts):
            # load_pipeline loads TI2V folders as WanTI2VPipeline (both tasks); a direct load of another class,
            # or a TI2V folder with two experts (no such model), is refused.
            raise CheckpointError(
                f"{folder}: model_index.json sets expand_timesteps (Wan 2.2's TI2V model) in a "
                f"{type(self).__name__}{' with two experts' if experts else ''}: TI2V folders load as "
                "WanTI2VPipeline (load_pipeline picks it)"
            )
        if experts and sorted(experts) != ["boundary_ratio", "transformer_2"]:
            # diffusers would switch to a missing transformer_2 (or never switch) mid-loop.
            raise CheckpointError(
                f"{folder}: model_index.json sets {experts} (Wan 2.2's two-expert model) without the other of "
                "transformer_2 and boundary_ratio"
            )
        if not is_flow_config(self.scheduler_config):
            # A beta-schedule UniPC or DPM-Solver config would sample a velocity model as a noise predictor.
            raise CheckpointError(
                f"{folder / 'scheduler'}: a Wan folder's scheduler runs in flow matching's form "
                "(use_flow_sigmas with prediction_type 'flow_prediction', or FlowMatchEulerDiscreteScheduler)"
            )
        if self.scheduler_config.get("use_dynamic_shifting"):
            # diffusers' WanPipeline passes no mu, so its set_timesteps would fail on such a config too.
            raise CheckpointError(
                f"{folder / 'scheduler'}: use_dynamic_shifting needs a mu WanPipeline never passes"
            )
        self.folder_defaults = folder_serving_defaults(folder)
        self.tokenizer = load_t5_tokenizer(folder / "tokenizer")
        text_encoder = self.load_module(load_t5_encoder, folder / "text_encoder", T5_RULES)
        loader = load_wan_transformer
        if experts:  # Wan 2.2 A14B: both experts as one denoiser (two_experts.py)
            boundary = float(index["boundary_ratio"]) * self.scheduler_config.get("num_train_timesteps", 1000)
            loader = partial(load_wan_experts, boundary=boundary)
            self.enable_two_experts(boundary)
        transformer = self.load_module(loader, folder / "transformer", WAN_RULES, attention=self.attention)
        # Wan 2.1's image-to-video transformer takes CLIP image tokens (image_dim); Wan 2.2's two image-to-video
        # experts take the image as the latent condition alone (diffusers encodes no image for them).
        image_tokens = self.task == "image-to-video" and not experts
        if transformer.config.image_to_video != image_tokens:
            raise CheckpointError(
                f"{folder / 'transformer'}: an image-to-video transformer (image_dim) in a {type(self).__name__} "
                "folder; its model_index.json should name WanImageToVideoPipeline"
                if transformer.config.image_to_video
                else f"{folder / 'transformer'}: no image_dim: a text-to-video transformer, which "
                f"{type(self).__name__} cannot condition on an image (Wan 2.1; Wan 2.2's two experts take none)"
            )
        self.validate_heads(
            {transformer.config.num_attention_heads}
            | ({transformer.transformer_2.config.num_attention_heads} if experts else set())
        )
        # fp32 whatever the pipeline dtype: diffusers' Wan examples load the VAE in fp32, and it runs once per
        # video, not once per step (a bf16 3D VAE is not measured here, so a pool cannot ask for it).
        if self.vae_dtype_override not in (None, jnp.dtype(jnp.float32)):
            raise PipelineError(
                f"vae_dtype: Wan's 3D VAE decodes in float32 only, got {self.vae_dtype_override}"
            )
        # Its decode is split by `decode_sharding` (its mid-block attention is over
        # one frame's pixels, gathered by XLA).
        vae = self.load_module(
            load_autoencoder_kl_wan,
            folder / "vae",
            VAE_RULES,
            dtype=jnp.float32,
            attention=self.plain_attention,
        )
        self.transformer_config, self.vae_config = transformer.config, vae.config
        self._check_geometry(folder)
        return {"text_encoder": text_encoder, "transformer": transformer, "vae": vae}

    def enable_two_experts(self, boundary: float) -> None:
        """Wan 2.2's two experts: diffusers' guidance_scale_2 (the low-noise steps' CFG scale, guidance_scale's
        when left out) becomes a row field; a step cache keeps a state per expert (models/wan/two_experts.py)."""
        self.row_fields = (*self.row_fields, "guidance_scale_2")
        self.row_field_fallbacks = {"guidance_scale_2": "guidance_scale"}
        self.boundary_timestep = boundary

    def step_guidance(self, rows):
        if self.boundary_timestep is None:
            return rows[self.cfg_field]
        boundary, high, low = self.boundary_timestep, rows["guidance_scale"], rows["guidance_scale_2"]
        return lambda t: jnp.where(t >= boundary, high, low)

    def load_lora(self, name: str, source, load_into_transformer_2: bool = False) -> dict:
        """Wan 2.2's two experts, as diffusers' WanLoraLoaderMixin: an adapter file names one transformer's
        layers, `transformer`'s unless load_into_transformer_2 (a high- and a low-noise adapter, e.g. a
        distillation's, are two adapters, each given per request as any other)."""
        if self.boundary_timestep is None:
            if load_into_transformer_2:
                raise PipelineError(
                    "load_into_transformer_2: this model has one transformer (Wan 2.2's two experts)"
                )
            return super().load_lora(name, source)
        return self.lora.load(
            name, source, into="transformer_2" if load_into_transformer_2 else "transformer"
        )

    @property
    def transformer_in_channels(self) -> int:
        """The transformer's input channels this pipeline feeds it: the latents (image-to-video adds more)."""
        return self.vae_config.z_dim

    def _check_geometry(self, folder: Path) -> None:
        t, v = self.transformer_config, self.vae_config
        if t.in_channels != self.transformer_in_channels or t.output_channels != v.z_dim:
            raise CheckpointError(
                f"{folder}: transformer channels in {t.in_channels} / out {t.output_channels}; with the VAE's "
                f"z_dim {v.z_dim} it should take {self.transformer_in_channels} and give {v.z_dim}"
            )
        # diffusers reads the factors from the VAE config; they must be what the VAE really does, or the frame
        # count and the latent size would disagree with the decoded video.
        if (self.temporal_factor, self.spatial_factor) != (v.temporal_compression, v.spatial_compression):
            raise CheckpointError(
                f"{folder / 'vae'}: scale_factor_temporal/spatial ({self.temporal_factor}, {self.spatial_factor})"
                f" differ from the VAE's layers ({v.temporal_compression}, {v.spatial_compression})"
            )

    # ----------------------------------------------------------------------------------------------
    # What the serving layer reads

    @property
    def temporal_factor(self) -> int:
        return int(self.vae_config.scale_factor_temporal or 4)

    @property
    def spatial_factor(self) -> int:
        return int(self.vae_config.scale_factor_spatial or 8)

    @property
    def max_frames(self) -> int:
        return TI2V_MAX_FRAMES if self.expand_timesteps else MAX_FRAMES

    @property
    def size_multiple(self) -> int:
        # The VAE's factor x the patch (diffusers' h_multiple_of / w_multiple_of; 16 for Wan 2.1).
        _, ph, pw = self.transformer_config.patch_size
        return math.lcm(self.spatial_factor * ph, self.spatial_factor * pw)

    @property
    def _frame_rule(self) -> tuple[int, int]:
        """(offset, step): the frame counts whose latent frames divide into the temporal patch, offset + k step.
        Wan 2.1's patch takes one latent frame (1 + 4k frames); a patch of pt latent frames (3 in a tiny-wan
        trial, docs/embedded-model.md) needs a multiple of pt, which diffusers does not check: it would drop
        the remainder."""
        pt, tf = self.transformer_config.patch_size[0], self.temporal_factor
        return (pt - 1) * tf + 1, pt * tf

    def _conforming_frames(self, n: int) -> int:
        """The largest frame count the rule allows at or below n (its smallest where none is)."""
        offset, step = self._frame_rule
        return offset + max(n - offset, 0) // step * step

    @property
    def _small(self) -> bool:
        """Whether the RoPE tables cannot address diffusers' default video's patch grid."""
        pt, ph, pw = self.transformer_config.patch_size
        f = self.spatial_factor
        grid = (
            ((DEFAULT_FRAMES - 1) // self.temporal_factor + 1) // pt,
            DEFAULT_HEIGHT // f // ph,
            DEFAULT_WIDTH // f // pw,
        )
        return max(grid) > self.transformer_config.rope_max_seq_len

    @property
    def defaults(self) -> dict:
        small = self._small
        defaults = {
            "width": SMALL_PATCHES[1] * self.size_multiple if small else DEFAULT_WIDTH,
            "height": SMALL_PATCHES[0] * self.size_multiple if small else DEFAULT_HEIGHT,
            "num_inference_steps": SMALL_STEPS if small else DEFAULT_STEPS,
            "guidance_scale": DEFAULT_GUIDANCE,
            "fps": TI2V_FPS if self.expand_timesteps else FPS,
            **self.folder_defaults,  # what the model was made to be served with (meshserve.json)
        }
        if self.boundary_timestep is not None:
            # Published so the API takes it; a call leaving it out takes its own guidance_scale
            # (`row_field_fallbacks`), so the default is guidance_scale's.
            defaults["guidance_scale_2"] = defaults["guidance_scale"]
        return defaults

    @property
    def limits(self) -> dict:
        d = self.defaults
        limits = image_limits(self.size_multiple, max(d["width"], d["height"]))
        _, ph, pw = self.transformer_config.patch_size
        rope = self.transformer_config.rope_max_seq_len
        # The largest size whose patch grid the RoPE tables address, down to a multiple.
        m = self.size_multiple
        limits["max_size"] = min(limits["max_size"], rope * self.spatial_factor * min(ph, pw) // m * m)
        limits["schedulers"] = list(FLOW_SCHEDULER_NAMES)
        limits["output_formats"] = list(VIDEO_FORMATS)
        limits["max_sequence_length"] = WAN_MAX_SEQUENCE_LENGTH
        offset, step = self._frame_rule
        pt, tf = self.transformer_config.patch_size[0], self.temporal_factor
        small = self._conforming_frames(SMALL_FRAMES)
        limits["frames"] = {
            "min_frames": offset,
            # The RoPE tables address rope positions of pt latent frames each.
            "max_frames": self._conforming_frames(min(self.max_frames, (rope * pt - 1) * tf + 1)),
            "step": step,
            "offset": offset,
            "default": d.get("num_frames", small if self._small else self._conforming_frames(DEFAULT_FRAMES)),
        }
        limits["loras"] = self.lora.limits
        if self.boundary_timestep is not None:  # an adapter may go into either expert (load_lora)
            limits["loras"] = {**limits["loras"], "load_into_transformer_2": True}
        limits["cache"] = self.cache_limits()
        return limits

    # ----------------------------------------------------------------------------------------------
    # The stages

    def make_scheduler(self, name):
        config, overrides = self.scheduler_config, {}
        if (name or config.get("_class_name")) in ("flow_match_euler", "FlowMatchEulerDiscreteScheduler"):
            # diffusers' Euler class has no prediction_type (it always takes a velocity); UniPC's
            # "flow_prediction" is no value of the beta-schedule family's setting, so it is left out.
            config = {k: v for k, v in config.items() if k != "prediction_type"}
            own = config.get("_class_name") == "FlowMatchEulerDiscreteScheduler"
            if "flow_shift" in config and "shift" not in config and not own:
                # Wan's schedule shift is part of the model (flow_shift: 3.0 at 480p, 5.0 at 720p); the Euler
                # class calls it `shift`, and from_config alone would drop it to 1.0. A folder whose own
                # scheduler is Euler keeps diffusers' reading: flow_shift is no Euler key, the shift is 1.
                overrides["shift"] = float(config["flow_shift"])
        return _Fp32Latents(make_scheduler(name, config, **overrides))

    def schedule_options(self, scheduler, shape):
        # diffusers' WanPipeline passes no sigmas: the Euler scheduler's own over its training range.
        return (
            {"pipeline_sigmas": False} if isinstance(scheduler.inner, FlowMatchEulerDiscreteScheduler) else {}
        )

    def denoise_extras(self, shape, text_len):
        """The transformer's (cos, sin) RoPE tables for this latent video (host float64 -> fp32, as
        WanTransformer3DModel.rope), on the devices."""
        c = self.transformer_config
        grid = tuple(d // p for d, p in zip(shape[:3], c.patch_size, strict=True))
        return self.put_replicated(wan_rope(grid, c.attention_head_dim, c.rope_max_seq_len))

    def tokenize(self, texts, settings):
        tokens = tokenize_wan_prompts(self.tokenizer, texts, settings["max_sequence_length"])
        return tokens.input_ids, tokens.attention_mask

    def encode_prompt(self, states, ids, mask):
        """ids, mask [T, L] -> embeds [T, L, D] in the model dtype."""
        return encode_wan_prompts(self.merged("text_encoder", states["text_encoder"]), ids, mask).astype(
            self.dtype
        )

    def noise_shape(self, settings):
        f, frames = self.spatial_factor, (settings["num_frames"] - 1) // self.temporal_factor + 1
        return (frames, settings["height"] // f, settings["width"] // f, self.vae_config.z_dim)

    @property
    def latent_dtype(self):
        return jnp.float32

    def denoiser(self, state, embeds, rows, rope, *, shape, do_cfg):
        embeds = embeds.astype(self.dtype)

        def model(x, t, i):
            transformer, x = self.merged_per_step(state, x)
            # diffusers: latents.to(transformer_dtype), t.expand(B) (UniPC's integer t, untouched).
            return transformer(x.astype(self.dtype), jnp.broadcast_to(t, (x.shape[0],)), embeds, rope)

        return model

    def normalized(self, latents):
        """The VAE's latents as the loop holds them: diffusers' (z - latents_mean) * (1 / latents_std), per
        channel, in fp32 (image-to-video's conditions; `decode` undoes it)."""
        cfg = self.vae_config
        inv_std = 1.0 / jnp.asarray(cfg.latents_std, jnp.float32)
        return (latents.astype(jnp.float32) - jnp.asarray(cfg.latents_mean, jnp.float32)) * inv_std

    def decode(self, vae_state, latents, *, shape):
        # Weights gathered whole (a no-op without shard_over): besides the usual reason, XLA's partitioner
        # computes a 3x3 conv wrongly when its kernel is split beside a spatially split input on a 2-D mesh
        # (docs/weights.md, Found), which is what the spatial split below would otherwise meet.
        vae = self.merged("vae", vae_state)
        cfg = self.vae_config
        # diffusers: latents / (1 / std) + mean, per channel, fp32 (the same roundings as its two tensors).
        inv_std = 1.0 / jnp.asarray(cfg.latents_std, jnp.float32)
        z = latents.astype(jnp.float32) / inv_std + jnp.asarray(cfg.latents_mean, jnp.float32)
        constrain = None
        if self.placement is not None:
            b, _, h, w, _ = latents.shape
            constrain = decode_constraint(self.placement.mesh, b, h, w)
        video = vae.decode(z, constrain)  # [B, F, H, W, 3] in [-1, 1]
        return jnp.clip(video / 2 + 0.5, 0.0, 1.0)


def two_experts(index: dict) -> list[str]:
    """The model_index.json keys that make a Wan 2.2 two-expert folder (a transformer for the high-noise
    steps, transformer_2 for those below boundary_ratio)."""
    keys = (("transformer_2", index.get("transformer_2")), ("boundary_ratio", index.get("boundary_ratio")))
    return [name for name, value in keys if value not in (None, [None, None])]


def decode_constraint(mesh: Mesh, batch: int, height: int, width: int) -> Callable:
    """x [B, T, H, W, C] -> x pinned to `decode_sharding`, except a map whose split dimension has fewer than
    MIN_ROWS rows per device, which stays whole across the spatial axes (batch split only): XLA's partitioner
    computes wrong convolutions on such maps (models/parallel/small_maps.py; a 16x16 video, 2x2 latents, on data 2
    x context 4 decoded 0.33 max abs pixel off one device)."""
    split = decode_sharding(mesh, batch, height, width)
    axis = 2 if height > width else 3
    names = split.spec[axis]
    sizes = dict(mesh.shape)
    ways = math.prod(sizes[a] for a in ((names,) if isinstance(names, str) else names or ()))
    whole = NamedSharding(mesh, P(split.spec[0], None, None, None, None))

    def constrain(x):
        small = x.shape[axis] < MIN_ROWS * ways
        return jax.lax.with_sharding_constraint(x, whole if small else split)

    return constrain


def decode_sharding(mesh: Mesh, batch: int, height: int, width: int) -> NamedSharding:
    """The VAE decode's activation sharding, for every [B, T, H, W, C] array of the decode program: the batch
    over the batch axes (data, cfg where they divide it, as the denoise loop's), the larger spatial dimension
    (the width on a tie) over every other mesh axis larger than 1, so one video on an 8-device pool decodes
    split 8 ways instead of replicated. `height`, `width`: the latents' (any level's split is the same axes).

    No divisibility rule: a dimension that does not divide (a 240x416 video's 52 latent columns over 8) is
    split unevenly, XLA padding the last shard, and the convs' halos are exchanged between neighbours; the
    decoded video equals the single-device one either way (tests/parallel/test_wan_layouts.py). The memory
    this saves is in docs/wan.md (VAE, "Split over the pool's devices")."""
    sizes = dict(mesh.shape)
    batch_axes = batch_axes_for(mesh, batch) or ()
    rest = tuple(a for a in mesh.axis_names if sizes[a] > 1 and a not in batch_axes)
    spatial = (rest[0] if len(rest) == 1 else rest) if rest else None
    spec = [batch_axes or None, None, None, None, None]
    spec[2 if height > width else 3] = spatial
    return NamedSharding(mesh, P(*spec))
