"""The Wan 2.1 text-to-video pipeline: UMT5 -> one compiled denoising loop over video latents -> causal 3D VAE.

Mirrors diffusers' WanPipeline (`pipelines/wan/pipeline_wan.py`, the reference it is tested against) on the
shared pipeline contract (`base.py`) and denoising loop (`denoise_loop.py`). What is Wan's own:

- Text: `prompt_clean`, UMT5 WITH its attention mask at 512 tokens, each prompt's states trimmed to its length
  and zero-padded back (models/wan/text.py); the transformer's cross-attention has no mask.
- The negative prompt: diffusers' `negative_prompt or ""` (None is the empty string, never zeros). CFG runs when
  a row's guidance scale is > 1 (diffusers' `do_classifier_free_guidance`); the negative pass is interleaved
  [neg0, pos0, neg1, pos1, ...] as the shared CFG path is, so on a cfg=2 mesh the two passes run on the two
  sides of the cfg axis. A row with guidance <= 1 in a CFG batch gets its positive prediction selected
  (`jnp.where`), which is what that row alone (no CFG) computes.
- Latents are fp32 video [B, T, h, w, C] channels-last, T = (num_frames - 1) // 4 + 1, h, w = H / 8, W / 8;
  the transformer's input is cast to the model dtype each step and the guidance combine runs in that dtype,
  as diffusers does. Initial noise is drawn per row from the row's seed key in that shape.
- Decode: `z / (1 / latents_std) + latents_mean` in fp32 (diffusers' exact arithmetic), the VAE in fp32, frames
  `clip(x / 2 + 0.5, 0, 1)` -> [B, F, H, W, 3] (diffusers' `postprocess_video(output_type="np")`).

Three compiled programs, one per stage:

    text_encode  ids, mask [T, 512] (T = prompts, + negatives with CFG) -> embeds [B or 2B, 512, D]
    denoise      seeds' key data [B, 2] (or latents [B, T, h, w, C]), embeds, guidance [B], cfg_rows [B],
                 RoPE tables -> latents (a lax.while_loop)
    vae_decode   latents -> frames [B, F, H, W, 3] in [0, 1], split over the whole mesh: the batch over
                 (data, cfg), the larger spatial dimension over the other axes (`decode_sharding`)

Prompt, negative prompt, seed, guidance scale and step count are traced inputs: only a new shape (size, frame
count, batch), a new scheduler or switching CFG on or off compiles.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshserve.models.attention import AttentionSettings
from meshserve.models.attention.context import batch_axes_for
from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.t5 import SHARDING_RULES as T5_SHARDING_RULES
from meshserve.models.components.t5 import load_t5_encoder
from meshserve.models.components.t5_tokenizer import load_t5_tokenizer
from meshserve.models.engine.common import PipelineError, PipelineOutput, to_list
from meshserve.models.engine.denoise_loop import denoise_loop, interleave
from meshserve.models.engine.pipeline import DiffusionPipeline, image_limits, to_host
from meshserve.models.engine.seeds import initial_noise, per_row, row_keys, row_seeds
from meshserve.models.parallel.placement import Placement, gathered, gathered_per_step
from meshserve.models.schedulers import (
    FLOW_SCHEDULER_NAMES,
    FlowMatchEulerDiscreteScheduler,
    make_scheduler,
    pad_schedule,
)
from meshserve.models.wan.autoencoder_kl_wan import SHARDING_RULES as VAE_SHARDING_RULES
from meshserve.models.wan.autoencoder_kl_wan import load_autoencoder_kl_wan
from meshserve.models.wan.text import WAN_MAX_SEQUENCE_LENGTH, encode_wan_prompts, tokenize_wan_prompts
from meshserve.models.wan.transformer_wan import SHARDING_RULES as WAN_SHARDING_RULES
from meshserve.models.wan.transformer_wan import load_wan_transformer, wan_rope

__all__ = ["WanPipeline", "decode_sharding"]

# diffusers' WanPipeline.__call__ defaults (480p, 5 s at 16 fps: the Wan 2.1 model card's setting).
DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_FRAMES, DEFAULT_STEPS, DEFAULT_GUIDANCE = 480, 832, 81, 50, 5.0
FPS = 16
# Wan 2.1 was trained on videos of up to 81 frames; diffusers accepts more, which nothing here has tested.
MAX_FRAMES = 81
# A model whose RoPE tables (rope_max_seq_len positions per axis) cannot address diffusers' default grid
# (480x832 -> 30 x 52 patches; real checkpoints have 1024 positions, the tiny test models 32) is a test model:
# it defaults to this small video (2 x 3 patches, 2 latent frames) and 4 steps, so warm-up stays cheap.
SMALL_HEIGHT, SMALL_WIDTH, SMALL_FRAMES, SMALL_STEPS = 32, 48, 5, 4
_SCHEDULER_CLASSES = ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler")


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

    def step(self, schedule, state, model_output, sample, i, key=None):
        prev, state = self.inner.step(schedule, state, model_output, sample, i, key)
        return prev.astype(sample.dtype), state


class WanPipeline(DiffusionPipeline):
    family = "wan"
    task = "text-to-video"
    batch_fields = ("width", "height", "num_frames", "num_inference_steps", "scheduler")
    # A padded row would be a whole extra video (base.py): compile the exact batch sizes instead.
    pads_batches = False

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
        self._ropes = lru_cache(maxsize=64)(self._make_rope)
        folder = Path(folder)
        self.folder = folder
        self.model_id = model_id or folder.name
        self.dtype = jnp.dtype(dtype)
        settings = attention or AttentionSettings()
        # Only the transformer runs attention on the mesh; UMT5 (once per request) and the VAE run plain
        # kernels, UMT5's batch split by whatever sharding it carries, the VAE's decode split by
        # `decode_sharding` (its mid-block attention is over one frame's pixels, gathered by XLA).
        plain = dataclasses.replace(settings, mesh=None)
        self.placement = placement

        self.scheduler_config = read_json(folder / "scheduler" / "scheduler_config.json")
        class_name = self.scheduler_config.get("_class_name")
        if class_name not in _SCHEDULER_CLASSES:
            raise CheckpointError(
                f"{folder / 'scheduler'}: a Wan pipeline needs one of {list(_SCHEDULER_CLASSES)}, got {class_name!r}"
            )
        if self.scheduler_config.get("use_dynamic_shifting"):
            # diffusers' WanPipeline passes no mu, so its set_timesteps would fail on such a config too.
            raise CheckpointError(
                f"{folder / 'scheduler'}: use_dynamic_shifting needs a mu WanPipeline never passes"
            )
        self.tokenizer = load_t5_tokenizer(folder / "tokenizer")
        text_encoder = load_t5_encoder(
            folder / "text_encoder",
            dtype=self.dtype,
            place=placement.placer(T5_SHARDING_RULES) if placement else None,
        )
        transformer = load_wan_transformer(
            folder / "transformer",
            dtype=self.dtype,
            settings=settings,
            place=placement.placer(WAN_SHARDING_RULES) if placement else None,
        )
        if placement:
            placement.validate_heads({transformer.config.num_attention_heads}, settings.context_strategy)
        # fp32 whatever the pipeline dtype: diffusers' Wan examples load the VAE in fp32, and it runs once per
        # video, not once per step.
        vae = load_autoencoder_kl_wan(
            folder / "vae",
            dtype=jnp.float32,
            settings=plain,
            place=placement.placer(VAE_SHARDING_RULES) if placement else None,
        )
        self.transformer_config = transformer.config
        self.vae_config = vae.config
        self._check_geometry(folder)
        self.scheduler(None)  # fail at load time on an unsupported scheduler config

        self.split_modules({"text_encoder": text_encoder, "transformer": transformer, "vae": vae})

    def _check_geometry(self, folder: Path) -> None:
        t, v = self.transformer_config, self.vae_config
        if t.in_channels != v.z_dim or t.output_channels != v.z_dim:
            raise CheckpointError(
                f"{folder}: transformer channels in {t.in_channels} / out {t.output_channels} differ from the "
                f"VAE's z_dim {v.z_dim}"
            )
        if t.patch_size[0] != 1:
            raise CheckpointError(f"{folder}: temporal patch size {t.patch_size[0]}; Wan 2.1's is 1")
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
    def size_multiple(self) -> int:
        # The VAE's factor x the patch (diffusers' h_multiple_of / w_multiple_of; 16 for Wan 2.1).
        _, ph, pw = self.transformer_config.patch_size
        return math.lcm(self.spatial_factor * ph, self.spatial_factor * pw)

    def _grid_fits(self, height: int, width: int, frames: int) -> bool:
        """Whether the RoPE tables address this video's patch grid (every axis <= rope_max_seq_len)."""
        _, ph, pw = self.transformer_config.patch_size
        f = self.spatial_factor
        grid = ((frames - 1) // self.temporal_factor + 1, height // f // ph, width // f // pw)
        return max(grid) <= self.transformer_config.rope_max_seq_len

    @property
    def _small(self) -> bool:
        return not self._grid_fits(DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_FRAMES)

    @property
    def defaults(self) -> dict:
        small = self._small
        return {
            "width": SMALL_WIDTH if small else DEFAULT_WIDTH,
            "height": SMALL_HEIGHT if small else DEFAULT_HEIGHT,
            "num_inference_steps": SMALL_STEPS if small else DEFAULT_STEPS,
            "guidance_scale": DEFAULT_GUIDANCE,
            "fps": FPS,
        }

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
        # service/contract.py's VIDEO_FORMATS, MP4 the default (models never import the service).
        limits["output_formats"] = ["mp4", "webp"]
        tf = self.temporal_factor
        limits["frames"] = {
            "min_frames": 1,
            "max_frames": min(MAX_FRAMES, (rope - 1) * tf + 1),
            "step": tf,
            "offset": 1,
            "default": SMALL_FRAMES if self._small else DEFAULT_FRAMES,
        }
        return limits

    # ----------------------------------------------------------------------------------------------
    # Host-side caches

    def scheduler(self, name: str | None):
        if name is not None and name not in (*FLOW_SCHEDULER_NAMES, *_SCHEDULER_CLASSES):
            raise PipelineError(
                f"scheduler must be one of {list(FLOW_SCHEDULER_NAMES)} for a Wan model, got {name!r}"
            )
        if name not in self._schedulers:
            config, overrides = self.scheduler_config, {}
            flow_euler = name in ("flow_match_euler", "FlowMatchEulerDiscreteScheduler") or (
                name is None and config.get("_class_name") == "FlowMatchEulerDiscreteScheduler"
            )
            if flow_euler:
                # diffusers' Euler class has no prediction_type (it always takes a velocity); UniPC's
                # "flow_prediction" is no value of the beta-schedule family's setting, so it is left out.
                config = {k: v for k, v in config.items() if k != "prediction_type"}
                if "flow_shift" in config and "shift" not in config:
                    # Wan's schedule shift is part of the model (flow_shift: 3.0 at 480p, 5.0 at 720p); the
                    # Euler class calls it `shift`, and from_config alone would drop it to 1.0.
                    overrides["shift"] = float(config["flow_shift"])
            try:
                self._schedulers[name] = _Fp32Latents(make_scheduler(name, config, **overrides))
            except ValueError as e:
                raise PipelineError(str(e)) from None
        return self._schedulers[name]

    def _make_schedule(self, name, steps):
        sched = self.scheduler(name)
        if isinstance(sched.inner, FlowMatchEulerDiscreteScheduler):
            # diffusers' WanPipeline passes no sigmas: the scheduler's own over its training range.
            schedule = sched.inner.schedule(steps, pipeline_sigmas=False)
        else:
            schedule = sched.inner.schedule(steps)
        real = int(schedule.timesteps.shape[0])
        return sched, self.put_replicated(pad_schedule(schedule, self.limits["max_steps"])), real

    def _make_rope(self, frames: int, height: int, width: int):
        """The transformer's (cos, sin) RoPE tables for a latent video of this size (host float64 -> fp32, as
        WanTransformer3DModel.rope), on the devices."""
        c = self.transformer_config
        pt, ph, pw = c.patch_size
        grid = (frames // pt, height // ph, width // pw)
        return self.put_replicated(wan_rope(grid, c.attention_head_dim, c.rope_max_seq_len))

    # ----------------------------------------------------------------------------------------------
    # The three stages (pure functions of state + traced inputs)

    def _text_encode(self, encoder_state, ids, mask, *, prompts: int, n: int, do_cfg: bool):
        """ids, mask [T, L] (prompts, then negatives with CFG) -> embeds [B or 2B, L, D] in the model dtype,
        interleaved [neg0, pos0, neg1, pos1, ...] with CFG."""
        encoder = nnx.merge(
            self._graphs["text_encoder"], gathered(self.placement, encoder_state, T5_SHARDING_RULES)
        )
        embeds = encode_wan_prompts(encoder, ids, mask).astype(self.dtype)
        embeds = _repeat(embeds, n, prompts)
        if do_cfg:
            batch = prompts * n
            embeds = interleave(embeds[batch:], embeds[:batch])
        return embeds

    def _denoise(
        self,
        transformer_state,
        schedule,
        latents,
        key_data,
        embeds,
        guidance,
        cfg_rows,
        rope,
        *,
        scheduler,
        do_cfg: bool,
        latent_shape: tuple[int, int, int, int],
    ):
        """latents [B, T, h, w, C] fp32 or None (then drawn from each row's key); embeds [2B or B, L, D];
        guidance [B] float32; cfg_rows [B] bool. Returns (latents fp32, steps_done)."""
        keys = row_keys(key_data)
        if latents is None:
            latents = initial_noise(keys, latent_shape)
        latents = self.constrain(latents.astype(jnp.float32) * scheduler.init_noise_sigma(schedule))
        embeds = embeds.astype(self.dtype)

        def model(x, t):
            # Weights split over FSDP axes are gathered per step, tied to this step's x (see sdxl.py).
            state, x = gathered_per_step(self.placement, transformer_state, x, WAN_SHARDING_RULES)
            transformer = nnx.merge(self._graphs["transformer"], state)
            # diffusers: latents.to(transformer_dtype), t.expand(B) (UniPC's integer t, untouched).
            out = transformer(x.astype(self.dtype), jnp.broadcast_to(t, (x.shape[0],)), embeds, rope)
            if do_cfg:
                # A row without CFG: its "negative" prediction is its positive one, so the combine
                # neg + g * (pos - neg) returns the positive prediction exactly (that row alone runs no CFG).
                pairs = out.reshape(-1, 2, *out.shape[1:])
                keep = cfg_rows.reshape(-1, *([1] * (out.ndim - 1)))
                out = interleave(jnp.where(keep, pairs[:, 0], pairs[:, 1]), pairs[:, 1])
            return out

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
        # Weights gathered whole (a no-op without shard_over): besides the usual reason, XLA's partitioner
        # computes a 3x3 conv wrongly when its kernel is split beside a spatially split input on a 2-D mesh
        # (docs/weights.md, Found), which is what the spatial split below would otherwise meet.
        vae = nnx.merge(self._graphs["vae"], gathered(self.placement, vae_state, VAE_SHARDING_RULES))
        cfg = self.vae_config
        # diffusers: latents / (1 / std) + mean, per channel, fp32 (the same roundings as its two tensors).
        inv_std = 1.0 / jnp.asarray(cfg.latents_std, jnp.float32)
        z = latents.astype(jnp.float32) / inv_std + jnp.asarray(cfg.latents_mean, jnp.float32)
        constrain = None
        if self.placement is not None:
            b, _, h, w, _ = latents.shape
            sharding = decode_sharding(self.placement.mesh, b, h, w)
            constrain = partial(jax.lax.with_sharding_constraint, shardings=sharding)
        video = vae.decode(z, constrain)  # [B, F, H, W, 3] in [-1, 1]
        return jnp.clip(video / 2 + 0.5, 0.0, 1.0)

    # ----------------------------------------------------------------------------------------------
    # Host side

    def check_frames(self, num_frames) -> int:
        fr = self.limits["frames"]
        if not isinstance(num_frames, int | np.integer) or isinstance(num_frames, bool):
            raise PipelineError(f"num_frames must be an integer, got {num_frames!r}")
        num_frames = int(num_frames)
        if not fr["min_frames"] <= num_frames <= fr["max_frames"]:
            raise PipelineError(
                f"num_frames must be between {fr['min_frames']} and {fr['max_frames']}, got {num_frames}"
            )
        if (num_frames - fr["offset"]) % fr["step"]:
            raise PipelineError(
                f"num_frames must be {fr['step']}k+{fr['offset']} (the VAE's temporal factor), got {num_frames}"
            )
        return num_frames

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str | None] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | Sequence[float] | None = None,
        seed: int | Sequence[int] | None = None,
        latents=None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        output_type: str = "np",
        callback: Callable[[int, int], bool | None] | None = None,
    ):
        """Generates videos. `latents` takes diffusers' layout [B, C, T, h, w] (B = prompts x videos per
        prompt); output_type "np": frames [B, F, H, W, 3] float in [0, 1], "latent": diffusers' layout,
        "pil": a list (per video) of lists of PIL frames.

        Per row (one value, one per prompt or one per video): guidance_scale (> 1: CFG with the negative
        prompt), seed. negative_prompt: one for all, or one per prompt (None: "", as diffusers)."""
        prompts = to_list(prompt, "prompt")
        n = num_images_per_prompt
        defaults, limits = self.defaults, self.limits
        height = int(defaults["height"] if height is None else height)
        width = int(defaults["width"] if width is None else width)
        steps = int(defaults["num_inference_steps"] if num_inference_steps is None else num_inference_steps)
        frames = self.check_frames(limits["frames"]["default"] if num_frames is None else num_frames)
        self.check_request(height, width, steps, n, output_type)
        for name, value in (("height", height), ("width", width)):
            if value > limits["max_size"]:
                raise PipelineError(f"{name} must be at most {limits['max_size']}, got {value}")
        batch = len(prompts) * n
        guidance = per_row(
            defaults["guidance_scale"] if guidance_scale is None else guidance_scale,
            len(prompts),
            n,
            "guidance_scale",
            float,
        )
        if not np.all(np.isfinite(guidance)):
            raise PipelineError("guidance_scale must be a finite number")
        negatives = _per_prompt(negative_prompt, len(prompts))
        cfg_rows = np.asarray(guidance) > 1.0  # diffusers' do_classifier_free_guidance, per row
        do_cfg = bool(cfg_rows.any())
        sched, schedule, steps = self.schedule(scheduler, steps)
        seeds = row_seeds(seed, len(prompts), n)

        f = self.spatial_factor
        latent_shape = (
            (frames - 1) // self.temporal_factor + 1,
            height // f,
            width // f,
            self.transformer_config.in_channels,
        )
        if latents is not None:
            latents = np.asarray(latents, np.float32)
            expected = (batch, latent_shape[3], *latent_shape[:3])
            if latents.shape != expected:
                raise PipelineError(
                    f"latents: expected shape {expected} [B, C, T, h, w], got {latents.shape}"
                )
            latents = self.put_batch(np.ascontiguousarray(latents.transpose(0, 2, 3, 4, 1)))
        timings = {}
        compiled_before = self.compilations

        # 1. Text: one encoder call over the prompts and (with CFG) the negatives.
        t0 = time.perf_counter()
        texts = prompts + ([neg or "" for neg in negatives] if do_cfg else [])
        tokens = tokenize_wan_prompts(self.tokenizer, texts, WAN_MAX_SEQUENCE_LENGTH)
        embeds = self.programs.run(
            "text_encode",
            self._text_encode,
            {"prompts": len(prompts), "n": n, "do_cfg": do_cfg},
            self._states["text_encoder"],
            self.put_batch(tokens.input_ids),
            self.put_batch(tokens.attention_mask),
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
            self.put_batch(np.float32(guidance)),
            self.put_batch(cfg_rows),
            self._ropes(*latent_shape[:3]),
        )
        latents = self.run_denoise(
            steps,
            callback,
            lambda: self.programs.run("denoise", self._denoise, static, self._states["transformer"], *inputs),
        )
        timings["denoise"] = time.perf_counter() - t0

        if output_type == "latent":  # diffusers' layout [B, C, T, h, w], before the VAE's statistics
            video = np.transpose(to_host(latents).astype(np.float32, copy=False), (0, 4, 1, 2, 3))
            return PipelineOutput(
                images=video, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
            )

        # 3. Decode.
        t0 = time.perf_counter()
        video = self.programs.run("vae_decode", self._vae_decode, {}, self._states["vae"], latents)
        video = to_host(video).astype(np.float32, copy=False)
        timings["vae_decode"] = time.perf_counter() - t0
        if output_type == "pil":
            from PIL import Image

            video = [[Image.fromarray(np.round(fr * 255).astype(np.uint8)) for fr in v] for v in video]
        return PipelineOutput(
            images=video, seeds=seeds, timings=timings, compiled=self.compilations > compiled_before
        )


# --------------------------------------------------------------------------------------------------


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
