"""The Wan 2.1 image-to-video pipeline: WanPipeline plus a first frame that conditions every step.

Mirrors diffusers' WanImageToVideoPipeline (`pipelines/wan/pipeline_wan_i2v.py`, the reference it is tested
against) on the engine's image hook (models/engine/pipeline.py, models/engine/image_inputs.py): the call's
`image=` (one for all, one per prompt or one per output row) makes the task "image-to-video", and the
`image_encode` program turns it into two inputs of the denoise program:

- condition [B, T, h, w, 4 + z]: the mask channels (the VAE's temporal factor of them: 1 on the first latent
  frame, 0 on the others; diffusers' `mask_lat_size`) then the VAE posterior's MODE (deterministic: diffusers'
  `sample_mode="argmax"`) of the video [image, 0, 0, ...] (num_frames frames, the image resized to the call's
  height x width by diffusers' VaeImageProcessor rules: models/components/image_processor.py), normalised
  `(z - latents_mean) * (1 / latents_std)` in fp32. The engine concatenates it after the noisy latents on the
  channel axis at every step (`with_condition`): 16 + 4 + 16 = 36 channels for the real models.
- image_embeds [B, 257, 1280]: the CLIP vision encoder's PENULTIMATE hidden states (diffusers' `encode_image`:
  `hidden_states[-2]`) of the image as the folder's CLIPImageProcessor prepares it (shortest side 224, center
  crop: models/components/clip_vision.py), in the transformer dtype; with CFG both halves take the same
  embeds (diffusers passes `image_embeds` to the conditional and the unconditional call alike).

First-last-frame-to-video (Wan2.1-FLF2V-14B-720P: a transformer whose config has `pos_embed_seq_len`, twice the
CLIP tokens) takes `last_image=` too, and requires it, as diffusers' `last_image`: the condition video is
[image, 0, ..., 0, last image], its mask also 1 on the last frame (the last latent frame's last channel), and
the image states both images' CLIP states one after the other ([B, 2 x 257, 1280]). An I2V model without the
position embedding refuses `last_image` (diffusers' would fail on the doubled image states).

The loop starts from pure noise (each row's seed, or `latents=` as that noise) as diffusers' I2V does; the
image enters only as the condition and the image tokens, so there is no `strength` (an error names it), and
no `mask_image` (no inpainting). What is Wan's own is otherwise WanPipeline's (text, scheduler, decode,
limits); the frame count, size and steps follow the same limits.

A folder is image-to-video when its model_index.json names WanImageToVideoPipeline: image_encoder/ (CLIP vision,
CLIPVisionModel or ...WithProjection), image_processor/ (preprocessor_config.json) and a transformer with
image_dim / added_kv_proj_dim whose in_channels are 2 z_dim + the VAE's temporal factor. Wan 2.2's I2V-A14B
folders (transformer_2 and boundary_ratio: two experts, models/wan/two_experts.py) have no image encoder and
transformers without image_dim: the image enters as the condition alone (diffusers encodes no image for them),
so `image_tokens` is False. They take a `last_image` too, optionally, as diffusers' pipeline does for them: it
enters the condition alone (the video [image, 0, ..., 0, last image], the mask's last-frame bit). One
image_encode program serves both: without a last image the last frame is zeros, as diffusers' condition video
has there, and a per-row flag leaves the mask's bit off, so a pool warms up one program, not two. TI2V
folders (expand_timesteps) load as models/wan/pipeline_ti2v.py's pipeline, not this one.

Deliberate differences from diffusers, none of which changes a number of what both accept:
- diffusers' attention processor takes the image tokens to be the first `S - 512` rows of one context, so its
  I2V is only right at max_sequence_length 512 (its default); here they are passed apart, any text length works.
- diffusers encodes one image for the whole call (`image_embeds.repeat(batch_size, ...)`); here every output
  row has its own image (and its own CLIP embeds), so a batch may mix images. The parity tests compare a
  batch of two images with two diffusers calls.
- a numpy image (diffusers takes PIL images and tensors only) is the PIL image it makes: uint8 as is, floats
  in [0, 1] scaled by 255 and rounded, for the CLIP preprocessing; the VAE's pixels follow
  models/components/image_processor.py.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.clip_vision import SHARDING_RULES as CLIP_VISION_RULES
from meshserve.models.components.clip_vision import CLIPImagePreprocessor, load_clip_vision_model
from meshserve.models.components.image_processor import image_rows, preprocess_image
from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.denoise_loop import interleave
from meshserve.models.wan.pipeline import WanPipeline, two_experts

__all__ = ["WanImageToVideoPipeline"]


class WanImageToVideoPipeline(WanPipeline):
    task = "image-to-video"
    image_fields = ("last_image",)  # the video's last frame (first-last-frame models; Wan 2.2's two experts)

    # Whether the transformer takes the image's CLIP tokens (Wan 2.1); Wan 2.2's two experts take the latent
    # condition alone, as diffusers' pipeline runs them (no image encoder).
    image_tokens: bool = True
    # A first-last-frame model (Wan 2.1 FLF2V: pos_embed_seq_len): it needs last_image.
    first_last: bool = False

    @property
    def takes_last_image(self) -> bool:
        """FLF2V needs a last frame; Wan 2.2's two experts take one or none (the condition alone)."""
        return self.first_last or not self.image_tokens

    def load(self, folder: Path) -> dict:
        index = read_json(folder / "model_index.json")
        # Wan 2.2's experts encode no image; nor does TI2V-5B (expand_timesteps: WanPipeline.load refuses it here)
        self.image_tokens = not two_experts(index) and not index.get("expand_timesteps")
        if self.image_tokens:
            for part in ("image_encoder", "image_processor"):
                if not (folder / part).is_dir():
                    raise CheckpointError(f"{folder}: no {part}/ (a Wan 2.1 image-to-video folder has one)")
        # text encoder, transformer (Wan 2.1: checked for image_dim; Wan 2.2: the two experts), VAE
        modules = super().load(folder)
        if not self.image_tokens:
            return modules
        self.image_processor = CLIPImagePreprocessor.from_folder(folder / "image_processor")
        # fp32 whatever the pipeline dtype, as diffusers' Wan I2V example loads it: it runs once per video.
        image_encoder = self.load_module(
            load_clip_vision_model,
            folder / "image_encoder",
            CLIP_VISION_RULES,
            dtype=jnp.float32,
            attention=self.plain_attention,
        )
        c = image_encoder.config
        if c.hidden_size != self.transformer_config.image_dim:
            raise CheckpointError(
                f"{folder}: the image encoder's hidden size {c.hidden_size} is not the transformer's image_dim "
                f"{self.transformer_config.image_dim}"
            )
        if self.image_processor.output_size() is None:
            raise CheckpointError(
                f"{folder / 'image_processor'}: without a center crop or a fixed size its images take each "
                f"input's aspect; the image encoder takes {c.image_size}x{c.image_size} images: not supported"
            )
        if self.image_processor.output_size() != (c.image_size, c.image_size):
            raise CheckpointError(
                f"{folder / 'image_processor'}: makes {self.image_processor.output_size()} images, the image "
                f"encoder takes {c.image_size}x{c.image_size}"
            )
        # First-last-frame-to-video: the transformer's image position embedding covers both frames' CLIP states.
        tokens = (c.image_size // c.patch_size) ** 2 + 1
        self.first_last = self.transformer_config.pos_embed_seq_len is not None
        if self.first_last and self.transformer_config.pos_embed_seq_len != 2 * tokens:
            raise CheckpointError(
                f"{folder / 'transformer'}: pos_embed_seq_len {self.transformer_config.pos_embed_seq_len} is not "
                f"twice the image encoder's {tokens} tokens (the first and the last frame's)"
            )
        modules["image_encoder"] = image_encoder
        return modules

    def split_modules(self, modules) -> None:
        super().split_modules(modules)
        # Not a text encoder: the image_encode program takes it, the text_encode program does not.
        self._text_states.pop("image_encoder", None)

    @property
    def transformer_in_channels(self) -> int:
        # noise (z) + mask (one channel per frame the VAE folds into a latent frame) + the image latents (z)
        return 2 * self.vae_config.z_dim + self.temporal_factor

    def task_of(self, image, mask_image) -> str:
        # The engine's rule takes a call without an image as the model's text task; this model has none.
        if image is None and mask_image is None:
            raise PipelineError(
                f"{self.model_id or self.family} needs an image (image=): it takes {list(self.tasks)}"
            )
        return super().task_of(image, mask_image)

    @property
    def limits(self) -> dict:
        # WanPipeline's (sizes, frames, steps, text length), for the one task an image is required for.
        limits = {**super().limits, "tasks": [self.task], "last_image": self.takes_last_image}
        return limits | {"last_image_optional": self.takes_last_image and not self.first_last}

    # ----------------------------------------------------------------------------------------------
    # The image inputs

    @property
    def image_encode_states(self) -> dict:
        """The image_encode program's modules: the VAE (the condition) and the CLIP vision encoder (Wan 2.1)."""
        if not self.image_tokens:
            return {"vae": self._states["vae"]}
        return {"vae": self._states["vae"], "image_encoder": self._states["image_encoder"]}

    def warm_up_inputs(self, width: int, height: int) -> dict:
        # Any image compiles the same programs (its pixels are traced inputs): a black one of the video's size.
        black = np.zeros((height, width, 3), np.uint8)
        return {"image": black, "last_image": black} if self.first_last else {"image": black}

    def preprocess_images(self, image, mask_image, prompts: int, n: int, settings: dict, last_image=None):
        """Host: one row per output video of the call's images, twice: for the VAE [B, H, W, 3] in [-1, 1] at
        the call's size, and for CLIP [B, 224, 224, 3] (the folder's image processor); first-last-frame models
        the same of `last_image` ("last_video", "last_clip")."""
        if mask_image is not None:  # the engine's task check refuses it first; kept for direct callers
            raise PipelineError("mask_image: Wan image-to-video takes no mask")
        if self.first_last and last_image is None:
            raise PipelineError(
                f"{self.model_id or self.family} is a first-last-frame model: it needs last_image= (the last "
                "frame) besides image="
            )
        if not self.takes_last_image and last_image is not None:
            raise PipelineError(
                f"last_image: {self.model_id or self.family} is not a first-last-frame model (its transformer "
                "has no pos_embed_seq_len); it takes image= alone"
            )
        if last_image is not None and settings["num_frames"] < 2:
            raise PipelineError(
                "num_frames: a first-last-frame video needs more than one frame (the first and the last): 5 at least"
            )
        height, width = settings["height"], settings["width"]
        pixels = {}
        for prefix, name, value in (("", "image", image), ("last_", "last_image", last_image)):
            if value is not None:
                pixels[prefix + "video"] = image_rows(
                    value, prompts, n, name, preprocess_image, height, width
                )
                if self.image_tokens:
                    pixels[prefix + "clip"] = image_rows(
                        value, prompts, n, name, self._clip_pixels, height, width
                    )
        if not self.image_tokens and settings["num_frames"] > 1:  # one program with a last frame or without
            rows = len(pixels["video"])
            pixels.setdefault("last_video", np.zeros_like(pixels["video"]))
            pixels["has_last"] = np.full((rows,), float(last_image is not None), np.float32)
        return pixels, None

    def _clip_pixels(self, image, height: int, width: int, name: str) -> np.ndarray:
        if isinstance(image, np.ndarray):
            if image.ndim != 3 or image.shape[-1] != 3:
                raise PipelineError(f"{name}: a numpy image must be [H, W, 3], got shape {list(image.shape)}")
            if image.dtype != np.uint8:
                if (
                    image.dtype.kind != "f"
                    or not np.all(np.isfinite(image))
                    or image.min() < 0
                    or image.max() > 1
                ):
                    raise PipelineError(f"{name}: a numpy image must be uint8 or floats in [0, 1]")
                image = np.round(image * 255.0).astype(np.uint8)
        try:
            return self.image_processor([image])[0]
        except (ValueError, TypeError, AttributeError) as e:
            raise PipelineError(f"{name}: {e}") from None

    def image_inputs(self, states, pixels, mask, *, shape, task):
        """Traced (the image_encode program): {"video": [B, H, W, 3] in [-1, 1], "clip": [B, 224, 224, 3]} (and
        first-last-frame's "last_video", "last_clip"; Wan 2.2's "last_video" and "has_last" [B] of {0, 1}) ->
        {"condition": [B, T, h, w, tf + z] fp32, "image_embeds": [B, 257 (first-last: 514), image_dim] in the
        model dtype; none for Wan 2.2}."""
        b, height, width, _ = pixels["video"].shape
        frames = (shape[0] - 1) * self.temporal_factor + 1
        image = pixels["video"].astype(jnp.float32)[:, None]
        last = pixels["last_video"].astype(jnp.float32)[:, None] if "last_video" in pixels else None
        zeros = jnp.zeros((b, frames - 1 - (last is not None), height, width, 3), jnp.float32)
        video = jnp.concatenate([image, zeros] + ([last] if last is not None else []), axis=1)
        latents = self.normalized(self.merged("vae", states["vae"]).encode(video).mode())  # [B, T, h, w, z]
        mask = jnp.zeros((*latents.shape[:4], self.temporal_factor), jnp.float32).at[:, 0].set(1.0)
        if last is not None:
            # diffusers' mask keeps the last frame too: the last latent frame's last channel (the frame it ends
            # with); Wan 2.2's rows without a last image leave it off.
            kept = pixels["has_last"][:, None, None] if "has_last" in pixels else 1.0
            mask = mask.at[:, -1, ..., -1].set(kept)
        if not self.image_tokens:  # Wan 2.2's experts: the condition alone
            return {"condition": self.constrain(jnp.concatenate([mask, latents], axis=-1))}
        encoder = self.merged("image_encoder", states["image_encoder"])
        embeds = encoder(pixels["clip"]).hidden_states[-2].astype(self.dtype)
        if last is not None:  # the image states are both images' CLIP states, the first image's first
            last_embeds = encoder(pixels["last_clip"]).hidden_states[-2].astype(self.dtype)
            embeds = jnp.concatenate([embeds, last_embeds], axis=1)
        return {
            "condition": self.constrain(jnp.concatenate([mask, latents], axis=-1)),
            "image_embeds": self.constrain(embeds),
        }

    # ----------------------------------------------------------------------------------------------
    # The denoiser

    def denoiser(self, state, embeds, rows, rope, *, shape, do_cfg, image=None):
        if image is None:
            raise PipelineError("Wan image-to-video needs an image")
        embeds = embeds.astype(self.dtype)
        image_embeds = image.get("image_embeds")  # None: Wan 2.2's experts take no image tokens
        if image_embeds is not None:
            image_embeds = image_embeds.astype(self.dtype)
        if do_cfg and image_embeds is not None:  # the same image states for each row's two halves
            image_embeds = interleave(image_embeds, image_embeds)

        def model(x, t, i):  # x: the latents with the condition after them (the engine's with_condition)
            transformer, x = self.merged_per_step(state, x)
            return transformer(
                x.astype(self.dtype), jnp.broadcast_to(t, (x.shape[0],)), embeds, rope, image_embeds
            )

        return model
