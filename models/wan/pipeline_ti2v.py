"""Wan 2.2's TI2V-5B: text-to-video and image-to-video from one folder.

A folder whose model_index.json sets `expand_timesteps` (Wan2.2-TI2V-5B: a 5B transformer on 48 latent channels,
the Wan 2.2 VAE, 16x in space) is what diffusers runs as WanPipeline (text-to-video) and as
WanImageToVideoPipeline (image-to-video); here one pipeline takes both tasks, the call's `image=` choosing, as
SDXL's takes text-to-image and image-to-image.

- Text-to-video is WanPipeline's: diffusers' per-token timesteps are then all the step's (models/wan/pipeline.py).
- Image-to-video mirrors diffusers' WanImageToVideoPipeline with expand_timesteps: the image, resized to the
  call's size (diffusers' VideoProcessor rules: models/components/image_processor.py), is encoded ALONE (one
  frame, no zero frames after it) to one latent frame, the posterior's mode normalised `(z - latents_mean) *
  (1 / latents_std)` in fp32. Every step the model's input has those latents in place of the first latent
  frame (diffusers' `(1 - first_frame_mask) * condition + first_frame_mask * latents`) and the first frame's
  tokens take timestep 0 (the transformer's `first_frame_timestep`); the loop starts from noise, as
  diffusers'. After every step the first latent frame is set to the image's latents again (`after_step`):
  the model never sees that frame of the loop's latents and the scheduler's arithmetic is per element, so
  nothing else changes, and the loop ends on diffusers' final latents (which set it once, after the loop).
  What a step-end callback or a preview reads of frame 0 is therefore the image, where diffusers' holds the
  stepped noise until the end. No CLIP image tokens, no `last_image` (diffusers ignores one here; refused),
  no strength, no mask.
"""

from __future__ import annotations

import jax.numpy as jnp

from meshserve.models.components.image_processor import image_rows, preprocess_image
from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.denoise_loop import interleave
from meshserve.models.wan.pipeline import WanPipeline

__all__ = ["WanTI2VPipeline"]


class WanTI2VPipeline(WanPipeline):
    @property
    def tasks(self) -> tuple[str, ...]:
        return ("text-to-video", "image-to-video")

    @property
    def limits(self) -> dict:
        return {**super().limits, "tasks": list(self.tasks)}

    # ----------------------------------------------------------------------------------------------
    # The image

    def preprocess_images(self, image, mask_image, prompts: int, n: int, settings: dict):
        """Host: one row per output video of the call's images, [B, H, W, 3] in [-1, 1] at the call's size."""
        if mask_image is not None:  # the engine's task check refuses it first; kept for direct callers
            raise PipelineError("mask_image: Wan image-to-video takes no mask")
        height, width = settings["height"], settings["width"]
        return image_rows(image, prompts, n, "image", preprocess_image, height, width), None

    def image_inputs(self, vae_state, pixels, mask, *, shape, task):
        """Traced (the image_encode program): pixels [B, H, W, 3] -> {"first_frame": [B, 1, h, w, z] fp32},
        the image's normalised latents."""
        latents = self.merged("vae", vae_state).encode(pixels.astype(jnp.float32)[:, None]).mode()
        return {"first_frame": self.constrain(self.normalized(latents))}

    def after_step(self, image, scheduler, schedule, noise, stop):
        return lambda x, i: with_first_frame(image["first_frame"], x)

    # ----------------------------------------------------------------------------------------------
    # The denoiser

    def denoiser(self, state, embeds, rows, rope, *, shape, do_cfg, image=None):
        if image is None:
            return super().denoiser(state, embeds, rows, rope, shape=shape, do_cfg=do_cfg)
        embeds = embeds.astype(self.dtype)
        first = image["first_frame"]
        if do_cfg:  # both halves of a row see its image
            first = interleave(first, first)

        def model(x, t, i):
            transformer, x = self.merged_per_step(state, with_first_frame(first, x))
            t = jnp.broadcast_to(t, (x.shape[0],))
            return transformer(x.astype(self.dtype), t, embeds, rope, None, jnp.zeros_like(t))

        return model


def with_first_frame(first, x):
    """x [B, T, h, w, z] with its first latent frame replaced by `first` [B, 1, h, w, z]."""
    return jnp.concatenate([first.astype(x.dtype), x[:, 1:]], axis=1)
