"""The Flux.1 text-to-image pipeline (dev, schnell, true CFG): CLIP pooled + T5 -> one compiled denoising loop
over packed latents -> VAE decode.

Mirrors diffusers' FluxPipeline (the reference it is tested against) on the shared pipeline contract
(`base.py`) and denoising loop (`denoise_loop.py`). What is Flux's own:

- Text: CLIP's pooled output (77 tokens) feeds the time embedding; T5 runs WITHOUT an attention mask on ids
  padded to `max_sequence_length` (diffusers does, so the pad positions are real, attended tokens), and its
  states are the transformer's text stream.
- Latents are 2x2-packed: [B, h, w, C] -> [B, (h/2)(w/2), 4C] (diffusers' `_pack_latents`, channels-last
  here), which is why sizes are multiples of 2 x the VAE's factor. The RoPE tables of the joint
  [text, image] sequence are built on the host in float64 (models/transformer_flux.flux_rope) once per size.
- Guidance: "dev" checkpoints (`guidance_embeds`) take the guidance scale per row as an input embedding (one
  pass per step); "schnell" has none (the scale is ignored). True CFG (`true_cfg_scale` > 1 AND a negative
  prompt, per row) adds a second pass with the negative text, interleaved [neg0, pos0, neg1, pos1, ...] as
  the shared CFG path is (so on a cfg=2 mesh the two passes run on the two sides of the cfg axis), combined
  `neg + s * (pos - neg)`. Whether any row runs it is static per batch; a row without it in a true-CFG batch
  gets its positive prediction selected (`jnp.where`), not s = 1 arithmetic.
- Schedule: flow-match Euler with diffusers' pipeline sigmas `linspace(1, 1/N, N)`, shifted by `mu` from the
  image sequence length (`use_dynamic_shifting`) or statically. Cached per (scheduler, steps, mu).
- The timestep enters as `round_to(round_to(t, dtype) / 1000, dtype)`, as diffusers' `t.to(dtype) / 1000`.

Three compiled programs, one per stage:

    text_encode  CLIP ids [T, 77], T5 ids [T, L] (T = prompts, + negatives with true CFG)
                 -> embeds [B or 2B, L, D], pooled [B or 2B, P]
    denoise      seeds' key data [B, 2] (or packed latents [B, S, 4C]), embeds, pooled, guidance [B],
                 true_cfg [B], cfg_rows [B], rope tables -> packed latents (a lax.while_loop)
    vae_decode   packed latents -> images [B, H, W, 3] in [0, 1] (unpacked, z / scaling + shift, VAE in fp32)

Prompt, seed, guidance, true_cfg_scale and the step count are traced inputs: only a new shape (size, batch,
text length), a new scheduler or switching true CFG on or off compiles.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.attention import AttentionSettings
from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_SHARDING_RULES
from meshserve.models.components.autoencoder_kl import load_autoencoder_kl
from meshserve.models.components.clip import SHARDING_RULES as CLIP_SHARDING_RULES
from meshserve.models.components.clip import load_clip_text_model
from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize
from meshserve.models.components.t5 import SHARDING_RULES as T5_SHARDING_RULES
from meshserve.models.components.t5 import load_t5_encoder
from meshserve.models.components.t5_tokenizer import load_t5_tokenizer, tokenize_t5
from meshserve.models.engine.common import PipelineError, PipelineOutput, to_list
from meshserve.models.engine.denoise_loop import denoise_loop, interleave
from meshserve.models.engine.pipeline import DiffusionPipeline, image_limits, to_host
from meshserve.models.engine.seeds import initial_noise, per_row, row_keys, row_seeds
from meshserve.models.flux.transformer_flux import SHARDING_RULES as FLUX_SHARDING_RULES
from meshserve.models.flux.transformer_flux import flux_rope, image_ids, load_flux_transformer, round_to
from meshserve.models.parallel.placement import Placement, gathered, gathered_per_step
from meshserve.models.schedulers import flux_mu, pad_schedule

__all__ = ["FluxPipeline", "pack_latents", "unpack_latents"]

# diffusers' FluxPipeline refuses a longer T5 text (`check_inputs`); it is also its default for dev.
MAX_SEQUENCE_LENGTH = 512
# FLUX.1-schnell's model card: "max_sequence_length <= 256" (it was distilled with 256-token prompts).
SCHNELL_MAX_SEQUENCE_LENGTH = 256
# The scheduler class the folder's scheduler_config.json must name (flow matching: velocity prediction).
_FLOW_CLASS = "FlowMatchEulerDiscreteScheduler"
# The schedulers a Flux model offers: diffusers' FluxPipeline runs FlowMatchEulerDiscreteScheduler with its own
# sigmas. UniPC (the other flow scheduler here) is implemented and tested for Wan's schedule only, not with
# Flux's pipeline sigmas and shift, so it is not offered.
FLUX_SCHEDULER_NAMES: tuple[str, ...] = ("flow_match_euler",)


def pack_latents(x):
    """[B, h, w, C] -> [B, (h/2)(w/2), 4C]: diffusers' `_pack_latents` from channels-last latents (each token's
    features ordered (C, 2, 2), as diffusers' permute(0, 2, 4, 1, 3, 5) of [B, C, h, w])."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)  # [B, h/2, w/2, C, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x, h: int, w: int):
    """The inverse of `pack_latents`: [B, (h/2)(w/2), 4C] -> [B, h, w, C]."""
    b, _, c4 = x.shape
    c = c4 // 4
    x = x.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)  # [B, h/2, 2, w/2, 2, C]
    return x.reshape(b, h, w, c)


