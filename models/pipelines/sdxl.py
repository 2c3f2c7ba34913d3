"""The SDXL text-to-image pipeline: tokenize -> two CLIP encoders -> one compiled denoising loop -> VAE decode.

Mirrors diffusers' StableDiffusionXLPipeline (the reference it is tested against) with three compiled
programs, one per stage, so stage times can be reported:

    text_encode  ids [2, B, 77]                       -> embeds [B, 77, D1+D2], pooled [B, P]
    denoise      latents [B, h, w, C], embeds, ...    -> latents            (a lax.while_loop over steps)
    vae_decode   latents [B, h, w, C]                 -> images [B, H, W, 3] in [0, 1]

Everything that varies per request (prompt embeddings, guidance scale, latents / seed, the schedule's
timesteps and sigmas) is a traced input, so only a new shape (bucket, batch, step count) or a new scheduler
compiles. Whether CFG runs at all is static (it doubles the UNet batch); `warm_up` compiles both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from meshserve.models.attention import AttentionSettings
from meshserve.models.autoencoder_kl import SHARDING_RULES as VAE_SHARDING_RULES
from meshserve.models.autoencoder_kl import load_autoencoder_kl
from meshserve.models.clip import SHARDING_RULES as CLIP_SHARDING_RULES
from meshserve.models.clip import load_clip_text_model
from meshserve.models.clip_tokenizer import load_clip_tokenizer, tokenize
from meshserve.models.loading import read_json
from meshserve.models.parallel.placement import Placement
from meshserve.models.pipelines.common import GenerationCancelled, PipelineError, PipelineOutput, to_list
from meshserve.models.schedulers import SCHEDULER_NAMES, make_scheduler
from meshserve.models.unet_2d_condition import SHARDING_RULES as UNET_SHARDING_RULES
from meshserve.models.unet_2d_condition import Attention as UNetAttention
from meshserve.models.unet_2d_condition import load_unet

MAX_STEPS = 200
MAX_IMAGES = 8


@dataclass
class _Programs:
    """Compiled-program bookkeeping: how many times each stage was traced (= compiled)."""

    traces: dict[str, int] = field(default_factory=lambda: {"text_encode": 0, "denoise": 0, "vae_decode": 0})
    compile_seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.traces.values())


class StableDiffusionXLPipeline:
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
    ):
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
        # One scheduler object per name: it is a static argument of the denoise program, so reusing the
        # instance keeps the jit cache hit (a fresh object would hash anew and recompile).
        self._schedulers: dict[str | None, object] = {}
        self._scheduler(None)  # fail at load time on an unsupported default scheduler

        # Split the modules into graph + state once: jitted functions take the state as an argument and
        # merge inside, so no Python walks the module tree per call (nnx.jit would, every call).
        self._graphs, self._states = {}, {}
        for name, module in (
            ("text_encoder", text_encoders[0]),
            ("text_encoder_2", text_encoders[1]),
            ("unet", unet),
            ("vae", vae),
        ):
            graph, state = nnx.split(module)
            self._graphs[name] = graph
            self._states[name] = state
        self._programs = _Programs()
        self._jit_text = jax.jit(self._text_encode)
        self._jit_denoise = jax.jit(self._denoise, static_argnames=("scheduler", "do_cfg"))
        self._jit_decode = jax.jit(self._vae_decode)

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
        }

    @property
    def limits(self) -> dict:
        default = self.defaults["width"]
        return {
            "size_multiple": self.size_multiple,
            "min_size": self.size_multiple,
            "max_size": max(2048, default * 2),
            "min_steps": 1,
            "max_steps": MAX_STEPS,
            "max_n": MAX_IMAGES,
            "schedulers": list(SCHEDULER_NAMES),
        }

    @property
    def compilations(self) -> int:
        return self._programs.total

    # ----------------------------------------------------------------------------------------------
    # The three stages (pure functions of state + traced inputs)

    def _text_encode(self, states, ids, ids_2):
        self._programs.traces["text_encode"] += 1
        te = nnx.merge(self._graphs["text_encoder"], states["text_encoder"])
        te2 = nnx.merge(self._graphs["text_encoder_2"], states["text_encoder_2"])
        out, out_2 = te(ids), te2(ids_2)
        embeds = jnp.concatenate([out.hidden_states[-2], out_2.hidden_states[-2]], axis=-1)  # [B, S, D1+D2]
        return embeds, out_2.text_embeds  # pooled: the projection of the second encoder, [B, P]

    def _denoise(
        self,
        unet_state,
        schedule,
        latents,
        embeds,
        pooled,
        time_ids,
        guidance,
        key,
        *,
        scheduler,
        do_cfg: bool,
    ):
        """latents [B, h, w, C]; embeds [2B or B, S, D]; guidance [B]. Returns (latents, steps_done).

        With CFG the UNet batch is interleaved per sample, [u0, c0, u1, c1, ...]: split over (data, cfg), every
        sample's two halves land on the two sides of the cfg axis, and the guidance combine is one exchange.
        """
        self._programs.traces["denoise"] += 1
        unet = nnx.merge(self._graphs["unet"], unet_state)
        num_steps = schedule.timesteps.shape[0]

        def body(carry):
            i, go, latents, sched_state, key = carry
            key, step_key = jax.random.split(key)
            x = _interleave(latents, latents) if do_cfg else latents
            x = self._constrain(scheduler.scale_model_input(schedule, x, i))
            t = jnp.broadcast_to(schedule.timesteps[i], (x.shape[0],))
            eps = unet(x, t, embeds, text_embeds=pooled, time_ids=time_ids)
            if do_cfg:
                eps = eps.reshape(-1, 2, *eps.shape[1:])
                eps_uncond, eps_cond = eps[:, 0], eps[:, 1]
                g = guidance.astype(eps.dtype)[:, None, None, None]
                eps = eps_uncond + g * (eps_cond - eps_uncond)
            latents, sched_state = scheduler.step(schedule, sched_state, eps, latents, i, step_key)
            latents = self._constrain(latents)
            # The host hears of every step and may stop the loop (cancel). Always compiled in, so a call with
            # and one without a callback share one program; the host round trip is tiny next to a UNet step.
            go = io_callback(self._on_step, jax.ShapeDtypeStruct((), jnp.bool_), i + 1, ordered=True)
            return i + 1, go, latents, sched_state, key

        carry = (jnp.int32(0), jnp.bool_(True), latents, scheduler.init_state(latents), key)
        i, _, latents, _, _ = jax.lax.while_loop(lambda c: (c[0] < num_steps) & c[1], body, carry)
        return latents, i

    def _constrain(self, x):
        return self.placement.constrain_batch(x) if self.placement else x

    def _vae_decode(self, vae_state, latents):
        self._programs.traces["vae_decode"] += 1
        vae = nnx.merge(self._graphs["vae"], vae_state)
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

    _step_listener: Callable | None = None
    _step_total: int = 0

    def _on_step(self, step) -> np.bool_:
        listener = self._step_listener
        if listener is None:
            return np.bool_(True)
        return np.bool_(listener(int(step), self._step_total) is not False)

    def _encode_prompts(self, prompts: list[str]):
        ids = tokenize(self.tokenizers[0], prompts)
        ids_2 = tokenize(self.tokenizers[1], prompts)
        return self._jit_text(self._states, jnp.asarray(ids), jnp.asarray(ids_2))

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
        defaults = self.defaults
        height = int(defaults["height"] if height is None else height)
        width = int(defaults["width"] if width is None else width)
        steps = int(defaults["num_inference_steps"] if num_inference_steps is None else num_inference_steps)
        self._check(height, width, steps, num_images_per_prompt, output_type)
        batch = len(prompts) * num_images_per_prompt
        guidance = _per_sample(
            guidance_scale if guidance_scale is not None else defaults["guidance_scale"],
            len(prompts),
            num_images_per_prompt,
            "guidance_scale",
            float,
        )
        negatives = _per_prompt(negative_prompt, len(prompts))
        do_cfg = bool(np.any(np.asarray(guidance) > 1.0))
        sched = self._scheduler(scheduler)
        schedule = sched.schedule(steps)
        timings = {}
        compiled_before = self.compilations

        # 1. Text: one encoder call over prompts and (when needed) negatives together.
        t0 = time.perf_counter()
        zero_negative = [n is None and self.force_zeros_for_empty_prompt for n in negatives]
        texts = prompts + ([n or "" for n in negatives] if do_cfg else [])
        embeds, pooled = self._encode_prompts(texts)
        embeds, pooled = (
            _repeat(embeds, num_images_per_prompt, len(prompts)),
            _repeat(pooled, num_images_per_prompt, len(prompts)),
        )
        if do_cfg:
            keep = jnp.asarray(np.repeat(~np.asarray(zero_negative), num_images_per_prompt))
            neg, neg_pooled = embeds[batch:], pooled[batch:]
            neg = jnp.where(keep[:, None, None], neg, 0.0)
            neg_pooled = jnp.where(keep[:, None], neg_pooled, 0.0)
            embeds = _interleave(neg, embeds[:batch])  # each sample's uncond row, then its cond row
            pooled = _interleave(neg_pooled, pooled[:batch])
        # Micro-conditioning: (original size, crop top-left, target size), the same for both CFG halves.
        time_ids = jnp.tile(
            jnp.asarray([[height, width, 0, 0, height, width]], embeds.dtype), (embeds.shape[0], 1)
        )
        embeds.block_until_ready()
        timings["text_encode"] = time.perf_counter() - t0

        # 2. Noise.
        shape = (
            batch,
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
            self.unet_config.in_channels,
        )
        seeds = _seeds(seed, len(prompts), num_images_per_prompt)
        if latents is not None:
            latents = jnp.transpose(
                jnp.asarray(latents, jnp.float32), (0, 2, 3, 1)
            )  # [B, C, h, w] -> [B, h, w, C]
            if latents.shape != shape:
                raise PipelineError(
                    f"latents: expected shape {(shape[0], shape[3], shape[1], shape[2])}, "
                    f"got {tuple(np.transpose(np.zeros(latents.shape), (0, 3, 1, 2)).shape)}"
                )
        else:
            latents = jnp.stack([jax.random.normal(jax.random.key(s), shape[1:], jnp.float32) for s in seeds])
        latents = (latents * sched.init_noise_sigma(schedule)).astype(self.dtype)
        key = jax.random.key(seeds[0] ^ 0x5EED)

        # 3. The denoising loop: one program.
        t0 = time.perf_counter()
        steps = int(schedule.timesteps.shape[0])  # DPM-Solver's clipped schedules can be shorter
        self._step_listener, self._step_total = callback, steps
        try:
            latents, done = self._jit_denoise(
                self._states["unet"],
                schedule,
                latents,
                embeds.astype(self.dtype),
                pooled.astype(self.dtype),
                time_ids.astype(self.dtype),
                jnp.asarray(guidance, jnp.float32),
                key,
                scheduler=sched,
                do_cfg=do_cfg,
            )
            done = int(done)
        finally:
            self._step_listener = None
        if done < steps:
            raise GenerationCancelled(f"stopped after {done} of {steps} steps")
        timings["denoise"] = time.perf_counter() - t0

        if output_type == "latent":  # diffusers' layout [B, C, h, w], before the VAE's scaling
            images = np.transpose(np.asarray(latents, dtype=np.float32), (0, 3, 1, 2))
            return PipelineOutput(
                images=images, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
            )

        # 4. Decode.
        t0 = time.perf_counter()
        images = np.asarray(self._jit_decode(self._states["vae"], latents), dtype=np.float32)
        timings["vae_decode"] = time.perf_counter() - t0
        return PipelineOutput.make(
            images, output_type, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
        )

    def _scheduler(self, name: str | None):
        if name not in self._schedulers:
            try:
                self._schedulers[name] = make_scheduler(name, self.scheduler_config)
            except ValueError as e:
                raise PipelineError(str(e)) from None
        return self._schedulers[name]

    def _check(self, height: int, width: int, steps: int, n: int, output_type: str) -> None:
        m = self.size_multiple
        for name, value in (("height", height), ("width", width)):
            if value % m or value < m:
                raise PipelineError(f"{name} must be a positive multiple of {m}, got {value}")
        if not 1 <= steps <= MAX_STEPS:
            raise PipelineError(f"num_inference_steps must be between 1 and {MAX_STEPS}, got {steps}")
        if not 1 <= n <= MAX_IMAGES:
            raise PipelineError(f"num_images_per_prompt must be between 1 and {MAX_IMAGES}, got {n}")
        if output_type not in ("pil", "np", "latent"):
            raise PipelineError(f"output_type must be 'pil', 'np' or 'latent', got {output_type!r}")

    def warm_up(
        self,
        buckets: Sequence[tuple[int, int]] | None = None,
        batch_sizes: Sequence[int] = (1,),
        num_inference_steps: int | None = None,
    ) -> float:
        """Compiles every stage for each (width, height) bucket and batch size, with and without CFG."""
        t0 = time.perf_counter()
        d = self.defaults
        for width, height in buckets or [(d["width"], d["height"])]:
            for b in batch_sizes:
                for g in (d["guidance_scale"], 1.0):
                    self(
                        [""] * b,
                        height=height,
                        width=width,
                        num_inference_steps=num_inference_steps,
                        guidance_scale=g,
                        seed=0,
                        output_type="np",
                    )
        self._programs.compile_seconds += time.perf_counter() - t0
        return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------


def _interleave(a, b):
    """[B, ...] x 2 -> [2B, ...] as a0, b0, a1, b1, ..."""
    return jnp.stack([a, b], axis=1).reshape(-1, *a.shape[1:])


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


def _per_sample(value, prompts: int, n: int, name: str, kind) -> list:
    if isinstance(value, int | float):
        return [kind(value)] * (prompts * n)
    values = [kind(v) for v in value]
    if len(values) == prompts:
        return [v for v in values for _ in range(n)]
    if len(values) == prompts * n:
        return values
    raise PipelineError(f"{name}: expected one value, one per prompt or one per image, got {len(values)}")


def _seeds(seed, prompts: int, n: int) -> list[int]:
    if seed is None:
        rng = np.random.default_rng()
        return [int(s) for s in rng.integers(0, 2**31 - 1, size=prompts * n)]
    if isinstance(seed, int):
        return [seed + i for i in range(prompts * n)]  # distinct noise per image, reproducible from one seed
    return _per_sample(seed, prompts, n, "seed", int)
