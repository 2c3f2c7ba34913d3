"""The SDXL text-to-image pipeline: tokenize -> two CLIP encoders -> one compiled denoising loop -> VAE decode.

Mirrors diffusers' StableDiffusionXLPipeline (the reference it is tested against) on the shared pipeline
contract (`base.py`) and denoising loop (`denoise_loop.py`); what is here is SDXL's own: the two encoders and
their pooled projection, the UNet call with its micro-conditioning, the VAE's latent scaling. Three compiled
programs, one per stage, so stage times can be reported:

    text_encode  ids [T, 77] x 2 (T = prompts, + negatives with CFG) -> embeds [B or 2B, 77, D1+D2], pooled
    denoise      seeds' key data [B, 2] (or latents [B, h, w, C]), embeds, ... -> latents (a lax.while_loop)
    vae_decode   latents [B, h, w, C]                                         -> images [B, H, W, 3] in [0, 1]

Everything that varies per request (prompt embeddings, guidance scale, seeds, the schedule's timesteps and
sigmas, the step count) is a traced input, so only a new shape (bucket, batch) or a new scheduler compiles.
Whether CFG runs at all is static (it doubles the UNet batch); `warm_up` compiles both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.attention import AttentionSettings
from meshserve.models.checkpoints.loading import read_json
from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_SHARDING_RULES
from meshserve.models.components.autoencoder_kl import load_autoencoder_kl
from meshserve.models.components.clip import SHARDING_RULES as CLIP_SHARDING_RULES
from meshserve.models.components.clip import load_clip_text_model
from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize
from meshserve.models.engine.common import PipelineError, PipelineOutput, to_list
from meshserve.models.engine.denoise_loop import denoise_loop, interleave
from meshserve.models.engine.pipeline import (
    MAX_IMAGES,
    MAX_STEPS,
    DiffusionPipeline,
    folder_serving_defaults,
    image_limits,
    to_host,
)
from meshserve.models.engine.seeds import initial_noise, per_row, row_keys, row_seeds
from meshserve.models.parallel.placement import Placement, gathered, gathered_per_step
from meshserve.models.sdxl.unet_2d_condition import SHARDING_RULES as UNET_SHARDING_RULES
from meshserve.models.sdxl.unet_2d_condition import Attention as UNetAttention
from meshserve.models.sdxl.unet_2d_condition import load_unet

__all__ = ["StableDiffusionXLPipeline", "MAX_STEPS", "MAX_IMAGES"]


class StableDiffusionXLPipeline(DiffusionPipeline):
    family = "sdxl"
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
        folder = Path(folder)
        self.folder = folder
        self.model_id = model_id or folder.name
        self.dtype = jnp.dtype(dtype)
        settings = attention or AttentionSettings()
        # Only the UNet (nearly all the FLOPs) runs attention on the mesh; the text encoders (77 tokens) and
        # the VAE run plain kernels, their batch split by whatever sharding it carries, their weights placed
        # by their own rules tables.
        plain = dataclasses.replace(settings, mesh=None)
        self.placement = placement
        text_place = placement.placer(CLIP_SHARDING_RULES) if placement else None
        index = read_json(folder / "model_index.json")
        self.force_zeros_for_empty_prompt = bool(index.get("force_zeros_for_empty_prompt", True))
        self.folder_defaults = folder_serving_defaults(folder)

        self.tokenizers = [
            load_clip_tokenizer(folder / "tokenizer"),
            load_clip_tokenizer(folder / "tokenizer_2"),
        ]
        text_encoders = [
            load_clip_text_model(folder / "text_encoder", dtype=self.dtype, settings=plain, place=text_place),
            load_clip_text_model(
                folder / "text_encoder_2", dtype=self.dtype, settings=plain, place=text_place
            ),
        ]
        unet = load_unet(
            folder / "unet",
            dtype=self.dtype,
            settings=settings,
            place=placement.placer(UNET_SHARDING_RULES) if placement else None,
        )
        if placement:
            heads = {m.heads for _, m in nnx.iter_graph(unet) if isinstance(m, UNetAttention)}
            placement.validate_heads(heads, settings.context_strategy)
        # The VAE decodes in fp32 whatever the pipeline dtype: SDXL's VAE overflows in fp16 (diffusers'
        # force_upcast), and decoding is a small share of the time.
        vae = load_autoencoder_kl(
            folder / "vae",
            dtype=jnp.float32,
            settings=plain,
            place=placement.placer(VAE_SHARDING_RULES) if placement else None,
        )
        self.unet_config = unet.config
        self.vae_config = vae.config
        self.projection_dim = text_encoders[1].config.projection_dim
        self.scheduler_config = read_json(folder / "scheduler" / "scheduler_config.json")
        self.scheduler(None)  # fail at load time on an unsupported default scheduler

        self.split_modules(
            {"text_encoder": text_encoders[0], "text_encoder_2": text_encoders[1], "unet": unet, "vae": vae}
        )
        self._text_states = {k: self._states[k] for k in ("text_encoder", "text_encoder_2")}

    # ----------------------------------------------------------------------------------------------
    # What the serving layer reads

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        # Latents must halve cleanly at every UNet downsampling; never less than 8, the VAE's usual factor.
        downsamples = len(self.unet_config.down_block_types) - 1
        return max(8, self.vae_scale_factor * 2**downsamples)

    @property
    def defaults(self) -> dict:
        size = self.unet_config.sample_size * self.vae_scale_factor
        return {
            "width": size,
            "height": size,
            "num_inference_steps": 30 if size >= 512 else 4,
            "guidance_scale": 5.0,
            **self.folder_defaults,  # what the model was made to be served with (meshserve.json)
        }

    @property
    def limits(self) -> dict:
        return image_limits(self.size_multiple, self.defaults["width"])

    # ----------------------------------------------------------------------------------------------
    # The three stages (pure functions of state + traced inputs)

    def _text_encode(self, states, ids, ids_2, keep, *, prompts: int, n: int, do_cfg: bool):
        """ids [T, 77] (prompts, then negatives with CFG); keep [B]: rows whose negative embedding is kept
        (False: zeros, diffusers' force_zeros_for_empty_prompt). Returns the UNet's conditioning, interleaved
        [u0, c0, u1, c1, ...] with CFG: embeds [B or 2B, 77, D1+D2], pooled [B or 2B, P]."""
        # Weights split over shard_over are gathered where used (placement.gather_weights says why).
        te = nnx.merge(
            self._graphs["text_encoder"],
            gathered(self.placement, states["text_encoder"], CLIP_SHARDING_RULES),
        )
        te2 = nnx.merge(
            self._graphs["text_encoder_2"],
            gathered(self.placement, states["text_encoder_2"], CLIP_SHARDING_RULES),
        )
        out, out_2 = te(ids), te2(ids_2)
        embeds = jnp.concatenate([out.hidden_states[-2], out_2.hidden_states[-2]], axis=-1)
        pooled = out_2.text_embeds  # the projection of the second encoder
        embeds, pooled = _repeat(embeds, n, prompts), _repeat(pooled, n, prompts)
        if do_cfg:
            batch = prompts * n
            neg = jnp.where(keep[:, None, None], embeds[batch:], 0.0)
            neg_pooled = jnp.where(keep[:, None], pooled[batch:], 0.0)
            embeds = interleave(neg, embeds[:batch])  # each sample's uncond row, then its cond row
            pooled = interleave(neg_pooled, pooled[:batch])
        return embeds, pooled

    def _denoise(
        self,
        unet_state,
        schedule,
        latents,
        key_data,
        embeds,
        pooled,
        guidance,
        *,
        scheduler,
        do_cfg: bool,
        latent_shape: tuple[int, ...],
    ):
        """latents [B, h, w, C] float32 or None (then drawn from each row's key); key_data [B, 2];
        embeds [2B or B, S, D]; guidance [B]. Returns (latents, steps_done)."""
        keys = row_keys(key_data)
        if latents is None:
            latents = initial_noise(keys, latent_shape)
        latents = self.constrain((latents * scheduler.init_noise_sigma(schedule)).astype(self.dtype))
        embeds, pooled = embeds.astype(self.dtype), pooled.astype(self.dtype)
        # Micro-conditioning: (original size, crop top-left, target size), the same for both CFG halves.
        height, width = (d * self.vae_scale_factor for d in latent_shape[:2])
        time_ids = jnp.tile(
            jnp.asarray([[height, width, 0, 0, height, width]], self.dtype), (embeds.shape[0], 1)
        )

        def model(x, t):
            # Merged in the loop body; FSDP-split weights gathered per step, tied to this step's x so XLA cannot
            # hoist the gathers out of the loop (which keeps the whole UNet gathered: docs/weights.md).
            state, x = gathered_per_step(self.placement, unet_state, x, UNET_SHARDING_RULES)
            unet = nnx.merge(self._graphs["unet"], state)
            return unet(x, jnp.broadcast_to(t, (x.shape[0],)), embeds, text_embeds=pooled, time_ids=time_ids)

        return denoise_loop(
            model,
            scheduler,
            schedule,
            latents,
            keys,
            guidance,
            do_cfg=do_cfg,
            on_step=self.step_reporter,
            constrain=self.constrain,
        )

    def _vae_decode(self, vae_state, latents):
        vae = nnx.merge(self._graphs["vae"], gathered(self.placement, vae_state, VAE_SHARDING_RULES))
        cfg = self.vae_config
        latents = latents.astype(jnp.float32)
        if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
            latents = latents * jnp.asarray(cfg.latents_std) / cfg.scaling_factor + jnp.asarray(
                cfg.latents_mean
            )
        else:
            latents = latents / cfg.scaling_factor
            if getattr(cfg, "shift_factor", None) is not None:
                latents = latents + cfg.shift_factor
        image = vae.decode(latents)  # [B, H, W, 3] in [-1, 1]
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
        seed: int | Sequence[int] | None = None,
        latents=None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        output_type: str = "pil",
        callback: Callable[[int, int], bool | None] | None = None,
    ):
        """Generates images. `latents` takes diffusers' layout [B, C, h, w] (B = prompts x images per prompt)."""
        prompts = to_list(prompt, "prompt")
        n = num_images_per_prompt
        defaults = self.defaults
        height = int(defaults["height"] if height is None else height)
        width = int(defaults["width"] if width is None else width)
        steps = int(defaults["num_inference_steps"] if num_inference_steps is None else num_inference_steps)
        self.check_request(height, width, steps, n, output_type)
        batch = len(prompts) * n
        guidance = per_row(
            guidance_scale if guidance_scale is not None else defaults["guidance_scale"],
            len(prompts),
            n,
            "guidance_scale",
            float,
        )
        negatives = _per_prompt(negative_prompt, len(prompts))
        do_cfg = bool(np.any(np.asarray(guidance) > 1.0))
        sched, schedule, steps = self.schedule(scheduler, steps)
        seeds = row_seeds(seed, len(prompts), n)
        latent_shape = (
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
            self.unet_config.in_channels,
        )
        if latents is not None:
            latents = np.transpose(
                np.asarray(latents, np.float32), (0, 2, 3, 1)
            )  # [B, C, h, w] -> [B, h, w, C]
            if latents.shape != (batch, *latent_shape):
                raise PipelineError(
                    f"latents: expected shape {(batch, latent_shape[2], *latent_shape[:2])}, "
                    f"got {(latents.shape[0], latents.shape[3], *latents.shape[1:3])}"
                )
            latents = self.put_batch(latents)
        timings = {}
        compiled_before = self.compilations

        # 1. Text: one encoder call over prompts and (when needed) negatives together.
        t0 = time.perf_counter()
        texts = prompts + ([neg or "" for neg in negatives] if do_cfg else [])
        keep = np.repeat([not (neg is None and self.force_zeros_for_empty_prompt) for neg in negatives], n)
        embeds, pooled = self.programs.run(
            "text_encode",
            self._text_encode,
            {"prompts": len(prompts), "n": n, "do_cfg": do_cfg},
            self._text_states,
            self.put_batch(tokenize(self.tokenizers[0], texts)),
            self.put_batch(tokenize(self.tokenizers[1], texts)),
            self.put_batch(keep),
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
        )
        latents = self.run_denoise(
            steps,
            callback,
            lambda: self.programs.run("denoise", self._denoise, static, self._states["unet"], *inputs),
        )
        timings["denoise"] = time.perf_counter() - t0

        if output_type == "latent":  # diffusers' layout [B, C, h, w], before the VAE's scaling
            images = np.transpose(to_host(latents).astype(np.float32, copy=False), (0, 3, 1, 2))
            return PipelineOutput(
                images=images, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
            )

        # 3. Decode.
        t0 = time.perf_counter()
        images = self.programs.run("vae_decode", self._vae_decode, {}, self._states["vae"], latents)
        images = to_host(images).astype(np.float32, copy=False)
        timings["vae_decode"] = time.perf_counter() - t0
        return PipelineOutput.make(
            images, output_type, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
        )


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
    return values
