"""SDXL with a ControlNet: text-to-image, image-to-image and inpainting steered by a control image (an edge,
depth or pose map).

Mirrors diffusers' StableDiffusionXLControlNetPipeline, StableDiffusionXLControlNetImg2ImgPipeline and
StableDiffusionXLControlNetInpaintPipeline with one ControlNetModel (a folder whose model_index.json names
one of them, with a `controlnet/` component): one class, the task chosen by the images given, as SDXL's.
Every step the ControlNet (models/sdxl/controlnet.py) reads the UNet's input, timestep, text states and
micro-conditioning with the control image, and the UNet adds its residuals, times
`controlnet_conditioning_scale`, to its skips and mid block. The ControlNet rides inside the denoiser's
module (as `unet.controlnet`), so it is loaded, placed, split over the pool's mesh and gathered per step as the
UNet is; the UNet's own parameter names are unchanged (LoRA adapters find their layers).

- The control image: `control_image` (the engine's and the API's name; diffusers' Img2Img and Inpaint
  pipelines'), or `image` when no control_image is given (diffusers' text-to-image pipeline's name for it);
  with both, `image` is the picture to start from (image-to-image; with `mask_image`, inpaint), noised to
  `strength` as SDXL's own image tasks (diffusers' defaults: 0.8 and 0.9999). One for all prompts, one per
  prompt (repeated over its images, diffusers' repeat_interleave) or one per output image. Resized to the
  call's size as diffusers' control image processor does (PIL: Lanczos; numpy: nearest), in [0, 1], not
  normalised. Without a height and width the output takes the first control image's size (rounded down to the
  size multiple), as diffusers.
- `controlnet_conditioning_scale`, `control_guidance_start`, `control_guidance_end` and `guess_mode`: per row
  here (one value, one per prompt or one per image; diffusers: one per call), traced: a new value compiles
  nothing. (diffusers' Img2Img pipeline defaults `controlnet_conditioning_scale` to 0.8; here the card's 1.0,
  the text-to-image and inpaint pipelines' default, serves every task.) The guidance window is diffusers' to
  the step: step i of the L model calls the call runs (after a strength's cut, as diffusers) has the
  ControlNet when not (i / L < start or (i + 1) / L > end), worked out on the host in double precision (as
  diffusers, so a boundary such as 0.3 of 10 steps falls where it does there) as each row's first step and the
  step it stops before; outside it the residuals are scaled by 0 (the ControlNet still runs: one program for
  every window). Guess mode: the ControlNet's residuals ramp from 0.1 to 1.0 over its levels
  (models/sdxl/controlnet.py) and, with CFG, the unconditional pass gets none (diffusers runs the ControlNet
  on the conditional half only; here it runs on both and the unconditional half's residuals are dropped, the
  same numbers for twice the ControlNet's work on such a row).
- `generator=` reproduces diffusers' noise for text-to-image (the control image is not encoded: nothing is
  drawn for it); image tasks take seed= or latents= as SDXL's do.
- Not implemented (refused as unsupported arguments): several ControlNets (MultiControlNetModel),
  `padding_mask_crop` (models/engine/control_image.py); step caches (the ControlNet runs every step: a cached
  UNet step would still pay for it).
"""

from __future__ import annotations

import jax.numpy as jnp

from meshserve.models.checkpoints.loading import CheckpointError
from meshserve.models.components.image_processor import image_size
from meshserve.models.engine.common import PipelineError
from meshserve.models.engine.control_image import ControlImageInput
from meshserve.models.engine.denoise_loop import interleave
from meshserve.models.sdxl.controlnet import load_controlnet
from meshserve.models.sdxl.pipeline import StableDiffusionXLPipeline
from meshserve.models.sdxl.unet_2d_condition import SHARDING_RULES as UNET_RULES

__all__ = ["StableDiffusionXLControlNetPipeline"]


