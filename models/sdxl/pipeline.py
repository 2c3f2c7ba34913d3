"""The SDXL text-to-image pipeline: tokenize -> two CLIP encoders -> one compiled denoising loop -> VAE decode.

Mirrors diffusers' StableDiffusionXLPipeline (the reference it is tested against) on the engine's pipeline
(models/engine/pipeline.py: the call, CFG rows, schedules, programs) and denoising loop. What is here is SDXL's
own: the two encoders and their pooled projection, the UNet call with its micro-conditioning, the VAE's latent
scaling, zeros for a missing negative prompt (`force_zeros_for_empty_prompt`), `guidance_rescale` per row.
Latents are channels-last [B, h, w, C] in the loop, diffusers' [B, C, h, w] at the call's edges.

Image inputs (docs/image-inputs.md), as StableDiffusionXLImg2ImgPipeline and StableDiffusionXLInpaintPipeline:
the image's latents are the VAE posterior's mode x scaling_factor (img2img: (z - mean) x scaling / std when the
VAE config has latents_mean/std; diffusers' inpaint pipeline scales by scaling_factor alone even then);
strength picks the start step by diffusers' int rule (image_inputs.start_step);
default strength 0.3 (img2img), 0.9999 (inpaint). Inpainting with the base (4-channel) UNet puts the known
region back after every step, noised to the next step; at strength 1 it starts from noise x init sigma
(diffusers' is_strength_max). A 9-channel inpainting UNet folder (StableDiffusionXLInpaintPipeline) takes
[mask, masked image latents] after the latents every step and only inpaints. A refiner folder
(requires_aesthetics_score, no first text encoder: stable-diffusion-xl-refiner-1.0) conditions on
text_encoder_2 alone, puts diffusers' aesthetic_score / negative_aesthetic_score (row fields) in its five
time ids, and takes images only (image-to-image, inpaint), as diffusers runs it. Programs:

    text_encode  ids [T, 77] x 2 (T = prompts, + negatives with CFG) -> embeds [B or 2B, 77, D1+D2], pooled
    denoise      seeds' key data [B, 2] (or latents [B, h, w, C]), embeds, pooled, guidance -> latents
    vae_decode   latents [B, h, w, C] -> images [B, H, W, 3] in [0, 1]
    image_encode images [B, H, W, 3] (masks [B, H, W, 1]) -> image latents, mask or condition [B, h, w, ...]
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_RULES
from meshserve.models.components.autoencoder_kl import load_autoencoder_kl
from meshserve.models.components.clip import SHARDING_RULES as CLIP_RULES
from meshserve.models.components.clip import load_clip_text_model
from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize
from meshserve.models.components.layers import guidance_scale_embedding
from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.denoise_loop import interleave
from meshserve.models.engine.pipeline import DiffusionPipeline, folder_serving_defaults, image_limits
from meshserve.models.sdxl.unet_2d_condition import SHARDING_RULES as UNET_RULES
from meshserve.models.sdxl.unet_2d_condition import Attention as UNetAttention
from meshserve.models.sdxl.unet_2d_condition import load_unet

__all__ = ["StableDiffusionXLPipeline"]

_ENCODERS = ("text_encoder", "text_encoder_2")


class StableDiffusionXLPipeline(DiffusionPipeline):
    family = "sdxl"
    attention_kwargs_name = "cross_attention_kwargs"  # its "scale" scales the LoRA adapters
    denoiser_name = "unet"
    generator_in_steps = True  # diffusers' SDXL pipelines pass their generator to the scheduler's step
    lora_text_encoders = _ENCODERS  # both CLIPs take LoRA factors (docs/lora.md)
    # diffusers' guidance_rescale (rescale_noise_cfg after the CFG combine; 0: off), one value per row.
    row_fields = ("guidance_scale", "guidance_rescale")
    # prompt_2 / negative_prompt_2: text_encoder_2's texts (OpenCLIP ViT-bigG in SDXL base).
    second_prompt = True
    # encode_prompt's outputs, as diffusers names them (a call may give them: models/engine/prompt_embeds.py)
    embeds_names = ("prompt_embeds", "pooled_prompt_embeds")
    # diffusers' clip_skip: the prompt's states from hidden_states[-(clip_skip + 2)] of both encoders (the
    # negatives' stay at [-2], as in diffusers), per prompt, a traced layer index (any value, one program).
    text_fields = ("clip_skip",)
    # StableDiffusionXLPipeline's custom schedules (Euler takes both, DPM-Solver timesteps) and DDIM's eta.
    schedule_fields = ("timesteps", "sigmas", "eta")
    # diffusers' denoising_end / denoising_start: a base + refiner schedule (models/engine/denoising_split.py).
    denoising_split = True
    # StableDiffusionXLImg2ImgPipeline's output is its image's size (rounded down to 8); inpaint's is 1024.
    image_sized_tasks = ("image-to-image",)
    # diffusers' micro-conditioning (SDXL paper, section 2.2), per row: the UNet's time ids (original size, crop
    # top-left, target size) for the prompt and for the negative prompt (pair_rows: diffusers' defaults).
    pair_fields = (
        "original_size",
        "crops_coords_top_left",
        "target_size",
        "negative_original_size",
        "negative_crops_coords_top_left",
        "negative_target_size",
    )
    rescale_field = "guidance_rescale"
    latents_axes = (0, 3, 1, 2)
    latents_layout = "[B, C, h, w]"
    strength_rule = "int"  # diffusers' SDXL get_timesteps: int(steps * strength) steps run
    pure_noise_tasks = ("inpaint",)
    # The step caches (models/engine/step_cache.py): deep features reused while the first down block changes
    # little; TeaCache's whole-UNet residual reused while the first resnet's time-conditioned state drifts
    # little. Default thresholds: docs/step-cache.md (measured on the embedded trained model).
    cache_methods = {"deep_features": 0.1, "teacache": 0.2}
    # XLA:GPU's dot merger may join the self-attention's to_q, to_k and to_v (one input) into one dot, which
    # concatenates their kernels and slices q, k and v out of its result every step (the H200 profile's 60
    # concatenates and 3 x 60 slices a step fit that; not read from the HLO). Off, the UNet's CFG step at
    # 1024x1024 ran 1.04x and 1.03x faster in two alternating comparisons on an H200 (42.9 against 45.0 ms,
    # 40.7 against 42.8 ms; bench/README.md, "GPU") and compiled in 18 s instead of 27.
    gpu_xla_options = {"xla_gpu_dot_merger_threshold_mb": 0}

    def load(self, folder: Path) -> dict:
        index = read_json(folder / "model_index.json")
        self.zeros_for_empty_negative = bool(index.get("force_zeros_for_empty_prompt", True))
        # The refiner (stable-diffusion-xl-refiner-1.0): the aesthetic score in its time ids instead of the
        # target size, and no first text encoder; diffusers runs it with its img2img and inpaint pipelines.
        self.aesthetics = bool(index.get("requires_aesthetics_score"))
        # diffusers' SDXL pipelines run with the first text encoder absent (`[null, null]` in the index: the
        # refiner has no CLIP-L): the conditioning is then the second encoder's alone. The second, which makes
        # the pooled vector, is needed.
        absent = [n for n in ("tokenizer_2", "text_encoder_2") if not (folder / n).is_dir()]
        first = [(folder / n).is_dir() for n in ("tokenizer", "text_encoder")]
        if absent or (any(first) and not all(first)):
            partial = [n for n, here in zip(("tokenizer", "text_encoder"), first, strict=True) if not here]
            missing = absent + (partial if any(first) else [])
            raise CheckpointError(
                f"{folder}: no {', '.join(missing)}; meshserve's SDXL needs the second CLIP text encoder and its "
                "tokenizer, and the first with its tokenizer or neither (the refiner has only the second)"
            )
        self.encoders = _ENCODERS if all(first) else _ENCODERS[1:]
        # Both encoders' own texts (prompt_2); with one, diffusers encodes `prompt` with it and ignores prompt_2.
        self.second_prompt = len(self.encoders) == 2
        self.lora_text_encoders = self.encoders
        if self.aesthetics:  # diffusers' img2img / inpaint call arguments, one value per row here
            self.row_fields = (*type(self).row_fields, "aesthetic_score", "negative_aesthetic_score")
        self.folder_defaults = folder_serving_defaults(folder)
        self.tokenizers = [
            load_clip_tokenizer(folder / name.replace("text_encoder", "tokenizer")) for name in self.encoders
        ]
        plain = self.plain_attention
        modules = {
            name: self.load_module(load_clip_text_model, folder / name, CLIP_RULES, attention=plain)
            for name in self.encoders
        }
        unet = self.load_module(load_unet, folder / "unet", UNET_RULES, attention=self.attention)
        self.validate_heads({m.heads for _, m in nnx.iter_graph(unet) if isinstance(m, UNetAttention)})
        # The VAE decodes in bf16 in a bf16 pipeline (as diffusers does: its force_upcast is for fp16 only), its
        # error within diffusers' own bf16 error (tests/models/test_vae_dtype.py; docs/outputs.md), and in fp32
        # otherwise: SDXL's VAE overflows in fp16. A pool's vae_dtype overrides it.
        vae = self.load_module(
            load_autoencoder_kl,
            folder / "vae",
            VAE_RULES,
            dtype=self.vae_dtype_for(self.dtype if self.dtype == jnp.bfloat16 else jnp.float32),
            attention=self.plain_attention,
        )
        self.unet_config, self.vae_config = unet.config, vae.config
        latent = vae.config.latent_channels
        if unet.config.in_channels not in (latent, 2 * latent + 1):
            raise CheckpointError(
                f"{folder / 'unet'}: in_channels {unet.config.in_channels} is neither the VAE's {latent} latent "
                f"channels nor an inpainting UNet's {2 * latent + 1} (latents, mask, masked image)"
            )
        # A 9-channel UNet inpaints only: it takes the mask and the masked image's latents every step.
        self.inpaint_condition = unet.config.in_channels == 2 * latent + 1
        self.projection_dim = modules["text_encoder_2"].config.projection_dim
        # What the UNet takes must be what the encoders make (diffusers fails in the UNet, or in
        # _get_add_time_ids, on the first call): the states' width and the added embedding's input.
        width = sum(modules[n].config.hidden_size for n in self.encoders)
        context = unet.config.cross_attention_dim
        if any(c != width for c in (context if isinstance(context, tuple | list) else (context,))):
            raise CheckpointError(
                f"{folder / 'unet'}: cross_attention_dim {context} is not the width of the text states "
                f"{' + '.join(self.encoders)} make ({width})"
            )
        time_ids = 5 if self.aesthetics else 6
        added = unet.config.projection_class_embeddings_input_dim
        if added is not None and unet.config.addition_time_embed_dim is not None:
            if added != time_ids * unet.config.addition_time_embed_dim + self.projection_dim:
                raise CheckpointError(
                    f"{folder / 'unet'}: projection_class_embeddings_input_dim {added} is not {time_ids} time ids "
                    f"x {unet.config.addition_time_embed_dim} + the pooled projection {self.projection_dim} "
                    "(requires_aesthetics_score in model_index.json: 5 time ids, else 6)"
                )
        # hidden_states[-(clip_skip + 2)] must exist in every encoder: their layers - 1 at most (11 for SDXL).
        self.max_clip_skip = min(modules[n].config.num_hidden_layers for n in self.encoders) - 1
        return {**modules, "unet": unet, "vae": vae}

    # ----------------------------------------------------------------------------------------------
    # What the serving layer reads

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        # diffusers' rule (StableDiffusionXLPipeline.check_inputs: multiples of 8), and whole latents. Latents
        # need not halve cleanly at every downsampling: the UNet upsamples to each skip's size, as diffusers'
        # forward_upsample_size does (1024x1000 and 40x56 run; before, SDXL took multiples of 32 alone).
        return max(8, self.vae_scale_factor)

    @property
    def defaults(self) -> dict:
        # diffusers' default_sample_size: the UNet's sample_size, 128 where the config has none;
        # a (height, width) pair is read as one.
        sample = self.unet_config.sample_size
        sample = (128, 128) if sample is None else sample if isinstance(sample, tuple) else (sample, sample)
        height, width = (s * self.vae_scale_factor for s in sample)
        return {
            "width": width,
            "height": height,
            "num_inference_steps": 30 if min(height, width) >= 512 else 4,
            "guidance_scale": 5.0,
            "guidance_rescale": 0.0,
            # diffusers' img2img / inpaint defaults for a model with the aesthetic score (the refiner)
            **({"aesthetic_score": 6.0, "negative_aesthetic_score": 2.5} if self.aesthetics else {}),
            **self.folder_defaults,  # what the model was made to be served with (meshserve.json)
        }

    @property
    def tasks(self) -> tuple[str, ...]:
        if self.inpaint_condition:
            return ("inpaint",)
        if self.aesthetics:  # diffusers' text-to-image pipeline cannot make the refiner's time ids
            return ("image-to-image", "inpaint")
        return ("text-to-image", "image-to-image", "inpaint")

    def default_strength(self, task):
        # diffusers' defaults: StableDiffusionXLImg2ImgPipeline 0.3, StableDiffusionXLInpaintPipeline 0.9999.
        return {"image-to-image": 0.3, "inpaint": 0.9999}.get(task)

    @property
    def limits(self) -> dict:
        limits = image_limits(self.size_multiple, self.defaults["width"])
        return {
            **limits,
            "tasks": list(self.tasks),
            "strength": self.strength_limits(),
            "loras": self.lora.limits,
            "cache": self.cache_limits(),
            "max_clip_skip": self.max_clip_skip,
            "micro_conditioning": True,
            "scheduler_arguments": self.scheduler_argument_limits(limits["schedulers"]),
        }

    # ----------------------------------------------------------------------------------------------
    # The stages

    def tokenize(self, texts, settings, texts_2=None, clip_skip=None):
        """Each encoder's ids [T, 77] (the first encoder's of `texts`; with two, the second's of `texts_2`, else
        `texts`) and each text's clip_skip [T] (0: the penultimate layer's states)."""
        skip = [0 if s is None else s for s in clip_skip or [None] * len(texts)]
        for s in skip:
            if not 0 <= s <= self.max_clip_skip:
                raise PipelineError(
                    f"clip_skip must be an integer between 0 and {self.max_clip_skip}, got {s}"
                )
        seconds = texts if texts_2 is None else texts_2
        ids = [tokenize(t, texts if i == 0 else seconds) for i, t in enumerate(self.tokenizers)]
        return (*ids, np.asarray(skip, np.int32))

    def encode_prompt(self, states, *tokens):
        """ids [T, 77] per encoder, clip_skip [T] -> embeds [T, 77, D1(+D2)] (the encoders' hidden_states[-(skip
        + 2)]: the penultimate layer's at 0), pooled [T, P] (the second encoder's projection)."""
        *ids, clip_skip = tokens
        outs = [self.merged(name, states[name])(x) for name, x in zip(self.encoders, ids, strict=True)]
        # diffusers' encode_prompt pools from the first encoder whose output [0] is 2-D: text_encoder's when
        # it is a CLIPTextModelWithProjection too (its text_embeds), else text_encoder_2's.
        pooled = next(out.text_embeds for out in outs if out.text_embeds is not None)
        embeds = [_skipped(out.hidden_states, clip_skip, self.max_clip_skip) for out in outs]
        return jnp.concatenate(embeds, axis=-1), pooled

    def noise_shape(self, settings):
        f = self.vae_scale_factor
        return (settings["height"] // f, settings["width"] // f, self.vae_config.latent_channels)

    def encode_image(self, vae_state, pixels, *, shape, task):
        """pixels [B, H, W, 3] in [-1, 1] -> the posterior's mode, scaled as diffusers' pipelines scale it:
        img2img's prepare_latents by the VAE's latents_mean / latents_std where it has them, the inpaint
        pipeline's _encode_vae_image (image and masked image) by scaling_factor alone, even then."""
        cfg = self.vae_config
        z = self.merged("vae", vae_state).encode(pixels.astype(jnp.float32)).mode()
        stats = (
            getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None
        )
        if stats and task != "inpaint":
            z = (z - jnp.asarray(cfg.latents_mean)) * cfg.scaling_factor / jnp.asarray(cfg.latents_std)
        else:
            z = z * cfg.scaling_factor
        return z.astype(self.latent_dtype)

    def latent_mask(self, mask, *, shape):
        """[B, H, W, 1] -> [B, h, w, 1]: torch's nearest interpolate to the latent size (every f-th pixel)."""
        f = self.vae_scale_factor
        return mask[:, ::f, ::f, :].astype(self.latent_dtype)

    def pair_rows(self, pairs, settings, task, rows):
        """The micro-conditioning's pairs per row -> time ids [B, 6] for the prompt and for the negative, with
        diffusers' defaults: sizes (height, width), crops (0, 0). The negative's: StableDiffusionXLPipeline
        takes the negative triple only when both negative sizes are given, else the prompt's ids (its crop
        included); the img2img and inpaint pipelines default each negative size to the prompt's and take the
        prompt's crop (their _get_add_time_ids read no negative crop without an aesthetic score). Where the
        negative sizes differ from the prompt's, a StableDiffusionXLPipeline call of several images orders its
        time ids [neg, pos, neg, pos] against embeddings [neg, neg, pos, pos] (its `cat([neg, pos])` then
        `repeat(batch)`, diffusers 0.42.1): each row here is what its own one-image call gives (an audit found
        2.4e-2 to 4.6e-2 from a several-image diffusers call, 1.3e-6 from one-image calls).
        The refiner's are [B, 5]: (original size, crop, the row's aesthetic_score) and the negative's (negative
        original size or the prompt's, negative crop or (0, 0), negative_aesthetic_score), as diffusers' img2img
        and inpaint pipelines make them with requires_aesthetics_score."""
        size, corner = (float(settings["height"]), float(settings["width"])), (0.0, 0.0)
        ids, negative_ids = [], []
        for row, (original, crop, target, n_original, n_crop, n_target) in enumerate(
            zip(*(pairs[name] for name in self.pair_fields), strict=True)
        ):
            original, crop, target = original or size, crop or corner, target or size
            if (
                self.aesthetics
            ):  # the refiner: (original size, crop, aesthetic score), the negative's own crop
                ids.append((*original, *crop, rows["aesthetic_score"][row]))
                n_score = rows["negative_aesthetic_score"][row]
                negative_ids.append((*(n_original or original), *(n_crop or corner), n_score))
                continue
            ids.append((*original, *crop, *target))
            if task != "text-to-image":
                negative_ids.append((*(n_original or original), *crop, *(n_target or target)))
            elif n_original and n_target:
                negative_ids.append((*n_original, *(n_crop or corner), *n_target))
            else:
                negative_ids.append(ids[-1])
        return {
            "time_ids": np.asarray(ids, np.float32),
            "negative_time_ids": np.asarray(negative_ids, np.float32),
        }

    def denoiser(self, state, cond, rows, extras, *, shape, do_cfg, image=None):
        embeds, pooled = (c.astype(self.dtype) for c in cond)
        # Micro-conditioning per row; with CFG each row's negative first, as the conditioning is interleaved.
        time_ids = rows["time_ids"]
        if do_cfg:
            time_ids = interleave(rows["negative_time_ids"], time_ids)
        time_ids = time_ids.astype(self.dtype)

        # An LCM-distilled UNet takes each row's guidance as an embedding of w = guidance_scale - 1 (diffusers'
        # timestep_cond); such a UNet never runs CFG (`guided_by_cfg`).
        cond_dim = self.unet_config.time_cond_proj_dim
        timestep_cond = None
        if cond_dim is not None:
            timestep_cond = guidance_scale_embedding(rows["guidance_scale"] - 1.0, cond_dim).astype(
                self.dtype
            )

        def model(x, t, i):
            unet, x = self.merged_per_step(state, x)
            t = jnp.broadcast_to(t, (x.shape[0],))
            added = {"text_embeds": pooled, "time_ids": time_ids}
            residuals = self.unet_residuals(unet, x, t, i, embeds, added, rows, image, do_cfg)
            return unet(x, t, embeds, **added, timestep_cond=timestep_cond, **residuals)

        return model

    def unet_residuals(self, unet, x, t, i, embeds, added, rows, image, do_cfg) -> dict:
        """Traced, every step (i: the schedule's step): what the UNet adds to its skips and mid block (a
        ControlNet's residuals, models/sdxl/pipeline_controlnet.py); none here."""
        return {}

    @property
    def guided_by_cfg(self) -> bool:
        return self.unet_config.time_cond_proj_dim is None

    def decode(self, vae_state, latents, *, shape):
        vae = self.merged("vae", vae_state)
        cfg = self.vae_config
        latents = latents.astype(jnp.float32)
        if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
            latents = latents * jnp.asarray(cfg.latents_std) / cfg.scaling_factor + jnp.asarray(
                cfg.latents_mean
            )
        else:
            # diffusers' SDXL pipelines never read the VAE's shift_factor (that is Flux's, SD3's)
            latents = latents / cfg.scaling_factor
        image = vae.decode(latents).astype(jnp.float32)  # [B, H, W, 3] in [-1, 1], in the VAE's dtype
        return jnp.clip(image / 2 + 0.5, 0.0, 1.0)


def _skipped(hidden_states, clip_skip, max_skip: int):
    """Each row's hidden_states[-(clip_skip + 2)]: [T, S, D] from the (layers + 1) states and clip_skip [T].
    Selected in the layers' order, the earliest candidate first, so no layer's states need outlive the next
    selection (a gather from them stacked would hold them all at once)."""
    chosen = hidden_states[-(max_skip + 2)]
    for skip in range(max_skip - 1, -1, -1):
        chosen = jnp.where((clip_skip == skip)[:, None, None], hidden_states[-(skip + 2)], chosen)
    return chosen
