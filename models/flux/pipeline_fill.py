"""FLUX.1 Fill: inpainting and outpainting by a transformer that takes the masked image and the mask every step.

Mirrors diffusers' FluxFillPipeline (a folder whose model_index.json names it: FLUX.1-Fill-dev, whose
transformer takes 384 channels: the 64 of the packed latents, 64 of the packed masked image's latents and 256
of the mask, each 16 x 16 pixel patch of it folded into channels). What differs from Flux's inpainting
(FluxInpaintPipeline, models/flux/pipeline.py), which puts the known region back after every step:

- The condition, [masked image latents, mask] after the latents on the channel axis every step (the engine's
  `with_condition`, as SDXL's 9-channel inpainting UNet): the masked image is the image with the region to
  repaint set to 0 (mid-gray in [-1, 1]), encoded to (mode - shift) x scaling and packed; the mask, binarised
  at the call's size, has each VAE-factor x VAE-factor block of pixels folded into channels (diffusers'
  view / permute / reshape to [B, 64, h, w]), then packed like the latents. Nothing is blended back.
- The task is inpaint alone (an image and a mask; outpainting is a mask over the borders), strength 1.0 by
  default: the loop starts from noise (flow matching's noising at sigma 1 is the noise itself); a smaller one
  starts from the image noised by Flux's float rule (diffusers' get_timesteps and scale_noise).
- diffusers' defaults: 50 steps, guidance_scale 30 (the guidance embedding; FLUX.1-Fill-dev is guidance
  distilled). diffusers' FluxFillPipeline takes no negative prompt; here true CFG (`negative_prompt`,
  `true_cfg_scale` > 1) is Flux's, an extension that runs both passes with the same condition.
"""

from __future__ import annotations

import jax.numpy as jnp

from meshserve.models.flux.pipeline import FluxPipeline, pack_latents

__all__ = ["FluxFillPipeline"]


class FluxFillPipeline(FluxPipeline):
    @property
    def condition_channels(self) -> int:
        f = self.vae_scale_factor
        return 4 * self.vae_config.latent_channels + 4 * f * f  # packed masked-image latents, packed mask

    @property
    def defaults(self) -> dict:
        # FluxFillPipeline's __call__ defaults; what the folder says (meshserve.json) still comes last.
        return {**super().defaults, "num_inference_steps": 50, "guidance_scale": 30.0, **self.folder_defaults}

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("inpaint",)

    def default_strength(self, task):
        return 1.0 if task == "inpaint" else None

    def image_inputs(self, vae_state, pixels, mask, *, shape, task):
        """Traced (the image_encode program): pixels [B, H, W, 3] in [-1, 1], mask [B, H, W, 1] of {0, 1} ->
        {"image_latents": what a strength < 1 noises, "condition": [B, S, 4C + 4 f^2]}."""
        masked = self.encode_image(vae_state, pixels * (mask < 0.5), shape=shape, task=task)
        return {
            "image_latents": self.encode_image(vae_state, pixels, shape=shape, task=task),
            "condition": jnp.concatenate([masked, self.folded_mask(mask)], axis=-1),
        }

    def folded_mask(self, mask):
        """[B, H, W, 1] -> packed [B, S, 4 f^2]: each f x f block of pixels (f the VAE's factor) as channels in
        diffusers' order (row within the block, then column), then packed like the latents."""
        f = self.vae_scale_factor
        b, h, w = mask.shape[0], mask.shape[1] // f, mask.shape[2] // f
        blocks = mask[..., 0].reshape(b, h, f, w, f).transpose(0, 1, 3, 2, 4).reshape(b, h, w, f * f)
        return pack_latents(blocks).astype(self.latent_dtype)
