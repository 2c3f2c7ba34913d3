"""FLUX.1 Canny and Depth: text-to-image, image-to-image and inpainting steered by a control image the
transformer takes every step.

Mirrors diffusers' FluxControlPipeline, FluxControlImg2ImgPipeline and FluxControlInpaintPipeline (a folder
whose model_index.json names one of them: FLUX.1-Canny-dev, FLUX.1-Depth-dev, whose transformer takes 128
channels, the packed latents' 64 and the control image's 64): one class, the task chosen by the images given.
The control image (an edge map, a depth map: made by the client, as diffusers takes it) is resized to the call's
size, encoded to (z - shift) x scaling and packed like the latents; every step it follows the latents on the
channel axis (the engine's condition, as FLUX.1 Fill's masked image). Without `image=` the loop starts from
noise (Flux's text-to-image); with it, from the image noised to `strength` (0.6 by default, diffusers'), and
with `mask_image=` the known region is put back after every step, as Flux's own image tasks.

- `control_image` is required: one for all prompts, one per prompt (each repeated over its
  num_images_per_prompt images, diffusers' `repeat_interleave`; not tiled as `image=` is) or one per output
  image.
- The encoded control image is the posterior's mode, where diffusers samples it with the call's generator
  (before it draws the noise): `generator=` is refused (give seed= or latents=).
- diffusers' FluxControl pipelines take no negative prompt; `negative_prompt` with `true_cfg_scale` > 1 runs
  Flux's true CFG here, both passes with the control image (an extension).
"""

from __future__ import annotations

from meshserve.models.engine.control_image import ControlImageInput
from meshserve.models.flux.pipeline import FluxPipeline

__all__ = ["FluxControlPipeline"]


class FluxControlPipeline(ControlImageInput, FluxPipeline):
    @property
    def condition_channels(self) -> int:
        return 4 * self.vae_config.latent_channels  # the packed control image's latents

    def control_inputs(self, vae_state, control, *, shape, task) -> dict:
        """Traced: control pixels [B, H, W, 3] in [-1, 1] -> {"condition": packed latents}."""
        return {"condition": self.encode_image(vae_state, control, shape=shape, task=task)}
