"""A pipeline steered by a control image on every call (FLUX.1 Canny / Depth, SDXL with a ControlNet).

Mixed in before the family's pipeline class: `control_image=` is required, one for all prompts, one per prompt or
one per output image (the family's `preprocess_images` pairs them with the rows: components/image_processor.py
`control_rows`); it conditions the text task (`condition_fields`: the image_encode program runs without
`image=`), the card says so (`limits["control_image"]`, the API's rule for the request field), and a pool warms up
with a black one (its pixels are traced inputs: any image compiles the same programs).
"""

from __future__ import annotations

import numpy as np

from meshserve.models.engine.common import PipelineError

__all__ = ["ControlImageInput"]


class ControlImageInput:
    image_fields = ("control_image",)
    condition_fields = ("control_image",)

    @property
    def limits(self) -> dict:
        return {**super().limits, "control_image": True}

    def __call__(self, prompt=None, *, control_image=None, **kwargs):
        if control_image is None:
            raise PipelineError(
                f"control_image: {self.model_id or type(self).__name__} needs one (its edge, depth or pose map)"
            )
        return super().__call__(prompt, control_image=control_image, **kwargs)

    def warm_up_inputs(self, width: int, height: int) -> dict:
        return {"control_image": np.zeros((height, width, 3), np.uint8)}
