"""Image inputs on 8 devices give the single-device result: each image pipeline (SDXL img2img, SDXL inpainting
with the base 4-channel UNet and with a 9-channel inpainting UNet, Flux img2img and inpainting) on one mesh that
crosses every boundary the image inputs add: data2 x cfg2 x context2, the two images of a batch over data,
each image's negative/positive passes over cfg, its tokens over context, and every weight stored split 8 ways
(FSDP, `shard_over`) and gathered where used. What is compared is the decoded picture, fp32.

One layout per pipeline, one pipeline object per model and mesh, one single-device reference per pipeline:
each layout costs a compile of the whole denoise program (~20 s here). Every call is a batch of 2 prompts
with 2 different images (and masks), CFG with negatives (Flux: true CFG), and a strength that starts the
loop at step 1 of 3, so the image noised to a middle step is the start and 2 steps run (SDXL: 3 - int(3 x
0.7) = 1; Flux: int(3 - 3 x 0.6) = 1); inpainting blends the known region back after each. The noise is given
(`latents=`: the noise the image is noised with), so both sides draw the same.
"""

import jax
import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.flux.pipeline import pack_latents

MESH = {"data": 2, "cfg": 2, "context": 2}
WEIGHTS = {"shard_over": ["data", "cfg", "context"]}
PROMPTS = ["a photo of a cat", "a red car"]
NEGATIVE = ["blurry", "low quality"]
STEPS = 3
SDXL_HW = (64, 48)  # latents 32 x 24
FLUX_HW = (
    36,
    28,
)  # latents 18 x 14: 9 x 7 = 63 packed tokens + 16 text tokens, split over context by padding


def _images(height: int, width: int, seed: int) -> list[np.ndarray]:
    """Two different smooth images with a little noise (a random image's latents are near noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    out = []
    for _ in range(2):
        a, b, c = rng.uniform(0.2, 0.8, 3)
        img = np.stack([a * x + 0.2, b * y + 0.1, c * (1 - x * y)], axis=-1)
        out.append(np.clip(img + 0.05 * rng.standard_normal(img.shape), 0, 1).astype(np.float32))
    return out


def _masks(height: int, width: int) -> list[np.ndarray]:
    """A rectangle and a disc (1: repaint)."""
    y, x = np.mgrid[0:height, 0:width]
    rect = ((y > height // 4) & (x > width // 3)).astype(np.float32)
    disc = ((y - height / 2) ** 2 + (x - width / 2) ** 2 < (min(height, width) / 3) ** 2).astype(np.float32)
    return [rect, disc]


def _sdxl_kw(mask: bool) -> dict:
    height, width = SDXL_HW
    noise = np.random.default_rng(1).standard_normal((2, 4, height // 2, width // 2)).astype(np.float32)
    kw = dict(
        image=_images(height, width, 0),
        latents=noise,
        strength=0.7,
        negative_prompt=NEGATIVE,
        guidance_scale=5.0,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        output_type="np",
    )
    return {**kw, "mask_image": _masks(height, width)} if mask else kw


def _flux_kw(mask: bool) -> dict:
    height, width = FLUX_HW
    noise = np.random.default_rng(2).standard_normal((2, height // 2, width // 2, 4)).astype(np.float32)
    kw = dict(
        image=_images(height, width, 3),
        latents=np.asarray(pack_latents(noise)),
        strength=0.6,
        negative_prompt=NEGATIVE,
        true_cfg_scale=2.0,
        guidance_scale=3.5,
        height=height,
        width=width,
        num_inference_steps=STEPS,
        max_sequence_length=16,
        output_type="np",
    )
    return {**kw, "mask_image": _masks(height, width)} if mask else kw


# case -> (model, call arguments)
CASES = {
    "sdxl-img2img": ("sdxl", lambda: _sdxl_kw(mask=False)),
    "sdxl-inpaint-4ch": ("sdxl", lambda: _sdxl_kw(mask=True)),
    "sdxl-inpaint-9ch": ("sdxl_inpaint", lambda: _sdxl_kw(mask=True)),
    "flux-img2img": ("flux", lambda: _flux_kw(mask=False)),
    "flux-inpaint": ("flux", lambda: _flux_kw(mask=True)),
}


@pytest.fixture(scope="module")
def folders(tiny_sdxl_path, tiny_flux_dev_path, tmp_path_factory):
    from tests.fixtures.tiny_sdxl import build_tiny_sdxl

    inpaint = build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl_inpaint"), inpaint=True)
    return {"sdxl": tiny_sdxl_path, "sdxl_inpaint": inpaint, "flux": tiny_flux_dev_path}


@pytest.fixture(scope="module")
def pipes(folders):
    """model -> (one device, 8 devices), loaded once and shared by the cases of that model."""
    loaded = {}

    def get(model: str):
        if model not in loaded:
            single = load_pipeline(folders[model])
            mesh = load_pipeline(folders[model], mesh=MESH, devices=list(range(8)), weights=WEIGHTS)
            loaded[model] = (single, mesh)
        return loaded[model]

    return get


def _split_fraction(state) -> float:
    """The smallest share of a weight one device holds (1/8 when the weights are split 8 ways)."""
    shares = [
        s.data.size / leaf.size
        for leaf in jax.tree_util.tree_leaves(state)
        if isinstance(leaf, jax.Array) and leaf.size >= 64
        for s in leaf.addressable_shards[:1]
    ]
    return min(shares)


@pytest.mark.parametrize("case", list(CASES))
def test_image_input_pipeline_on_8_devices_matches_single_device(pipes, case, record_property):
    model, kwargs = CASES[case]
    single, mesh = pipes(model)
    denoiser = "transformer" if model == "flux" else "unet"
    assert _split_fraction(mesh._states[denoiser]) == 1 / 8  # the weights really are stored split
    expected = single(PROMPTS, **kwargs()).images
    got = mesh(PROMPTS, **kwargs()).images
    assert got.shape == expected.shape == (2, *(FLUX_HW if model == "flux" else SDXL_HW), 3)
    err = float(np.abs(got - expected).max())
    record_property("pipeline_max_abs_err", err)
    print(f"{case}: 8 devices vs one, max abs pixel error {err:.2e}")
    assert err <= 1e-4, f"{case}: max abs pixel error {err:.2e}"
    assert expected.std() > 1e-3 and not np.allclose(expected[0], expected[1], atol=1e-2)
