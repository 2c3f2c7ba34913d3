"""A pipeline steered by a control image on every call (FLUX.1 Canny / Depth, SDXL with a ControlNet).

Mixed in before the family's pipeline class: `control_image=` is required, one for all prompts, one per prompt or
one per output image (paired with the rows by components/image_processor.py `control_rows`); it conditions every
task (`condition_fields`: the image_encode program runs without `image=` too), the card says so
(`limits["control_image"]`, the API's rule for the request field), and a pool warms up with a black one (its
pixels are traced inputs: any image compiles the same programs).

With `image=` (and `mask_image=`) too, the call is the family's image-to-image (inpaint) steered by the control
image (diffusers' *ControlImg2Img / *ControlInpaint and ControlNet Img2Img / Inpaint pipelines): the family's
own image inputs plus its `control_inputs`. The pixels the image_encode program takes are {"control": [B, H, W,
3] in [-1, 1]} and, with an image, "image" (the family's). `padding_mask_crop` is refused (the control image
would need the same crop; none of those diffusers pipelines but SDXL's inpaint one takes it).
"""

from __future__ import annotations

import numpy as np

from meshserve.models.components.image_processor import control_rows
from meshserve.models.engine.common import PipelineError

__all__ = ["ControlImageInput"]


class ControlImageInput:
    image_fields = ("control_image",)
    condition_fields = ("control_image",)

    @property
    def limits(self) -> dict:
        return {**super().limits, "control_image": True}

    def __call__(self, prompt=None, *, control_image=None, padding_mask_crop=None, **kwargs):
        if control_image is None:
            raise PipelineError(
                f"control_image: {self.model_id or type(self).__name__} needs one (its edge, depth or pose map)"
            )
        if padding_mask_crop is not None:
            raise PipelineError("padding_mask_crop is not supported with a control image")
        return super().__call__(prompt, control_image=control_image, **kwargs)

    def warm_up_inputs(self, width: int, height: int) -> dict:
        return {"control_image": np.zeros((height, width, 3), np.uint8)}

    def preprocess_images(self, image, mask_image, prompts: int, n: int, settings: dict, control_image=None):
        """Host: {"control": one control image per output row at the call's size, and with an image task the
        family's "image"}, and the family's masks (inpaint) or None."""
        control = control_rows(control_image, prompts, n, settings["height"], settings["width"])
        if image is None:
            return {"control": control}, None
        pixels, masks = super().preprocess_images(image, mask_image, prompts, n, settings)
        return {"image": pixels, "control": control}, masks

    def image_inputs(self, vae_state, pixels, mask, *, shape, task):
        """Traced (the image_encode program): the family's image inputs (image tasks) and its control inputs."""
        inputs = {}
        if "image" in pixels:
            inputs = super().image_inputs(vae_state, pixels["image"], mask, shape=shape, task=task)
        return {**inputs, **self.control_inputs(vae_state, pixels["control"], shape=shape, task=task)}

    def control_inputs(self, vae_state, control, *, shape, task) -> dict:
        """Traced: control pixels [B, H, W, 3] in [-1, 1] -> what the family's denoiser reads."""
        raise NotImplementedError
