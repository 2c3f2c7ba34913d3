"""Image inputs on a mesh give the single-device result (8 CPU devices): SDXL inpainting with the base UNet
(the image_encode program, the noised image as the start, the known region blended back after every step)
with CFG over cfg, context-parallel attention and the weights stored split over both (FSDP). One layout:
each costs a compile of the whole denoise program (~20 s here), and this one crosses every boundary the
image inputs add (the image_encode outputs placed by batch, the blend's mask and noise inside the loop)."""

import numpy as np
import pytest

from meshserve.models import load_pipeline

H, W = 64, 48


def _inputs():
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:H, 0:W]
    images = [rng.uniform(0, 1, (H, W, 3)).astype(np.float32) * 0.3 + 0.35 for _ in range(2)]
    masks = [(x > 20).astype(np.float32), ((y - 32) ** 2 + (x - 24) ** 2 < 200).astype(np.float32)]
    noise = rng.standard_normal((2, 4, H // 2, W // 2)).astype(np.float32)
    return dict(
        image=images,
        mask_image=masks,
        latents=noise,
        strength=0.6,
        negative_prompt="blurry",
        guidance_scale=5.0,
        height=H,
        width=W,
        num_inference_steps=4,
        output_type="np",
    )


@pytest.mark.parametrize(
    "sizes,weights",
    [({"cfg": 2, "context": 2}, {"shard_over": ["cfg", "context"]})],
    ids=["cfg2-context2-fsdp"],
)
def test_inpaint_on_a_mesh_matches_single_device(tiny_sdxl_path, sizes, weights, record_property):
    prompts = ["a photo of a cat", "a red car"]
    single = load_pipeline(tiny_sdxl_path)(prompts, **_inputs()).images
    n = int(np.prod(list(sizes.values())))
    pipe = load_pipeline(tiny_sdxl_path, mesh=sizes, devices=list(range(n)), weights=weights)
    got = pipe(prompts, **_inputs()).images
    err = float(np.abs(got - single).max())
    record_property("pipeline_max_abs_err", err)
    assert err <= 1e-4, f"max abs pixel error {err:.2e}"
    assert single.std() > 1e-3