class FluxPipeline(DiffusionPipeline):
    family = "flux"
    task = "text-to-image"

    def __init__(
        self,
        folder: Path,
        *,
        dtype=jnp.float32,
        model_id: str | None = None,
        attention: AttentionSettings | None = None,
        placement: Placement | None = None,
        max_programs: int | None = None,
    ):
        super().__init__(max_programs=max_programs)
        # The schedule cache takes the dynamic shift too (base.py caches per (name, steps) only).
        self._schedules = lru_cache(maxsize=256)(self._make_schedule)
        self._ropes = lru_cache(maxsize=64)(self._make_rope)
        folder = Path(folder)
        self.folder = folder
        self.model_id = model_id or folder.name
        self.dtype = jnp.dtype(dtype)
        settings = attention or AttentionSettings()
        # Only the transformer runs attention on the mesh; the text encoders (77 and L tokens, once per
        # request) and the VAE run plain kernels, their batch split by whatever sharding it carries.
        plain = dataclasses.replace(settings, mesh=None)
        self.placement = placement

        self.scheduler_config = read_json(folder / "scheduler" / "scheduler_config.json")
        if self.scheduler_config.get("_class_name") != _FLOW_CLASS:
            raise CheckpointError(
                f"{folder / 'scheduler'}: a Flux pipeline needs {_FLOW_CLASS}, "
                f"got {self.scheduler_config.get('_class_name')!r}"
            )
        self.tokenizer = load_clip_tokenizer(folder / "tokenizer")
        self.tokenizer_2 = load_t5_tokenizer(folder / "tokenizer_2")
        text_encoder = load_clip_text_model(
            folder / "text_encoder",
            dtype=self.dtype,
            settings=plain,
            place=placement.placer(CLIP_SHARDING_RULES) if placement else None,
        )
        text_encoder_2 = load_t5_encoder(
            folder / "text_encoder_2",
            dtype=self.dtype,
            place=placement.placer(T5_SHARDING_RULES) if placement else None,
        )
        transformer = load_flux_transformer(
            folder / "transformer",
            dtype=self.dtype,
            settings=settings,
            place=placement.placer(FLUX_SHARDING_RULES) if placement else None,
        )
        if placement:
            placement.validate_heads({transformer.config.num_attention_heads}, settings.context_strategy)
        # The VAE decodes in fp32 whatever the pipeline dtype (diffusers runs it in the pipeline's dtype):
        # it runs once per image, not once per step, so fp32 costs little and keeps bf16 rounding out of
        # the pixels.
        vae = load_autoencoder_kl(
            folder / "vae",
            dtype=jnp.float32,
            settings=plain,
            place=placement.placer(VAE_SHARDING_RULES) if placement else None,
        )
        self.transformer_config = transformer.config
        self.vae_config = vae.config
        # Whether the VAE config states its sample size (the dataclass fills in diffusers' 32 otherwise).
        self._vae_sample_size = read_json(folder / "vae" / "config.json").get("sample_size")
        if self.transformer_config.in_channels != 4 * self.vae_config.latent_channels:
            raise CheckpointError(
                f"{folder}: transformer in_channels {self.transformer_config.in_channels} is not 4 x the "
                f"VAE's latent_channels {self.vae_config.latent_channels} (2x2 packing)"
            )
        self.scheduler(None)  # fail at load time on an unsupported scheduler config

        self.split_modules(
            {
                "text_encoder": text_encoder,
                "text_encoder_2": text_encoder_2,
                "transformer": transformer,
                "vae": vae,
            }
        )
        self._text_states = {k: self._states[k] for k in ("text_encoder", "text_encoder_2")}

    # ----------------------------------------------------------------------------------------------
    # What the serving layer reads

    @property
    def guidance_embeds(self) -> bool:
        """A "dev"-type checkpoint (guidance distilled into an input embedding); False: "schnell"-type."""
        return bool(self.transformer_config.guidance_embeds)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        # The VAE's factor x the 2x2 packing (16 for FLUX.1).
        return self.vae_scale_factor * 2

    @property
    def max_sequence_length(self) -> int:
        """The longest (and default) T5 text: 512 for dev, 256 for schnell."""
        return MAX_SEQUENCE_LENGTH if self.guidance_embeds else SCHNELL_MAX_SEQUENCE_LENGTH

    @property
    def defaults(self) -> dict:
        size = self._vae_sample_size
        if size is None:  # diffusers' default_sample_size (128 latents) x the VAE factor: 1024 for FLUX.1
            height = width = 128 * self.vae_scale_factor
        elif isinstance(size, int | float):
            height = width = int(size)
        else:
            height, width = (int(s) for s in size)
        dev = self.guidance_embeds
        return {
            "width": width,
            "height": height,
            # FluxPipeline's own default (28) and the guidance its docs give for dev; schnell: 4 steps, no
            # guidance embedding. true_cfg_scale's presence tells the serving side the field is accepted.
            "num_inference_steps": 28 if dev else 4,
            "guidance_scale": 3.5 if dev else 0.0,
            "true_cfg_scale": 1.0,
        }

    @property
    def limits(self) -> dict:
        d = self.defaults
        limits = image_limits(self.size_multiple, max(d["width"], d["height"]))
        limits["schedulers"] = list(FLUX_SCHEDULER_NAMES)
        limits["max_sequence_length"] = self.max_sequence_length
        return limits

    def batch_key(self, request) -> tuple:
        # The T5 text length is a shape: two jobs share a batch only with equal lengths.
        length = request.get("max_sequence_length") or self.max_sequence_length
        return (*super().batch_key(request), int(length))

    def warm_up(
        self,
        buckets: Sequence[tuple[int, int]] | None = None,
        batch_sizes: Sequence[int] = (1,),
        num_inference_steps: int | None = None,
    ) -> float:
        """Compiles every stage for each (width, height) bucket and batch size, with and without true CFG
        (the guidance scale is traced: it needs no second program here)."""
        t0 = time.perf_counter()
        d = self.defaults
        for width, height in buckets or [(d["width"], d["height"])]:
            for b in batch_sizes:
                for true_cfg in (False, True):
                    self(
                        [""] * b,
                        negative_prompt="" if true_cfg else None,
                        true_cfg_scale=2.0 if true_cfg else 1.0,
                        height=height,
                        width=width,
                        num_inference_steps=1,
                        seed=0,
                        output_type="np",
                    )
        return time.perf_counter() - t0

    # ----------------------------------------------------------------------------------------------
    # Host-side caches

    def scheduler(self, name: str | None):
        if name is not None and name not in (*FLUX_SCHEDULER_NAMES, _FLOW_CLASS):
            raise PipelineError(
                f"scheduler must be one of {list(FLUX_SCHEDULER_NAMES)} for a Flux model, got {name!r}"
            )
        return super().scheduler(name)

    def schedule(self, name: str | None, steps: int, mu: float | None = None):
        """(scheduler, padded schedule on the pool's devices, steps), cached per (name, steps, mu)."""
        return self._schedules(name, int(steps), mu)

    def _make_schedule(self, name, steps, mu=None):
        sched = self.scheduler(name)
        # diffusers' FluxPipeline passes sigmas = linspace(1, 1/N, N) unless the config asks for the
        # scheduler's own flow sigmas.
        pipeline_sigmas = not self.scheduler_config.get("use_flow_sigmas", False)
        schedule = sched.schedule(steps, mu=mu, pipeline_sigmas=pipeline_sigmas)
        real = int(schedule.timesteps.shape[0])
        return sched, self.put_replicated(pad_schedule(schedule, self.limits["max_steps"])), real

    def _make_rope(self, text_len: int, grid_h: int, grid_w: int):
        """The (cos, sin) tables [L + grid_h * grid_w, head_dim] of the joint sequence, on the devices:
        text ids all zero (diffusers' text_ids), image ids [0, row, col]."""
        ids = np.concatenate([np.zeros((text_len, 3), np.float32), image_ids(grid_h, grid_w)], axis=0)
        return self.put_replicated(flux_rope(ids, self.transformer_config.axes_dims_rope))

    # ----------------------------------------------------------------------------------------------
    # The three stages (pure functions of state + traced inputs)

    def _text_encode(self, states, clip_ids, t5_ids, *, prompts: int, n: int, do_cfg: bool):
        """clip_ids [T, 77], t5_ids [T, L] (prompts, then negatives with true CFG) -> the transformer's
        conditioning, interleaved [neg0, pos0, neg1, pos1, ...] with true CFG: embeds [B or 2B, L, D],
        pooled [B or 2B, P]."""
        clip = nnx.merge(
            self._graphs["text_encoder"],
            gathered(self.placement, states["text_encoder"], CLIP_SHARDING_RULES),
        )
        t5 = nnx.merge(
            self._graphs["text_encoder_2"],
            gathered(self.placement, states["text_encoder_2"], T5_SHARDING_RULES),
        )
        pooled = clip(clip_ids).pooler_output.astype(self.dtype)
        embeds = t5(t5_ids).last_hidden_state.astype(self.dtype)  # no mask, as diffusers
        embeds, pooled = _repeat(embeds, n, prompts), _repeat(pooled, n, prompts)
        if do_cfg:
            batch = prompts * n
            embeds = interleave(embeds[batch:], embeds[:batch])
            pooled = interleave(pooled[batch:], pooled[:batch])
        return embeds, pooled

    def _denoise(
        self,
        transformer_state,
        schedule,
        latents,
        key_data,
        embeds,
        pooled,
        guidance,
        true_cfg,
        cfg_rows,
        rope,
        *,
        scheduler,
        do_cfg: bool,
        latent_shape: tuple[int, int, int],
    ):
        """latents [B, S, 4C] packed, or None (then drawn from each row's key in the unpacked channels-last
        shape latent_shape = (h, w, C) and packed, so a seed gives the same image at any batch and layout);
        embeds [2B or B, L, D]; guidance, true_cfg [B] float32; cfg_rows [B] bool. Returns (latents, steps)."""
        keys = row_keys(key_data)
        if latents is None:
            latents = pack_latents(initial_noise(keys, latent_shape))
        dtype = self.dtype
        latents = self.constrain((latents * scheduler.init_noise_sigma(schedule)).astype(dtype))
        embeds, pooled = embeds.astype(dtype), pooled.astype(dtype)
        # The guidance embedding's input (dev only), the same for a row's two true-CFG passes (diffusers).
        g = None
        if self.guidance_embeds:
            g = jnp.repeat(guidance, 2) if do_cfg else guidance

        def model(x, t):
            # Weights split over FSDP axes are gathered per step, tied to this step's x (see sdxl.py).
            state, x = gathered_per_step(self.placement, transformer_state, x, FLUX_SHARDING_RULES)
            transformer = nnx.merge(self._graphs["transformer"], state)
            # diffusers: t.expand(B).to(latents.dtype) / 1000, in the latents' dtype.
            timestep = round_to(round_to(t, dtype) / 1000, dtype)
            timestep = jnp.broadcast_to(timestep, (x.shape[0],))
            out = transformer(x, embeds, pooled, timestep, rope, g)
            if do_cfg:
                # Rows without true CFG: their "negative" prediction is their positive one, so the combine
                # neg + s * (pos - neg) = pos + s * 0 returns the positive prediction exactly.
                pairs = out.reshape(-1, 2, *out.shape[1:])
                neg = jnp.where(cfg_rows.reshape(-1, *([1] * (out.ndim - 1))), pairs[:, 0], pairs[:, 1])
                out = interleave(neg, pairs[:, 1])
            return out

        return denoise_loop(
            model,
            scheduler,
            schedule,
            latents,
            keys,
            true_cfg,
            do_cfg=do_cfg,
            on_step=self.step_reporter,
            constrain=self.constrain,
        )

    def _vae_decode(self, vae_state, latents, *, latent_shape: tuple[int, int, int]):
        vae = nnx.merge(self._graphs["vae"], gathered(self.placement, vae_state, VAE_SHARDING_RULES))
        cfg = self.vae_config
        h, w, _ = latent_shape
        z = unpack_latents(latents.astype(jnp.float32), h, w) / cfg.scaling_factor
        if cfg.shift_factor is not None:
            z = z + cfg.shift_factor
        image = vae.decode(z)  # [B, H, W, 3] in [-1, 1]
        return jnp.clip(image / 2 + 0.5, 0.0, 1.0)

    # ----------------------------------------------------------------------------------------------
    # Host side

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str | None] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | Sequence[float] | None = None,
        true_cfg_scale: float | Sequence[float] | None = None,
        seed: int | Sequence[int] | None = None,
        latents=None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        max_sequence_length: int | None = None,
        output_type: str = "pil",
        callback: Callable[[int, int], bool | None] | None = None,
    ):
        """Generates images. `latents` takes diffusers' packed layout [B, (h/2)(w/2), 4C] (B = prompts x images
        per prompt); output_type "latent" returns that layout, "np" [B, H, W, 3] floats in [0, 1].

        Per row (one value, one per prompt or one per image): guidance_scale (dev: the guidance embedding;
        schnell: ignored), true_cfg_scale (> 1 with a negative prompt: a second, negative pass), seed.
        negative_prompt: one for all, or one per prompt (None: that prompt has no negative)."""
        prompts = to_list(prompt, "prompt")
        n = num_images_per_prompt
        defaults = self.defaults
        height = int(defaults["height"] if height is None else height)
        width = int(defaults["width"] if width is None else width)
        steps = int(defaults["num_inference_steps"] if num_inference_steps is None else num_inference_steps)
        self.check_request(height, width, steps, n, output_type)
        text_len = self.max_sequence_length if max_sequence_length is None else max_sequence_length
        if not isinstance(text_len, int | np.integer) or not 1 <= text_len <= self.max_sequence_length:
            raise PipelineError(
                f"max_sequence_length must be an integer between 1 and {self.max_sequence_length}, "
                f"got {max_sequence_length!r}"
            )
        text_len = int(text_len)
        batch = len(prompts) * n
        guidance = per_row(
            defaults["guidance_scale"] if guidance_scale is None else guidance_scale,
            len(prompts),
            n,
            "guidance_scale",
            float,
        )
        true_cfg = per_row(
            defaults["true_cfg_scale"] if true_cfg_scale is None else true_cfg_scale,
            len(prompts),
            n,
            "true_cfg_scale",
            float,
        )
        for name, values in (("guidance_scale", guidance), ("true_cfg_scale", true_cfg)):
            if not np.all(np.isfinite(values)):
                raise PipelineError(f"{name} must be a finite number")
        negatives = _per_prompt(negative_prompt, len(prompts))
        # diffusers' rule, per row: true CFG runs when the scale is > 1 AND a negative prompt is given.
        has_negative = np.repeat([neg is not None for neg in negatives], n)
        cfg_rows = has_negative & (np.asarray(true_cfg) > 1.0)
        do_cfg = bool(cfg_rows.any())

        f = self.vae_scale_factor
        latent_shape = (height // f, width // f, self.vae_config.latent_channels)
        grid_h, grid_w = latent_shape[0] // 2, latent_shape[1] // 2
        image_seq_len = grid_h * grid_w
        mu = flux_mu(image_seq_len, self.scheduler_config) if self._dynamic_shift(scheduler) else None
        sched, schedule, steps = self.schedule(scheduler, steps, mu)
        seeds = row_seeds(seed, len(prompts), n)
        if latents is not None:
            latents = np.asarray(latents, np.float32)
            expected = (batch, image_seq_len, 4 * latent_shape[2])
            if latents.shape != expected:
                raise PipelineError(f"latents: expected packed shape {expected}, got {latents.shape}")
            latents = self.put_batch(latents)
        timings = {}
        compiled_before = self.compilations

        # 1. Text: one call per encoder over the prompts and (with true CFG) the negatives.
        t0 = time.perf_counter()
        texts = prompts + ([neg or "" for neg in negatives] if do_cfg else [])
        embeds, pooled = self.programs.run(
            "text_encode",
            self._text_encode,
            {"prompts": len(prompts), "n": n, "do_cfg": do_cfg},
            self._text_states,
            self.put_batch(tokenize(self.tokenizer, texts)),
            self.put_batch(tokenize_t5(self.tokenizer_2, texts, text_len).input_ids),
        )
        embeds.block_until_ready()
        timings["text_encode"] = time.perf_counter() - t0

        # 2. The denoising loop, initial noise included: one program.
        t0 = time.perf_counter()
        static = {"scheduler": sched, "do_cfg": do_cfg, "latent_shape": latent_shape}
        inputs = (
            schedule,
            latents,
            self.put_keys(seeds),
            embeds,
            pooled,
            self.put_batch(np.float32(guidance)),
            self.put_batch(np.float32(true_cfg)),
            self.put_batch(cfg_rows),
            self._ropes(text_len, grid_h, grid_w),
        )
        latents = self.run_denoise(
            steps,
            callback,
            lambda: self.programs.run("denoise", self._denoise, static, self._states["transformer"], *inputs),
        )
        timings["denoise"] = time.perf_counter() - t0

        if output_type == "latent":  # diffusers' packed layout, before the VAE's scaling
            images = to_host(latents).astype(np.float32, copy=False)
            return PipelineOutput(
                images=images, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
            )

        # 3. Decode.
        t0 = time.perf_counter()
        images = self.programs.run(
            "vae_decode", self._vae_decode, {"latent_shape": latent_shape}, self._states["vae"], latents
        )
        images = to_host(images).astype(np.float32, copy=False)
        timings["vae_decode"] = time.perf_counter() - t0
        return PipelineOutput.make(
            images, output_type, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
        )

    def _dynamic_shift(self, name: str | None) -> bool:
        return bool(getattr(self.scheduler(name), "use_dynamic_shifting", False))


# --------------------------------------------------------------------------------------------------


def _repeat(x, n: int, prompts: int):
    """Repeats each prompt's rows n times (prompt-major, as diffusers does); negatives follow the prompts."""
    if n == 1:
        return x
    return jnp.repeat(x.reshape(-1, prompts, *x.shape[1:]), n, axis=1).reshape(-1, *x.shape[1:])


def _per_prompt(value, prompts: int) -> list:
    if value is None or isinstance(value, str):
        return [value] * prompts
    values = list(value)
    if len(values) != prompts:
        raise PipelineError(
            f"negative_prompt: expected {prompts} entries (one per prompt), got {len(values)}"
        )
    if not all(v is None or isinstance(v, str) for v in values):
        raise PipelineError("negative_prompt must be a string, None, or a list of strings / None")
    return values
