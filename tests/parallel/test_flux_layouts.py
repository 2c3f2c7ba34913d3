"""Every Flux layout gives the single-device result (8 CPU devices): context parallelism over the joint
[text, image] sequence (ring, Ulysses, hybrid), tensor parallelism over heads and MLP, CFG parallelism of the
true-CFG passes and weights stored split over the mesh (FSDP).

The tiny dev-type Flux (4 heads of 16, 2 double + 2 single blocks; VAE factor 2, so a 36 x 28 image is a
9 x 7 grid of 63 packed tokens) with a 16-token T5 text gives a joint sequence of 79 tokens: divisible by
neither 2 nor 4, so every context layout pads it and must mask the padded keys (a padding attended would
change every output). True CFG runs (negative prompt, true_cfg_scale 2), so the transformer batch is the
interleaved [negative, positive] pair the cfg axis splits. Strategies are forced: with 79 tokens `auto`
would pick allgather (K/V <= allgather_max_kv) everywhere.
"""

import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.attention import AttentionSettings

H, W = 36, 28  # 9 x 7 packed tokens
TEXT_LEN = 16  # joint sequence 16 + 63 = 79: not a multiple of 2 or 4
STEPS = 2
# name -> (mesh sizes, attention settings, weights). The tiny transformer has 4 heads: Ulysses-4 divides them
# (one head per device), cfg2 x context2 x tensor2 leaves 2 heads per tensor shard for Ulysses-2.
LAYOUTS = {
    "cfg2-context2-tensor2-ulysses": (
        {"cfg": 2, "context": 2, "tensor": 2},
        AttentionSettings(context_strategy="ulysses"),
        None,
    ),
    "context4-ring": ({"context": 4}, AttentionSettings(context_strategy="ring"), None),
    "context4-ulysses": ({"context": 4}, AttentionSettings(context_strategy="ulysses"), None),
    # Weights split 8 ways over cfg x context (FSDP) with hybrid attention: Ulysses in pairs, a ring of 2.
    "cfg2-context4-hybrid-fsdp": (
        {"cfg": 2, "context": 4},
        AttentionSettings(context_strategy="hybrid", ulysses_degree=2),
        {"shard_over": ["cfg", "context"]},
    ),
}


def _kw(steps: int, output_type: str) -> dict:
    latents = np.random.default_rng(0).standard_normal((1, (H // 4) * (W // 4), 16)).astype(np.float32)
    return dict(
        negative_prompt="blurry",
        true_cfg_scale=2.0,
        guidance_scale=3.5,
        height=H,
        width=W,
        num_inference_steps=steps,
        max_sequence_length=TEXT_LEN,
        latents=latents,
        output_type=output_type,
    )


PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def reference(tiny_flux_dev_path):
    """One device: the latents after one step and the image after STEPS steps."""
    pipe = load_pipeline(tiny_flux_dev_path)
    step = pipe(PROMPT, **_kw(1, "latent")).images
    image = pipe(PROMPT, **_kw(STEPS, "np")).images
    assert image.std() > 1e-3 and np.abs(step).max() > 0.1
    return step, image


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flux_layout_matches_single_device(tiny_flux_dev_path, reference, name, record_property):
    sizes, settings, weights = LAYOUTS[name]
    n = int(np.prod(list(sizes.values())))
    pipe = load_pipeline(
        tiny_flux_dev_path, mesh=sizes, devices=list(range(n)), attention=settings, weights=weights
    )
    step_ref, image_ref = reference
    step = pipe(PROMPT, **_kw(1, "latent")).images
    image = pipe(PROMPT, **_kw(STEPS, "np")).images
    latent_err = float(np.abs(step - step_ref).max())
    image_err = float(np.abs(image - image_ref).max())
    record_property("latent_max_abs_err", latent_err)
    record_property("image_max_abs_err", image_err)
    print(f"{name}: latent max abs err {latent_err:.2e}, image max abs err {image_err:.2e}")
    assert latent_err <= 1e-4, f"{name}: one denoise step, latents max abs error {latent_err:.2e}"
    assert image_err <= 1e-4, f"{name}: {STEPS}-step image max abs pixel error {image_err:.2e}"


def test_weights_are_stored_split(tiny_flux_dev_path):
    """The FSDP layout really stores a split weight: each device holds 1/8 of a q projection (cfg x context)."""
    sizes, settings, weights = LAYOUTS["cfg2-context4-hybrid-fsdp"]
    pipe = load_pipeline(
        tiny_flux_dev_path, mesh=sizes, devices=list(range(8)), attention=settings, weights=weights
    )
    # The blocks are stacked (models/components/block_stack.py): [blocks, in, out], the blocks' axis whole.
    q = pipe._states["transformer"]["transformer_blocks"]["stacked"]["attn"]["to_q"]["kernel"][...]
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 8, q.shape[2])}
