"""FLUX.1 Kontext: image editing by in-context image tokens, and text-to-image from the same folder.

Mirrors diffusers' FluxKontextPipeline (a folder whose model_index.json names it: FLUX.1-Kontext-dev). The
transformer is Flux's; what Kontext adds is the image as context:

- The image, resized to the call's size, is encoded to its posterior's mode, (z - shift) x scaling, and
  packed like the latents (diffusers' `_encode_vae_image` with sample_mode="argmax", then `_pack_latents`).
- Every step the model sees [latents, image latents] along the token axis; the image's position ids are
  the latents' with the first coordinate 1 instead of 0 (diffusers' `image_ids[..., 0] = 1`), so both
  halves share the RoPE grid but not the tokens' identity. Only the latents' half of the output is the
  prediction (`noise_pred[:, :latents.size(1)]`); both true-CFG passes see the image.
- The loop starts from noise (no strength); the schedule's shift reads the latents' token count alone.
- The image is resized to the output's size, where diffusers by default (`_auto_resize=True`) resizes it to
  the one of its 17 preferred Kontext resolutions nearest its aspect ratio and scales the output to
  `max_area` (1024 x 1024) at the requested aspect ratio. Here the call's height and width are the
  output's, and the image's: the image's token count is then the output's, one program per size whatever
  the image (diffusers' token count follows the image's aspect ratio: a compilation per ratio). It is
  diffusers' result for `_auto_resize=False`, `max_area=height * width` and an image of that size, which
  the parity test checks; ask for one of PREFERRED_KONTEXT_RESOLUTIONS to edit at Kontext's trained sizes.
  Without an image the call is FluxPipeline's text-to-image (as diffusers' with `image=None`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from meshserve.models.engine.denoise_loop import interleave
from meshserve.models.flux.pipeline import FluxPipeline
from meshserve.models.flux.transformer_flux import flux_rope, image_ids

__all__ = ["PREFERRED_KONTEXT_RESOLUTIONS", "FluxKontextPipeline"]

# diffusers' PREFERRED_KONTEXT_RESOLUTIONS as (width, height): the sizes FLUX.1 Kontext was trained at.
PREFERRED_KONTEXT_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)


class FluxKontextPipeline(FluxPipeline):
    @property
    def tasks(self) -> tuple[str, ...]:
        return ("text-to-image", "image-to-image")

    def default_strength(self, task):
        return None  # the image conditions the model; the loop always starts from noise

    def denoise_extras(self, shape, text_len):
        """(text-to-image's RoPE tables, image-to-image's): the second's joint sequence is [text, latents,
        image], the image's ids [1, row, col] (diffusers' image_ids). Both are built once per size on the
        host; a call's task picks one in `denoiser`."""
        grid = image_ids(shape[0] // 2, shape[1] // 2)
        context = grid.copy()
        context[:, 0] = 1
        text = np.zeros((text_len, 3), np.float32)
        axes = self.transformer_config.axes_dims_rope
        plain = flux_rope(np.concatenate([text, grid]), axes)
        return self.put_replicated((plain, flux_rope(np.concatenate([text, grid, context]), axes)))

    def image_inputs(self, vae_state, pixels, mask, *, shape, task):
        """Traced (the image_encode program): pixels [B, H, W, 3] -> {"context_latents": packed [B, S, 4C]}."""
        return {"context_latents": self.encode_image(vae_state, pixels, shape=shape, task=task)}

    def denoiser(self, state, cond, rows, rope, *, shape, do_cfg, image=None):
        plain, with_context = rope
        if image is None:
            return super().denoiser(state, cond, rows, plain, shape=shape, do_cfg=do_cfg)
        model = super().denoiser(state, cond, rows, with_context, shape=shape, do_cfg=do_cfg)
        context = image["context_latents"]
        if do_cfg:  # both passes of a row see its image
            context = interleave(context, context)

        def in_context(x, t, i):
            tokens = x.shape[1]
            return model(jnp.concatenate([x, context.astype(x.dtype)], axis=1), t, i)[:, :tokens]

        return in_context
