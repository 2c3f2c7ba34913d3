"""The Flux.1 text-to-image pipeline (dev, schnell, true CFG): CLIP pooled + T5 -> one compiled denoising loop
over packed latents -> VAE decode.

Mirrors diffusers' FluxPipeline (the reference it is tested against) on the engine's pipeline
(models/engine/pipeline.py) and denoising loop. What is Flux's own:

- Text: CLIP's pooled output (77 tokens) feeds the time embedding; T5 runs WITHOUT an attention mask on ids
  padded to `max_sequence_length` (diffusers does, so the pad positions are real, attended tokens), and its
  states are the transformer's text stream. The text length is a shape: a batch field.
- Latents are 2x2-packed: [B, h, w, C] -> [B, (h/2)(w/2), 4C] (diffusers' `_pack_latents`, channels-last
  here), which is why sizes are multiples of 2 x the VAE's factor. The RoPE tables of the joint
  [text, image] sequence are built on the host in float64 (transformer_flux.flux_rope) once per size.
- Guidance: "dev" checkpoints (`guidance_embeds`) take the guidance scale per row as an input embedding (one
  pass per step); "schnell" has none (the scale is ignored). True CFG is the engine's CFG with
  `true_cfg_scale` as its scale, for rows that also have a negative prompt (diffusers' rule).
- Schedule: flow-match Euler with diffusers' pipeline sigmas `linspace(1, 1/N, N)`, shifted by `mu` from the
  image sequence length (`use_dynamic_shifting`) or statically.
- The timestep enters as `round_to(round_to(t, dtype) / 1000, dtype)`, as diffusers' `t.to(dtype) / 1000`.

    text_encode  CLIP ids [T, 77], T5 ids [T, L] -> embeds [B or 2B, L, D], pooled [B or 2B, P]
    denoise      seeds' key data [B, 2] (or packed latents [B, S, 4C]), embeds, pooled, guidance and
                 true_cfg_scale [B], rope tables -> packed latents
    vae_decode   packed latents -> images [B, H, W, 3] in [0, 1] (unpacked, z / scaling + shift, VAE in fp32)
    image_encode images [B, H, W, 3] (masks [B, H, W, 1]) -> packed image latents (and packed mask)

Image inputs (docs/image-inputs.md), as FluxImg2ImgPipeline and FluxInpaintPipeline: the image's latents are
(posterior mode - shift_factor) x scaling_factor, packed; strength picks the start step by Flux's float rule
(image_inputs.start_step; default 0.6) and the image is noised with `scale_noise`; inpainting puts the known
region back after every step (FluxInpaintPipeline's blend, the mask packed like the latents).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from meshserve.models.checkpoints.loading import CheckpointError
from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_RULES
from meshserve.models.components.autoencoder_kl import load_autoencoder_kl
from meshserve.models.components.clip import SHARDING_RULES as CLIP_RULES
from meshserve.models.components.clip import load_clip_text_model
from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize
from meshserve.models.components.t5 import SHARDING_RULES as T5_RULES
from meshserve.models.components.t5 import load_t5_encoder
from meshserve.models.components.t5_tokenizer import load_t5_tokenizer, tokenize_t5
from meshserve.models.engine.pipeline import DiffusionPipeline, folder_serving_defaults, image_limits
from meshserve.models.flux.transformer_flux import SHARDING_RULES as FLUX_RULES
from meshserve.models.flux.transformer_flux import flux_rope, image_ids, load_flux_transformer, round_to
from meshserve.models.schedulers import flux_mu

__all__ = ["FluxPipeline", "pack_latents", "unpack_latents"]

# diffusers' FluxPipeline refuses a longer T5 text (`check_inputs`); it is also its default, for dev and
# schnell alike. FLUX.1-schnell's model card asks for 256 (it was distilled on 256-token prompts): a folder's
# meshserve.json sets that ("defaults": {"max_sequence_length": 256}); a call may still pass up to 512.
MAX_SEQUENCE_LENGTH = 512
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
    attention_kwargs_name = "joint_attention_kwargs"  # its "scale" scales the LoRA adapters
    row_fields = ("guidance_scale", "true_cfg_scale")
    batch_fields = (*DiffusionPipeline.batch_fields, "max_sequence_length")
    cfg_field = "true_cfg_scale"
    cfg_needs_negative = True
    second_prompt = True  # prompt_2 / negative_prompt_2: T5's texts (CLIP's pooled vector reads `prompt`)
    # encode_prompt's outputs, as diffusers names them (a call may give them: models/engine/prompt_embeds.py)
    embeds_names = ("prompt_embeds", "pooled_prompt_embeds")
    schedule_fields = ("sigmas",)  # FluxPipeline's custom sigmas (shifted for the size, as its own)
    # Step caches (models/engine/step_cache.py): first-block and TeaCache. The default thresholds are starting
    # values, not yet measured on trained weights (docs/step-cache.md).
    step_cache_methods = {"first_block": 0.08, "teacache": 0.1}
    scheduler_classes = ("FlowMatchEulerDiscreteScheduler",)  # flow matching: velocity prediction
    latents_layout = "[B, (h/2)(w/2), 4C] (packed)"
    strength_rule = "float"  # FluxImg2ImgPipeline's get_timesteps: int(steps - steps * strength) is the start
    # The CLIP takes LoRA factors (kohya lora_te_/lora_te1_, diffusers text_encoder.); T5 LoRA is refused.
    lora_text_encoders = ("text_encoder",)

    def load(self, folder: Path) -> dict:
        self.folder_defaults = folder_serving_defaults(folder)
        self.tokenizer = load_clip_tokenizer(folder / "tokenizer")
        self.tokenizer_2 = load_t5_tokenizer(folder / "tokenizer_2")
        plain = self.plain_attention
        text_encoder = self.load_module(
            load_clip_text_model, folder / "text_encoder", CLIP_RULES, attention=plain
        )
        text_encoder_2 = self.load_module(load_t5_encoder, folder / "text_encoder_2", T5_RULES)
        transformer = self.load_module(
            load_flux_transformer, folder / "transformer", FLUX_RULES, attention=self.attention
        )
        self.validate_heads({transformer.config.num_attention_heads})
        # The VAE decodes in fp32 unless the pool's vae_dtype says bfloat16 (diffusers runs it in the pipeline's
        # dtype): it runs once per image, not once per step, so fp32 costs little and keeps bf16 rounding out
        # of the pixels. (SDXL's bf16 default rests on a measurement on its VAE: docs/outputs.md.)
        vae = self.load_module(
            load_autoencoder_kl,
            folder / "vae",
            VAE_RULES,
            dtype=self.vae_dtype_for(jnp.float32),
            attention=plain,
        )
        self.transformer_config, self.vae_config = transformer.config, vae.config
        packed = 4 * self.vae_config.latent_channels
        if self.transformer_config.in_channels != packed + self.condition_channels:
            raise CheckpointError(
                f"{folder}: transformer in_channels {self.transformer_config.in_channels} is not 4 x the "
                f"VAE's latent_channels {self.vae_config.latent_channels} (2x2 packing)"
                + (f" + {self.condition_channels} condition channels" if self.condition_channels else "")
            )
        modules = {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2}
        return {**modules, "transformer": transformer, "vae": vae}

    # ----------------------------------------------------------------------------------------------
    # What the serving layer reads

    @property
    def guidance_embeds(self) -> bool:
        """A "dev"-type checkpoint (guidance distilled into an input embedding); False: "schnell"-type."""
        return bool(self.transformer_config.guidance_embeds)

    @property
    def cache_methods(self) -> dict[str, float]:
        # "first_block" reads the first double block's residual: a transformer without double blocks has
        # none (its residual would read 0 and skip every step), so it offers TeaCache alone.
        if self.transformer_config.num_layers:
            return self.step_cache_methods
        return {k: v for k, v in self.step_cache_methods.items() if k != "first_block"}

    @property
    def condition_channels(self) -> int:
        """Channels the transformer takes after the packed latents' every step: none here (FLUX.1 Fill's
        masked image and mask: models/flux/pipeline_fill.py)."""
        return 0

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config.block_out_channels) - 1)

    @property
    def defaults(self) -> dict:
        # diffusers' FluxPipeline: default_sample_size (128 latents) x the VAE factor, whatever the VAE config
        # says (1024 for FLUX.1); a folder made to be served smaller says so in its meshserve.json.
        height = width = 128 * self.vae_scale_factor
        dev = self.guidance_embeds
        return {
            "width": width,
            "height": height,
            # FluxPipeline's own default (28) and the guidance its docs give for dev; schnell: 4 steps, no
            # guidance embedding. true_cfg_scale's presence tells the serving side the field is accepted.
            "num_inference_steps": 28 if dev else 4,
            "guidance_scale": 3.5 if dev else 0.0,
            "true_cfg_scale": 1.0,
            **self.folder_defaults,  # what the model was made to be served with (meshserve.json)
        }

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("text-to-image", "image-to-image", "inpaint")

    def default_strength(self, task):
        # FluxImg2ImgPipeline's and FluxInpaintPipeline's default.
        return 0.6 if task in ("image-to-image", "inpaint") else None

    @property
    def limits(self) -> dict:
        d = self.defaults
        # The VAE's factor x the 2x2 packing (16 for FLUX.1).
        limits = image_limits(self.vae_scale_factor * 2, max(d["width"], d["height"]))
        limits["schedulers"] = list(FLUX_SCHEDULER_NAMES)
        limits["max_sequence_length"] = MAX_SEQUENCE_LENGTH
        limits["tasks"] = list(self.tasks)
        limits["strength"] = self.strength_limits()
        limits["loras"] = self.lora.limits
        limits["cache"] = self.cache_limits()
        limits["scheduler_arguments"] = self.scheduler_argument_limits(limits["schedulers"])
        return limits

    # ----------------------------------------------------------------------------------------------
    # The stages

    def schedule_options(self, scheduler, shape):
        mu = None
        if shape is not None and getattr(scheduler, "use_dynamic_shifting", False):
            mu = flux_mu((shape[0] // 2) * (shape[1] // 2), self.scheduler_config)
        # diffusers' FluxPipeline passes sigmas = linspace(1, 1/N, N) unless the config asks for the
        # scheduler's own flow sigmas.
        return {"mu": mu, "pipeline_sigmas": not self.scheduler_config.get("use_flow_sigmas", False)}

    def denoise_extras(self, shape, text_len):
        """The (cos, sin) tables [L + grid_h * grid_w, head_dim] of the joint sequence, on the devices:
        text ids all zero (diffusers' text_ids), image ids [0, row, col]."""
        ids = np.concatenate([np.zeros((text_len, 3), np.float32), image_ids(shape[0] // 2, shape[1] // 2)])
        return self.put_replicated(flux_rope(ids, self.transformer_config.axes_dims_rope))

    def tokenize(self, texts, settings, texts_2=None):
        t5 = tokenize_t5(
            self.tokenizer_2, texts if texts_2 is None else texts_2, settings["max_sequence_length"]
        )
        return tokenize(self.tokenizer, texts), t5.input_ids

    def encode_prompt(self, states, clip_ids, t5_ids):
        """CLIP ids [T, 77], T5 ids [T, L] -> embeds [T, L, D] (T5, no mask, as diffusers), pooled [T, P]."""
        pooled = self.merged("text_encoder", states["text_encoder"])(clip_ids).pooler_output
        embeds = self.merged("text_encoder_2", states["text_encoder_2"])(t5_ids).last_hidden_state
        return embeds.astype(self.dtype), pooled.astype(self.dtype)

    def noise_shape(self, settings):
        f = self.vae_scale_factor
        return (settings["height"] // f, settings["width"] // f, self.vae_config.latent_channels)

    def pack(self, noise):
        return pack_latents(noise)

    def encode_image(self, vae_state, pixels, *, shape, task):
        """pixels [B, H, W, 3] in [-1, 1] -> packed (mode - shift) x scaling, as diffusers' _encode_vae_image
        (the img2img and inpaint pipelines' alike)."""
        cfg = self.vae_config
        z = self.merged("vae", vae_state).encode(pixels.astype(jnp.float32)).mode()
        if cfg.shift_factor is not None:
            z = z - cfg.shift_factor
        return pack_latents(z * cfg.scaling_factor).astype(self.latent_dtype)

    def latent_mask(self, mask, *, shape):
        """[B, H, W, 1] -> packed [B, S, 4C]: nearest to the latent size, repeated over the latent channels and
        packed (diffusers' prepare_mask_latents)."""
        f = self.vae_scale_factor
        m = mask[:, ::f, ::f, :]
        m = jnp.broadcast_to(m, (*m.shape[:3], self.vae_config.latent_channels))
        return pack_latents(m).astype(self.latent_dtype)

    def denoiser(self, state, cond, rows, rope, *, shape, do_cfg, image=None):
        dtype = self.dtype
        embeds, pooled = (c.astype(dtype) for c in cond)
        # The guidance embedding's input (dev only), the same for a row's two true-CFG passes (diffusers).
        g = None
        if self.guidance_embeds:
            g = jnp.repeat(rows["guidance_scale"], 2) if do_cfg else rows["guidance_scale"]

        def model(x, t, i):
            transformer, x = self.merged_per_step(state, x)
            # diffusers: t.expand(B).to(latents.dtype) / 1000, in the latents' dtype.
            timestep = jnp.broadcast_to(round_to(round_to(t, dtype) / 1000, dtype), (x.shape[0],))
            return transformer(x, embeds, pooled, timestep, rope, g)

        return model

    def decode(self, vae_state, latents, *, shape):
        vae = self.merged("vae", vae_state)
        cfg = self.vae_config
        z = unpack_latents(latents.astype(jnp.float32), shape[0], shape[1]) / cfg.scaling_factor
        if cfg.shift_factor is not None:
            z = z + cfg.shift_factor
        image = vae.decode(z).astype(jnp.float32)  # [B, H, W, 3] in [-1, 1], in the VAE's dtype
        return jnp.clip(image / 2 + 0.5, 0.0, 1.0)
