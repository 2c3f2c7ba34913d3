"""output_type="uint8": the decode program ends in the [0, 1] -> uint8 conversion on the device, and gives
exactly the bytes the worker's host conversion (workers/encoding.to_uint8) gives from the float output."""

from __future__ import annotations

import jax
import numpy as np

from meshserve.models.engine.pipeline import device_uint8
from meshserve.workers.encoding import to_uint8


def test_device_conversion_rounds_as_the_host_does():
    """Ties, values next to ties, out-of-range values and float32's awkward sums (0.5 - 2**-25 + 0.5 rounds to
    1.0) convert to the same uint8 on the device as on the host."""
    k = np.arange(256, dtype=np.float32)
    ties = (k + 0.5) / np.float32(255.0)
    edges = np.concatenate(
        [
            k / 255,
            ties,
            np.nextafter(ties, np.float32(0)),
            np.nextafter(ties, np.float32(1)),
            np.float32([-1.0, -0.0, 0.0, 1.0, 1.5, np.float32(0.5 - 2**-25) / 255, 1e-9, 0.99999994]),
        ]
    ).astype(np.float32)
    noise = np.random.default_rng(0).uniform(-0.05, 1.05, 200_000).astype(np.float32)
    x = np.concatenate([edges, noise])[: (len(edges) + len(noise)) // 3 * 3].reshape(-1, 1, 3)
    got = np.asarray(jax.jit(device_uint8)(x))
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, to_uint8(x))


def test_uint8_output_equals_host_conversion_of_float_output(embedded_sdxl):
    """The same call with output_type "np" and "uint8" (CFG on, two rows): equal bytes, a quarter the size."""
    pipe = embedded_sdxl
    kwargs = {"seed": [3, 4], "num_inference_steps": 2, "guidance_scale": 5.0}
    prompts = ["a red circle", "a blue square"]
    floats = pipe(prompts, output_type="np", **kwargs).images
    before = dict(pipe.programs.by_stage)
    out = pipe(prompts, output_type="uint8", **kwargs)
    after = pipe.programs.by_stage
    # Denoise and text are shared with the float call; only the uint8 decode program may be new. May: the
    # pipeline is the session's, and a file that ran before on this worker may have compiled it already.
    assert {k: n for k, n in after.items() if k != "vae_decode"} == {
        k: n for k, n in before.items() if k != "vae_decode"
    }
    assert after.get("vae_decode", 0) - before.get("vae_decode", 0) <= 1
    assert out.images.dtype == np.uint8 and out.images.shape == floats.shape
    assert floats.dtype == np.float32 and floats.nbytes == 4 * out.images.nbytes
    np.testing.assert_array_equal(out.images, to_uint8(floats))
    assert 0 < len(np.unique(out.images)) <= 256  # a picture, not a constant
    assert out.images.std() > 1.0