class StableDiffusionXLControlNetPipeline(ControlImageInput, StableDiffusionXLPipeline):
    conditions_encoded = False  # the control image is read by the ControlNet, never by the VAE
    row_fields = (
        *StableDiffusionXLPipeline.row_fields,
        "controlnet_conditioning_scale",
        "control_guidance_start",
        "control_guidance_end",
        "guess_mode",
    )
    cache_methods = {}

    def load(self, folder):
        modules = super().load(folder)
        unet = modules["unet"]
        controlnet = self.load_module(
            load_controlnet, folder / "controlnet", UNET_RULES, attention=self.attention
        )
        # Its residuals must meet the UNet's skips one for one (channels and count: the layers per block).
        a, b = unet.config, controlnet.config
        fields = ("block_out_channels", "cross_attention_dim", "addition_embed_type")
        if [getattr(a, f) for f in fields] + [a.per_block("layers_per_block")] != [
            getattr(b, f) for f in fields
        ] + [b.per_block("layers_per_block")]:
            raise CheckpointError(
                f"{folder / 'controlnet'}: its block_out_channels, layers_per_block, cross_attention_dim or "
                "addition_embed_type differ from the UNet's: not a ControlNet of this model"
            )
        factor = 2 ** (len(controlnet.controlnet_config.conditioning_embedding_out_channels) - 1)
        if factor != self.vae_scale_factor:
            raise CheckpointError(
                f"{folder / 'controlnet'}: its conditioning embedding halves the control image "
                f"{len(controlnet.controlnet_config.conditioning_embedding_out_channels) - 1} times, the VAE's "
                f"factor is {self.vae_scale_factor}"
            )
        unet.controlnet = controlnet  # the denoiser's module: placed, split and gathered with the UNet
        return modules

    @property
    def defaults(self) -> dict:
        return {
            **super().defaults,
            "controlnet_conditioning_scale": 1.0,
            "control_guidance_start": 0.0,
            "control_guidance_end": 1.0,
            "guess_mode": False,
            **self.folder_defaults,
        }

    def default_strength(self, task):
        # diffusers' StableDiffusionXLControlNetImg2ImgPipeline 0.8, ...InpaintPipeline 0.9999.
        return {"image-to-image": 0.8, "inpaint": 0.9999}.get(task)

    def __call__(
        self,
        prompt=None,
        *,
        image=None,
        control_image=None,
        mask_image=None,
        height=None,
        width=None,
        **kwargs,
    ):
        # diffusers' StableDiffusionXLControlNetPipeline calls the control image `image`
        if control_image is None:
            if mask_image is not None:
                raise PipelineError(
                    "inpainting with a ControlNet takes the control image as control_image= (image= is the "
                    "picture to inpaint)"
                )
            control_image, image = image, None
        if control_image is not None and height is None and width is None:  # diffusers: its size
            height, width = image_size(control_image, "control_image", self.limits["size_multiple"])
        return super().__call__(
            prompt,
            image=image,
            control_image=control_image,
            mask_image=mask_image,
            height=height,
            width=width,
            **kwargs,
        )

    def _latent_image(self, image, task: str):
        if super()._latent_image(image, task) is not None:  # the refiner's hand-off: no picture to steer by
            raise PipelineError("with a ControlNet, image= is a picture (or the control image), not latents")
        return None

    def step_rows(self, rows: dict, start: int, calls: int) -> dict:
        """Host: each row's ControlNet window as [first step, step it stops before) of the model calls
        start..calls the call runs, diffusers' controlnet_keep in double precision (the module docstring)."""
        first, stop, runs = [], [], calls - start
        for begin, end in zip(rows["control_guidance_start"], rows["control_guidance_end"], strict=True):
            if not 0.0 <= begin < end <= 1.0:
                raise PipelineError(
                    "control_guidance_start and control_guidance_end must satisfy "
                    f"0 <= start < end <= 1, got {begin} and {end}"
                )
            kept = [i for i in range(runs) if not (i / runs < begin or (i + 1) / runs > end)]
            first.append(start + kept[0] if kept else 0)
            stop.append(start + kept[-1] + 1 if kept else 0)
        return {"controlnet_first_step": first, "controlnet_stop_step": stop}

    def control_inputs(self, vae_state, control, *, shape, task) -> dict:
        """Traced: the control pixels in [0, 1] (diffusers' control image processor does not normalise)."""
        return {"control": (control + 1) / 2}

    def unet_residuals(self, unet, x, t, i, embeds, added, rows, image, do_cfg) -> dict:
        control, scale = image["control"], rows["controlnet_conditioning_scale"]
        in_window = (i >= rows["controlnet_first_step"]) & (i < rows["controlnet_stop_step"])
        scale = jnp.where(in_window, scale, 0.0)  # diffusers: scale x keep, keep 0 outside the window
        guess = (rows["guess_mode"] > 0) | unet.controlnet.controlnet_config.global_pool_conditions
        if do_cfg:  # both passes of a row: its control image, scale and guess mode
            control, scale, guess = interleave(control, control), jnp.repeat(scale, 2), jnp.repeat(guess, 2)
        # A 9-channel inpainting UNet's input carries [mask, masked image latents] after the latents; the
        # ControlNet reads the latents alone (diffusers concatenates them after its call).
        latents = x[..., : unet.controlnet.config.in_channels]
        down, mid = unet.controlnet(latents, t, embeds, control, scale, guess_mode=guess, **added)
        # Guess mode: the unconditional pass takes no residuals (interleaved [u0, c0, u1, c1, ...]).
        if do_cfg:
            unconditional = jnp.arange(guess.shape[0]) % 2 == 0
            dropped = (guess & unconditional).reshape(-1, 1, 1, 1)
            down = [jnp.where(dropped, 0, r).astype(r.dtype) for r in down]
            mid = jnp.where(dropped, 0, mid).astype(mid.dtype)
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
